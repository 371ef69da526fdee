"""A real vLLM Scheduler with the instrumented connector, no engines, no model weights.

Patterned on upstream's ``tests/v1/kv_connector/unit/utils.py``; the model is a
``config.json`` written to a temp dir (no hub access).
"""

from __future__ import annotations

import copy
import json
from itertools import count
from typing import Any

import torch
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

CLASS = "KvobsNixlConnector"
MODULE = "connector_instrumented"
BS = 16
EOS = 2

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 4096,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": EOS,
}
_ids = count(1)
init_none_hash(sha256)


def write_model(path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(_TINY_LLAMA))
    return str(path)


def make_config(model_dir: str, extra: dict[str, Any] | None = None, policy: str = "fail",
                connector: str = CLASS, module: str | None = MODULE) -> VllmConfig:
    model_config = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                               dtype="float32", seed=42, max_model_len=4096)
    extra = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0, **(extra or {})}
    return VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                         max_model_len=4096, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        model_config=model_config,
        cache_config=CacheConfig(block_size=BS, gpu_memory_utilization=0.9,
                                 enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector=connector,
                                            kv_connector_module_path=module,
                                            kv_role="kv_both", kv_connector_extra_config=extra,
                                            kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int = 1000) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BS, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])


def make_scheduler(vllm_config: VllmConfig, num_blocks: int = 1000) -> Scheduler:
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config(num_blocks),
                     log_stats=True, structured_output_manager=StructuredOutputManager(
                         vllm_config), block_size=BS)


def make_request(tokens: list[int], params: dict | None, max_tokens: int = 1) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.update_from_generation_config({}, EOS)
    req = Request(request_id=f"req-{next(_ids)}", prompt_token_ids=list(tokens),
                  sampling_params=sampling, pooling_params=None, mm_features=None,
                  block_hasher=get_request_block_hasher(BS, sha256))
    req.kv_transfer_params = params
    return req


def runner_output(reqs: list[Request], **kv: Any) -> ModelRunnerOutput:
    ids = [r.request_id for r in reqs]
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[7] for _ in ids], logprobs=None,
                            prompt_logprobs_dict={}, pooler_output=None)
    if kv:
        out.kv_connector_output = KVConnectorOutput(**kv)
    return out


def empty_output(**kv: Any) -> ModelRunnerOutput:
    out = copy.deepcopy(EMPTY_MODEL_RUNNER_OUTPUT)
    if kv:
        out.kv_connector_output = KVConnectorOutput(**kv)
    return out


def step(scheduler: Scheduler, output: ModelRunnerOutput | None = None, **kv: Any):
    """One scheduler step; every request that got tokens samples one (max_tokens=1)."""
    so = scheduler.schedule()
    if output is None:
        reqs = [scheduler.requests[r] for r in so.num_scheduled_tokens]
        output = runner_output(reqs, **kv) if reqs else empty_output(**kv)
    return so, scheduler.update_from_output(so, output)


def d_params(request_id: str, blocks: list[int], tokens: int, **extra: Any) -> dict:
    """What P receives on turn 2: D's exported params (shape of request_finished)."""
    return {"do_remote_prefill": False, "do_remote_decode": True,
            "remote_block_ids": [list(blocks)], "remote_engine_id": "decode-engine",
            "remote_request_id": request_id, "remote_host": "127.0.0.1",
            "remote_port": 5678, "tp_size": 1, "remote_num_tokens": tokens, **extra}


class SpanCapture:
    """Routes the connector's spans into an in-memory exporter (one per service).

    Spans are built off the hook by each ``SpanSink``'s thread: ``spans()`` flushes the
    sinks (``sinks``, filled by the ``spans`` fixture) before reading, so assertions
    never race the builder thread.
    """

    def __init__(self):
        self.exporter = InMemorySpanExporter()
        self.sinks: list = []

    def flush(self):
        for sink in self.sinks:
            sink.flush()

    def factory(self, service):
        provider = TracerProvider(resource=Resource.create({"service.name": service.value}))
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        return provider.get_tracer("kvobs-test")

    def spans(self, name=None):
        self.flush()
        return [s for s in self.exporter.get_finished_spans()
                if name is None or s.name == getattr(name, "name", name)]
