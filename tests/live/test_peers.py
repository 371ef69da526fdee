"""GET /conversations/ID across the classifiers of a sharded tier (issue #24): real
classifier apps on real ports, each with a store of its own conversations, each told the
others as peers (kvobs collect --peer)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, unused_port
from prometheus_client.parser import text_string_to_metric_families

from kvobs import semconv as sc
from kvobs.live.classifier import superseded
from kvobs.live.service import LiveSettings, build_app
from kvobs.live.turnstore import TurnStore
from spanfactory import TurnSpec, classified_store

TWO_TURNS = [TurnSpec(), TurnSpec(read="done")]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two classifiers' stores: each holds its own conversations only."""
    return {
        name: classified_store(str(tmp_path_factory.mktemp(name)),
                               {f"{name}-1": TWO_TURNS, f"{name}-2": [TurnSpec()]})
        for name in ("a", "b")
    }


def _url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def _classifier(store: str, port: int, peers: list[int | str], seen: list[str],
                timeout_s: float = 2.0) -> TestClient:
    """A classifier app on ``port`` whose peers are ``peers`` (ports or URLs); every
    conversation request it gets is appended to ``seen``."""
    app = build_app(store, LiveSettings(
        window_s=600, peers=tuple(_url(p) if isinstance(p, int) else p for p in peers),
        peer_timeout_s=timeout_s))

    @web.middleware
    async def record(request, handler):
        if request.path.startswith("/conversations/"):
            seen.append(f"{port} {request.path_qs}")
        return await handler(request)

    app.middlewares.append(record)
    return TestClient(TestServer(app, port=port))


