"""Proxy overhead benchmark: latency added vs calling a stand-in directly, throughput, CPU.

Runs instant stand-in engines (P and D, one process), the proxy (its own process, pinned
to one core), and a load generator (this process). For 1, 64 and 256 concurrent clients,
streaming and not, it measures p50/p99 latency direct to the D stand-in and through the
proxy (which makes two upstream calls: P then D), proxied req/s, and the proxy's CPU
seconds per request (from /proc, via psutil). All figures come from one run.

    /work/venv/bin/python bench/proxy_bench.py [--requests-scale 1.0] [--core 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_engines(p_port: int, d_port: int) -> None:
    """Instant stand-ins: answer at once with P- or D-style kv_transfer_params."""
    from aiohttp import web

    def make(role: str) -> web.Application:
        body = json.dumps({
            "id": "x", "choices": [{"index": 0, "message": {"role": "assistant",
                                                            "content": "tok " * 8}}],
            "usage": {"prompt_tokens": 10},
            "kv_transfer_params": {
                "do_remote_prefill": role == "prefill", "do_remote_decode": role == "decode",
                "remote_block_ids": [[1, 2]], "remote_engine_id": role,
                "remote_request_id": "r", "remote_host": "h", "remote_port": 1,
                "remote_num_tokens": 10,
                "remote_blocks_expiry_time": time.monotonic() + 1e6 if role == "decode"
                else None}}).encode()

        async def handle(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            if b'"stream": true' not in raw:
                return web.Response(body=body, content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(CHUNK * 8 + b"data: [DONE]\n\n")
            await response.write_eof()
            return response

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handle)
        return app

    async def main() -> None:
        for role, port in (("prefill", p_port), ("decode", d_port)):
            runner = web.AppRunner(make(role), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def serve_proxy(port: int, p_port: int, d_port: int) -> None:
    os.environ.setdefault("OTEL_SDK_DISABLED", "true")
    from connector_instrumented.proxy import Endpoint, ProxyConfig, run_proxy

    run_proxy(ProxyConfig(prefill=(Endpoint("127.0.0.1", p_port),),
                          decode=(Endpoint("127.0.0.1", d_port),),
                          host="127.0.0.1", port=port))


async def _wait_up(url: str, timeout_s: float = 60.0) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.post(url, data=b'{"messages": []}') as response:
                    await response.read()
                    return
            except aiohttp.ClientError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def _load(url: str, concurrency: int, total: int, stream: bool,
                conversation: bool) -> tuple[list[float], float]:
    import aiohttp

    latencies: list[float] = []
    messages = [{"role": "user", "content": "hello " * 50}]
    counter = iter(range(total))

    async def worker(session: aiohttp.ClientSession, wid: int) -> None:
        for i in counter:
            body = {"model": "m", "messages": messages, "stream": stream}
            if conversation:
                body["conversation_id"] = f"c{wid}-{i % 4}"
            data = json.dumps(body).encode()
            start = time.perf_counter()
            async with session.post(url, data=data) as response:
                await response.read()
                assert response.status == 200, response.status
            latencies.append(time.perf_counter() - start)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session, w) for w in range(concurrency)))
        elapsed = time.perf_counter() - start
    return latencies, elapsed


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-scale", type=float, default=1.0)
    parser.add_argument("--core", type=int, default=0, help="core the proxy is pinned to")
    parser.add_argument("--serve-engines", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-proxy", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engines:
        return serve_engines(*args.serve_engines)
    if args.serve_proxy:
        return serve_proxy(*args.serve_proxy)

    import psutil

    p_port, d_port, proxy_port = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cores = sorted(os.sched_getaffinity(0))
    proxy_core = cores[args.core % len(cores)]
    others = [c for c in cores if c != proxy_core] or cores
    engines = subprocess.Popen([sys.executable, __file__, "--serve-engines", str(p_port),
                                str(d_port)], env=env)
    proxy = subprocess.Popen([sys.executable, __file__, "--serve-proxy", str(proxy_port),
                              str(p_port), str(d_port)], env=env)
    try:
        os.sched_setaffinity(proxy.pid, {proxy_core})
        os.sched_setaffinity(engines.pid, set(others))
        os.sched_setaffinity(0, set(others))
        direct_url = f"http://127.0.0.1:{d_port}/v1/chat/completions"
        proxy_url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
        asyncio.run(_wait_up(direct_url))
        asyncio.run(_wait_up(proxy_url))
        proc = psutil.Process(proxy.pid)
        print(f"proxy pinned to core {proxy_core}; engines and load on {others}")
        print(f"{'mode':<7}{'conc':>5} | {'direct p50':>10} {'p99':>8} | {'proxy p50':>10} "
              f"{'p99':>8} | {'added p50':>9} {'p99':>8} | {'ratio p50':>9} | "
              f"{'req/s':>7} | {'cpu/req':>8} | {'req/s/core':>10}")
        for stream in (False, True):
            for concurrency, total in ((1, 1000), (64, 6000), (256, 8000)):
                total = max(concurrency, int(total * args.requests_scale))
                asyncio.run(_load(proxy_url, concurrency, min(total, 500), stream, True))
                direct, _ = asyncio.run(_load(direct_url, concurrency, total, stream, False))
                cpu_before = sum(proc.cpu_times()[:2])
                proxied, elapsed = asyncio.run(_load(proxy_url, concurrency, total, stream,
                                                     True))
                cpu = sum(proc.cpu_times()[:2]) - cpu_before
                d50, d99 = _pct(direct, 0.5), _pct(direct, 0.99)
                p50, p99 = _pct(proxied, 0.5), _pct(proxied, 0.99)
                print(f"{'stream' if stream else 'json':<7}{concurrency:>5} | "
                      f"{d50 * 1e3:>8.2f}ms {d99 * 1e3:>6.2f}ms | {p50 * 1e3:>8.2f}ms "
                      f"{p99 * 1e3:>6.2f}ms | {(p50 - d50) * 1e3:>7.2f}ms "
                      f"{(p99 - d99) * 1e3:>6.2f}ms | {p50 / d50:>8.2f}x | "
                      f"{total / elapsed:>7.0f} | {cpu / total * 1e3:>6.3f}ms | "
                      f"{total / cpu if cpu else float('inf'):>10.0f}")
    finally:
        for child in (proxy, engines):
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


if __name__ == "__main__":
    main()
