"""The other classifiers of a sharded tier (``kvobs collect --peer URL``), asked for a
conversation this one does not hold.

The shard a conversation's spans go to is not its id, so whoever asks one replica for a
conversation (an operator, a Grafana link) cannot know which replica holds it. A replica
that holds none of its turns asks every peer at once with ``?local=1``, which makes a
peer answer from its own memory and store only: a peer never asks further, so a peer
list that names the replica itself, or two replicas that name each other, cannot loop.
A peer's answer also names the keys it retired (lineage moved the turn elsewhere), so a
turn retired on one replica hides its older version on another (``kvobs.live.latest``).

Each peer gets ``timeout_s``; one that is down, hangs or answers garbage is counted on
/metrics (``semconv.M_CLASSIFIER_PEER_FAILURES``), logged, and named in a 404, never
turned into a failure of the answer another peer gave.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import quote

import aiohttp
from prometheus_client import Counter

from kvobs import semconv as sc
from kvobs.live.latest import answer_entries, latest

_LOG = logging.getLogger("kvobs.live.peers")

LOCAL = "local"  # query flag: answer from this classifier alone (what a peer is asked)


def asked_locally(query) -> bool:
    return query.get(LOCAL) == "1"


@dataclass
class Found:
    """A conversation's turns, the peer that held them (None: this classifier), the
    peers that did not answer (URL -> reason, one of ``semconv.PEER_FAILURE_REASONS``),
    and, answering a peer, the keys this classifier retired."""

    turns: list[dict[str, Any]]
    held_by: str | None = None
    unanswered: dict[str, str] = field(default_factory=dict)
    retired: list[dict[str, Any]] = field(default_factory=list)  # a local answer's


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

    async def find(
        self, conversation_id: str, tenant: str | None, retired: Iterable[dict] = ()
    ) -> Found:
        """The conversation as the peers hold it, each turn at its latest version over
        all of them and the keys this classifier ``retired`` (``kvobs.live.latest``)."""
        own = answer_entries(None, (), retired)
        if self._session is None:
            return Found([])
        params = {LOCAL: "1"} | ({"tenant": tenant} if tenant is not None else {})
        path = "/conversations/" + quote(conversation_id, safe="")
        answers = await asyncio.gather(*(self._ask(url, path, params) for url in self.urls))
        unanswered = {
            url: answer for url, answer in zip(self.urls, answers) if isinstance(answer, str)
        }
        kept, holders = latest(
            itertools.chain(
                own,
                *(
                    answer_entries(url, *answer)
                    for url, answer in zip(self.urls, answers)
                    if not isinstance(answer, str)
                ),
            )
        )
        return Found(
            [entry.turn for entry in kept if entry.turn is not None],
            holders.get(conversation_id),
            unanswered,
        )

    async def _ask(
        self, url: str, path: str, params: dict[str, str]
    ) -> tuple[list[dict], list[dict]] | str:
        """The peer's turns and the keys it retired (none for a 404), else why it gave
        none."""
        assert self._session is not None
        try:
            async with self._session.get(url + path, params=params) as response:
                if response.status == 404:
                    return [], []
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
        retired = body.get("retired", []) if isinstance(body, dict) else None
        if not (isinstance(turns, list) and _dicts(turns)) or not (
            isinstance(retired, list) and _dicts(retired)
        ):
            return self._failed(url, "bad-answer", "no list of turns")
        return turns, retired

    def _failed(self, url: str, reason: str, detail: str) -> str:
        self.failures.labels(url, reason).inc()
        _LOG.warning("peer classifier %s did not answer (%s): %s", url, reason, detail)
        return reason


def _dicts(items: list) -> bool:
    """Turns (or retired keys) the merge can rank: dicts with an integer version."""
    return all(isinstance(item, dict) and type(item.get("version", 0)) is int for item in items)
