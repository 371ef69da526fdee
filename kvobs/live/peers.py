"""The other classifiers of a sharded tier (``kvobs collect --peer URL``), asked for a
conversation this one does not hold.

The shard a conversation's spans go to is not its id, so whoever asks one replica for a
conversation (an operator, a Grafana link) cannot know which replica holds it. A replica
that holds none of its turns asks every peer at once with ``?local=1``, which makes a
peer answer from its own memory and store only: a peer never asks further, so a peer
list that names the replica itself, or two replicas that name each other, cannot loop.

Each peer gets ``timeout_s``; one that is down, hangs or answers garbage is counted on
/metrics (``semconv.M_CLASSIFIER_PEER_FAILURES``), logged, and named in a 404, never
turned into a failure of the answer another peer gave.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import quote

import aiohttp
from prometheus_client import Counter

from kvobs import semconv as sc

_LOG = logging.getLogger("kvobs.live.peers")

LOCAL = "local"  # query flag: answer from this classifier alone (what a peer is asked)


def asked_locally(query) -> bool:
    return query.get(LOCAL) == "1"


@dataclass
class Found:
    """A conversation's turns, the peer that held them (None: this classifier), and the
    peers that did not answer (URL -> reason, one of ``semconv.PEER_FAILURE_REASONS``)."""

    turns: list[dict[str, Any]]
    held_by: str | None = None
    unanswered: dict[str, str] = field(default_factory=dict)


class Peers:
    def __init__(self, urls: tuple[str, ...], timeout_s: float, failures: Counter):
        self.urls = tuple(dict.fromkeys(url.rstrip("/") for url in urls))
        self.timeout_s = timeout_s
        self.failures = failures
        for url in self.urls:  # a rate over a peer's first failure needs the series before
            for reason in sc.PEER_FAILURE_REASONS:
                failures.labels(url, reason)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self.urls:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def find(self, conversation_id: str, tenant: str | None) -> Found:
        """The conversation as the peers hold it, each turn at its latest version over
        all of them (as ``TurnRowsUnion`` reads several stores)."""
        if self._session is None:
            return Found([])
        params = {LOCAL: "1"} | ({"tenant": tenant} if tenant is not None else {})
        path = "/conversations/" + quote(conversation_id, safe="")
        answers = await asyncio.gather(*(self._ask(url, path, params) for url in self.urls))
        unanswered = {
            url: answer for url, answer in zip(self.urls, answers) if isinstance(answer, str)
        }
        turns, holders = latest_turns(
            (url, answer) for url, answer in zip(self.urls, answers) if isinstance(answer, list)
        )
        return Found(turns, holders.get(conversation_id), unanswered)

    async def _ask(self, url: str, path: str, params: dict[str, str]) -> list[dict] | str:
        """The peer's turns ([] for a 404), else why it gave none."""
        assert self._session is not None
        try:
            async with self._session.get(url + path, params=params) as response:
                if response.status == 404:
                    return []
                if response.status != 200:
                    return self._failed(url, "bad-answer", f"status {response.status}")
                body = await response.json()
        except asyncio.TimeoutError:
            return self._failed(url, "timeout", f"no answer within {self.timeout_s:g} s")
        except (aiohttp.ClientResponseError, ValueError) as error:  # not JSON
            return self._failed(url, "bad-answer", str(error))
        except (aiohttp.ClientError, OSError) as error:
            return self._failed(url, "unreachable", str(error))
        turns = body.get("turns") if isinstance(body, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            return self._failed(url, "bad-answer", "no list of turns")
        return turns

    def _failed(self, url: str, reason: str, detail: str) -> str:
        self.failures.labels(url, reason).inc()
        _LOG.warning("peer classifier %s did not answer (%s): %s", url, reason, detail)
        return reason


def latest_turns(
    answers: Iterable[tuple[str, Iterable[dict[str, Any]]]],
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The turns the peers gave (their answers hold no retired key), each (tenant,
    conversation, turn) at its highest version, a tie going to the later holder, in key
    order; and, per conversation, the holder of the turn taken last (a conversation
    re-routed between replicas is read where it went on)."""
    best: dict[tuple, dict[str, Any]] = {}
    holders: dict[str, str] = {}
    for holder, turns in answers:
        for turn in turns:
            key = (turn.get("tenant"), turn.get("conversation_id"), turn.get("turn"))
            if key not in best or turn.get("version", 0) >= best[key].get("version", 0):
                best[key] = turn
                holders[str(key[1])] = holder
    ordered = sorted(best, key=lambda k: (str(k[0]), str(k[1]), k[2] or 0))
    return [best[key] for key in ordered], holders
