"""kvobs turns and kvobs diagnose over the stores of several classifiers (a sharded tier,
issue #24): --source given once per store, read as one as kvobs report reads them."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvobs.cli import main
from spanfactory import Tracers, TurnSpec, classified_store, write_conversation


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Two classifiers' stores, each with its own conversations' spans and turn rows,
    and a span store of the same conversations (the source of the expected answers)."""
    conversations = {
        "a": {"a-1": [TurnSpec(), TurnSpec(read="done")], "a-2": [TurnSpec()]},
        "b": {"b-1": [TurnSpec(), TurnSpec(lookup="miss", decision="no-params")]},
    }
    spans = str(tmp_path_factory.mktemp("spans"))
    tracers = Tracers(spans)
    for held in conversations.values():
        for cid, turns in held.items():
            write_conversation(tracers, cid, turns)
    return {"spans": spans, **{name: classified_store(str(tmp_path_factory.mktemp(name)), held)
                               for name, held in conversations.items()}}


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _keyed(rows: list[dict]) -> list[tuple]:
    return sorted((r["conversation_id"], r["turn"], r["verdict"]) for r in rows)


def test_turns_lists_every_stores_turns_as_one(stores):
    both = run("turns", "--json", "--source", stores["a"], "--source", stores["b"])
    assert both.exit_code == 0, both.output
    listed = json.loads(both.stdout)
    expected = json.loads(run("turns", "--json", "--from-spans",
                              "--source", stores["spans"]).stdout)
    assert _keyed(listed) == _keyed(expected) == [
        ("a-1", 1, "first-turn"), ("a-1", 2, "remote-hit"), ("a-2", 1, "first-turn"),
        ("b-1", 1, "first-turn"), ("b-1", 2, "missing-metadata")]
    assert f"in {stores['a']} + {stores['b']}" in both.stderr
    only_b = json.loads(run("turns", "--json", "--conversation", "b-1", "--source", stores["a"],
                            "--source", stores["b"]).stdout)
    assert _keyed(only_b) == [("b-1", 1, "first-turn"), ("b-1", 2, "missing-metadata")]


def test_turns_refuses_a_span_source_among_several(stores):
    mixed = run("turns", "--source", stores["a"], "--source", stores["spans"])
    assert mixed.exit_code == 2 and "classified turn rows" in mixed.output
    from_spans = run("turns", "--from-spans", "--source", stores["a"], "--source", stores["b"])
    assert from_spans.exit_code == 2 and "one --source" in from_spans.output


@pytest.mark.parametrize("cid, holder, status", [("a-1", "a", 0), ("b-1", "b", 1)])
def test_diagnose_reads_the_spans_of_the_store_that_holds_it(stores, cid, holder, status):
    """Either order of the stores: the same diagnosis as over the one store holding the
    conversation, from that store's spans."""
    alone = run("diagnose", cid, "--json", "--source", stores[holder])
    assert alone.exit_code == status
    other = "b" if holder == "a" else "a"
    assert run("diagnose", cid, "--source", stores[other]).exit_code == 2  # not there
    for order in (("a", "b"), ("b", "a")):
        both = run("diagnose", cid, "--json", *(f"--source={stores[name]}" for name in order))
        assert both.exit_code == status, both.output
        assert json.loads(both.stdout) == json.loads(alone.stdout)
        assert f"reading the spans of {stores[holder]}," in both.stderr


def test_diagnose_over_several_stores_refuses_what_it_cannot_place(stores):
    unknown = run("diagnose", "nobody", "--source", stores["a"], "--source", stores["b"])
    assert unknown.exit_code == 2
    assert f"unknown conversation id 'nobody' in the classified turn rows of {stores['a']} " \
        f"+ {stores['b']}" in " ".join(unknown.output.split())
    mixed = run("diagnose", "a-1", "--source", stores["spans"], "--source", stores["a"])
    assert mixed.exit_code == 2 and "classified turn rows" in mixed.output
