"""Background requests a scenario sends straight at one engine, around the proxy (no
conversation, no kvobs correlation): they compete with a turn for that engine's steps."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from kvobs.testbed.scenario import TurnSpec

if TYPE_CHECKING:
    from kvobs.testbed.runner import Testbed

MODEL_NAME = "tiny"

_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def random_text(rng: random.Random, tokens: int) -> str:
    """``tokens`` single-byte characters: one token each with the byte-level tokenizer."""
    return "".join(rng.choice(_ALPHABET) for _ in range(tokens))


class Load:
    """Background requests straight at one engine (streamed, no kvobs correlation),
    competing with a turn for its steps. ``start`` returns once each is in the engine
    (its response headers came back) or, with ``generating``, once each streamed a first
    token; ``join`` waits for them to end."""

    def __init__(self, url: str, bodies: list[dict[str, Any]], generating: bool):
        self.started = threading.Semaphore(0)
        self.threads = [
            threading.Thread(target=self._run, args=(url, body, generating), daemon=True)
            for body in bodies
        ]

    def _run(self, url: str, body: dict[str, Any], generating: bool) -> None:
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        released = False
        try:
            with urllib.request.urlopen(request, timeout=300) as response:
                if not generating:  # headers back: the engine holds the request
                    self.started.release()
                    released = True
                for line in response:
                    if not released and line.startswith(b"data:"):
                        self.started.release()
                        released = True
        except (urllib.error.URLError, OSError, ValueError):
            pass
        finally:
            if not released:  # a failed load must not hang the scenario
                self.started.release()

    def start(self, wait: bool = True, settle_s: float = 0.05) -> "Load":
        for thread in self.threads:
            thread.start()
        if wait:
            for _ in self.threads:
                self.started.acquire(timeout=120)
            time.sleep(settle_s)
        return self

    def join(self) -> None:
        for thread in self.threads:
            if thread.ident is not None:  # started
                thread.join(timeout=300)


def prefill_load(testbed: Testbed, turn: TurnSpec, rng: random.Random) -> Load | None:
    """Long prompts for P, to send right before the turn (it queues behind their
    prefills) or ``prefill_load_delay_s`` after it (they land while P holds it)."""
    if not turn.prefill_load:
        return None
    bodies = [
        {
            "model": MODEL_NAME,
            "prompt": random_text(rng, turn.prefill_load_tokens),
            "max_tokens": 1,
            "temperature": 0.0,
        }
        for _ in range(turn.prefill_load)
    ]
    return Load(testbed.engine_url("prefill"), bodies, generating=False)


def decode_load(
    testbed: Testbed, turn: TurnSpec, rng: random.Random, safe_ids: list[int]
) -> Load | None:
    if not turn.decode_load:
        return None
    bodies = [
        {
            "model": MODEL_NAME,
            "prompt": random_text(rng, turn.decode_load_prompt_tokens),
            "max_tokens": turn.decode_load_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "allowed_token_ids": safe_ids,
        }
        for _ in range(turn.decode_load)
    ]
    return Load(testbed.engine_url("decode"), bodies, generating=True)
