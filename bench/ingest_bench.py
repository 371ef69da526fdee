"""The whole `kvobs collect` service per span: an export request's body, as the Collector's
``otlphttp`` exporter sends it (protobuf, or JSON), through the receiver's decode and
encode, the append to the live segment, the live classifier's sink and its passes, in CPU
seconds per span, stage by stage; two kvobs trees run by turns (A B, B A, ...) in two
worker processes, as ``classifier_ab.py`` does.

    python bench/ingest_bench.py --a /tmp/base_ingest --b . [--rounds 6] [--format protobuf]
        [--conversations 1000] [--spans-per-request 300] [--spans-per-pass 10000]

Each tree is a directory holding ``kvobs`` (``git archive`` of a commit). The workload:
the synthetic fleet (``kvobs.synth.small``, as ``classifier_bench.py``), spans in end-time
order, cut into requests of ``--spans-per-request`` spans, each grouped by resource (a
service: ``service.name``, the SDK's ``telemetry.sdk.*``) as an SDK's exporter groups them.
JSON bodies are protobuf's JSON mapping with hex ids (the Collector's). Each worker builds
the same bodies (their digest is compared) and, per round, runs them all through a new
service (``Live``, its turn store in the run's store directory) with a pass every
``--spans-per-pass`` spans (``Live.run_pass``: the classifier's pass, the turns counted on
/metrics, the final ones written to the turn store). Not included: HTTP (aiohttp's request
parsing and response), the /metrics scrape, and the store's hourly upkeep (merging and
expiring partitions, off the event loop).

Stages, each the tree's own function the handler calls:
- ``decode``: the body to the stored line (old: ``collect._line``; new: ``collect.decode``);
- ``append``: ``LiveSegmentWriter.append`` into a fresh store under ``--tmp``;
- ``sink``: ``Live.receive`` (old: the line parsed again; new: the decoded document),
  which is the rows (``kvobs.sources._rows``) and the classifier's buffer;
- ``pass``: the service's passes (``Live.run_pass``; in ``detail``, the classifier's
  alone).
After the rounds, one more run per tree splits ``decode`` and ``sink`` further
(protobuf parse, to dict, ``json_line``; reading back, rows, ``buffer.add``). A tree with
the compiled decoder (``kvobs.emit.native``) decodes a protobuf body in one call: its
"parse" is that call, "to dict", "json_line" and "read back" none, "rows" the rows'
coercion.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

STAGES = ("decode", "append", "sink", "pass")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--format", choices=("protobuf", "json"), default="protobuf")
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--spans-per-request", type=int, default=300)
    parser.add_argument("--spans-per-pass", type=int, default=10000)
    parser.add_argument("--tmp", default=tempfile.gettempdir())
    parser.add_argument("--chains", action="store_true",
                        help="the connector's prefix chains on P's and D's spans "
                             "(bench/_chains.py): the lineage stage runs, as in a deployment")
    args = parser.parse_args()
    if args.worker:
        return _work(args)
    trees = {"a": os.path.abspath(args.a), "b": os.path.abspath(args.b)}
    argv = [a for a in sys.argv[1:] if not a.startswith(("--a=", "--b="))]
    workers = {
        name: subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv, "--worker"],
            env={**os.environ, "PYTHONPATH": tree},
            cwd=tree,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, tree in trees.items()
    }
    hello = {name: json.loads(w.stdout.readline()) for name, w in workers.items()}
    assert hello["a"]["digest"] == hello["b"]["digest"], "the two trees built other bodies"
    info = hello["a"]
    print(
        f"workload: {info['spans']} spans in {info['requests']} {args.format} requests "
        f"({info['body_bytes'] / info['requests'] / 1024:.0f} KiB a request), a pass every "
        f"{args.spans_per_pass} spans; load average at start "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    results: dict[str, list[dict]] = {"a": [], "b": []}

    def ask(name: str, command: str) -> dict:
        worker = workers[name]
        worker.stdin.write(command + "\n")
        worker.stdin.flush()
        return json.loads(worker.stdout.readline())

    for round_ in range(args.rounds):
        for name in ("a", "b") if round_ % 2 == 0 else ("b", "a"):
            results[name].append(ask(name, "run"))
        line = "  ".join(
            f"{name} {info['spans'] / sum(results[name][-1].values()):8.0f}" for name in "ab"
        )
        print(f"round {round_ + 1}: {line} spans/CPU-s (load {os.getloadavg()[0]:.2f})",
              flush=True)
    detail = {name: ask(name, "detail") for name in ("a", "b")}
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    spans = info["spans"]
    for name in ("a", "b"):
        runs = results[name]
        whole = [spans / sum(run.values()) for run in runs]
        print(f"{name} ({trees[name]}): whole median {statistics.median(whole):.0f}, best "
              f"{max(whole):.0f} spans/CPU-s; every round: "
              + ", ".join(f"{rate:.0f}" for rate in whole))
        medians = {stage: statistics.median(run[stage] for run in runs) for stage in STAGES}
        print("  per stage, median us/span: " + ", ".join(
            f"{stage} {1e6 * seconds / spans:.2f}" for stage, seconds in medians.items()))
        print("  split (one run), us/span: " + ", ".join(
            f"{stage} {1e6 * seconds / spans:.2f}" for stage, seconds in detail[name].items()))
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


# ---------------------------------------------------------------------------- worker


def _bodies(args) -> tuple[list[bytes], int]:
    """The synthetic fleet's spans as export request bodies, and the span count."""
    import numpy as np
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from kvobs.synth import small, spans_table

    config = small(args.conversations)
    table, _ = spans_table(config, np.arange(config.conversations))
    if args.chains:
        from _chains import with_prefix_chains  # this bench's own: both trees get one table

        table = with_prefix_chains(table)
    table = table.sort_by([("end_ns", "ascending")])
    rows = [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
    columns = ("trace_id", "span_id", "parent_span_id", "name", "service", "start_ns",
               "end_ns", "error")
    bodies = []
    for i in range(0, len(rows), args.spans_per_request):
        message = ExportTraceServiceRequest()
        by_service: dict = {}
        for row in rows[i:i + args.spans_per_request]:
            service = row.get("service", "unknown")
            if service not in by_service:
                resource_spans = message.resource_spans.add()
                for key, value in (("service.name", service),
                                   ("telemetry.sdk.language", "python"),
                                   ("telemetry.sdk.name", "opentelemetry"),
                                   ("telemetry.sdk.version", "1.39.1")):
                    resource_spans.resource.attributes.add(key=key).value.string_value = value
                scope_spans = resource_spans.scope_spans.add()
                scope_spans.scope.name = "kvobs"
                by_service[service] = scope_spans
            span = by_service[service].spans.add()
            span.trace_id = bytes.fromhex(row["trace_id"])
            span.span_id = bytes.fromhex(row["span_id"])
            if row.get("parent_span_id"):
                span.parent_span_id = bytes.fromhex(row["parent_span_id"])
            span.name = row["name"]
            span.kind = 1
            span.start_time_unix_nano = row["start_ns"]
            span.end_time_unix_nano = row["end_ns"]
            span.flags = 0x100
            if row.get("error"):
                span.status.code = 2
            else:
                span.status.SetInParent()
            for key, value in row.items():
                if key in columns:
                    continue
                any_value = span.attributes.add(key=key).value
                if isinstance(value, bool):
                    any_value.bool_value = value
                elif isinstance(value, int):
                    any_value.int_value = value
                elif isinstance(value, float):
                    any_value.double_value = value
                else:
                    any_value.string_value = str(value)
        if args.format == "protobuf":
            bodies.append(message.SerializeToString())
        else:
            from kvobs.emit.otlp_json import request_to_otlp_dict

            bodies.append(json.dumps(request_to_otlp_dict(message)).encode())
    return bodies, len(rows)


def _work(args) -> None:
    import contextlib
    import io

    from kvobs.emit import collect
    from kvobs.emit.segments import LiveSegmentWriter
    from kvobs.live.classifier import Classifier
    from kvobs.live.service import Live

    bodies, spans = _bodies(args)
    digest = hashlib.sha256(b"".join(bodies)).hexdigest()
    print(json.dumps({"spans": spans, "requests": len(bodies), "digest": digest,
                      "body_bytes": sum(map(len, bodies))}), flush=True)
    is_json = args.format == "json"
    new = hasattr(collect, "decode")

    def decode(body):  # the stored line, and what the sink is given
        if new:
            stored = collect.decode(body, is_json)
            return stored.line, stored
        line, _ = collect._line(body, is_json)
        return line, line

    # the decoded span counts and times of each request, for the passes' clock
    counts, ends = [], []
    for body in bodies:
        document = json.loads(decode(body)[0])
        spans_of = [span for rs in document.get("resourceSpans", ())
                    for ss in rs.get("scopeSpans", ()) for span in ss.get("spans", ())]
        counts.append(len(spans_of))
        ends.append(max(int(span["endTimeUnixNano"]) for span in spans_of) / 1e9)
    assert sum(counts) == spans
    # The bench's own bodies are no part of the service's heap: kept out of the
    # collector's full passes, which otherwise fall on whichever stage allocates.
    del document, spans_of
    gc.collect()
    gc.freeze()

    for command in sys.stdin:
        command = command.strip()
        if command not in ("run", "detail"):
            break
        store = tempfile.mkdtemp(prefix="ingest_bench_", dir=args.tmp)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                if command == "run":
                    result = _run(args, bodies, counts, ends, decode, store,
                                  LiveSegmentWriter, Classifier, Live)
                else:
                    result = _detail(args, bodies, counts, ends, new, store,
                                     LiveSegmentWriter, Classifier)
        finally:
            shutil.rmtree(store, ignore_errors=True)
        print(json.dumps(result), flush=True)


def _run(args, bodies, counts, ends, decode, store, writer_class, classifier_class, live_class):
    writer = writer_class(store, "bench")
    writer.makedirs()
    from kvobs.live.service import LiveSettings

    # The service as `kvobs collect` runs it: its passes also count the turns on /metrics
    # and write the final ones to its turn store (in this run's store directory).
    holder = live_class(store, LiveSettings(window_s=1e12, grace_s=5.0))
    classifier = holder.classifier
    simulated = SimulatedTime()  # add_request's arrival time: the request's last span end
    sys.modules[classifier_class.__module__].time = simulated
    clock = time.process_time
    spent = dict.fromkeys(STAGES, 0.0)
    taken = 0
    for body, count, now in zip(bodies, counts, ends):
        t0 = clock()
        line, given = decode(body)
        t1 = clock()
        writer.append(line + "\n")
        t2 = clock()
        simulated.now = now
        holder.receive(given)
        t3 = clock()
        spent["decode"] += t1 - t0
        spent["append"] += t2 - t1
        spent["sink"] += t3 - t2
        spent["pass"] += _passes(holder, args, taken, count, now)
        taken += count
    spent["pass"] += _passes(holder, args, taken, 0, ends[-1], last=True)
    assert classifier.spans_received == taken, (classifier.spans_received, taken)
    return spent


def _passes(runner, args, taken: int, count: int, now: float, last: bool = False) -> float:
    """A pass of ``runner`` (the service, ``Live``, or a bare ``Classifier``) where the
    ``count`` spans just taken cross a multiple of the spans a pass (``last``: the two
    final passes, a grace apart); their CPU seconds."""
    started = time.process_time()
    if last:
        grace_s = getattr(runner, "classifier", runner).grace_s
        runner.run_pass(now + 10)
        runner.run_pass(now + 10 + grace_s)
    elif (taken + count) // args.spans_per_pass > taken // args.spans_per_pass:
        runner.run_pass(now)
    return time.process_time() - started


class SimulatedTime:
    """The classifier module's ``time``, its ``time()`` the simulated fleet's clock (also
    ``classifier_idless_bench.py``'s)."""

    now = 0.0

    def time(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def _detail(args, bodies, counts, ends, new, store, writer_class, classifier_class):
    """One run with ``decode`` and ``sink`` split into the functions they call."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    from kvobs.emit import otlp_json
    from kvobs.sources._rows import rows as document_rows

    to_dict = getattr(otlp_json, "request_json", otlp_json.request_to_otlp_dict)
    loads = getattr(otlp_json, "loads", None)
    if loads is None:
        from kvobs.live.service import _loads as loads
    writer = writer_class(store, "bench")
    writer.makedirs()
    classifier = classifier_class(window_s=1e12, grace_s=5.0)
    clock = time.process_time
    names = ("parse", "to dict", "json_line", "append", "read back", "rows", "buffer.add",
             "pass")
    spent = dict.fromkeys(names, 0.0)
    taken = 0
    try:  # the compiled decoder, where the tree has it: its line and rows, one call
        from kvobs.emit.native import decode as compiled
        from kvobs.sources._rows import ReadRows
    except ImportError:
        compiled = None
    for body, count, now in zip(bodies, counts, ends):
        t0 = clock()
        decoded = compiled(body) if compiled and args.format == "protobuf" else None
        if decoded is not None:  # "parse": the whole compiled decode; "json_line": none
            line, document = decoded[0], ReadRows(decoded[1])
            t1 = t2 = t3 = clock()
            writer.append(line + "\n")
            t4 = t5 = clock()
            found = document_rows("otlp", document, [])
            t6 = clock()
            classifier.buffer.add(found, now)
            t7 = clock()
            for name, seconds in zip(names, (t1 - t0, 0.0, 0.0, t4 - t3, 0.0, t6 - t5,
                                             t7 - t6)):
                spent[name] += seconds
            spent["pass"] += _passes(classifier, args, taken, count, now)
            taken += count
            continue
        if args.format == "protobuf":
            message = ExportTraceServiceRequest()
            message.ParseFromString(body)
            t1 = clock()
            document = to_dict(message)
        else:
            if new:
                document = otlp_json.loads(body)
            else:
                document = json.loads(body)
            t1 = clock()
        t2 = clock()
        line, _ = otlp_json.json_line(document)
        t3 = clock()
        writer.append(line + "\n")
        t4 = clock()
        request = document if new else loads(line)
        t5 = clock()
        found = document_rows("otlp", request, [])
        t6 = clock()
        classifier.buffer.add(found, now)
        t7 = clock()
        for name, seconds in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4,
                                         t6 - t5, t7 - t6)):
            spent[name] += seconds
        spent["pass"] += _passes(classifier, args, taken, count, now)
        taken += count
    spent["pass"] += _passes(classifier, args, taken, 0, ends[-1], last=True)
    return spent


if __name__ == "__main__":
    main()
