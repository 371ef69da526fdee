"""``kvobs collect`` as an always-on classifier: the OTLP receiver (kvobs.emit.collect)
stores each export request and hands it to the classifier; a pass runs every
``interval_s``; final turns go to /metrics and the turn store.

Routes next to ``POST /v1/traces``:
- ``GET /metrics``: kvobs_turns_total{verdict,...}, causes, phases (OpenMetrics with the
  turns' trace ids as exemplars when the scraper asks for it) and the classifier's health;
- ``GET /conversations/{id}`` (``?tenant=DIGEST``): the conversation's turns as the
  classifier holds them (``kvobs diagnose --json``'s turn objects, each with its version,
  whether it is final and the fleet context it was priced with), else as the turn store
  keeps them once they left memory; 404 for an id it never saw;
- ``GET /conversations/{id}/html``: the same as a page (``kvobs diagnose``'s table).

With peers (``--peer URL``, the other classifiers of a sharded tier) a conversation this
one holds none of is asked of them (kvobs.live.peers; ``?local=1`` answers from this one
alone): the answer names the peer that held it (``held_by``), a 404 the peers that did
not answer.

At start it resumes from its stores (``Live.resume``: the turn store's final turns, then
a replay of the live span segments within the window), so a restart loses no open turn
and counts none twice.

One event loop does everything: a pass is short (the spans that arrived since the last
one) and nothing else touches the classifier's state, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from kvobs.emit import collect, native
from kvobs.emit.otlp_json import loads
from kvobs.emit.segments import segment_lines, written_since
from kvobs.semconv import CONVERSATION_ID, STORE_CLASSIFIER_HELD
from kvobs.fleet.turn_report import summarize
from kvobs.live.classifier import Classifier
from kvobs.live.metrics import TurnMetrics
from kvobs.live.peers import Found, Peers, asked_locally
from kvobs.live.recall import Recalled, recall
from kvobs.live.turnstore import TurnRows, TurnStore, write_aside
from kvobs.sources._errors import SourceError

_LOG = logging.getLogger("kvobs.live")
LIVE = web.AppKey("kvobs_live", object)

# A replay starts this much before the earliest span held was received: a segment's
# time comes from its file system (coarse on some), the note moves by whole seconds.
CLOCK_MARGIN_S = 60.0
# Conversations recalled from the span store in one read of its segments: a few are
# searched for in each line, more cost a pass over every line (bench/recall_bench.py).
RECALL_ROUND = 8
# Seconds between two rounds of the turn store's upkeep (retention, merging parts).
MAINTAIN_S = 600


@dataclass
class LiveSettings:
    window_s: float  # how long a conversation is held after its last span
    grace_s: float = 10.0  # a turn unchanged this long is final
    interval_s: float = 1.0  # between passes
    turn_retention_s: float = 30 * 86400.0
    read_slo_s: float | None = None
    peers: tuple[str, ...] = ()  # base URLs of the other classifiers of a sharded tier
    peer_timeout_s: float = 2.0  # each peer's answer is waited for this long at most


class Live:
    def __init__(self, store_dir: str, settings: LiveSettings, turns: TurnRows | None = None):
        self.settings = settings
        self.store_dir = store_dir
        self.classifier = Classifier(settings.window_s, settings.grace_s, settings.read_slo_s)
        # A conversation that comes back after the window is recalled from the span store
        # (kvobs.live.recall), not left unclassified.
        self.classifier.buffer.recalls = True
        # The recall under way: the conversations it reads, and its read off the loop.
        self._recalling: tuple[dict[str, float], asyncio.Future] | None = None
        self.metrics = TurnMetrics()
        # Final turn rows: the store directory's parquet unless given (ClickHouse).
        self.turns = turns or TurnStore(store_dir, settings.turn_retention_s)
        self.peers = Peers(settings.peers, settings.peer_timeout_s, self.metrics.peer_failures)
        self._task: asyncio.Task | None = None
        self._maintained_at = 0.0
        self._held_noted = 0.0

    def resume(self, now: float | None = None) -> None:
        """After a restart: the turns the turn store has final within the window, then
        the spans of the live segments written within it, replayed, so that turns open at
        the stop are finished and none is counted twice. Since earlier where the buffer
        held earlier spans (``STORE_CLASSIFIER_HELD``): a conversation that went on past
        the window is held whole again, as lineage needs it. Said in the log, with what
        could not be replayed."""
        now = time.time() if now is None else now
        started = time.perf_counter()
        since = now - self.classifier.buffer.window_s
        held = _read_held(self.store_dir)
        if held is not None:
            since = min(since, held - CLOCK_MARGIN_S)
        try:
            taken = self.classifier.resume(*self.turns.latest_and_retired(since=since), now)
        except (OSError, ValueError) as error:
            taken = 0
            _LOG.warning("could not read the turn store to resume from: %s", error)
        requests = unreadable = 0
        segments = written_since(self.store_dir, since)
        for written, line in segment_lines(segments, _unreplayable):
            if not line.strip():
                continue
            try:
                # Received by the time the segment was last written: the next restart's
                # replay then takes this segment again.
                self.classifier.add_request(loads(line), now, written)
                requests += 1
            except ValueError:
                unreadable += 1
        if requests:
            # Classified before the service listens: this pass takes every span of the
            # window, and on the event loop it would leave /health unanswered as long (a
            # liveness probe's kill, and the next start the same). A startup probe waits.
            try:
                self.run_pass(now)
            except Exception:  # noqa: BLE001 - the loop's first pass tries again
                _LOG.exception("could not classify the replayed spans")
        if taken or requests:
            _LOG.info(
                "resumed: %d final turns from the turn store, %d export requests "
                "replayed from the live segments written since %.0f s before the start "
                "(%d unreadable lines skipped), classified in %.1f s; turns whose spans "
                "left the live segments stay as stored",
                taken,
                requests,
                now - since,
                unreadable,
                time.perf_counter() - started,
            )

    def receive(self, stored: collect.Stored, now: float | None = None) -> None:
        """One stored export request: the classifier takes what its line reads back as."""
        try:
            self.classifier.add_request(stored.request(), now)
        except Exception:  # noqa: BLE001 - the spans are stored; classification is extra
            _LOG.exception("could not take spans for classification")

    def run_pass(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        result = self.classifier.run_pass(now)
        self.metrics.observe(result)
        try:
            self.turns.write(result.finalized, now)
        except OSError as error:
            self.metrics.write_errors.inc()
            _LOG.warning(
                "could not write final turns (%d kept for the next pass): %s",
                len(self.turns.pending),
                error,
            )
        self._note_held(now)
        c = self.classifier
        self.metrics.health(
            c.spans_received - c.buffer.late_spans,
            c.buffer.late_spans,
            c.spans_unreadable,
            c.open_turns(),
            len(c.buffer),
        )

    def _note_held(self, now: float) -> None:
        """Note when the earliest span held ended (``now`` when none is held), for a
        restart, once it moved by a second or more; a store that cannot take it keeps
        the last note (a restart then replays from earlier, never later)."""
        held = self.classifier.buffer.held_since()
        held = now if held is None else held
        if abs(held - self._held_noted) < 1.0:
            return
        try:
            _write_held(self.store_dir, held)
            self._held_noted = held
        except OSError as error:
            _LOG.warning("could not note the earliest span held: %s", error)

    def recall(self, since: dict[str, float]) -> tuple[Recalled, dict[str, tuple]]:
        """What reviving the conversations of ``since`` (``returning_since``) needs: their
        turns and retired keys in the turn store, their spans in the span store with the
        spans their turns name as evidence (the export of a turn of another conversation
        that one extends: lineage needs it again), from a window before they began (a
        turn extends one within the TTL), and the stored turns of the other conversations
        those spans tag. I/O alone: run off the event loop."""
        stored = {cid: self.turns.latest_and_retired(cid) for cid in since}
        named = {
            span: cid
            for cid, (turns, _) in stored.items()
            for turn in turns
            for key, span in (turn.get("evidence") or {}).items()
            if key.endswith("_span_id") and isinstance(span, str)
        }
        window = self.classifier.buffer.window_s
        found = recall(self.store_dir, {c: t - window for c, t in since.items()}, named)
        for spans in found.spans.values():
            for row in spans:
                cid = row.get(CONVERSATION_ID.key)
                if isinstance(cid, str) and cid not in stored:
                    stored[cid] = self.turns.latest_and_retired(cid)
        return found, stored

    def revive(self, recalled: tuple[Recalled, dict[str, tuple]], now: float) -> None:
        """Hold again the conversations ``recall`` read (on the loop: it changes the
        buffer the passes read)."""
        found, stored = recalled
        turns = [turn for rows, _ in stored.values() for turn in rows]
        retired = [key for _, keys in stored.values() for key in keys]
        self.classifier.revive(found.spans, turns, retired, now, found.received)
        _LOG.info(
            "%d conversations came back after the window: recalled %d of their spans "
            "from the span store (%d unreadable lines)",
            len(found.spans),
            sum(len(spans) for spans in found.spans.values()),
            found.unreadable,
        )

    def recall_returning(self, now: float | None = None) -> None:
        """``recall`` and ``revive`` at once, every conversation waiting (a stop, a test;
        the loop overlaps them, a round a pass)."""
        while since := self.classifier.buffer.returning_since(RECALL_ROUND):
            try:
                self.revive(self.recall(since), time.time() if now is None else now)
            except Exception as error:  # noqa: BLE001 - the spans are late, as without it
                self._recall_failed(since, error)

    def _recall_failed(self, since: dict[str, float], error: BaseException) -> None:
        self.classifier.buffer.give_up(since)
        _LOG.warning(
            "could not recall %d conversations that came back after the window (their "
            "spans are late): %s",
            len(since),
            error,
            # its traceback where it is no I/O error: a defect to report
            exc_info=error if not isinstance(error, (OSError, SourceError)) else None,
        )

    def _take_recall(self) -> None:
        assert self._recalling is not None
        (since, future), self._recalling = self._recalling, None
        try:
            self.revive(future.result(), time.time())
        except Exception as error:  # noqa: BLE001 - the spans are late, as without it
            self._recall_failed(since, error)

    def _step_recall(self) -> None:
        """The loop's recall: started off the loop when conversations came back, taken
        on the loop once read (a pass later at most)."""
        if self._recalling is not None:
            if not self._recalling[1].done():
                return
            self._take_recall()
        since = self.classifier.buffer.returning_since(RECALL_ROUND)
        if since:
            read = asyncio.get_running_loop().run_in_executor(None, self.recall, since)
            self._recalling = (since, read)

    def maintain(self, now: float | None = None) -> None:
        """The turn store's upkeep: partitions past the retention dropped, parts merged.
        Run off the event loop (seconds for a fleet's hour), never alongside itself."""
        now = time.time() if now is None else now
        for partition in self.turns.expire(now):
            _LOG.info("turn partition %s past retention: dropped", partition)
        try:
            for partition in self.turns.compact(now):
                _LOG.info("turn partition %s merged", partition)
        except OSError as error:  # a full disk: the parts stay, readable as they are
            _LOG.warning("could not merge turn partitions: %s", error)
        try:
            summarize(self.turns)  # a report then merges the hour's tally, not its rows
        except (OSError, SourceError) as error:  # the report reads those rows instead
            _LOG.warning("could not keep the report's tallies of merged turns: %s", error)

    def conversation(self, conversation_id: str, tenant: str | None) -> list[dict]:
        turns = self.classifier.conversation(conversation_id) or self.turns.latest(conversation_id)
        return _of_tenant(turns, tenant)

    async def _conversation(
        self, conversation_id: str, tenant: str | None
    ) -> tuple[list[dict], list[dict]]:
        """``conversation`` for the routes, and the keys of it this classifier retired
        (a peer's answer hides them): the store read (tens of ms at a million
        conversations) off the event loop that takes the spans; memory read on it (the
        passes change it there)."""
        turns = self.classifier.conversation(conversation_id)
        retired: list[dict] = []
        if not turns:
            turns, retired = await asyncio.get_running_loop().run_in_executor(
                None, self.turns.latest_and_retired, conversation_id
            )
        return _of_tenant(turns, tenant), _of_tenant(retired, tenant)

    # ------------------------------------------------------------------ aiohttp

    async def _loop(self) -> None:
        upkeep: asyncio.Future | None = None
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                self._step_recall()
            except Exception:  # noqa: BLE001 - never in the way of the pass
                _LOG.exception("recall of conversations that came back failed")
            try:
                self.run_pass()
            except Exception:  # noqa: BLE001 - the next pass tries again
                _LOG.exception("classification pass failed")
            now = time.time()
            if (upkeep is None or upkeep.done()) and now - self._maintained_at > MAINTAIN_S:
                self._maintained_at = now
                upkeep = asyncio.get_running_loop().run_in_executor(None, self._upkeep, now)

    def _upkeep(self, now: float) -> None:
        try:
            self.maintain(now)
        except Exception:  # noqa: BLE001 - the next round tries again
            _LOG.exception("turn store upkeep failed")

    async def start(self, _app: web.Application) -> None:
        await self.peers.start()
        self.resume()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self, _app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
        # Every turn is written as it stands: one pass classifies what arrived since the
        # last, a second one a grace later finds each turn unchanged, so final.
        try:
            if self._recalling is not None:  # the recall under way, then the rest at once
                await asyncio.wait([self._recalling[1]])
                self._take_recall()
            self.recall_returning()
            now = time.time()
            self.run_pass(now)
            self.run_pass(now + self.settings.grace_s)
        except Exception:  # noqa: BLE001
            _LOG.exception("last pass failed")
        await self.peers.stop()

    async def metrics_view(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        # Rendering ~2,000 series takes tens of ms: off the loop that takes the spans.
        body = await asyncio.get_running_loop().run_in_executor(
            None, encoder, self.metrics.registry
        )
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _find(self, request: web.Request) -> Found:
        """The conversation as this classifier holds it, else as a peer does (unless a
        peer is asking: it gets this one's answer alone, with the keys it retired)."""
        cid, tenant = request.match_info["conversation_id"], request.query.get("tenant")
        turns, retired = await self._conversation(cid, tenant)
        if asked_locally(request.query):
            return Found(turns, retired=retired)
        if turns:
            return Found(turns)
        return await self.peers.find(cid, tenant, retired)

    async def conversation_view(self, request: web.Request) -> web.Response:
        cid = request.match_info["conversation_id"]
        found = await self._find(request)
        if not found.turns and not found.retired:
            return web.json_response(
                {"error": _unknown(cid, found), "unanswered_peers": found.unanswered},
                status=404,
            )
        answer = {"conversation_id": cid, "turns": found.turns, "held_by": found.held_by}
        if asked_locally(request.query):
            answer["retired"] = found.retired
        return web.json_response(answer, dumps=_json_dumps)

    async def conversation_page(self, request: web.Request) -> web.Response:
        from kvobs.live.page import conversation_html

        cid = request.match_info["conversation_id"]
        found = await self._find(request)
        if not found.turns:
            return web.Response(status=404, text=_unknown(cid, found))
        return web.Response(text=conversation_html(cid, found.turns), content_type="text/html")


def _unknown(conversation_id: str, found: Found) -> str:
    """A 404's message: the peers that did not answer may hold it (URLs and reasons only)."""
    text = f"unknown conversation id {conversation_id!r}"
    if found.unanswered:
        text += "; peers that did not answer: " + ", ".join(
            f"{url} ({reason})" for url, reason in found.unanswered.items()
        )
    return text


def _of_tenant(turns: list[dict], tenant: str | None) -> list[dict]:
    return [t for t in turns if tenant is None or t["tenant"] == tenant]


def _unreplayable(path: str, error: OSError) -> None:
    _LOG.warning("could not replay %s: %s", path, error)


def _read_held(store_dir: str) -> float | None:
    """``_write_held``'s note; None when there is none or it cannot be read."""
    try:
        with open(os.path.join(store_dir, STORE_CLASSIFIER_HELD), encoding="utf-8") as handle:
            held = json.load(handle)["held_since"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        if not isinstance(error, FileNotFoundError):
            _LOG.warning("could not read the note of the earliest span held: %s", error)
        return None
    return float(held) if isinstance(held, (int, float)) else None


def _write_held(store_dir: str, held: float) -> None:
    write_aside(
        os.path.join(store_dir, STORE_CLASSIFIER_HELD), json.dumps({"held_since": held}).encode()
    )


def _json_dumps(value) -> str:
    return json.dumps(value, default=str)


def build_app(
    store_dir: str, settings: LiveSettings, turns: TurnRows | None = None
) -> web.Application:
    live = Live(store_dir, settings, turns)
    app = collect.build_app(collect.SegmentWriter(store_dir), sink=live.receive)
    app[LIVE] = live
    app.on_startup.append(live.start)
    app.on_cleanup.append(live.stop)
    app.router.add_get("/metrics", live.metrics_view)
    app.router.add_get("/conversations/{conversation_id}", live.conversation_view)
    app.router.add_get("/conversations/{conversation_id}/html", live.conversation_page)
    return app


def run(
    store_dir: str, host: str, port: int, settings: LiveSettings, turns: TurnRows | None = None
) -> None:
    _LOG.info(
        "kvobs collect: classifying live (window %.0f s, grace %.0f s), store %s, "
        "final turns to %s; OTLP/protobuf decoded by %s",
        settings.window_s,
        settings.grace_s,
        store_dir,
        turns.location if turns else "the store",
        native.described(),
    )
    web.run_app(
        build_app(store_dir, settings, turns),
        host=host,
        port=port,
        print=None,
        handle_signals=True,
        access_log=None,
    )
