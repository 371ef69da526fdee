"""Wall and CPU time of ``kvobs diagnose ID --json`` on span files, as a user meets it:
a span file, and a store whose writers are running (its spans in live segments only).

    python bench/span_file_bench.py --dir /tmp/kvobs-bench [--copies 100] [--repeat 9]
        [--also-rev REV]

Workload: the demo run's spans (tests/data/demo-spans.otlp.jsonl, 12 conversations)
without prefix chains (linking by chains, kvobs.turns.lineage, still loads pandas), repeated
``--copies`` times with new trace, span and conversation ids, as one OTLP JSON lines
file; the store is a directory whose ``spans/`` holds that file. Each process runs under
``/usr/bin/time``, round-robin with ``python -c pass`` and ``python -c "import pandas"``
(baselines, same run); ``--also-rev REV`` adds both diagnose commands run from kvobs/ as
it was at a git revision (a change's before). Prints medians; asserts nothing.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from startup_bench import (KVOBS, print_medians, round_robin,  # noqa: E402
                           timing_arguments, with_baselines)

from kvobs import semconv as sc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_SPANS = os.path.join(ROOT, "tests", "data", "demo-spans.otlp.jsonl")
_IDS = ("traceId", "spanId", "parentSpanId")


def _copy(document, copy: int):
    """``document`` without prefix chains, its ids those of copy number ``copy``."""
    if isinstance(document, list):
        return [_copy(item, copy) for item in document
                if not (isinstance(item, dict) and item.get("key") == sc.PREFIX_LINEAGE.key)]
    if not isinstance(document, dict):
        return document
    out = {key: _copy(value, copy) for key, value in document.items()}
    for key in _IDS:
        if out.get(key):
            out[key] = f"{copy:06x}{out[key][6:]}"
    if out.get("key") == sc.CONVERSATION_ID.key:
        out["value"] = {"stringValue": f"{out['value']['stringValue']}-{copy}"}
    return out


def span_workload(directory: str, copies: int) -> tuple[str, str]:
    """(span file, live store) of ``copies`` copies of the demo spans; written once."""
    store = os.path.join(directory, f"demo-spans-x{copies}")
    path = os.path.join(store, sc.STORE_LIVE_DIR, "demo.otlp.jsonl")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(DEMO_SPANS) as spans:
            documents = [json.loads(line) for line in spans]
        with open(path + ".tmp", "w") as out:
            for copy in range(copies):
                for document in documents:
                    out.write(json.dumps(_copy(document, copy)) + "\n")
        os.replace(path + ".tmp", path)
    return path, store


def main() -> None:
    parser = timing_arguments(__doc__, repeat=9)
    parser.add_argument("--copies", type=int, default=100)
    args = parser.parse_args()
    span_file, store = span_workload(args.dir, args.copies)
    picks = [f"agent-happy-{(i * 7919) % args.copies}" for i in range(args.repeat)]
    commands, envs = with_baselines({
        "diagnose ID --json (span file)": [KVOBS, "diagnose", "ID", "--source", span_file,
                                           "--json"],
        "diagnose ID --json (live store)": [KVOBS, "diagnose", "ID", "--source", store,
                                            "--json"],
    }, args.also_rev, args.dir)
    wall, cpu = round_robin(commands, envs, picks, args.repeat)
    print_medians(f"{args.copies} copies of the demo spans ({args.copies * 12} "
                  f"conversations); {args.repeat} runs each", wall, cpu)

if __name__ == "__main__":
    main()
