"""Id-less turns live where lineage puts them (``SpanBuffer.adopt``): a turn behind a
router that sends no id joins the unit of the turn it extends, so an id-less
conversation keeps its name, its numbering and its first turn for as long as it goes
on; a turn the proxy named ``anonymous:<trace>`` that lineage puts after another turn
merges into that turn's unit; and a pass takes the new spans and the conversations they
touch, not the window."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from turns.test_lineage import router_turns, span

from kvobs import semconv as sc
from kvobs.diagnose import classify_turns
from kvobs.live.buffer import IDLESS
from kvobs.live.classifier import Classifier
from kvobs.live.service import CLOCK_MARGIN_S
from kvobs.sources._frame import table_from_rows
from kvobs.turns import columns as col
from kvobs.turns.correlate import turns_from_spans

SECOND = 1_000_000_000


def _canonical(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items()
                       if k not in ("context", "measures", "version", "first_final")},
                      sort_keys=True, default=str)


class Written:
    """What a turn store holds of the final rows passes wrote: each key's latest
    version, none of a key a superseded row retired."""

    def __init__(self):
        self.latest: dict[tuple, dict] = {}
        self.keys_written: list[tuple[float | None, tuple]] = []  # (the pass's time, key)
        self.restarted_at: float | None = None  # the pass after which a restart came

    def take(self, result, now: float | None = None) -> None:
        for row in result.finalized:
            key = (row["tenant"], row["conversation_id"], row["turn"])
            self.keys_written.append((now, key))
            if key not in self.latest or row["version"] >= self.latest[key]["version"]:
                self.latest[key] = row

    def rows(self) -> dict[tuple, dict]:
        return {key: row for key, row in self.latest.items() if not row.get("superseded")}

    def retired(self) -> list[dict]:
        """The retired keys with their retirements' versions (what a restart takes)."""
        return [row for row in self.latest.values() if row.get("superseded")]


def _batch(rows: list[dict], context: dict) -> dict[tuple, dict]:
    turns = turns_from_spans(table_from_rows(rows), frame=False)
    diagnoses, _ = classify_turns(col.Columns(turns), None, context["prefill_tokens_per_s"],
                                  context["decode_s_per_token"])
    return {(d.tenant, d.conversation_id, d.turn.index): d.to_dict() for d in diagnoses}


def _assert_as_batch(live: dict[tuple, dict], rows: list[dict]) -> None:
    """Every turn ``live`` holds is the batch's over all ``rows``, and it holds every
    turn of the batch."""
    by_context: dict[str, list] = {}
    for key, row in live.items():
        by_context.setdefault(json.dumps(row["context"], sort_keys=True), []).append(key)
    for context, keys in by_context.items():
        batch = _batch(rows, json.loads(context))
        assert set(live) == set(batch)
        for key in keys:
            assert _canonical(live[key]) == _canonical(batch[key]), key


def _turn_of(rows: list[dict], k: int, conversation: str = "a") -> list[dict]:
    ids = {f"p-{conversation}-{k}", f"d-{conversation}-{k}"}
    return [r for r in rows if r.get(sc.REQUEST_ID.key) in ids]


def test_an_id_less_conversation_longer_than_the_window_keeps_its_name_and_first_turn():
    """Five turns 400 s apart, a window of 600 s: the first turn's spans are older than
    the window when the fourth comes, but the conversation went on, so they stay."""
    rows = router_turns("a", 5, 100.0, list(range(40)), gap_s=400.0)
    classifier, store = Classifier(window_s=600, grace_s=0), Written()
    written = []
    for k in range(1, 6):
        now = 100.0 + 400 * (k - 1) + 1
        classifier.buffer.add(_turn_of(rows, k), now=now)
        result = classifier.run_pass(now=now)
        store.take(result)
        written += result.finalized
    assert not [row for row in written if row.get("superseded")]
    assert [(row["turn"], row["prefill_request_id"]) for row in written] == [
        (k, f"p-a-{k}") for k in range(1, 6)]
    assert len({row["conversation_id"] for row in written}) == 1
    _assert_as_batch(store.rows(), rows)
    # It leaves once idle for the window: every turn with it.
    classifier.run_pass(now=100.0 + 1600 + 1 + 601)
    assert classifier.buffer.units == {} and classifier.turns == {}


