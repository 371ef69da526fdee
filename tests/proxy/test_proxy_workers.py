"""``kvobs proxy --workers 2``: two processes on one port (SO_REUSEPORT), a real Redis.

The proxy runs as the command does (a subprocess, stopped by PID), in front of stand-in
engines served from the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest
from click.testing import CliRunner

import kvobs.cli.proxy as cli_proxy
from proxy_standins import DecodeState, StandInDecode, StandInPrefill, free_port

ROOT = Path(__file__).resolve().parents[2]
KEY = {"Authorization": "Bearer sk-workers"}


def _free_pair() -> int:
    """A port whose next one is free too (the two workers' metrics ports)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _start(prefill, decode, redis_url, port, metrics_port, store_dir) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OTEL_SDK_DISABLED", None)
    return subprocess.Popen(
        [sys.executable, "-m", "kvobs", "proxy", "--host", "127.0.0.1", "--port", str(port),
         "--prefiller-host", "127.0.0.1", "--prefiller-port", str(prefill.port),
         "--decoder-host", "127.0.0.1", "--decoder-port", str(decode.port),
         "--decode-kv-ttl", "30", "--store", "redis", "--redis-url", redis_url,
         "--store-dir", str(store_dir), "--workers", "2",
         "--metrics-port", str(metrics_port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True)


def _stop(proc: subprocess.Popen, workers: list[int]) -> None:
    """Everything the test started goes, by PID, whatever happened."""
    for pid in [proc.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)


async def _workers_of(proc: subprocess.Popen, session, metrics_port: int) -> list[int]:
    """The two worker PIDs, once both serve their metrics."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            for port in (metrics_port, metrics_port + 1):
                async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                    assert response.status == 200
            return [c.pid for c in psutil.Process(proc.pid).children()]
        except aiohttp.ClientError:
            await asyncio.sleep(0.2)
    raise AssertionError("workers not serving after 60 s")


async def _metric(session, port: int, name: str, label: str = "") -> float:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and label in line)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@contextlib.asynccontextmanager
async def _two_workers(redis_url: str, store_dir: Path):
    """Stand-in P and D, and ``kvobs proxy --workers 2`` in front of them, serving."""
    state = DecodeState()
    prefill, decode = StandInPrefill(state), StandInDecode(state)
    await prefill.start()
    await decode.start()
    port, metrics_port = free_port(), _free_pair()
    proc = _start(prefill, decode, redis_url, port, metrics_port, store_dir)
    workers: list[int] = []
    try:
        async with aiohttp.ClientSession() as session:
            workers += await _workers_of(proc, session, metrics_port)
            assert len(workers) == 2
            yield proc, session, port, metrics_port, workers, prefill
    finally:
        _stop(proc, workers)
        await prefill.stop()
        await decode.stop()


def test_two_workers_share_a_port_and_reuse_across_workers(redis_url, tmp_path):
    async def scenario():
        async with _two_workers(redis_url, tmp_path / "store") as (
                proc, session, port, metrics_port, workers, prefill):
            # A new connection per turn: the kernel picks the worker each time.
            conversations, turns = 8, 5
            for c in range(conversations):
                messages = []
                for t in range(turns):
                    messages.append({"role": "user", "content": f"c{c} turn {t}"})
                    body = {"model": "m", "messages": messages, "conversation_id": f"c{c}"}
                    async with aiohttp.ClientSession() as fresh:
                        async with fresh.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                              data=json.dumps(body), headers=KEY) as r:
                            assert r.status == 200, await r.text()
                            out = await r.json()
                    messages.append(out["choices"][0]["message"])
            ports = (metrics_port, metrics_port + 1)
            served = [await _metric(session, p, "kvobs_proxy_turns_total") for p in ports]
            hits = [await _metric(session, p, "kvobs_proxy_lookups_total", 'outcome="hit"')
                    for p in ports]
            # Both took requests; each metrics port counts its own worker's turns only.
            assert all(n > 0 for n in served) and sum(served) == conversations * turns
            # Every later turn found the turn before it, whichever worker stored it.
            assert sum(hits) == conversations * (turns - 1) == len(prefill.reads)
            assert all(n > 0 for n in hits)
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                assert response.status == 404
                assert (await response.json())["metrics_ports"] == list(ports)
            # Each worker wrote its own span store segment. Spans reach a segment in
            # batches (OTEL_BSP_SCHEDULE_DELAY): a worker whose batch is still due has
            # none yet (seen at load 20), so wait for it, bounded.
            def writers() -> set[str]:
                return {p.name.rsplit("-", 1)[1].split(".")[0]
                        for p in (tmp_path / "store").rglob("*.otlp.jsonl")}

            deadline = time.monotonic() + 30
            while not {str(pid) for pid in workers} <= writers():
                assert time.monotonic() < deadline, (workers, writers())
                await asyncio.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert all(_gone(pid) for pid in workers)

    asyncio.run(scenario())


def test_a_worker_failing_stops_the_others(redis_url, tmp_path):
    async def scenario():
        async with _two_workers(redis_url, tmp_path / "store") as (proc, _, _, _, workers, _):
            os.kill(workers[0], signal.SIGKILL)
            assert proc.wait(timeout=30) == 1
            assert _gone(workers[1])

    asyncio.run(scenario())


@pytest.mark.parametrize("args", [["--workers", "2"],
                                  ["--workers", "0", "--redis-url", "redis://x:1"]])
def test_workers_need_redis_and_a_positive_count(monkeypatch, args):
    import kvobs.proxy as package

    monkeypatch.setattr(package, "run_proxy", lambda config: pytest.fail("must not serve"))
    result = CliRunner().invoke(cli_proxy.proxy_command, args)
    assert result.exit_code == 2
    assert "redis store" in result.output or "workers must be positive" in result.output
