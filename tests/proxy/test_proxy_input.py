"""Input (#26 item 5): NaN and Infinity are a 400, an unsupported Content-Encoding a 415
with a JSON error, a broken gzip or deflate body a JSON 400 with no traceback logged; a
good compressed body is served."""

from __future__ import annotations

import gzip
import json
import logging
import zlib

import pytest
from harness import CLIENT_KEY, Harness
from test_proxy_flow import run

CHAT = "/v1/chat/completions"
BODY = json.dumps({"messages": [{"role": "user", "content": "q"}],
                   "conversation_id": "c"}).encode()


async def _post(h: Harness, data: bytes, encoding: str | None = None):
    headers = {**CLIENT_KEY, "Content-Type": "application/json"}
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    async with h.session.post(h.proxy.url + CHAT, data=data, headers=headers) as response:
        return response.status, response.headers.get("Content-Type", ""), \
            await response.read()


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_non_finite_numbers_are_refused(literal):
    async def scenario():
        async with Harness() as h:
            data = b'{"messages": [{"role": "user", "content": "q"}], "temperature": ' \
                + literal.encode() + b"}"
            status, kind, raw = await _post(h, data)
            assert status == 400 and kind.startswith("application/json")
            assert json.loads(raw)["error"]["type"] == "invalid_request_error"
            assert h.prefill.requests == []  # no engine saw it
            assert h.proxy.metric("kvobs_proxy_rejected_requests_total",
                                  {"reason": "non-finite-number"}) == 1
            # finite numbers, and the words in text, still pass
            status, _, _ = await _post(h, b'{"messages": [{"role": "user", "content": '
                                          b'"NaN Infinity"}], "temperature": 1e2}')
            assert status == 200
    run(scenario())


@pytest.mark.parametrize("encoding", ["br", "zstd", "x-unknown", "gzip, br"])
def test_unsupported_encoding_is_415_json(encoding, caplog):
    caplog.set_level(logging.DEBUG)

    async def scenario():
        async with Harness() as h:
            status, kind, raw = await _post(h, BODY, encoding)
            assert status == 415 and kind.startswith("application/json")
            error = json.loads(raw)["error"]
            assert error["code"] == 415 and "Content-Encoding" in error["message"]
            assert h.prefill.requests == []
            assert h.proxy.metric("kvobs_proxy_rejected_requests_total",
                                  {"reason": "unsupported-encoding"}) == 1
            status, _, _ = await _post(h, BODY)  # the proxy still serves
            assert status == 200
    run(scenario())
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


@pytest.mark.parametrize("encoding, data", [
    ("gzip", gzip.compress(BODY)[:-6] + b"broken"),
    ("gzip", b"not gzip at all"),
    ("deflate", b"not deflate"),
    ("deflate", zlib.compress(BODY)[:-4]),
    ("gzip, gzip", gzip.compress(BODY))])
def test_broken_compressed_body_is_400_json_and_no_traceback(encoding, data, caplog):
    caplog.set_level(logging.DEBUG)

    async def scenario():
        async with Harness() as h:
            status, kind, raw = await _post(h, data, encoding)
            assert status == 400 and kind.startswith("application/json")
            assert json.loads(raw)["error"]["type"] == "invalid_request_error"
            assert h.proxy.metric("kvobs_proxy_rejected_requests_total",
                                  {"reason": "bad-body"}) == 1
            status, _, _ = await _post(h, BODY)
            assert status == 200
    run(scenario())
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not [r for r in caplog.records if r.name.startswith("aiohttp")
                and r.levelno >= logging.ERROR]


@pytest.mark.parametrize("encoding, data", [
    ("gzip", gzip.compress(BODY)), ("x-gzip", gzip.compress(BODY)),
    ("deflate", zlib.compress(BODY)), ("deflate", zlib.compress(BODY, wbits=-15)),
    ("GZIP", gzip.compress(BODY)), ("gzip, deflate", zlib.compress(gzip.compress(BODY))),
    ("identity", BODY)])
def test_compressed_bodies_are_served(encoding, data):
    async def scenario():
        async with Harness() as h:
            status, _, raw = await _post(h, data, encoding)
            assert status == 200, raw
            assert h.prefill.requests[0]["messages"] == [{"role": "user", "content": "q"}]
    run(scenario())


def test_decompression_bomb_is_413():
    async def scenario():
        async with Harness(max_body_bytes=64 * 1024) as h:
            bomb = gzip.compress(b'{"prompt": "' + b"a" * (1 << 20) + b'"}')
            assert len(bomb) < 64 * 1024
            status, kind, _ = await _post(h, bomb, "gzip")
            assert status == 413 and kind.startswith("application/json")
    run(scenario())
