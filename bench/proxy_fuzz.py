"""Fuzz the proxy with many more generated bad requests than CI sends (issue #10).

Same generator and checks as tests/proxy/test_proxy_fuzz.py (seeded; bad JSON, wrong
types, deep and huge bodies, invalid UTF-8, lone surrogates, bad headers, odd encodings,
chunking, slow clients, early disconnects), against an in-process proxy in front of
stand-in engines. Prints the answers by status, the rate, and every 5xx, hang or cut
stream; exits 1 when there is one.

    .venv/bin/python bench/proxy_fuzz.py --count 100000 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "proxy"))

from test_proxy_fuzz import BODY_TIMEOUT_S, fuzz, like_vllm  # noqa: E402

from fuzz_requests import FUZZ_MAX_BODY  # noqa: E402
from harness import Harness  # noqa: E402


async def main(seed: int, count: int) -> int:
    # aiohttp logs each request its HTTP parser refuses (it answers 400): not news here
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    async with Harness(max_body_bytes=FUZZ_MAX_BODY, body_timeout_s=BODY_TIMEOUT_S) as h:
        like_vllm(h.prefill)
        like_vllm(h.decode)
        result = await fuzz(h, seed, count)
        status, _ = await h.post({"messages": [{"role": "user", "content": "after"}]})
    print(f"{count} requests, seed {seed}: {result['seconds']:.1f} s "
          f"({count / result['seconds']:.0f} requests/s)")
    for code, n in sorted(result["statuses"].items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        print(f"  {code if code is not None else 'no answer (client left)'}: {n}")
    for name in ("server_errors", "hangs", "cut_streams"):
        print(f"{name}: {len(result[name])}", *result[name][:10], sep="\n  ")
    print(f"good request after: {status}")
    bad = result["server_errors"] or result["hangs"] or result["cut_streams"] or status != 200
    return 1 if bad else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.seed, args.count)))
