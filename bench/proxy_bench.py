"""Proxy overhead: kvobs proxy against vLLM's Rust router (vllm-router), in one run.

Front doors, each its own process, started pinned (``taskset``) to the same core, one
after the other in front of the same instant stand-in engines:

- ``router-rr``: vllm-router (PyPI, P/D mode) ``--policy round_robin``: the anchor;
- ``router-default``: vllm-router with its default policy (``cache_aware``);
- ``python-floor``: the least a P/D relay in Python does (aiohttp on uvloop, orjson;
  parse, post P, parse P's answer, post D, return D's bytes, a stream buffered whole; no
  state, spans or checks), the floor any Python proxy stands on;
- ``kvobs-default``: ``kvobs proxy`` with no flags (in-process store, no spans);
- ``kvobs-prod``: ``kvobs proxy --store redis --redis-url URL --store-dir DIR``: state in a
  real redis-server the bench starts, spans to a span store;
- ``kvobs-prod-w2`` (any ``-wN``): ``kvobs-prod`` with ``--workers N`` (SO_REUSEPORT),
  pinned to every core: what N workers give on this box, sharing the load generator's
  core; its metrics read from each worker's own port.

The stand-in P and D (one process), the load generator (this process) and redis-server
share the other core(s). Workload: chat conversations of 8 turns, each turn adding a user
message of ~800 characters and D's answer of ~200 (turn 8 sends ~7,800 characters of
history), ``conversation_id`` in the body, an API key per client (8 tenants: keyless
clients get no reuse), each client running its conversations back to back (closed loop).
Per front door: 1 client (latency; the added p50/p99 is over the client calling P then D
itself, measured just before), then 64 (req/s, and its share of the client calling P then D
itself with 64 clients, measured just before) and 256 clients (req/s, errors). CPU per request is
the front door's process (and its children) from /proc via psutil, over each phase.
Reuse is counted at the P stand-in: turns 2-8 whose P request carried D's params.

    .venv/bin/python bench/proxy_bench.py [--scale 1.0] [--stream] [--only kvobs-prod,...]
        [--also-rev REV] [--profile DIR]

``--also-rev REV`` adds ``kvobs-prod@REV``: the production configuration run from a
``git archive`` of REV (a change's before and after in one run); ``--profile DIR`` records
py-spy (``py-spy record --format raw --gil``: the thread holding the GIL, 250 Hz,
non-blocking) of each kvobs front door over its 64-client phase into DIR.
``--only ...,kvobs-prod-nohiredis`` adds the production configuration with redis-py's
pure-Python reply parser (hiredis hidden): what the C parser buys, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TURNS = 8
USER_CHARS = 800
ANSWER = ("The answer, in short: " + "tok " * 50)[:200]
TENANTS = 8
FRONT_DOORS = ("router-rr", "router-default", "python-floor", "kvobs-default", "kvobs-prod",
               "kvobs-prod-w2")
ANCHOR = "router-rr"
NO_HIREDIS = "kvobs-prod-nohiredis"  # kvobs-prod without redis-py's C parser (hiredis)
# kvobs-prod-wN: kvobs-prod with N worker processes on one port, pinned to every core
# (N workers on one core would share it: the figure is what this box gives).
WORKERS = "kvobs-prod-w"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _json():
    try:
        import orjson

        return orjson.dumps, orjson.loads
    except ImportError:  # pragma: no cover
        return (lambda value: json.dumps(value).encode()), json.loads


def _fast_loop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover
        pass


# ---------------------------------------------------------------------- stand-in engines


def serve_engines(p_port: int, d_port: int) -> None:
    """Instant stand-ins: answer at once with P- or D-style kv_transfer_params; count P's
    turns 2+ and those that carried D's params, and every request by path."""
    from aiohttp import web

    dumps, _ = _json()
    stats: dict[str, int] = {"p_later_turns": 0, "p_with_params": 0}

    def params(role: str) -> dict:
        return {"do_remote_prefill": role == "prefill", "do_remote_decode": role == "decode",
                "remote_block_ids": [[1, 2]], "remote_engine_id": role,
                "remote_request_id": "r", "remote_host": "h", "remote_port": 1,
                "remote_num_tokens": 10,
                "remote_blocks_expiry_time": time.monotonic() + 1e6 if role == "decode"
                else None}

    def make(role: str) -> web.Application:
        answer = ANSWER if role == "decode" else "x"
        body = dumps({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": answer}}],
            "usage": {"prompt_tokens": 10}, "kv_transfer_params": params(role)})
        pieces = [ANSWER[i:i + 25] for i in range(0, len(ANSWER), 25)]
        stream = b"".join(
            b"data: " + dumps({"choices": [{"index": 0, "delta": {"content": piece}}]})
            + b"\n\n" for piece in pieces) + b"data: " + dumps(
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
             "kv_transfer_params": params(role)}) + b"\n\ndata: [DONE]\n\n"

        async def handle(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            stats[f"{role} {request.method} {request.path}"] = \
                stats.get(f"{role} {request.method} {request.path}", 0) + 1
            if role == "prefill" and b'assistant"' in raw:
                stats["p_later_turns"] += 1
                at = raw.find(b'"remote_block_ids"')
                if at >= 0 and not raw[at + 18:at + 26].lstrip(b": ").startswith(b"null"):
                    stats["p_with_params"] += 1
            if not raw.startswith(b"{") or not (b'"stream":true' in raw
                                                 or b'"stream": true' in raw):
                return web.Response(body=body, content_type="application/json")
            if role == "prefill":
                return web.Response(body=body, content_type="application/json")
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(stream)
            await response.write_eof()
            return response

        async def other(request: web.Request) -> web.Response:
            stats[f"{role} {request.method} {request.path}"] = \
                stats.get(f"{role} {request.method} {request.path}", 0) + 1
            if request.path == "/bench/stats":
                return web.Response(body=dumps(stats), content_type="application/json")
            return web.json_response({})  # /health, and whatever a router polls

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", handle)
        app.router.add_route("*", "/{tail:.*}", other)
        return app

    async def main() -> None:
        for role, port in (("prefill", p_port), ("decode", d_port)):
            runner = web.AppRunner(make(role), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    _fast_loop()
    asyncio.run(main())


def serve_floor(port: int, p_url: str, d_url: str) -> None:
    """The least a P/D relay in Python does, as a floor for kvobs proxy: aiohttp on
    uvloop, orjson; parse the client's body, post P its prefill body (max_tokens 1,
    kv_transfer_params), parse P's answer, post D its body with P's params, return D's
    bytes. No state, no spans, no checks, no metrics."""
    import aiohttp
    from aiohttp import web

    dumps, loads = _json()
    headers = {"Content-Type": "application/json"}

    async def relay(request: web.Request) -> web.Response:
        body = loads(await request.read())
        session = request.app["session"]
        p_body = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False}}
        async with session.post(p_url + request.path, data=dumps(p_body),
                                headers=headers) as response:
            p_params = loads(await response.read()).get("kv_transfer_params")
        async with session.post(d_url + request.path, data=dumps(
                {**body, "kv_transfer_params": p_params}), headers=headers) as response:
            return web.Response(body=await response.read(), status=response.status,
                                content_type=response.content_type)

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(start)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/health", health)
    _fast_loop()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=lambda *_: None)


