"""Fuzz (issue #10): 10,000 generated bad requests (fuzz_requests.py, seeded) against the
proxy in front of stand-in engines. No answer is a 5xx, every request ends within a
bound, nothing is logged as an unhandled error, and a good request is served after.

KVOBS_FUZZ_SEED and KVOBS_FUZZ_COUNT change the run (bench/proxy_fuzz.py runs more)."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import time

from aiohttp import web
from fuzz_requests import FUZZ_MAX_BODY, KEY, cases
from harness import Harness
from rawclient import send
from test_proxy_flow import run

SEED = int(os.environ.get("KVOBS_FUZZ_SEED", "20261"))
COUNT = int(os.environ.get("KVOBS_FUZZ_COUNT", "10000"))
CONCURRENCY = 64
BODY_TIMEOUT_S = 0.5
# body timeout + lingering close + a busy 2-core box
BOUND_S = 8.0


def like_vllm(engine) -> None:
    """A stand-in engine answers input it cannot handle with a 400, as vLLM's request
    validation does: any 5xx the client sees is then the proxy's."""
    original = engine.answer

    async def answer(request, body):
        try:
            return await original(request, body)
        except Exception as error:  # noqa: BLE001
            return web.json_response({"error": {"message": repr(error)[:200],
                                                "type": "BadRequestError", "code": 400}},
                                     status=400)
    engine.answer = answer


async def fuzz(h: Harness, seed: int, count: int) -> dict:
    statuses: collections.Counter = collections.Counter()
    server_errors: list[tuple[str, int, bytes]] = []
    hangs: list[str] = []
    cut_streams: list[str] = []
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def one(case) -> None:
        async with semaphore:
            try:
                status, body = await asyncio.wait_for(
                    send(h.proxy.port, case.parts, case.pause_s, case.read, BOUND_S),
                    BOUND_S)
            except asyncio.TimeoutError:
                hangs.append(case.kind)
                return
            statuses[status] += 1
            if status is not None and status >= 500:
                server_errors.append((case.kind, status, body[:300]))
            elif status == 200 and body.startswith(b"data:") and \
                    not body.rstrip().endswith(b"data: [DONE]"):
                cut_streams.append(case.kind)  # a stream ends with [DONE], never cut

    started = time.monotonic()
    await asyncio.gather(*(one(case) for case in cases(seed, count)))
    return {"statuses": statuses, "server_errors": server_errors, "hangs": hangs,
            "cut_streams": cut_streams,
            "seconds": time.monotonic() - started}


def test_fuzz_bad_requests(caplog):
    caplog.set_level(logging.ERROR)

    async def scenario():
        async with Harness(max_body_bytes=FUZZ_MAX_BODY, body_timeout_s=BODY_TIMEOUT_S) as h:
            like_vllm(h.prefill)
            like_vllm(h.decode)
            result = await fuzz(h, SEED, COUNT)
            print(f"fuzz: {COUNT} requests (seed {SEED}) in {result['seconds']:.1f} s: "
                  f"{dict(result['statuses'])}")
            assert result["server_errors"] == []
            assert result["hangs"] == []
            assert result["cut_streams"] == []
            assert sum(result["statuses"].values()) == COUNT
            assert h.proxy.metric("kvobs_proxy_internal_errors_total") == 0
            # the proxy still serves
            body = {"messages": [{"role": "user", "content": "still there?"}],
                    "conversation_id": "after-fuzz"}
            for _ in range(2):
                status, out = await h.post(body, headers=dict([KEY]))
                assert status == 200, out
                body["messages"] += [out["choices"][0]["message"],
                                     {"role": "user", "content": "and now?"}]
            async with h.session.get(h.proxy.url + "/health") as response:
                assert response.status == 200
            status, out = await h.post({"prompt": "x", "stream": True})
            assert status == 200 and out[-1] == "[DONE]"
    run(scenario())
    unhandled = [r for r in caplog.records if r.name in ("aiohttp.server", "kvobs.proxy")
                 and r.levelno >= logging.ERROR and not _bad_http(r)]
    assert unhandled == [], [(r.getMessage(), repr(r.exc_info and r.exc_info[1]))
                             for r in unhandled[:5]]


def _bad_http(record: logging.LogRecord) -> bool:
    """aiohttp logs at ERROR the requests its HTTP parser refuses (it answers 400), and a
    broken body (bad gzip) it meets again while draining it after the proxy's 400."""
    from aiohttp.http_exceptions import BadHttpMessage

    error = record.exc_info[1] if record.exc_info else None
    return isinstance(error, (BadHttpMessage, web.RequestPayloadError))


def test_fuzz_cases_are_seeded():
    first = [(c.kind, c.parts) for c in cases(7, 50)]
    assert first == [(c.kind, c.parts) for c in cases(7, 50)]
    assert first != [(c.kind, c.parts) for c in cases(8, 50)]
    kinds = {c.kind.split("/")[i] for c in cases(1, 2000) for i in range(3)}
    for kind in ("deep", "surrogate", "invalid-utf8", "wrong-type", "huge", "gzip",
                 "chunked-slow", "disconnect-mid-body", "bad-utf8-session", "long-length"):
        assert kind in kinds
    json.dumps(sorted(kinds))
