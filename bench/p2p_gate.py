"""What llm-d's router-side gate (``minCachedTokenDelta``) weighs, measured on configuration
(b): the time to pull a prefix from a peer's host tier (p2p, NIXL) against recomputing it.

    python bench/p2p_gate.py [--sizes 256,1024,2048,3072] [--rounds 3] [--out DIR]

Starts P and D with the p2p host tier (``PDPair(p2p_host_bytes=)``), then per round and
prefix size N (tokens; one character is one token with the testbed's tokenizer): a fresh
N-token turn 1 on D (saved whole in D's host tier, 1 token out), then on P the same
prefix plus 64 new tokens, 1 token out, twice in alternating order: naming D in
``remote_kv_source`` (the pull) and with a fresh ``cache_salt`` (the recompute, same
tokens). Prints per size the median wall time of each, their ratio, and the tokens P
actually took from the p2p tier (``prompt_tokens_cached_by_source{source="p2p"}``). On
this box's tiny model recompute is cheap, so the pull's fixed cost (the p2p lookup's
round trips) dominates; on a real model and GPU the break-even moves, which is why the
gate is a calibrated parameter. Printed, never asserted. Run under the testbed lock.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvobs import semconv as sc
from kvobs.testbed.engines import SERVED_MODEL_NAME, PDPair
from kvobs.testbed.model import build_tiny_model, safe_token_ids
from kvobs.testbed.stack import DEFAULT_MODEL_DIR, MODEL_SIZE

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _post(url: str, body: dict) -> float:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()
    return time.perf_counter() - start


def _p2p_tokens(engine) -> float:
    name, total = sc.M_VLLM_PROMPT_CACHED_BY_SOURCE.name, 0.0
    for line in engine.metrics().splitlines():
        if line.startswith(name + "{") and 'source="p2p"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256,1024,2048,3072")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    out = Path(args.out or tempfile.mkdtemp(prefix="kvobs-p2p-gate-"))
    model, _ = build_tiny_model(DEFAULT_MODEL_DIR, **MODEL_SIZE)
    rng = random.Random(7)
    base = {"model": SERVED_MODEL_NAME, "temperature": 0.0, "ignore_eos": True,
            "max_tokens": 1, "allowed_token_ids": safe_token_ids()}
    pulls: dict[int, list[float]] = {n: [] for n in sizes}
    recomputes: dict[int, list[float]] = {n: [] for n in sizes}
    pulled: dict[int, list[float]] = {n: [] for n in sizes}
    with PDPair.on_free_ports(model, out, p2p_host_bytes=256 * 1024 * 1024) as pair:
        print(f"engines ready in {pair.start_s:.1f}s; logs in {out}", file=sys.stderr)
        for round_ in range(args.rounds):
            for n in sizes:
                prefix = "".join(rng.choice(ALPHABET) for _ in range(n))
                _post(pair.decode.url, {**base, "prompt": prefix})
                time.sleep(1.0)  # the last stores go out on the step after the request
                prompt = prefix + "".join(rng.choice(ALPHABET) for _ in range(64))
                before = _p2p_tokens(pair.prefill)
                pull = {**base, "prompt": prompt, "kv_transfer_params":
                        pair.decode.p2p_source(f"gate-{round_}-{n}")}
                recompute = {**base, "prompt": prompt, "cache_salt": f"gate-{round_}-{n}"}
                order = [("pull", pull), ("recompute", recompute)]
                for label, body in order if round_ % 2 == 0 else order[::-1]:
                    seconds = _post(pair.prefill.url, body)
                    (pulls if label == "pull" else recomputes)[n].append(seconds)
                pulled[n].append(_p2p_tokens(pair.prefill) - before)
    print(f"{'prefix':>7} {'p2p tokens':>10} {'pull s':>8} {'recompute s':>11} "
          f"{'pull/recompute':>14}")
    for n in sizes:
        pull, rec = statistics.median(pulls[n]), statistics.median(recomputes[n])
        print(f"{n:>7} {statistics.median(pulled[n]):>10.0f} {pull:>8.3f} {rec:>11.3f} "
              f"{pull / rec:>14.2f}")


if __name__ == "__main__":
    main()