def test_turns_the_proxy_named_apart_follow_lineage_into_one_conversation():
    """The proxy named each turn ``anonymous:<its trace>`` (it inferred nothing);
    lineage puts each after the one it extends: live, every turn is kept, under the key
    the batch gives it, and the later turns' names become aliases of the first's unit."""
    rows = router_turns("a", 4, 100.0, list(range(40)), gap_s=5.0)
    for row in rows:
        k = row[sc.REQUEST_ID.key].rsplit("-", 1)[1]
        row.update({sc.CONVERSATION_ID.key: f"anonymous:t{k}", sc.TURN_INDEX.key: 1})
    classifier = Classifier(window_s=600, grace_s=0)
    for k in range(1, 5):
        classifier.buffer.add(_turn_of(rows, k), now=100.0 + 5 * k)
        classifier.run_pass(now=100.0 + 5 * k)
    assert sorted(key[1:] for key in classifier.turns) == [("anonymous:t1", k)
                                                          for k in range(1, 5)]
    _assert_as_batch({k: st.row for k, st in classifier.turns.items()}, rows)
    assert set(classifier.buffer.units) == {"anonymous:t1"}
    # A late span sent under a merged name goes to the unit it merged into.
    late = {**_turn_of(rows, 3)[1], "span_id": "late", "name": sc.SPAN_RELEASE.name,
            sc.RELEASE_REASON.key: "finished"}
    classifier.buffer.add([late], now=130.0)
    assert "late" in {row["span_id"] for row in classifier.buffer.rows_of("anonymous:t1")}


def test_an_id_less_pass_takes_the_new_turn_and_its_conversation_not_the_window():
    base = list(range(40))
    fleet = [router_turns(f"c{n}", 3, 100.0 + n, [n * 100 + t for t in base], gap_s=20.0)
             for n in range(30)]
    classifier = Classifier(window_s=600, grace_s=0)
    for k in (1, 2):
        classifier.buffer.add([r for rows in fleet for r in _turn_of(rows, k, "")
                               or [r for r in rows if r[sc.REQUEST_ID.key].endswith(f"-{k}")]],
                              now=150.0 + k)
        classifier.run_pass(now=150.0 + k)
    assert not classifier.buffer.rows_of(IDLESS)  # every turn adopted
    assert len(classifier.buffer.units) == 30
    third = [r for r in fleet[7] if r[sc.REQUEST_ID.key].endswith("-3")]
    classifier.buffer.add(third, now=200.0)
    keys, spans = classifier.buffer.take_dirty()
    # c7's three turns (two spans each); the engines' starts come along as context.
    assert IDLESS in keys and spans is not None
    assert {r for r in spans.column(sc.REQUEST_ID.key).to_pylist() if r.startswith("p-")} == {
        "p-c7-1", "p-c7-2", "p-c7-3"}
    assert spans.num_rows <= 6 + 1


def test_a_late_id_less_span_of_an_adopted_turn_goes_to_its_conversation():
    """D's release of turn 1 comes in a trace of its own after turn 1 was adopted: it
    goes to the conversation by its request id, and turn 2 says the export was released
    as the batch does."""
    rows = router_turns("a", 2, 100.0, list(range(40)), gap_s=20.0)
    release = span(sc.SPAN_RELEASE, 105.0, "t-release", **{
        sc.REQUEST_ID.key: "d-a-1", sc.ROLE.key: "decode", sc.RELEASE_REASON.key: "finished"})
    classifier = Classifier(window_s=600, grace_s=0)
    classifier.buffer.add(_turn_of(rows, 1), now=101.0)
    classifier.run_pass(now=101.0)
    classifier.buffer.add([release], now=106.0)
    assert not classifier.buffer.rows_of(IDLESS)
    classifier.run_pass(now=106.0)
    classifier.buffer.add(_turn_of(rows, 2), now=121.0)
    classifier.run_pass(now=121.0)
    _assert_as_batch({k: st.row for k, st in classifier.turns.items()}, rows + [release])
    (second,) = [s.row for k, s in classifier.turns.items() if k[2] == 2]
    assert second["prefill_request_id"] == "p-a-2"


