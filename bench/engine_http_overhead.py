"""What kvobs.emit.engine_http adds to a request in an engine's API server.

A stand-in ASGI app (reads the request whole, answers in chunks) is called directly, with
and without the middleware, in the same run (the anchor: the same app bare). The
middleware's tracer is the real one (``configure_tracing``: the batch processor and the
span store's file exporter, as on the testbed), so the figure includes building and
queueing the span; the export runs on its own thread, as in production.

    .venv/bin/python bench/engine_http_overhead.py [--requests 20000] [--body-kib 1,64,512]

Prints, per request body size, the median and p99 of the per-request time bare and with
the middleware, and the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from kvobs.emit.engine_http import EngineHttpTiming
from kvobs.emit.setup import configure_tracing
from kvobs import semconv as sc


async def _app(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(3):
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _run(app, body: bytes, requests: int) -> list[float]:
    chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)] or [b""]
    headers = [(b"host", b"p"), (b"content-type", b"application/json")]
    scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST"}

    async def send(message):
        return None

    times = []
    for _ in range(requests):
        receive = _receiver(list(chunks))

        started = time.perf_counter_ns()
        await app({**scope, "headers": list(headers)}, receive, send)
        times.append((time.perf_counter_ns() - started) / 1e3)
    return times


def _receiver(pending: list[bytes]):
    async def receive():
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    return receive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--body-kib", default="1,64,512")
    args = parser.parse_args()
    store = tempfile.mkdtemp(prefix="kvobs-http-bench-")
    timed = EngineHttpTiming(_app)
    timed._tracer = configure_tracing(sc.Service.ENGINE, store)
    print(f"{args.requests:,} requests per run, span store {store}")
    print("body KiB | bare p50 / p99 us | with middleware p50 / p99 us | added p50 us")
    for kib in (int(k) for k in args.body_kib.split(",")):
        # A D request: the conversation, then P's params with the shard at the end.
        body = (
            b'{"prompt":"'
            + b"x" * (kib * 1024)
            + b'","kv_transfer_params":{"kvobs_shard":"0011223344556677"}}'
        )
        runs = {}
        for name, app in (("bare", _app), ("with", timed), ("bare", _app), ("with", timed)):
            times = asyncio.run(_run(app, body, args.requests))
            runs.setdefault(name, []).extend(times)
        stats = {
            name: (statistics.median(t), statistics.quantiles(t, n=100)[98])
            for name, t in runs.items()
        }
        (b50, b99), (w50, w99) = stats["bare"], stats["with"]
        print(f"{kib:8} | {b50:7.1f} / {b99:7.1f} | {w50:7.1f} / {w99:7.1f} | {w50 - b50:+.1f}")


if __name__ == "__main__":
    main()
