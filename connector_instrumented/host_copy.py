"""``KvobsHostCopySpec``, ``KvobsTieringHostCopySpec``: vLLM's CPU offloading specs with a
host memory copy.

The CPU stand-in for the copy engine only. vLLM's ``CPUOffloadingSpec`` refuses the CPU
platform at start-up because its worker copies with CUDA streams, pinned memory and swap
kernels; everything else it builds (the offloading manager: what to store, LRU eviction,
lookups, KV events, metrics) is platform-free and kept as is. This spec replaces only
the worker: each store or load is a synchronous ``index_copy_`` between the engine's KV
cache tensors and host tensors, so the copy times it reports (``vllm:kv_offload_*_time``,
kvobs's ``kvobs.host.duration``) are host memory copies, labelled
``kvobs.host.copy_engine = host-memcpy``, never a GPU's DMA figures.

Load it through the offloading connector's extra config::

    "kv_connector_extra_config": {"spec_name": "KvobsHostCopySpec",
        "spec_module_path": "connector_instrumented.host_copy",
        "cpu_bytes_to_use": 67108864, ...}

``KvobsTieringHostCopySpec`` does the same for vLLM's ``TieringOffloadingSpec`` (a host
primary tier plus secondary tiers, e.g. ``p2p``: llm-d's peer-to-peer host path). Its
primary tier lives in the shared memory region upstream's tiering manager hands its
secondary tiers (the p2p tier registers it with NIXL), so the worker copies into that
region's per-worker views, exactly where upstream's worker would::

    "kv_connector_extra_config": {"spec_name": "KvobsTieringHostCopySpec",
        "spec_module_path": "connector_instrumented.host_copy",
        "cpu_bytes_to_use": 67108864,
        "secondary_tiers": [{"type": "p2p", "host": "127.0.0.1", "port": 5710}]}

Byte counts follow vLLM's own worker (unpadded page bytes per layer per block), so the
offload counters read the same as they would with the device copy engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["KvobsHostCopySpec", "KvobsTieringHostCopySpec", "HostCopyWorker", "HOST_COPY_SPECS"]


def _host_blocks(spec: LoadStoreSpec) -> BlockIDsLoadStoreSpec:
    """vLLM's worker API takes any medium's spec; this worker copies to and from host
    blocks only (its specs pair GPU with CPU), so another medium is a wiring error."""
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"host copy needs host block ids, got {type(spec).__name__}")
    return spec


@dataclass(frozen=True)
class _Copy:
    """One group's rows: device block rows <-> host (chunk, page) pairs, and the tensors
    they live in."""

    device_rows: torch.Tensor
    host_chunks: torch.Tensor
    host_pages: torch.Tensor
    tensor_ids: tuple[int, ...]


class HostCopyWorker(OffloadingWorker):
    """Copies blocks between the engine's KV cache and host tensors, synchronously.

    Host storage per KV tensor is one row of ``blocks_per_chunk`` pages per chunk (upstream's
    CPU page layout): sub-block ``j`` of chunk ``c`` is ``host[c, j]``. The rows are private
    tensors, or ``host_chunks`` given by the spec (views of a shared region, strided).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        host_chunks: list[torch.Tensor] | None = None,
        release=None,
    ):
        self._blocks_per_chunk = blocks_per_chunk
        # Byte pages, as upstream's worker views them (int8: strides are bytes).
        self._device = [
            entry.tensor.view(torch.int8).view(-1, entry.page_size_bytes)
            for entry in kv_caches.tensors
        ]
        if host_chunks is None:
            host_chunks = [
                torch.zeros(
                    (num_chunks, blocks_per_chunk * entry.page_size_bytes),
                    dtype=torch.int8,
                    device="cpu",
                )
                for entry in kv_caches.tensors
            ]
        self._host = [_pages(rows, blocks_per_chunk) for rows in host_chunks]
        self._release = release
        self._group_tensors = [
            tuple(sorted({ref.tensor_idx for ref in refs})) for refs in kv_caches.group_data_refs
        ]
        self._group_page_bytes = [
            sum(ref.page_size_bytes for ref in refs) for refs in kv_caches.group_data_refs
        ]
        self._finished: list[TransferResult] = []

    def _plan(
        self, device_spec: GPULoadStoreSpec, host_spec: BlockIDsLoadStoreSpec
    ) -> tuple[list[_Copy], int]:
        per_chunk = self._blocks_per_chunk
        chunks = host_spec.block_ids.astype(np.int64)
        blocks = device_spec.block_ids.astype(np.int64)
        copies: list[_Copy] = []
        num_bytes = 0
        block_at = chunk_at = 0
        for group, (size, first_index) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices)
        ):
            if size == 0:
                continue
            skip = first_index % per_chunk
            num_chunks = -(-(size + skip) // per_chunk)
            group_chunks = chunks[chunk_at : chunk_at + num_chunks]
            host_rows = (group_chunks[:, None] * per_chunk + np.arange(per_chunk)).ravel()[
                skip : skip + size
            ]
            copies.append(
                _Copy(
                    torch.from_numpy(blocks[block_at : block_at + size]),
                    torch.from_numpy(host_rows // per_chunk),
                    torch.from_numpy(host_rows % per_chunk),
                    self._group_tensors[group],
                )
            )
            num_bytes += size * self._group_page_bytes[group]
            block_at += size
            chunk_at += num_chunks
        return copies, num_bytes

    def _run(
        self,
        job_id: int,
        device_spec: GPULoadStoreSpec,
        host_spec: BlockIDsLoadStoreSpec,
        to_host: bool,
    ) -> bool:
        start = time.perf_counter()
        copies, num_bytes = self._plan(device_spec, host_spec)
        for copy in copies:
            for idx in copy.tensor_ids:
                device, host = self._device[idx], self._host[idx]
                at = (copy.host_chunks, copy.host_pages)
                if to_host:
                    host[at] = device.index_select(0, copy.device_rows)
                else:
                    device.index_copy_(0, copy.device_rows, host[at])
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=num_bytes,
                transfer_time=time.perf_counter() - start,
            )
        )
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._run(job_id, src_spec, _host_blocks(dst_spec), to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._run(job_id, dst_spec, _host_blocks(src_spec), to_host=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # copies finish inside submit_*

    def shutdown(self) -> None:
        self._host.clear()
        self._device.clear()
        if self._release is not None:
            self._release()


def _pages(rows: torch.Tensor, blocks_per_chunk: int) -> torch.Tensor:
    """``(chunks, blocks_per_chunk * page)`` rows (possibly strided) as a
    ``(chunks, blocks_per_chunk, page)`` view of the same memory."""
    page = rows.shape[1] // blocks_per_chunk
    return rows.as_strided(
        (rows.shape[0], blocks_per_chunk, page),
        (rows.stride(0), page * rows.stride(1), rows.stride(1)),
        rows.storage_offset(),
    )


class _WholePageCopies:
    """What both kvobs specs share: their ``HostCopyWorker`` copies whole engine pages,
    so they refuse vLLM's canonical layout at start-up instead of copying it wrongly."""

    def __init__(self, config):
        super().__init__(config)
        if getattr(config, "canonical_layout", False):
            raise ValueError(
                f"{type(self).__name__} copies whole engine pages; the "
                "canonical (parallelism-free) layout is not supported"
            )
        self._host_worker: HostCopyWorker | None = None


class KvobsHostCopySpec(_WholePageCopies, CPUOffloadingSpec):
    """``CPUOffloadingSpec`` (manager, sizing, metrics) with ``HostCopyWorker`` copies."""

    def _uses_shared_region(self) -> bool:
        return False  # private host tensors, no shared mmap region to pin

    def get_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        if self._host_worker is None:
            self._host_worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._host_worker


class KvobsTieringHostCopySpec(_WholePageCopies, TieringOffloadingSpec):
    """``TieringOffloadingSpec`` (host primary tier in a shared region, secondary tiers
    such as p2p, their metrics) with ``HostCopyWorker`` copies into that region."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyWorker:
        if self._host_worker is None:
            # The worker's own mapping of the region the scheduler's primary tier (and
            # its p2p tier's NIXL registration) reads: upstream's create_worker, less its
            # CUDA copy handlers.
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                views = [
                    region.create_next_worker_view(entry.page_size_bytes * self.blocks_per_chunk)
                    for entry in kv_caches.tensors
                ]
                self._host_worker = HostCopyWorker(
                    kv_caches, self.blocks_per_chunk, self.num_chunks, views, region.cleanup
                )
            except Exception:
                region.cleanup()
                raise
        return self._host_worker


# The specs whose copies are this module's host memory copies (spans say host-memcpy).
HOST_COPY_SPECS = frozenset({KvobsHostCopySpec.__name__, KvobsTieringHostCopySpec.__name__})
