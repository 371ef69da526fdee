"""Live classifier throughput against the batch pipeline, on the same synthetic spans.

    python bench/classifier_bench.py [--conversations 2000] [--batch 64] [--pass-every 2.0]
                                     [--spans-per-pass N] [--window 960] [--mean-turns 5]
                                     [--repeat 3]

Synthetic fleet (``kvobs.synth.small``: every verdict scenario, ~10 spans and ~5 turns a
conversation), spans delivered in end-time order in export requests of ``--batch`` spans,
a classification pass every ``--pass-every`` simulated seconds (a 1 s pass interval in
production; the simulated fleet runs faster than real time, so one pass sees more spans
than it would). Prints, in one run:

- batch: ``classify_turns(turns_from_spans(all spans))`` (what ``kvobs turns`` runs);
- stream: the same spans through ``Classifier`` (buffer, passes, versions, finalization);
- the rows the service builds per span from an OTLP-JSON dict (the demo spans recorded
  on the testbed, ``kvobs.sources._rows``), measured apart: not the whole request path
  (protobuf decode, the stored line, the store: ``ingest_bench.py``);

each as spans per CPU-second (process time), and whether the two give the same verdict
to every turn. Stream's fleet context comes from its earlier final turns, so it is
compared with the batch classified at the context each turn recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from kvobs.turns import columns as col  # noqa: E402
from kvobs.turns.correlate import turns_from_spans  # noqa: E402
from kvobs.diagnose import classify_turns  # noqa: E402
from kvobs.live.classifier import Classifier  # noqa: E402
from kvobs.sources._rows import rows as document_rows  # noqa: E402
from kvobs.synth import small, spans_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pass-every", type=float, default=2.0)
    parser.add_argument("--spans-per-pass", type=int, default=0,
                        help="a pass every this many spans instead (a fleet sending S "
                             "spans/s to a service passing every second: S)")
    parser.add_argument("--window", type=float, default=960.0,
                        help="seconds a conversation is held (kvobs collect: 2 x D's TTL; "
                             "0: the whole run, nothing leaves memory)")
    parser.add_argument("--chains", action="store_true",
                        help="the connector's prefix chains on P's and D's spans "
                             "(bench/_chains.py): the lineage stage runs, as in a deployment")
    parser.add_argument("--mean-turns", type=float, default=5.0,
                        help="turns a conversation has on average (geometric, at most 64): "
                             "an agent's conversations run longer")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of batch and of stream; the least CPU time of each is "
                             "printed (one run's varies by 10 %% on a shared 2-core box)")
    args = parser.parse_args()

    config = small(args.conversations, mean_turns=args.mean_turns)
    table, _ = spans_table(config, np.arange(config.conversations))
    if args.chains:
        from _chains import with_prefix_chains

        table = with_prefix_chains(table)
    table = table.sort_by([("end_ns", "ascending")])
    rows = [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
    spans = len(rows)
    print(f"synthetic fleet: {args.conversations} conversations, {spans} spans")

    batch_s = float("inf")
    for _ in range(args.repeat):
        started = time.process_time()
        turns = turns_from_spans(table, frame=False)
        batch, context = classify_turns(col.Columns(turns))
        batch_s = min(batch_s, time.process_time() - started)
    print(f"batch:  {spans / batch_s:10.0f} spans/CPU-s ({batch_s:.2f} s, {len(batch)} turns)")

    stream_s = float("inf")
    for _ in range(args.repeat):
        seconds, final, passes, held, classifier = _stream(rows, args)
        stream_s = min(stream_s, seconds)
    print(f"stream: {spans / stream_s:10.0f} spans/CPU-s ({stream_s:.2f} s, {passes} passes, "
          f"{len(final)} final turns, at most {held} spans held, window "
          f"{args.window or 'whole run'} s); ratio stream/batch "
          f"{(spans / stream_s) / (spans / batch_s):.2f}")

    demo = os.path.join(ROOT, "tests", "data", "demo-spans.otlp.jsonl")
    requests = [json.loads(line) for line in open(demo).read().split("\n") if line.strip()]
    started = time.process_time()
    decoded = 0
    for _ in range(20):
        for request in requests:
            decoded += len(document_rows("otlp", request, []))
    decode_s = time.process_time() - started
    per_span = decode_s / decoded
    print(f"OTLP decode: {decoded / decode_s:10.0f} spans/CPU-s; stream with decode: "
          f"{1 / (stream_s / spans + per_span):10.0f} spans/CPU-s")

    contexts = {}
    for key, row in final.items():
        ctx = row["context"]
        contexts.setdefault((ctx["prefill_tokens_per_s"], ctx["decode_s_per_token"]),
                            []).append(key)
    differ = 0
    for (rate, per_token), keys in contexts.items():
        diagnoses, _ = classify_turns(col.Columns(turns), None, rate, per_token)
        by_key = {(d.tenant, d.conversation_id, d.turn.index): d.finding.verdict.value
                  for d in diagnoses}
        differ += sum(by_key.get(k) != final[k]["verdict"] for k in keys)
    missing = len({(d.tenant, d.conversation_id, d.turn.index) for d in batch} - set(final))
    print(f"verdicts: {differ} of {len(final)} final turns differ from the batch at their "
          f"context, {missing} batch turns missing in stream")


def _stream(rows: list[dict], args) -> tuple[float, dict, int, int, Classifier]:
    """One run of the spans through a new classifier: its CPU time, the latest final row
    of every turn (as the store keeps them), its passes and the most spans it held."""
    spans = len(rows)
    classifier = Classifier(window_s=args.window or 1e12, grace_s=5.0)
    end_s = [row["end_ns"] / 1e9 for row in rows]
    final: dict[tuple, dict] = {}  # the latest final row of every turn, as the store keeps
    pass_cpu: list[float] = []
    started = time.process_time()
    next_pass = end_s[0] + args.pass_every
    passes = 0
    held = 0

    def keep(result):
        for row in result.finalized:
            key = (row["tenant"], row["conversation_id"], row["turn"])
            if row.get("superseded"):
                final.pop(key, None)
            else:
                final[key] = row

    for i in range(0, spans, args.batch):
        chunk = rows[i:i + args.batch]
        now = end_s[min(i + args.batch, spans) - 1]
        classifier.buffer.add(chunk, now)
        due = (i + args.batch) // args.spans_per_pass > i // args.spans_per_pass \
            if args.spans_per_pass else now >= next_pass
        if due:
            result = classifier.run_pass(now)
            keep(result)
            pass_cpu.append(result.seconds)
            held = max(held, len(classifier.buffer))
            passes += 1
            next_pass = now + args.pass_every
    keep(classifier.run_pass(end_s[-1] + 10))
    keep(classifier.run_pass(end_s[-1] + 10 + classifier.grace_s))  # the last turns final
    stream_s = time.process_time() - started
    tenth = max(1, len(pass_cpu) // 10)
    print(f"  a pass: {1000 * np.mean(pass_cpu[:tenth]):.1f} ms in the first tenth of the run, "
          f"{1000 * np.mean(pass_cpu[-tenth:]):.1f} ms in the last (wall, "
          f"{len(pass_cpu)} passes; the window fills up in between)")
    return stream_s, final, passes, held, classifier


if __name__ == "__main__":
    main()