def test_a_tagged_span_takes_its_trace_back_from_the_conversation_that_adopted_it():
    """The engines' spans of a turn come first, id-less, and are adopted; then the
    proxy's span of P's trace, with the client's id: P's spans of that trace go to the
    client's conversation (a tagged trace's spans are placed by the trace, as correlate
    does), and the turns written are the batch's."""
    rows = router_turns("a", 1, 100.0, list(range(40)))
    proxy = span(sc.SPAN_PROXY_TURN, 99.9, "t-a-1", **{
        sc.CONVERSATION_ID.key: "C", sc.TURN_INDEX.key: 1})
    classifier, written = Classifier(window_s=600, grace_s=0), Written()
    classifier.buffer.add(rows, now=101.0)
    written.take(classifier.run_pass(now=101.0))
    (adopted,) = written.rows()
    assert adopted[1].startswith(sc.LINEAGE_PREFIX)
    classifier.buffer.add([proxy], now=102.0)
    assert {r["name"] for r in classifier.buffer.rows_of("C")} == {
        sc.SPAN_PROXY_TURN.name, sc.SPAN_PULL_DECISION.name}
    assert {r["name"] for r in classifier.buffer.rows_of(adopted[1])} == {sc.SPAN_EXPORT.name}
    written.take(classifier.run_pass(now=102.0))
    _assert_as_batch(written.rows(), rows + [proxy])


def test_a_conversation_a_fork_goes_on_from_stays_while_the_fork_does():
    """Client conversation C, three turns; an id-less fork from C's second turn (its
    own conversation, a second turn extending the same export) goes on, 250 s a turn,
    after C went quiet: C's spans are older than the window before the fork ends, but
    the fork's turns are numbered from C's, so C stays while it goes on."""
    base = list(range(40))
    rows = router_turns("c", 3, 100.0, base, gap_s=10.0, client_id="C")
    rows += router_turns("f", 4, 150.0, _retained_after("c", 2, base), gap_s=250.0)
    classifier, written = Classifier(window_s=600, grace_s=0), Written()
    for row in sorted(rows, key=lambda r: r["end_ns"]):
        now = row["end_ns"] / SECOND
        classifier.buffer.add([row], now=now)
        written.take(classifier.run_pass(now=now))
    assert "C" in classifier.buffer.units
    assert [key[2] for key in sorted(written.rows()) if key[1] != "C"] == [3, 4, 5, 6]
    _assert_as_batch(written.rows(), rows)
    written.take(classifier.run_pass(now=2000.0))  # both idle past the window: both leave
    assert classifier.buffer.units == {}


def _retained_after(conversation: str, k: int, base: list[int]) -> list[int]:
    """The tokens D retains after ``conversation``'s turn ``k`` (``router_turns``'
    making): what a fork from that turn starts with."""
    history, salt = list(base), sum(map(ord, conversation))
    for j in range(1, k + 1):
        history += [1000 + salt + j * 7 + i % 5 for i in range(100)]
        history += [2000 + salt + j * 13 + i % 7 for i in range(40)]
    return history


