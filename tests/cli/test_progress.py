"""Progress displays (#27): on a terminal's stderr only; a pipe gets exactly the bytes it
got without them (kvobs._progress, the one implementation every command uses)."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from kvobs._progress import progress, shown

DEMO_SPANS = Path(__file__).parents[1] / "data" / "demo-spans.otlp.jsonl"


def _pty() -> tuple[int, int]:
    """A pseudo-terminal (main, secondary) 120 columns wide."""
    main, secondary = os.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    return main, secondary


def _drain(fd: int, into: bytearray) -> threading.Thread:
    def read():
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: every writer closed
                return
            if not chunk:
                return
            into.extend(chunk)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_the_helper_draws_on_a_terminal_and_nothing_on_a_pipe(monkeypatch):
    monkeypatch.delenv("KVOBS_NO_PROGRESS", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    main, secondary = _pty()
    seen = bytearray()
    reader = _drain(main, seen)
    with os.fdopen(secondary, "w") as terminal:
        assert shown(terminal)
        with progress("fetching traces", 3, stream=terminal) as bar:
            assert bar.live
            for _ in range(3):
                time.sleep(0.05)
                bar.advance()
    reader.join(5)
    os.close(main)
    text = seen.decode(errors="replace")
    assert "fetching traces" in text and "3/3" in text
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as pipe:
        assert not shown(pipe)
        with progress("fetching traces", 3, stream=pipe, fallback=print) as bar:
            assert not bar.live
            bar.advance()
    with os.fdopen(read_end, "rb") as piped:
        assert piped.read() == b""


def _report(stderr_fd: int | None, **env) -> tuple[bytes, bytes | None, int]:
    inherited = {k: v for k, v in os.environ.items() if k != "KVOBS_NO_PROGRESS"}
    environment = {**inherited, "TERM": "xterm", **env}
    done = subprocess.run(
        [sys.executable, "-m", "kvobs", "report", "--source", str(DEMO_SPANS), "--json"],
        stdout=subprocess.PIPE,
        stderr=stderr_fd if stderr_fd is not None else subprocess.PIPE,
        env=environment,
        timeout=300,
    )
    return done.stdout, done.stderr, done.returncode


@pytest.mark.timeout(600)
def test_report_shows_progress_on_a_terminal_only_and_its_output_is_unchanged():
    piped_out, piped_err, piped_code = _report(None)
    quiet_out, quiet_err, quiet_code = _report(None, KVOBS_NO_PROGRESS="1")
    # a pipe: exactly the bytes of a run without any progress display
    assert (piped_out, piped_err, piped_code) == (quiet_out, quiet_err, quiet_code)
    assert b"reading spans into turns" not in piped_err and b"\x1b[" not in piped_err
    main, secondary = _pty()
    seen = bytearray()
    reader = _drain(main, seen)
    try:
        tty_out, _, tty_code = _report(secondary)
    finally:
        os.close(secondary)
        reader.join(10)
        os.close(main)
    assert b"reading spans into turns" in seen  # the spinner, on the terminal (stderr)
    assert (tty_out, tty_code) == (piped_out, piped_code)  # stdout's JSON untouched


def test_a_log_line_is_shown_as_it_is_not_as_markup(monkeypatch):
    """The testbed's log lines start with "[testbed]": rich would take it for a tag."""
    monkeypatch.delenv("KVOBS_NO_PROGRESS", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    main, secondary = _pty()
    seen = bytearray()
    reader = _drain(main, seen)
    with os.fdopen(secondary, "w") as terminal:
        with progress("starting the testbed", stream=terminal) as bar:
            bar.describe("[testbed] starting P and D")
            time.sleep(0.3)
    reader.join(5)
    os.close(main)
    assert "[testbed] starting P and D" in seen.decode(errors="replace")
