"""Run upstream's NIXL connector unit tests with KvobsNixlConnector swapped in.

Not collected by pytest (no ``test_`` prefix); run by hand, it takes a few minutes::

    pip download vllm==0.32.0 --no-deps --no-binary :all:   # or fetch the sdist
    tar xzf vllm-0.32.0.tar.gz
    /work/venv/bin/python tests/connector/upstream_parity.py vllm-0.32.0 [--keep DIR]

It copies upstream's ``tests/v1/kv_connector/unit`` into a scratch tree (with an empty
top-level conftest: upstream's pulls in the whole test stack), writes the Hugging Face
``config.json`` files the tests name into an offline cache, stubs ``ray`` when it is not
installed, then runs ``test_nixl_connector.py`` and ``test_bidirectional_kv_transfer.py``
twice: as shipped, and with ``NixlConnector`` (module attributes and the factory
registry) replaced by ``connector_instrumented.KvobsNixlConnector``. Exit status 0 when
the two pass sets are identical; prints any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FILES = ("test_nixl_connector.py", "test_bidirectional_kv_transfer.py")

HF_CONFIGS = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
        "ffn_dim": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768,
        "do_layer_norm_before": True, "torch_dtype": "float16", "pad_token_id": 1,
        "bos_token_id": 2, "eos_token_id": 2, "activation_function": "relu"},
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 1024,
        "ffn_dim": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
        "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 512,
        "do_layer_norm_before": False, "torch_dtype": "float16", "pad_token_id": 1,
        "bos_token_id": 2, "eos_token_id": 2, "activation_function": "relu"},
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "num_hidden_layers": 28, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645},
}

SWAP_PLUGIN = r'''
import os
if os.environ.get("KVOBS_SWAP") == "1":
    from connector_instrumented import KvobsNixlConnector
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import nixl
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector
    nixl.NixlConnector = KvobsNixlConnector
    connector.NixlConnector = KvobsNixlConnector
    KVConnectorFactory._registry["NixlConnector"] = lambda: KvobsNixlConnector

    def pytest_sessionfinish(session):
        import sys
        seen = {name: getattr(mod, "NixlConnector", None) is KvobsNixlConnector
                for name, mod in sys.modules.items() if name.startswith("tests.v1.kv_connector")
                and hasattr(mod, "NixlConnector")}
        cls = KVConnectorFactory._registry["NixlConnector"]()
        with open("swap-check.txt", "w") as f:
            f.write(f"factory={cls is KvobsNixlConnector} modules={seen}\n")
'''

# The fixtures these two files use from upstream's top-level conftest (which imports the
# whole test stack), restated.
CONFTEST = '''
import contextlib, os, tempfile
import pytest
from vllm.distributed import (cleanup_dist_env_and_memory, init_distributed_environment,
                              initialize_model_parallel)
from vllm.platforms import current_platform


@contextlib.contextmanager
def _ensure_config():
    from vllm.config import (VllmConfig, get_current_vllm_config_or_none,
                             set_current_vllm_config)
    if get_current_vllm_config_or_none() is not None:
        yield
        return
    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.fixture
def dist_init():
    fd, temp_file = tempfile.mkstemp()
    os.close(fd)
    try:
        with _ensure_config():
            init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=f"file://{temp_file}",
                local_rank=0, backend="gloo" if current_platform.is_cpu() else "nccl")
            initialize_model_parallel(1, 1)
            yield
        cleanup_dist_env_and_memory()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp_file)


@pytest.fixture
def default_vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config
    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


@pytest.fixture(autouse=True)
def cleanup_fixture():
    yield
    cleanup_dist_env_and_memory()
'''

RAY_STUB = '''
"""Stub: upstream's test module imports ray at top level; one test needs the real one."""
def __getattr__(name):
    raise ImportError("ray is not installed (kvobs parity stub)")
'''


def build(sdist: Path, work: Path) -> None:
    src = sdist / "tests"
    dst = work / "tests"
    shutil.copytree(src / "v1" / "kv_connector" / "unit", dst / "v1" / "kv_connector" / "unit")
    (dst / "v1" / "attention").mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "v1" / "attention" / "utils.py", dst / "v1" / "attention" / "utils.py")
    for pkg in (dst, dst / "v1", dst / "v1" / "kv_connector", dst / "v1" / "attention"):
        (pkg / "__init__.py").touch()
    (dst / "conftest.py").write_text(CONFTEST)
    (work / "kvobs_swap.py").write_text(SWAP_PLUGIN)
    try:
        import ray  # noqa: F401
    except ImportError:
        (work / "stubs" / "ray").mkdir(parents=True)
        (work / "stubs" / "ray" / "__init__.py").write_text(RAY_STUB)
    for repo, config in HF_CONFIGS.items():
        base = work / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
        snap = base / "snapshots" / ("0" * 40)
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(config))
        (base / "refs").mkdir()
        (base / "refs" / "main").write_text("0" * 40)


def run(work: Path, swap: bool) -> dict[str, str]:
    env = dict(os.environ, KVOBS_SWAP="1" if swap else "0", HF_HOME=str(work / "hf"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [
                   str(work), str(work / "stubs"), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
           "-p", "kvobs_swap", "--timeout=300"] + [
        f"tests/v1/kv_connector/unit/{name}" for name in FILES]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    (work / f"run-{'swap' if swap else 'upstream'}.log").write_text(proc.stdout + proc.stderr)
    outcomes = {}
    for line in proc.stdout.splitlines():
        match = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", line)
        if match:
            outcomes[match.group(2)] = match.group(1)
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help="extracted vllm source distribution")
    parser.add_argument("--keep", type=Path, help="scratch directory to keep")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvobs-parity-"))
    if not (work / "tests").exists():
        build(args.sdist, work)
    upstream = run(work, swap=False)
    swapped = run(work, swap=True)
    return report(work, upstream, swapped)


def report(work: Path, upstream: dict[str, str], swapped: dict[str, str]) -> int:
    """Print both runs' counts, the swap check and every difference; 0 when identical."""
    count = lambda o, k: sum(v == k for v in o.values())  # noqa: E731
    for name, outcomes in (("upstream", upstream), ("kvobs", swapped)):
        print(f"{name:9s} passed={count(outcomes, 'PASSED')} failed={count(outcomes, 'FAILED')}"
              f" error={count(outcomes, 'ERROR')} skipped={count(outcomes, 'SKIPPED')}")
    check = (work / "swap-check.txt").read_text().strip()
    print(f"swap check: {check}")
    swapped_ok = "factory=True" in check and "False" not in check
    diff = {t: (upstream.get(t), swapped.get(t)) for t in set(upstream) | set(swapped)
            if upstream.get(t) != swapped.get(t)}
    for test, (before, after) in sorted(diff.items()):
        print(f"DIFF {test}: upstream={before} kvobs={after}")
    print(f"logs in {work}")
    return 1 if diff or not upstream or not swapped_ok else 0


if __name__ == "__main__":
    sys.exit(main())