def _fleet(rng: random.Random) -> list[dict]:
    """Conversations behind a router: three starting alike (equal histories: lineage
    cannot tell which the second turns continue), one whose turns the proxy named apart,
    one with a client's id; forks from some conversation's turn, retried requests (the
    same prompt again), D's releases in traces of their own; turns far enough apart that
    conversations outlive the window."""
    rows: list[dict] = []
    made = []
    for n in range(rng.randint(3, 7)):
        base = list(range(40)) if n < 3 else [n * 100 + t for t in range(40)]
        same = ("c0", 2) if n in (1, 2) else ("", 0)
        turns, start = rng.randint(1, 5), 100.0 + rng.uniform(0, 60)
        gap = rng.choice([5.0, 30.0, 250.0, 450.0])
        spans = router_turns(f"c{n}", turns, start, base, gap_s=gap, same_as=same)
        for row in spans:
            k = int(row[sc.REQUEST_ID.key].rsplit("-", 1)[1])
            if n == 3:  # through the proxy, which named each turn apart
                row.update({sc.CONVERSATION_ID.key: f"anonymous:c3-{k}", sc.TURN_INDEX.key: 1})
            elif n == 4:
                row.update({sc.CONVERSATION_ID.key: "C4", sc.TURN_INDEX.key: k})
        made.append((f"c{n}", turns, start, gap, base, same))
        rows += spans
    for f in range(rng.randint(1, 2)):
        conversation, turns, start, gap, base, same = rng.choice(made)
        if not same[0]:
            k = rng.randint(1, turns)
            rows += router_turns(f"f{f}", rng.randint(1, 3),
                                 start + gap * (k - 1) + rng.uniform(1, 400),
                                 _retained_after(conversation, k, base),
                                 gap_s=rng.choice([5.0, 200.0]))
    prompts = [row for row in rows if row["name"] == sc.SPAN_PULL_DECISION.name]
    for prompt in rng.sample(prompts, min(2, len(prompts))):
        rid = prompt[sc.REQUEST_ID.key]
        for row in [r for r in rows
                    if rid in (r.get(sc.REQUEST_ID.key), r.get(sc.REMOTE_REQUEST_ID.key))]:
            retry = {**row, "start_ns": row["start_ns"] + SECOND // 3,
                     "end_ns": row["end_ns"] + SECOND // 3, "trace_id": row["trace_id"] + "-r",
                     "span_id": row["span_id"] + "-r"}
            for key in (sc.REQUEST_ID.key, sc.REMOTE_REQUEST_ID.key):
                if key in retry:
                    retry[key] += "r"
            rows.append(retry)
    exports = [row for row in rows if row["name"] == sc.SPAN_EXPORT.name]
    for export in rng.sample(exports, len(exports) // 2):
        d_request = export[sc.REQUEST_ID.key]
        rows.append(span(sc.SPAN_RELEASE, export["end_ns"] / SECOND + rng.uniform(1, 60),
                         f"rel-{d_request}", **{sc.REQUEST_ID.key: d_request,
                                                sc.ROLE.key: "decode",
                                                sc.RELEASE_REASON.key: "finished"}))
    return rows


def _streamed(rows: list[dict], rng: random.Random, every_s: float, delay_s: float,
              restart: bool = False) -> Written:
    """``rows`` arriving up to ``delay_s`` late, out of order, a pass every ``every_s``;
    what the passes wrote. ``restart``: once a random number of spans arrived, a new
    classifier resumes from what was written and a replay of the spans received since
    the window began or the earliest span held was received, whichever is earlier, as the
    service does from its stores (``Live.resume``)."""
    classifier, written = Classifier(window_s=600, grace_s=0), Written()
    arrival = sorted(rows, key=lambda r: r["end_ns"] / SECOND + rng.uniform(0, delay_s))
    restart_after = rng.randint(1, len(arrival) - 1) if restart else None
    clock, pending = 100.0, []
    received: list[tuple[float, dict]] = []
    for row in arrival:
        due = row["end_ns"] / SECOND
        while clock + every_s < due:
            classifier.buffer.add(pending, now=clock)
            received += [(clock, span) for span in pending]
            written.take(classifier.run_pass(now=clock))
            pending, clock = [], clock + every_s
            if restart_after is not None and len(received) >= restart_after:
                restart_after = None
                since = min(clock - 600, (classifier.buffer.held_since() or clock) - CLOCK_MARGIN_S)
                classifier = Classifier(window_s=600, grace_s=0)
                classifier.resume(written.rows().values(), written.retired(), clock)
                replay = [(at, span) for at, span in received if at >= since]
                for at, group in itertools.groupby(replay, key=lambda pair: pair[0]):
                    classifier.buffer.add([span for _, span in group], now=clock, received=at)
        pending.append(row)
    classifier.buffer.add(pending, now=clock)
    written.take(classifier.run_pass(now=clock))
    written.take(classifier.run_pass(now=clock + 1))
    return written


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("every_s", "delay_s"), [(10.0, 40.0), (1.0, 5.0)])
def test_an_id_less_fleet_streamed_in_any_order_gives_the_batch_s_turns(seed, every_s, delay_s):
    """``_fleet``'s spans arrive up to ``delay_s`` late, out of order, a pass every
    ``every_s``: what the passes wrote is what the batch gives."""
    rng = random.Random(seed)
    rows = _fleet(rng)
    _assert_as_batch(_streamed(rows, rng, every_s, delay_s).rows(), rows)


