"""Time kvobs.turns.lineage over id-less multi-turn traffic (what engines behind another router
write), against the same spans carrying conversation ids (no linking needed).

    python bench/lineage_bench.py [--conversations 20000] [--turns 5] [--first-tokens 2000]
                                  [--step-tokens 400] [--output-tokens 100]

Spans are built the way the instrumented engines emit them: P's decision span with its
prompt's chain and D's export with the chain of prompt + output (real digests from
``connector_instrumented._digest.encode`` over chained SHA-256 block hashes, block 16), D
naming P's request. Each conversation's prompt grows by ``step-tokens`` + the previous
output every turn. Prints the span count, the time of ``lineage.link`` alone and of the
whole turn table (``correlate.turns_from_spans``) with and without ids, and the baseline:
the same spans with ids and no chains (no lineage stage at all); per turn; and whether
every conversation was rebuilt in order.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402

from connector_instrumented import _digest  # noqa: E402
from kvobs import semconv as sc
from kvobs.turns import lineage  # noqa: E402
from kvobs.turns.correlate import turns_from_spans  # noqa: E402
from kvobs.sources._frame import frame_from_table, table_from_rows  # noqa: E402

BS = 16
SEED = "bench000"


def _extend(hashes: list[bytes], rng: random.Random, tokens: int) -> list[bytes]:
    parent = hashes[-1] if hashes else b"root"
    for _ in range(tokens // BS):
        parent = hashlib.sha256(parent + rng.randbytes(8)).digest()
        hashes.append(parent)
    return hashes


def spans(conversations: int, turns: int, first: int, step: int, output: int,
          with_ids: bool) -> pa.Table:
    rows = []
    rng = random.Random(7)
    t0 = 1_800_000_000.0
    for c in range(conversations):
        hashes: list[bytes] = []
        _extend(hashes, rng, first - step)
        start = t0 + rng.random() * 3600
        for k in range(1, turns + 1):
            _extend(hashes, rng, step)
            prompt_tokens = len(hashes) * BS
            p_id, d_id, trace = f"p-{c}-{k}", f"d-{c}-{k}", f"{c:016x}{k:016x}"
            keys = {sc.CONVERSATION_ID.key: f"conv-{c}", sc.TURN_INDEX.key: k} if with_ids \
                else {}
            rows.append({"name": sc.SPAN_PULL_DECISION.name, "trace_id": trace,
                         "span_id": trace[:8] + "p", "start_ns": int(start * 1e9),
                         "end_ns": int(start * 1e9) + 1000, **keys,
                         sc.REQUEST_ID.key: p_id, sc.PULL_DECISION.key: "no-params",
                         sc.PREFIX_LINEAGE.key: _digest.encode(hashes, prompt_tokens, BS, SEED)})
            _extend(hashes, rng, output)
            end = start + 0.5
            rows.append({"name": sc.SPAN_EXPORT.name, "trace_id": trace + "d",
                         "span_id": trace[:8] + "d", "start_ns": int(end * 1e9),
                         "end_ns": int(end * 1e9), **keys, sc.REQUEST_ID.key: d_id,
                         sc.REMOTE_REQUEST_ID.key: p_id,
                         sc.EXPORT_TOKENS.key: len(hashes) * BS,
                         sc.EXPORT_EXPIRES_AT.key: end + 480,
                         sc.PREFIX_LINEAGE.key: _digest.encode(hashes, len(hashes) * BS, BS,
                                                               SEED)})
            start = end + 5 + rng.random() * 30
    return table_from_rows(rows)


def timed(fn, *args):
    begin = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--first-tokens", type=int, default=2000)
    parser.add_argument("--step-tokens", type=int, default=400)
    parser.add_argument("--output-tokens", type=int, default=100)
    args = parser.parse_args()
    shape = (args.conversations, args.turns, args.first_tokens, args.step_tokens,
             args.output_tokens)
    idless_table, built = timed(spans, *shape, False)
    idless, with_ids = frame_from_table(idless_table), frame_from_table(spans(*shape, True))
    n_turns = args.conversations * args.turns
    chain = idless[sc.PREFIX_LINEAGE.key].str.len().mean()
    print(f"{len(idless):,} spans, {n_turns:,} turns ({args.conversations:,} conversations x "
          f"{args.turns}; prompts {args.first_tokens:,} tokens growing "
          f"{args.step_tokens + args.output_tokens:,} a turn); chain {chain:,.0f} chars "
          f"on average; built in {built:.1f}s")
    _, link_s = timed(lineage.link, idless_table)
    rebuilt, idless_s = timed(turns_from_spans, idless)
    _, ids_s = timed(turns_from_spans, with_ids)
    plain = with_ids.assign(**{sc.PREFIX_LINEAGE.key: pd.NA})  # no chains: no linking
    _, plain_s = timed(turns_from_spans, plain)
    ordered = all(list(g.sort_values("turn")["prefill_request_id"])
                  == [f"p-{g['prefill_request_id'].iloc[0].split('-')[1]}-{k}"
                      for k in range(1, len(g) + 1)]
                  for _, g in rebuilt.groupby("conversation_id"))
    print(f"lineage.link alone         {link_s:8.2f}s  {link_s / n_turns * 1e6:7.1f} us/turn")
    print(f"turn table, id-less spans  {idless_s:8.2f}s  {idless_s / n_turns * 1e6:7.1f} us/turn")
    print(f"turn table, spans with ids {ids_s:8.2f}s  {ids_s / n_turns * 1e6:7.1f} us/turn"
          f"  (ratio id-less/ids {idless_s / ids_s:.2f})")
    print(f"turn table, ids, no chains {plain_s:8.2f}s  {plain_s / n_turns * 1e6:7.1f} us/turn"
          f"  (the baseline: correlation without the lineage stage)")
    print(f"conversations rebuilt: {rebuilt['conversation_id'].nunique():,} of "
          f"{args.conversations:,}, every one in turn order: {ordered}")


if __name__ == "__main__":
    main()
