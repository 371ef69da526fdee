"""Run upstream's offloading connector unit tests with KvobsOffloadingConnector swapped in.

Not collected by pytest (no ``test_`` prefix); run by hand (a few minutes)::

    tar xzf vllm-0.32.0.tar.gz          # the sdist, as for upstream_parity.py
    .venv/bin/python tests/connector/upstream_offloading_parity.py vllm-0.32.0 [--keep DIR]

Same scratch tree as ``upstream_parity.py`` (its ``build`` and ``run``), other files and
another swap: ``OffloadingConnector`` (the connector module's attribute, the name the
test utils imported, and the factory registry) becomes
``connector_instrumented.offloading.KvobsOffloadingConnector``. Exit status 0 when the
pass sets of the two runs are identical.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import upstream_parity as parity  # noqa: E402

# The scheduler, worker, metrics, events and config tests. Not test_offloading_connector.py:
# it starts real engines with the stock CPU spec, which refuses the CPU platform (and its
# engines wait out the per-test timeout here).
FILES = ("offloading_connector",)

SWAP_PLUGIN = r'''
import os
if os.environ.get("KVOBS_SWAP") == "1":
    from connector_instrumented.offloading import KvobsOffloadingConnector
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import offloading_connector
    offloading_connector.OffloadingConnector = KvobsOffloadingConnector
    KVConnectorFactory._registry["OffloadingConnector"] = lambda: KvobsOffloadingConnector

    def pytest_sessionfinish(session):
        import sys
        seen = {name: getattr(mod, "OffloadingConnector", None) is KvobsOffloadingConnector
                for name, mod in sys.modules.items() if name.startswith("tests.v1.kv_connector")
                and hasattr(mod, "OffloadingConnector")}
        cls = KVConnectorFactory._registry["OffloadingConnector"]()
        with open("swap-check.txt", "w") as f:
            f.write(f"factory={cls is KvobsOffloadingConnector} modules={seen}\n")
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help="extracted vllm source distribution")
    parser.add_argument("--keep", type=Path, help="scratch directory to keep")
    args = parser.parse_args()
    parity.FILES = FILES
    parity.SWAP_PLUGIN = SWAP_PLUGIN
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvobs-offload-parity-"))
    if not (work / "tests").exists():
        parity.build(args.sdist, work)
    (work / "kvobs_swap.py").write_text(SWAP_PLUGIN)
    upstream = parity.run(work, swap=False)
    swapped = parity.run(work, swap=True)
    return parity.report(work, upstream, swapped)


if __name__ == "__main__":
    sys.exit(main())