# Seeds of sweeps (160 and 120 seeds x 2 cadences, a restart each) that differed before
# the restart took the retired keys (51: a key retired before it and given again after
# it was written below its retirement: lost), retired the keys the replay moved turns
# from at once, not a window later (66, 87: a turn under two keys until then), and
# replayed from the earliest span held (10, 13, 21: a conversation longer than the
# window renumbered after the restart; 29 of 240 cases).
_RESTART_SEEDS = (10, 13, 21, 51, 66, 87)


@pytest.mark.parametrize("seed", _RESTART_SEEDS)
@pytest.mark.parametrize(("every_s", "delay_s"), [(10.0, 40.0), (1.0, 5.0)])
def test_an_id_less_fleet_restarted_midway_gives_the_batch_s_turns(seed, every_s, delay_s):
    """``_fleet``'s spans streamed as above, the classifier restarted after a random
    number of them: what both runs wrote is what the batch gives."""
    rng = random.Random(seed)
    rows = _fleet(rng)
    _assert_as_batch(_streamed(rows, rng, every_s, delay_s, restart=True).rows(), rows)


def test_a_key_retired_and_given_again_is_written_past_its_retirement():
    """Turns the proxy named apart, arriving out of order: D's export of turn 1 alone is
    written as ``anonymous:a-1`` turn 1; turns 2 and 3 make lineage key it otherwise
    (a row retires the key); turn 1's decision comes last and gives the key back. That
    turn must be written at a later version than the retirement, or the store's
    latest-version rule keeps the key retired and turn 1 is lost."""
    rows = router_turns("a", 3, 100.0, list(range(40)), gap_s=5.0)
    for row in rows:
        k = row[sc.REQUEST_ID.key].rsplit("-", 1)[1]
        row.update({sc.CONVERSATION_ID.key: f"anonymous:a-{k}", sc.TURN_INDEX.key: 1})
    by_request = {row[sc.REQUEST_ID.key]: row for row in rows}
    classifier, written, finalized = Classifier(window_s=600, grace_s=0), Written(), []
    for now, requests in ((110, ["d-a-1"]), (120, ["p-a-2", "p-a-3"]),
                          (130, ["d-a-2", "d-a-3"]), (140, ["p-a-1"])):
        classifier.buffer.add([by_request[r] for r in requests], now=now)
        result = classifier.run_pass(now=now)
        written.take(result)
        finalized += result.finalized
    key = ("anonymous:a-1", 1)
    versions = [(row["version"], bool(row.get("superseded"))) for row in finalized
                if (row["conversation_id"], row["turn"]) == key]
    assert versions[:2] == [(1, False), (2, True)] and versions[2][0] > 2, versions
    _assert_as_batch(written.rows(), rows)


def test_a_client_turn_with_a_pooled_d_span_is_the_client_s_not_the_pool_s():
    """An untagged D span in a trace of its own that names a client's D request (not
    a release, so the client's conversation does not take it by request) waits in the
    pool; the client's turn is still the client's: a turn is the pool's only when its
    P request's spans are pooled."""
    rows = router_turns("c", 1, 100.0, list(range(40)), client_id="C")
    stray = span(sc.SPAN_DECODE_REQUEST, 101.0, "t-stray", **{
        sc.REQUEST_ID.key: "d-c-1", sc.ROLE.key: "decode"})
    classifier, written = Classifier(window_s=600, grace_s=0), Written()
    classifier.buffer.add(rows, now=101.0)
    written.take(classifier.run_pass(now=101.0))
    # C is clean when the stray comes: the pass forms a partial turn of C from context
    # spans (D's export shows its engine's start) and the stray, which is not the pool's.
    classifier.buffer.add([stray], now=102.0)
    assert [row["span_id"] for row in classifier.buffer.rows_of(IDLESS)] == [stray["span_id"]]
    assert classifier.buffer.holder("C", ("p-c-1", "d-c-1")) == "C"
    written.take(classifier.run_pass(now=102.0))
    _assert_as_batch(written.rows(), rows + [stray])
