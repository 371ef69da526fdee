"""Issue 12's reproductions, through the CLI: a damaged store is read the same way by
`diagnose`, `turns` and `report` (the rest read, each problem a warning naming the
file); an empty one is an input error for each; a span delivered twice counts once in
every path, the fleet's Arrow path included, and is reported."""

import glob
import json
import os
import shutil

import pytest
from click.testing import CliRunner

from kvobs import semconv as sc
from kvobs.cli import main
from kvobs.emit.spans import Correlation, emit
from kvobs.sources.store import compact
from spanfactory import SECOND, Tracers, TurnSpec, write_conversation

RECOMPUTED = 700


def _write(store):
    tracers = Tracers(str(store))
    write_conversation(tracers, "conv-a", [TurnSpec(), TurnSpec(read="failed")])
    write_conversation(tracers, "conv-b", [TurnSpec(), TurnSpec()])
    # P recomputed conv-a turn 2's prompt after the failed read
    emit(tracers[sc.Service.PREFILL], sc.SPAN_RECOMPUTE, Correlation("conv-a", 2, "tenant0"),
         {sc.RECOMPUTED_TOKENS.key: RECOMPUTED, sc.RECOMPUTE_REASON.key: "read-failed"},
         1_700_000_005 * SECOND, 1_700_000_005 * SECOND + 1000)
    tracers.flush()


@pytest.fixture
def store(tmp_path):
    _write(tmp_path)
    compact(str(tmp_path), writers_stopped=True)
    return tmp_path


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _all_commands(store):
    return {"diagnose": _run("diagnose", "conv-b", "--source", store, "--json"),
            "turns": _run("turns", "--source", store, "--json"),
            "report": _run("report", "--source", store, "--json")}


def _bucket_file(store, conversation_id, kind="compacted"):
    from kvobs.sources.store import bucket_of

    (path,) = glob.glob(str(store / kind / f"bucket={bucket_of(conversation_id):02d}"
                            / ("*.parquet" if kind == "compacted" else "*.arrow")))
    return path


@pytest.mark.parametrize("damage, why", [
    (lambda path: open(path, "wb").close(), "empty"),
    (lambda path: open(path, "wb").write(b"not parquet" * 50), "not a whole parquet file"),
    (lambda path: open(path, "r+b").truncate(300), "not a whole parquet file")])
def test_a_damaged_span_file_is_skipped_and_named_by_every_command(store, damage, why):
    healthy = {c: r.exit_code for c, r in _all_commands(store).items()}
    path = _bucket_file(store, "conv-a")
    damage(path)
    results = _all_commands(store)
    assert {c: r.exit_code for c, r in results.items()} == healthy  # the verdicts' status
    for command in ("turns", "report"):  # diagnose conv-b reads conv-b's bucket only
        assert f"warning: {path}: skipped unreadable span file ({why})" in results[
            command].stderr
    turns = json.loads(results["turns"].stdout)
    assert {t["conversation_id"] for t in turns} == {"conv-b"}
    assert json.loads(results["report"].stdout)["conversations"] == 1
    # diagnose of the lost conversation: unknown, with the reason before the error
    lost = _run("diagnose", "conv-a", "--source", store, "--json")
    assert lost.exit_code == 2
    assert f"{path}: skipped unreadable span file" in lost.stderr
    assert "unknown conversation id 'conv-a'" in lost.stderr


def test_a_corrupt_turn_file_is_rebuilt_from_its_spans(store):
    before = json.loads(_run("report", "--source", store, "--json").stdout)
    path = _bucket_file(store, "conv-a", "turns")
    with open(path, "wb") as handle:
        handle.write(b"garbage")
    results = _all_commands(store)
    assert [r.exit_code for r in results.values()][1:] == [0, 0]
    assert f"warning: {path}: unreadable turn file" in results["report"].stderr
    after = json.loads(results["report"].stdout)
    assert after["later_turns"] == before["later_turns"] and after["turns"] == 4


@pytest.mark.parametrize("layout", ["no-directories", "empty-live", "empty-compacted"])
def test_an_empty_store_is_an_input_error_for_every_command(tmp_path, layout):
    if layout != "no-directories":
        (tmp_path / ("spans" if layout == "empty-live" else "compacted")).mkdir()
    results = _all_commands(tmp_path)
    assert {c: r.exit_code for c, r in results.items()} == {
        "diagnose": 2, "turns": 2, "report": 2}
    assert "unknown conversation id 'conv-b'" in results["diagnose"].stderr
    assert f"no turns in {tmp_path}" in results["turns"].stderr
    assert f"no turns in {tmp_path}" in results["report"].stderr
    assert "Traceback" not in "".join(r.output + r.stderr for r in results.values())


def _recomputed(store):
    turns = json.loads(_run("turns", "--source", store, "--json").stdout)
    by_turn = {(t["conversation_id"], t["turn"]): t["recomputed_tokens"] for t in turns}
    report = json.loads(_run("report", "--source", store, "--json").stdout)
    return by_turn[("conv-a", 2)], report["later_turns"]["recomputed_tokens"]


@pytest.mark.parametrize("how", ["live-copied", "compacted-copied", "re-delivered-live",
                                 "compacted-twice"])