# ---------------------------------------------------------------------- load


class Workload:
    """Chat conversations of TURNS turns with growing histories (seeded text)."""

    def __init__(self, seed: int = 7):
        rng = random.Random(seed)
        words = ["kv", "cache", "decode", "prefill", "tensor", "block", "agent", "tool",
                 "history", "turn", "token", "router", "engine", "latency", "transfer",
                 "memory", "expiry", "replica", "tenant", "conversation"]
        self.pool = []
        for _ in range(64):
            text = ""
            while len(text) < USER_CHARS:
                text += rng.choice(words) + " "
            self.pool.append(text[:USER_CHARS])

    def user(self, conversation: str, turn: int) -> str:
        head = f"[{conversation} turn {turn}] "
        return head + self.pool[hash((conversation, turn)) % len(self.pool)][len(head):]


class Phase:
    def __init__(self):
        self.latencies: list[float] = []
        self.errors = 0
        self.error_kinds: dict[str, int] = {}
        self.elapsed = 0.0


async def run_load(url: str, workload: Workload, clients: int, conversations: int,
                   stream: bool, tag: str, direct: tuple[str, str] | None = None) -> Phase:
    """``clients`` workers, each running ``conversations`` conversations of TURNS turns.
    ``direct``: no front door, the client posts to P then to D itself (the baseline)."""
    import aiohttp

    dumps, loads = _json()
    phase = Phase()

    async def post(session, target: str, data: bytes, headers: dict) -> bytes:
        async with session.post(target, data=data, headers=headers) as response:
            raw = await response.read()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}")
            return raw

    def reply_of(raw: bytes) -> str:
        if not stream:
            return loads(raw)["choices"][0]["message"]["content"]
        out = []
        for line in raw.split(b"\n"):
            if line.startswith(b"data: {"):
                for choice in loads(line[6:]).get("choices", ()):
                    out.append((choice.get("delta") or {}).get("content") or "")
        return "".join(out)

    async def worker(session, wid: int) -> None:
        headers = {"Authorization": f"Bearer sk-bench-{wid % TENANTS}",
                   "Content-Type": "application/json"}
        for c in range(conversations):
            conversation = f"{tag}-{wid}-{c}"
            messages: list[dict] = []
            for turn in range(1, TURNS + 1):
                messages.append({"role": "user", "content": workload.user(conversation, turn)})
                data = dumps({"model": "m", "messages": messages, "stream": stream,
                              "max_tokens": 64, "conversation_id": conversation})
                start = time.perf_counter()
                try:
                    if direct is None:
                        raw = await post(session, url, data, headers)
                    else:
                        await post(session, direct[0], data, headers)
                        raw = await post(session, direct[1], data, headers)
                    reply = reply_of(raw)
                except Exception as error:  # noqa: BLE001 - counted, the client goes on
                    phase.errors += 1
                    kind = type(error).__name__ + (f" {error}" if isinstance(error, RuntimeError)
                                                   else "")
                    phase.error_kinds[kind] = phase.error_kinds.get(kind, 0) + 1
                    reply = ANSWER
                else:
                    phase.latencies.append(time.perf_counter() - start)
                messages.append({"role": "assistant", "content": reply})

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session, w) for w in range(clients)))
        phase.elapsed = time.perf_counter() - start
    return phase


