"""Every shape real producers write is read by content, and reads as the same spans."""

import pandas as pd
import pytest

from kvobs.diagnose import diagnose
from kvobs.sources import open_source
from trace_formats import file_formats, sample_lines

MICROSECOND_ROUNDED = {"jaeger-traces"}  # Jaeger keeps microseconds


@pytest.fixture(scope="module")
def lines_text(tmp_path_factory):
    return sample_lines(tmp_path_factory.mktemp("store"))


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(["trace_id", "span_id"]).reset_index(drop=True)


def _reference(tmp_path, lines_text):
    path = tmp_path / "reference.jsonl"
    path.write_text(lines_text)
    source = open_source(str(path))
    return source, _sorted(source.spans())


@pytest.mark.parametrize("name", sorted(file_formats('{"resourceSpans": []}\n')))
def test_each_format_reads_as_the_same_spans(tmp_path, lines_text, name):
    _, expected = _reference(tmp_path, lines_text)
    directory = tmp_path / "collector"
    directory.mkdir()
    (directory / name).write_bytes(file_formats(lines_text)[name])
    source = open_source(str(directory))
    spans = _sorted(source.spans())
    assert source.problems == []
    assert len(spans) == len(expected) >= 20
    if name in MICROSECOND_ROUNDED:
        for column in ("start_ns", "end_ns"):
            expected[column] = expected[column] // 1000 * 1000
    pd.testing.assert_frame_equal(spans, expected)
    verdicts = [t.finding.verdict for t in diagnose(source, "conv-a").turns]
    assert verdicts == [t.finding.verdict
                        for t in diagnose(open_source(str(tmp_path / "reference.jsonl")),
                                          "conv-a").turns]


def test_a_directory_of_every_format_reads_each_span_once(tmp_path, lines_text):
    _, expected = _reference(tmp_path, lines_text)
    directory = tmp_path / "mixed"
    directory.mkdir()
    formats = file_formats(lines_text)
    for name, data in formats.items():
        (directory / name).write_bytes(data)
    source = open_source(str(directory))
    assert len(source.spans()) == len(expected)
    # Every copy past the first is a duplicate, counted and reported.
    duplicates = len(expected) * (len(formats) - 1)
    assert source.problems == [f"{duplicates} duplicate span(s) (same trace and span id) "
                               "read once"]


def test_unreadable_files_are_reported_not_fatal(tmp_path, lines_text):
    directory = tmp_path / "dir"
    directory.mkdir()
    (directory / "spans").write_text(lines_text)
    (directory / "README").write_text("notes about these spans\n")
    (directory / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    good = file_formats(lines_text)["collector-proto"]
    (directory / "truncated-proto").write_bytes(good[:len(good) // 2])
    (directory / "truncated.gz").write_bytes(file_formats(lines_text)["copied-lines-gz"][:200])
    (directory / "empty").write_bytes(b"")
    pretty = file_formats(lines_text)["pretty-document"]
    (directory / "damaged-document").write_bytes(pretty.replace(b'"resourceSpans"',
                                                                b'"resourceSpans" #', 1))
    source = open_source(str(directory))
    assert len(source.spans()) >= 20
    problems = "\n".join(source.problems)
    assert f"{directory / 'README'}: skipped (neither JSON" in problems
    assert f"{directory / 'image.png'}: skipped" in problems
    assert f"{directory / 'truncated-proto'}:#" in problems and "truncated message" in problems
    assert f"{directory / 'truncated.gz'}: truncated gzip data" in problems
    assert "empty" not in problems
    damaged = [p for p in source.problems if "damaged-document" in p]
    assert damaged == [f"{directory / 'damaged-document'}: skipped corrupt JSON document "
                       f"({damaged[0].split('(', 1)[1]}"]  # once, not one line each


def test_one_unreadable_span_is_skipped_alone(tmp_path, lines_text):
    import json

    requests = [json.loads(line) for line in lines_text.splitlines()]
    spans = requests[0]["resourceSpans"][0]["scopeSpans"][0]["spans"]
    total = sum(len(ss["spans"]) for r in requests for rs in r["resourceSpans"]
                for ss in rs["scopeSpans"])
    spans[0]["status"] = "not an object"
    path = tmp_path / "spans"
    path.write_text("\n".join(json.dumps(r) for r in requests) + "\n")
    source = open_source(str(path))
    assert len(source.spans()) == total - 1
    assert source.problems == [f"{path}:1: skipped a span that cannot be read "
                               "('str' object has no attribute 'get')"]