def test_a_span_delivered_twice_counts_once_in_turns_and_report(tmp_path, how):
    _write(tmp_path)
    delivered = "".join(open(path).read() for path in glob.glob(str(tmp_path / "spans" / "*")))
    if how != "live-copied":
        compact(str(tmp_path), writers_stopped=True)
    assert _recomputed(tmp_path) == (RECOMPUTED, RECOMPUTED)
    if how == "live-copied":
        for path in glob.glob(str(tmp_path / "spans" / "*")):
            shutil.copy(path, path + ".retry")
    elif how == "compacted-copied":
        path = _bucket_file(tmp_path, "conv-a")
        shutil.copy(path, path.replace(".parquet", "-copy.parquet"))
    else:  # the exporter retried after compaction: the same spans come again
        (tmp_path / "spans" / "retry.otlp.jsonl").write_text(delivered)
        if how == "compacted-twice":
            compact(str(tmp_path), writers_stopped=True)
    assert _recomputed(tmp_path) == (RECOMPUTED, RECOMPUTED)
    for command in ("turns", "report"):
        result = _run(command, "--source", tmp_path, "--json")
        assert "duplicate span(s) (same trace and span id) read once" in result.stderr


def _corrupt_inside(path):
    """Whole-looking (magic at both ends, so ``readable`` lets it through), its pages
    garbage: only reading it finds out."""
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.seek(4)
        handle.write(b"\xff" * (size // 3))


def test_a_span_file_corrupt_inside_is_skipped_and_named_by_every_command(store):
    """With its turn file gone too, its turns are rebuilt from spans: the file that
    cannot be read is reported and the rest of the store read, as diagnose does."""
    healthy = {c: r.exit_code for c, r in _all_commands(store).items()}
    path = _bucket_file(store, "conv-a")
    os.remove(_bucket_file(store, "conv-a", "turns"))
    _corrupt_inside(path)
    results = _all_commands(store)
    assert {c: r.exit_code for c, r in results.items()} == healthy  # the verdicts' status
    for command in ("turns", "report"):
        assert f"warning: {path}: skipped unreadable span file" in results[command].stderr
    assert {t["conversation_id"] for t in json.loads(results["turns"].stdout)} == {"conv-b"}
    lost = _run("diagnose", "conv-a", "--source", store, "--json")
    assert lost.exit_code == 2 and f"{path}: skipped unreadable span file" in lost.stderr


@pytest.mark.parametrize("bad", [None, -5, 2 ** 62])
def test_a_missing_or_absurd_time_on_any_span_kind_never_crashes_a_reader(bad):
    """Every span kind of a real testbed run, its start or end made missing or absurd
    in turn: turns, verdicts and each turn's timeline still come out, one per turn."""
    import os

    from kvobs.turns.correlate import turns_from_spans
    from kvobs.diagnose import classify_turns
    from kvobs.sources import open_source

    demo = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                        "demo-spans.otlp.jsonl")
    spans = open_source(demo).spans()
    expected = len(turns_from_spans(spans))
    for name in sorted(spans["name"].unique()):
        for field in ("start_ns", "end_ns"):
            damaged = spans.copy()
            damaged[field] = damaged[field].astype(object)
            damaged.loc[damaged["name"] == name, field] = bad
            turns = turns_from_spans(damaged)
            diagnoses, _ = classify_turns(turns)
            assert len(diagnoses) == len(turns) == expected, (name, field)


@pytest.mark.timeout(120)  # a hang guard: opening a FIFO blocks until someone writes
@pytest.mark.parametrize("where", ["compacted", "live", "turns"])
def test_a_fifo_anywhere_in_a_store_is_skipped_by_every_command(store, where):
    """A FIFO named like a span or turn file (``*.parquet`` in ``compacted/`` hung
    ``turns`` and ``report``): skipped, named in a warning where it holds spans (a turn
    file that is none is rebuilt from its span file), the rest read as before."""
    def outcome(results):  # each command's status and output, less its warnings
        return {c: (r.exit_code, {k: v for k, v in json.loads(r.stdout).items()
                                  if k != "problems"} if c == "diagnose" else r.stdout)
                for c, r in results.items()}

    healthy = outcome(_all_commands(store))
    bucket = os.path.dirname(_bucket_file(store, "conv-a"))
    fifo = {"compacted": os.path.join(bucket, "fifo.parquet"),
            "live": str(store / sc.STORE_LIVE_DIR / "fifo.otlp.jsonl"),
            "turns": _bucket_file(store, "conv-a", "turns")}[where]
    os.makedirs(os.path.dirname(fifo), exist_ok=True)
    if os.path.exists(fifo):
        os.remove(fifo)
    os.mkfifo(fifo)
    results = _all_commands(store)
    assert outcome(results) == healthy
    if where != "turns":
        for command in ("turns", "report"):
            assert (f"warning: {fifo}: skipped (not a regular file: a FIFO)"
                    in results[command].stderr)
    compacted = _run("store", "compact", store, "--writers-stopped")
    assert compacted.exit_code == 0, compacted.output


@pytest.mark.timeout(120)
def test_a_fifo_given_as_the_source_is_named(tmp_path):
    fifo = tmp_path / "spans.otlp.jsonl"
    os.mkfifo(fifo)
    result = _run("turns", "--source", fifo)
    assert result.exit_code == 2
    assert f"{fifo}: skipped (not a regular file: a FIFO)" in result.output