async def _get_json(url: str):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            return await response.json(content_type=None)


def _metrics_text(name: str, port: int) -> str:
    """The front door's /metrics; with N workers, every worker's (each on its own port,
    ``--port`` + 1 + index), one after the other."""
    import urllib.request

    workers = int(name.partition("@")[0].removeprefix(WORKERS)) if name.startswith(WORKERS) \
        else 0
    ports = [port + 1 + i for i in range(workers)] or [port]
    texts = []
    for each in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{each}/metrics", timeout=5) as answer:
                texts.append(answer.read().decode())
        except OSError:
            pass
    return "\n".join(texts)


def _degraded(name: str, port: int) -> dict[str, float]:
    """The proxy's ``kvobs_proxy_store_degraded_total`` by reason: turns that went on
    without the store (budget spent, timeout, breaker open)."""
    out: dict[str, float] = {}
    for line in _metrics_text(name, port).splitlines():
        if line.startswith("kvobs_proxy_store_degraded_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.split()[-1])
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# ---------------------------------------------------------------------- front doors


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


def front_door_cmd(name: str, port: int, p_url: str, d_url: str, redis_url: str,
                   store_dir: str) -> list[str]:
    name = name.partition("@")[0]
    if name == "python-floor":
        return [sys.executable, str(Path(__file__).resolve()), "--serve-floor", str(port),
                p_url, d_url]
    if name.startswith("router"):
        policy = ["--policy", "round_robin"] if name == "router-rr" else []
        return [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
                "--port", str(port), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                "--prefill", p_url, "--decode", d_url, *policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
                "--worker-startup-check-interval", "1", "--disable-retries",
                "--disable-circuit-breaker", "--log-level", "warning"]
    p_host, p_port = p_url.removeprefix("http://").split(":")
    d_host, d_port = d_url.removeprefix("http://").split(":")
    cmd = [sys.executable, "-m", "kvobs", "proxy", "--host", "127.0.0.1", "--port", str(port),
           "--prefiller-host", p_host, "--prefiller-port", p_port,
           "--decoder-host", d_host, "--decoder-port", d_port]
    if name.startswith("kvobs-prod"):
        cmd += ["--store", "redis", "--redis-url", redis_url, "--store-dir", store_dir]
    if name.startswith(WORKERS):
        cmd += ["--workers", name.partition("@")[0].removeprefix(WORKERS)]
    return cmd


def _cpu(proc) -> float:
    import psutil

    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def _source_of(rev: str, work: Path) -> Path:
    """The repository at ``rev`` (``git archive``), to run a front door from."""
    target = work / f"rev-{rev.replace('/', '_')}"
    if not target.exists():
        target.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def bench_front_door(name: str, args, workload: Workload, urls: dict, core: int,
                     redis_proc, redis_url: str, store_dir: str, env: dict) -> dict:
    import psutil

    port = _free_port()
    work = Path(store_dir).parent
    log = open(work / f"{name}.log", "wb")
    source = ROOT
    if "@" in name:  # the same configuration from another revision of the repository
        source = _source_of(name.partition("@")[2], work)
        env = {**env, "PYTHONPATH": str(source) + os.pathsep + env.get("PYTHONPATH", "")}
    if name == NO_HIREDIS:  # redis-py falls back to its pure-Python RESP parser
        hidden = work / "no-hiredis"
        hidden.mkdir(exist_ok=True)
        (hidden / "hiredis.py").write_text('raise ImportError("hidden by proxy_bench")\n')
        env = {**env, "PYTHONPATH": str(hidden) + os.pathsep + env.get("PYTHONPATH", "")}
    if name.startswith(WORKERS):
        core = ",".join(str(c) for c in sorted(os.sched_getaffinity(0) | {core}))
    proc = subprocess.Popen(["taskset", "-c", str(core),
                             *front_door_cmd(name, port, urls["p"], urls["d"], redis_url,
                                             store_dir)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(source),
                            stdin=subprocess.DEVNULL, start_new_session=True)
    result: dict = {"name": name}
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 90, proc)
        ps = psutil.Process(proc.pid)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        redis_ps = psutil.Process(redis_proc.pid) if redis_proc is not None else None
        stream = args.stream
        asyncio.run(run_load(url, workload, 16, 1, stream, f"{name}-warm"))
        scale = args.scale
        for clients, conversations in ((1, 100), (64, 8), (256, 3)):
            conversations = max(1, int(round(conversations * scale)))
            tag = f"{name}-{clients}"
            if clients == 1:
                base = asyncio.run(run_load(None, workload, 1, conversations, stream,
                                            tag + "-direct", direct=(urls["p_chat"],
                                                                     urls["d_chat"])))
                result["direct_p50"] = _pct(base.latencies, 0.5)
                result["direct_p99"] = _pct(base.latencies, 0.99)
            if clients == 64:  # the throughput a front door is a share of, just before
                base = asyncio.run(run_load(None, workload, clients, conversations, stream,
                                            tag + "-direct", direct=(urls["p_chat"],
                                                                     urls["d_chat"])))
                result["direct_rps64"] = clients * conversations * TURNS / base.elapsed
            before = asyncio.run(_get_json(urls["stats"]))
            degraded0 = _degraded(name, port) if name.startswith("kvobs") else {}
            cpu0 = _cpu(ps)
            redis0 = _cpu(redis_ps) if redis_ps else 0.0
            spy = None
            if args.profile and clients == 64 and name.startswith("kvobs"):
                os.makedirs(args.profile, exist_ok=True)
                spy = subprocess.Popen(
                    [shutil.which("py-spy")
                     or os.path.join(os.path.dirname(sys.executable), "py-spy"),
                     "record", "--pid", str(proc.pid), "--rate", "250",
                     "--nonblocking", "--gil", "--format", "raw", "--output",
                     os.path.join(args.profile, f"{name}.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            phase = asyncio.run(run_load(url, workload, clients, conversations, stream, tag))
            if spy is not None:
                spy.send_signal(2)
                spy.wait(timeout=30)
            cpu = _cpu(ps) - cpu0
            redis_cpu = (_cpu(redis_ps) - redis0) if redis_ps else 0.0
            after = asyncio.run(_get_json(urls["stats"]))
            degraded = {reason: n - degraded0.get(reason, 0) for reason, n in
                        (_degraded(name, port) if name.startswith("kvobs") else {}).items()
                        if n - degraded0.get(reason, 0)}
            requests = clients * conversations * TURNS
            later = after["p_later_turns"] - before["p_later_turns"]
            hits = after["p_with_params"] - before["p_with_params"]
            engine_calls = sum(v - before.get(k, 0) for k, v in after.items()
                               if " " in k and "/bench/" not in k)
            result[clients] = {
                "requests": requests, "errors": phase.errors, "error_kinds": phase.error_kinds,
                "rps": requests / phase.elapsed, "cpu_ms": cpu / requests * 1e3,
                "redis_cpu_ms": redis_cpu / requests * 1e3,
                "p50": _pct(phase.latencies, 0.5), "p99": _pct(phase.latencies, 0.99),
                "hit_rate": hits / later if later else float("nan"),
                "store_degraded": degraded, "engine_calls": engine_calls / requests}
            print(f"  {name:<15}{clients:>4} clients: {requests:>5} req  "
                  f"{result[clients]['rps']:>7.0f} req/s  cpu {result[clients]['cpu_ms']:.3f} "
                  f"ms/req  p50 {result[clients]['p50'] * 1e3:.2f} ms  p99 "
                  f"{result[clients]['p99'] * 1e3:.2f} ms  hits "
                  f"{result[clients]['hit_rate']:.1%}  errors {phase.errors}"
                  + (f" {phase.error_kinds}" if phase.errors else "")
                  + (f"  redis cpu {result[clients]['redis_cpu_ms']:.3f} ms/req"
                     if name.startswith("kvobs-prod") else "")
                  + (f"  store degraded {degraded}" if degraded else "")
                  + f"  engine calls/req {result[clients]['engine_calls']:.2f}"
                  + (f"  direct {result['direct_rps64']:.0f} req/s" if clients == 64 else ""),
                  flush=True)
        if name.startswith("kvobs"):
            text = _metrics_text(name, port)
            if text:
                result["spans_lost"] = sum(
                    float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("kvobs_telemetry_dropped_spans_total{"))
    finally:
        try:
            os.killpg(proc.pid, 15)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()
    return result


# ---------------------------------------------------------------------- report


def profile_top(path: str, top: int = 25) -> str:
    """py-spy raw stacks (``frame;frame;... count``) as the top functions by self and by
    inclusive samples (frames named ``function (file)``, line numbers dropped)."""
    import re
    from collections import Counter

    own, inclusive, total = Counter(), Counter(), 0
    with open(path) as handle:
        for line in handle:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
            frames = [re.sub(r"\(/[^)]*/(site-packages|work/main)/", "(", f) for f in frames]
            n = int(count)
            total += n
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    lines = [f"{total} samples; self:"]
    lines += [f"  {n / total:6.1%}  {frame}" for frame, n in own.most_common(top)]
    lines.append("inclusive:")
    lines += [f"  {n / total:6.1%}  {frame}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines)



def report(results: list[dict], args) -> None:
    anchor = next((r for r in results if r["name"] == ANCHOR), None)

    def cpu_all(r: dict) -> float:
        total = sum(r[c]["cpu_ms"] * r[c]["requests"] for c in (1, 64, 256))
        return total / sum(r[c]["requests"] for c in (1, 64, 256))

    rows = []
    for r in results:
        rows.append({
            "name": r["name"], "cpu": cpu_all(r), "cpu64": r[64]["cpu_ms"],
            "add50": r[1]["p50"] - r["direct_p50"], "add99": r[1]["p99"] - r["direct_p99"],
            "rps64": r[64]["rps"], "share64": r[64]["rps"] / r["direct_rps64"],
            "rps256": r[256]["rps"], "hits": r[256]["hit_rate"],
            "errors256": r[256]["errors"], "lost": r.get("spans_lost")})
    base = next((row for row in rows if anchor and row["name"] == ANCHOR), None)
    mode = "streamed" if args.stream else "non-streamed"
    print(f"\nsummary ({mode}; cpu = front door process ms/request over all phases; added = "
          "1-client latency over the client calling P then D itself)")
    print(f"{'front door':<15}{'cpu/req':>9}{'added p50':>11}{'added p99':>11}"
          f"{'req/s @64':>11}{'of direct':>11}{'req/s @256':>12}{'hits @256':>11}"
          f"{'errors @256':>13}")
    for row in rows:
        print(f"{row['name']:<15}{row['cpu']:>7.3f}ms{row['add50'] * 1e3:>9.2f}ms"
              f"{row['add99'] * 1e3:>9.2f}ms{row['rps64']:>11.0f}{row['share64']:>11.2f}"
              f"{row['rps256']:>12.0f}"
              f"{row['hits']:>11.1%}{row['errors256']:>13}"
              + (f"   spans lost {row['lost']:.0f}" if row["lost"] is not None else ""))
    if base is None:
        return
    print(f"\nratios to {ANCHOR} (same run; cpu, added latency: lower is better; req/s: "
          "higher is better); added p99 difference in ms")
    print(f"{'front door':<15}{'cpu/req':>9}{'added p50':>11}{'added p99':>11}"
          f"{'p99 diff':>10}{'req/s @64':>11}{'req/s @256':>12}")
    for row in rows:
        def ratio(key, row=row):
            return row[key] / base[key] if base[key] > 0 else float("nan")
        print(f"{row['name']:<15}{ratio('cpu'):>8.2f}x{ratio('add50'):>10.2f}x"
              f"{ratio('add99'):>10.2f}x{(row['add99'] - base['add99']) * 1e3:>8.2f}ms"
              f"{ratio('rps64'):>10.2f}x{ratio('rps256'):>11.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0,
                        help="conversations per client, times (1: 100 / 8 / 3)")
    parser.add_argument("--stream", action="store_true", help="streamed turns")
    parser.add_argument("--only", default=",".join(FRONT_DOORS),
                        help="front doors to run, in order (comma-separated)")
    parser.add_argument("--core", type=int, default=-1,
                        help="core the front door is pinned to (default: the last)")
    parser.add_argument("--keep", help="keep the work directory here (logs, span store)")
    parser.add_argument("--also-rev", help="add kvobs-prod@REV: the production "
                        "configuration from a git revision (a change's before, in the run)")
    parser.add_argument("--profile", help="py-spy of each kvobs front door's 64-client "
                        "phase into this directory")
    parser.add_argument("--serve-engines", nargs=2, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-floor", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engines:
        return serve_engines(*args.serve_engines)
    if args.serve_floor:
        return serve_floor(int(args.serve_floor[0]), *args.serve_floor[1:])
    if shutil.which("taskset") is None:
        sys.exit("taskset (util-linux) is needed to pin the front doors")

    from kvobs.testbed.services import RedisServer

    _fast_loop()
    names = [n for n in args.only.split(",") if n]
    if args.also_rev:
        names.insert(names.index("kvobs-prod") if "kvobs-prod" in names else len(names),
                     f"kvobs-prod@{args.also_rev}")
    cores = sorted(os.sched_getaffinity(0))
    core = cores[args.core % len(cores)]
    others = [c for c in cores if c != core] or cores
    work = Path(args.keep or tempfile.mkdtemp(prefix="proxy-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    store_dir = work / "store"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("OTEL_SDK_DISABLED", None)
    env.pop("KVOBS_STORE", None)
    p_port, d_port = _free_port(), _free_port()
    engines = subprocess.Popen([sys.executable, __file__, "--serve-engines", str(p_port),
                                str(d_port)], env=env, start_new_session=True)
    redis = RedisServer(work / "redis") if any(n.startswith("kvobs-prod") for n in names) \
        else None
    results = []
    try:
        os.sched_setaffinity(engines.pid, set(others))
        if redis is not None:
            os.sched_setaffinity(redis.pid, set(others))
        os.sched_setaffinity(0, set(others))
        urls = {"p": f"http://127.0.0.1:{p_port}", "d": f"http://127.0.0.1:{d_port}",
                "p_chat": f"http://127.0.0.1:{p_port}/v1/chat/completions",
                "d_chat": f"http://127.0.0.1:{d_port}/v1/chat/completions",
                "stats": f"http://127.0.0.1:{p_port}/bench/stats"}
        _wait_http(urls["stats"], 30, engines)
        workload = Workload()
        print(f"front doors pinned to core {core}; engines, redis and load on {others}; "
              f"{'streamed' if args.stream else 'non-streamed'} chat, {TURNS} turns of "
              f"~{USER_CHARS + len(ANSWER)} chars, {TENANTS} API keys; work dir {work}",
              flush=True)
        for name in names:
            if redis is not None:
                import redis as redis_py

                client = redis_py.Redis.from_url(redis.url)
                client.flushall()
                client.close()
            results.append(bench_front_door(name, args, workload, urls, core,
                                            redis.proc if redis else None,
                                            redis.url if redis else "", str(store_dir), env))
        report(results, args)
        if args.profile:
            for name in names:
                path = os.path.join(args.profile, f"{name}.txt")
                if os.path.exists(path):
                    print(f"\nprofile of {name} (64 clients): {path}")
                    print(profile_top(path))
    finally:
        if redis is not None:
            redis.stop()
        try:
            os.killpg(engines.pid, 15)
        except ProcessLookupError:
            pass
        engines.wait(timeout=10)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