def _samples(text: str, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_either_classifier_answers_for_every_conversation(stores):
    """Each peer list names both replicas, itself included (as the StatefulSet gives
    every pod the same list): a conversation is found wherever it is held, and a peer's
    ask (?local=1) is answered from its own store without asking further."""
    pa, pb = unused_port(), unused_port()
    seen: list[str] = []

    async def scenario():
        async with _classifier(stores["a"], pa, [pa, pb], seen) as a, \
                _classifier(stores["b"], pb, [pa, pb], seen) as b:
            answers = {}
            for client, name in ((a, "a"), (b, "b")):
                for cid in ("a-1", "a-2", "b-1", "b-2"):
                    response = await client.get(f"/conversations/{cid}")
                    answers[name, cid] = response.status, await response.json()
            page = await a.get("/conversations/b-1/html")
            page_text = await page.text()
            local = await a.get("/conversations/b-1", params={"local": "1"})
            seen.clear()
            unknown = await a.get("/conversations/nobody")
            unknown_page = await b.get("/conversations/nobody/html")
            return (answers, (page.status, page_text), local.status,
                    (unknown.status, await unknown.json()), unknown_page.status)

    answers, page, local, unknown, unknown_page = asyncio.run(scenario())
    for asked in ("a", "b"):
        for holder, cid, turns in (("a", "a-1", 2), ("a", "a-2", 1), ("b", "b-1", 2),
                                   ("b", "b-2", 1)):
            status, body = answers[asked, cid]
            assert status == 200, (asked, cid, body)
            assert [t["conversation_id"] for t in body["turns"]] == [cid] * turns
            assert body["held_by"] == (None if asked == holder else
                                       _url(pa if holder == "a" else pb))
    assert [t["verdict"] for t in answers["a", "b-1"][1]["turns"]] == \
        ["first-turn", "remote-hit"]
    assert answers["a", "b-1"][1]["turns"] == answers["b", "b-1"][1]["turns"]
    assert page[0] == 200 and "remote-hit" in page[1] and "b-1" in page[1]
    assert local == 404  # the flag: this classifier alone
    assert unknown == (404, {"error": "unknown conversation id 'nobody'",
                             "unanswered_peers": {}})
    assert unknown_page == 404
    # one ask of each peer, each answered locally: no fan-out from a peer, no loop
    assert sorted(seen) == sorted([f"{pa} /conversations/nobody",
                                   f"{pa} /conversations/nobody?local=1",
                                   f"{pb} /conversations/nobody?local=1",
                                   f"{pb} /conversations/nobody/html",
                                   f"{pa} /conversations/nobody?local=1",
                                   f"{pb} /conversations/nobody?local=1"])


async def _hanging_peer(port: int, released: asyncio.Event) -> asyncio.AbstractServer:
    """Accepts the connection, reads the request, answers nothing until released."""
    async def hang(reader, writer):
        await reader.read(65536)
        await released.wait()
        writer.close()

    return await asyncio.start_server(hang, "127.0.0.1", port)


def _peer(port: int, answer) -> TestServer:
    """A stand-in peer that answers every conversation asked with ``answer()``."""
    async def conversation(_request):
        return answer()

    app = web.Application()
    app.router.add_get("/conversations/{cid}", conversation)
    return TestServer(app, port=port)


def test_a_dead_or_hanging_peer_never_fails_an_answer_another_gave(stores):
    pa, pb, dead, hanging, failing = (unused_port() for _ in range(5))
    timeout_s = 0.5
    peers = [_url(dead), _url(hanging), _url(failing), pb]

    async def scenario():
        released = asyncio.Event()
        hang = await _hanging_peer(hanging, released)
        try:
            async with _peer(failing, lambda: web.Response(status=500, text="boom")), \
                    _classifier(stores["a"], pa, peers, [], timeout_s) as a, \
                    _classifier(stores["b"], pb, [], []):
                t0 = time.monotonic()
                found = await a.get("/conversations/b-1")
                took = time.monotonic() - t0
                found_body = await found.json()
                page = await a.get("/conversations/b-2/html")
                unknown = await a.get("/conversations/nobody")
                unknown_page = await a.get("/conversations/nobody/html")
                metrics = await (await a.get("/metrics")).text()
                return (found.status, found_body, took, page.status, unknown.status,
                        await unknown.json(), await unknown_page.text(), metrics)
        finally:
            released.set()
            hang.close()
            await hang.wait_closed()

    (status, body, took, page, unknown, unknown_body, unknown_page,
     metrics) = asyncio.run(scenario())
    assert status == 200 and [t["turn"] for t in body["turns"]] == [1, 2]
    assert body["held_by"] == _url(pb)
    assert took < timeout_s + 1.5  # the hanging peer is given up on, not waited out
    assert page == 200
    expected = {_url(dead): "unreachable", _url(hanging): "timeout",
                _url(failing): "bad-answer"}
    assert unknown == 404 and unknown_body["unanswered_peers"] == expected
    for url, reason in expected.items():
        assert f"{url} ({reason})" in unknown_page
    failures = _samples(metrics, sc.M_CLASSIFIER_PEER_FAILURES.name)
    for url, reason in expected.items():  # the answers above and the 404s: 4 asks each
        assert failures[(("peer", url), ("reason", reason))] == 4
    assert failures[(("peer", _url(pb)), ("reason", "timeout"))] == 0  # zeroed, listed
    assert "nobody" not in metrics and "b-1" not in metrics


def test_the_latest_version_wins_when_two_peers_hold_a_turn(stores):
    """A conversation re-routed between replicas: the turn's later version, whichever
    peer holds it (as TurnRowsUnion reads several stores)."""
    pa, pb, newer = unused_port(), unused_port(), unused_port()

    async def scenario():
        async with _classifier(stores["b"], pb, [], []) as b:
            held = (await (await b.get("/conversations/b-1")).json())["turns"]
            later = [{**turn, "version": turn["version"] + 1,
                      "verdict": "insufficient-evidence"} for turn in held[1:]]
            answer = {"conversation_id": "b-1", "turns": later}
            async with _peer(newer, lambda: web.json_response(answer)), \
                    _classifier(stores["a"], pa, [pb, newer], []) as a:
                return held, await (await a.get("/conversations/b-1")).json()

    held, body = asyncio.run(scenario())
    assert [(t["turn"], t["verdict"]) for t in body["turns"]] == \
        [(1, held[0]["verdict"]), (2, "insufficient-evidence")]
    assert body["held_by"] == _url(newer)


def test_a_turn_retired_on_one_replica_hides_its_older_version_on_another(stores, tmp_path):
    """Lineage moved b-1's turn 2 under another key on replica a (its store ends that key
    with a retirement) while replica b still holds the turn's first version: asked of a,
    which holds no turn of b-1, the conversation is read without it. A peer's local
    answer names the keys it retired; a replica answering for itself never does."""
    held = TurnStore(stores["b"], 400 * 86400).latest("b-1")
    retiring = str(tmp_path / "a")
    TurnStore(retiring, 400 * 86400).write(
        [superseded(held[1], held[1]["version"] + 1)], time.time())
    pa, pb = unused_port(), unused_port()

    async def scenario():
        async with _classifier(retiring, pa, [pa, pb], []) as a, \
                _classifier(stores["b"], pb, [pa, pb], []) as b:
            local = await (await a.get("/conversations/b-1", params={"local": "1"})).json()
            return (local, await (await a.get("/conversations/b-1")).json(),
                    await (await b.get("/conversations/b-1")).json())

    local, via_a, own = asyncio.run(scenario())
    assert local["turns"] == [] and local["retired"] == [
        {"tenant": held[1]["tenant"], "conversation_id": "b-1", "turn": 2,
         "version": held[1]["version"] + 1}]
    assert [t["turn"] for t in via_a["turns"]] == [1]
    assert via_a["held_by"] == _url(pb)
    # b holds turns of b-1 itself, so it answers from its own store alone (both turns)
    assert [t["turn"] for t in own["turns"]] == [1, 2] and "retired" not in own


def test_a_peer_whose_versions_cannot_be_ranked_is_a_bad_answer(stores):
    """A turn whose version is no integer cannot be ranked against another peer's: that
    peer's answer is dropped as a bad answer, never a failure of the one b gave."""
    pa, pb, odd = unused_port(), unused_port(), unused_port()
    answer = {"turns": [{"tenant": None, "conversation_id": "b-1", "turn": 1,
                         "version": "2"}]}

    async def scenario():
        async with _peer(odd, lambda: web.json_response(answer)), \
                _classifier(stores["b"], pb, [], []) as b, \
                _classifier(stores["a"], pa, [odd, pb], []) as a:
            own = await (await b.get("/conversations/b-1")).json()
            response = await a.get("/conversations/b-1")
            return own, response.status, await response.json()

    own, status, body = asyncio.run(scenario())
    assert status == 200 and body["turns"] == own["turns"]
    assert body["held_by"] == _url(pb)


def test_collect_takes_its_peers_from_flags_or_the_environment(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from kvobs.cli import main
    from kvobs.cli.collect import ENV_PEERS

    started: list[LiveSettings] = []
    monkeypatch.setattr("kvobs.live.service.run",
                        lambda store, host, port, settings, turns: started.append(settings))
    runner = CliRunner()
    store = ["collect", "--store-dir", str(tmp_path)]
    flags = runner.invoke(main, [*store, "--peer", "http://a:4319", "--peer", "http://b:4319",
                                 "--peer-timeout", "0.5"])
    env = runner.invoke(main, store, env={ENV_PEERS: "http://a:4319 http://b:4319"})
    assert flags.exit_code == env.exit_code == 0, flags.output + env.output
    assert [(s.peers, s.peer_timeout_s) for s in started] == \
        [(("http://a:4319", "http://b:4319"), 0.5), (("http://a:4319", "http://b:4319"), 2.0)]
    bad = runner.invoke(main, [*store, "--peer", "kvobs-classifier-1:4319"])
    assert bad.exit_code == 2 and "not an http:// or https:// URL" in bad.output
    assert ENV_PEERS in runner.invoke(main, ["collect", "--help"]).output
