"""``HostCopyWorker``: stores and loads land where upstream's CPU pages are, in private
tensors and in the strided per-worker views of a shared region (the tiering spec's, which
its p2p tier hands peers), including a first block unaligned to a multi-block chunk."""

from __future__ import annotations

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from connector_instrumented.host_copy import HostCopyWorker

PAGE, BLOCKS, CHUNKS, PER_CHUNK = 8, 10, 4, 2


def _caches(num_tensors: int = 2) -> CanonicalKVCaches:
    tensors = [CanonicalKVCacheTensor(
        torch.arange(BLOCKS * PAGE, dtype=torch.int8).view(BLOCKS, PAGE) + t, PAGE)
        for t in range(num_tensors)]
    refs = [[CanonicalKVCacheRef(t, PAGE) for t in range(num_tensors)]]
    return CanonicalKVCaches(tensors, refs)


def _round_trip(worker: HostCopyWorker, caches: CanonicalKVCaches) -> None:
    original = [entry.tensor.clone() for entry in caches.tensors]
    # Blocks 3..5 of a request, logical index 1: the first sits in the second half of
    # host chunk 2, the next two fill chunk 0.
    device = GPULoadStoreSpec([7, 2, 5], group_sizes=[3], block_indices=[1])
    assert worker.submit_store(1, device, CPULoadStoreSpec([2, 0]))
    for entry in caches.tensors:
        entry.tensor.zero_()
    assert worker.submit_load(2, CPULoadStoreSpec([2, 0]), device)
    for entry, before in zip(caches.tensors, original):
        assert torch.equal(entry.tensor[[7, 2, 5]], before[[7, 2, 5]])
        assert not entry.tensor[[0, 1, 3]].any()  # nothing else written
    stored, loaded = worker.get_finished()
    assert stored.transfer_size == loaded.transfer_size == 3 * 2 * PAGE


def test_private_host_tensors_round_trip():
    caches = _caches()
    _round_trip(HostCopyWorker(caches, PER_CHUNK, CHUNKS), caches)


def test_strided_region_views_round_trip_in_place():
    caches = _caches()
    row = 2 * PER_CHUNK * PAGE + 16  # both tensors' pages plus alignment padding
    region = torch.zeros(CHUNKS * row, dtype=torch.int8)
    views = [region.as_strided((CHUNKS, PER_CHUNK * PAGE), (row, 1), t * PER_CHUNK * PAGE)
             for t in range(2)]
    released = []
    worker = HostCopyWorker(caches, PER_CHUNK, CHUNKS, views, lambda: released.append(1))
    before = caches.tensors[1].tensor.clone()
    _round_trip(worker, caches)
    # Chunk 0 of tensor 1 holds device blocks 2 and 5 (what a peer reads from the region).
    assert torch.equal(region[row * 0 + PER_CHUNK * PAGE: row * 0 + 2 * PER_CHUNK * PAGE],
                       before[[2, 5]].reshape(-1))
    assert not region[row - 16:row].any()  # the padding stays untouched
    worker.shutdown()
    assert released == [1]
