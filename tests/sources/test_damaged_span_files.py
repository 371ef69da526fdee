"""Damage a crash, a preallocating writer, a copy or an editor leaves in span files, read
past in time linear in the file (issue 27): runs of NUL bytes, wherever they sit; a
decompression bomb; a file of countless corrupt lines. Each costs one bounded set of
warnings, and the rest of the file is read. Time and memory: bench/reader_damage_bench.py
(a timed test is not one: here the work is counted, not clocked)."""

import gzip

import pytest

from kvobs.sources import _decode, open_source
from kvobs.sources.otlp_json import read_rows
from trace_formats import framed, requests_of, sample_lines, to_proto, zstd

MIB = 1 << 20


@pytest.fixture(scope="module")
def lines_text(tmp_path_factory):
    return sample_lines(tmp_path_factory.mktemp("store"))


@pytest.fixture
def parsed(monkeypatch):
    """Counts the messages parsed as protobuf: each NUL run was millions of them."""
    calls = []
    original = _decode._proto

    def counting(payload, where, problems):
        calls.append(len(payload))
        return original(payload, where, problems)

    monkeypatch.setattr(_decode, "_proto", counting)
    return calls


def _read(path):
    problems = []
    return list(read_rows(str(path), problems)), problems


def test_eight_mib_of_nuls_is_one_warning_and_no_message(tmp_path, parsed):
    path = tmp_path / "preallocated"
    path.write_bytes(b"\0" * (8 * MIB))
    rows, problems = _read(path)
    assert rows == [] and parsed == []
    assert problems == [f"{path}: skipped {8 * MIB} NUL byte(s) in 1 run(s) (blocks never "
                        "written, or a preallocated file)"]


@pytest.mark.parametrize("layout", ["nuls-first", "nuls-between", "nuls-last",
                                    "nuls-everywhere"])
def test_json_lines_around_nul_blocks_are_all_read(tmp_path, lines_text, parsed, layout):
    lines = lines_text.splitlines(keepends=True)
    expected = len(_read_text(tmp_path, lines_text))
    block = b"\0" * MIB
    middle = len(lines) // 2
    data = {"nuls-first": block + lines_text.encode(),
            "nuls-between": "".join(lines[:middle]).encode() + block
            + "".join(lines[middle:]).encode(),
            "nuls-last": lines_text.encode() + block,
            "nuls-everywhere": b"".join(block[:4096] + line.encode() for line in lines)
            + block}[layout]
    path = tmp_path / layout
    path.write_bytes(data)
    rows, problems = _read(path)
    assert len(rows) == expected >= 20
    assert parsed == []
    assert len(problems) == 1 and "NUL byte(s)" in problems[0]


def _read_text(tmp_path, text):
    path = tmp_path / "reference.jsonl"
    path.write_text(text)
    return _read(path)[0]


@pytest.mark.parametrize("compress", [None, zstd, gzip.compress])
def test_framed_messages_around_nul_runs_are_all_read(tmp_path, lines_text, parsed,
                                                      compress):
    """Where a message's size is due, a NUL run (no exporter writes an empty message) is
    skipped to the next message, whose own size may begin with NULs."""
    messages = [to_proto(r) for r in requests_of(lines_text)]
    nul_runs = [b"\0" * n for n in (MIB, 5, 4, 4096)]
    data = b"".join(nul_runs[i % len(nul_runs)] + framed([m])
                    for i, m in enumerate(messages)) + b"\0" * 100
    path = tmp_path / "framed-with-holes"
    path.write_bytes(compress(data) if compress else data)
    rows, problems = _read(path)
    assert len(rows) == len(_read_text(tmp_path, lines_text))
    # each message parsed once, and once more where the reader resumes after a NUL
    # run: the work follows the messages, not the NUL bytes
    assert len(parsed) <= 2 * len(messages)
    assert len(problems) == 1 and f"in {len(messages) + 1} run(s)" in problems[0]


def test_a_decompression_bomb_is_read_up_to_the_bound(tmp_path, lines_text, monkeypatch,
                                                      parsed):
    monkeypatch.setattr(_decode, "MAX_DECOMPRESSED_BYTES", 4 * MIB)
    path = tmp_path / "bomb.gz"
    path.write_bytes(gzip.compress(lines_text.encode() + b"\0" * (64 * MIB), 1))
    rows, problems = _read(path)
    assert len(rows) == len(_read_text(tmp_path, lines_text))
    assert f"{path}: decompresses to more than {4 * MIB} bytes; read what precedes" in problems[0]
    zstd_path = tmp_path / "bomb.zst"
    zstd_path.write_bytes(zstd(b"\0" * (64 * MIB)))
    rows, problems = _read(zstd_path)
    assert rows == [] and parsed == [] and "decompresses to more than" in problems[0]


def test_one_file_adds_at_most_a_bounded_number_of_warnings(tmp_path, lines_text):
    path = tmp_path / "mostly-garbage.jsonl"
    path.write_text(lines_text + "{not json\n" * 5000)
    source = open_source(str(path))
    assert len(source.spans()) >= 20
    assert len(source.problems) == _decode.MAX_PROBLEMS_PER_FILE + 1
    assert source.problems[-1] == (f"{path}: {5000 - _decode.MAX_PROBLEMS_PER_FILE} more "
                                   "problem(s) not listed")


@pytest.mark.parametrize("compress", [zstd, gzip.compress])
def test_decompressed_nuls_are_counted_not_kept(tmp_path, lines_text, compress):
    """A bomb of NULs under the bound costs decompression time, not its size in memory:
    whole MiB of NULs after NULs are dropped as they come, and the lines after them read."""
    problems = []
    data = _decode._decompressed(compress(b"\0" * (64 * MIB) + lines_text.encode()),
                                 "bomb", problems)
    assert len(data) <= 2 * MIB + len(lines_text)
    assert data.endswith(lines_text.encode())
    dropped = 64 * MIB - data.count(0)
    assert dropped >= 62 * MIB
    assert problems == [f"bomb: skipped {dropped} NUL byte(s) while decompressing (whole "
                        "MiB of them)"]
    path = tmp_path / "bomb"
    path.write_bytes(compress(b"\0" * (64 * MIB) + lines_text.encode()))
    rows, problems = _read(path)
    assert len(rows) == len(_read_text(tmp_path, lines_text)) and len(problems) == 2
