"""The testbed's own services: ``kvobs collect`` started niced as a whole session."""

from __future__ import annotations

from test_proc import _niceness_of

from kvobs.testbed.services import CollectProcess


def test_collect_yields_the_cpu_as_a_session(tmp_path):
    """A collector's session is its own autogroup: a `nice -n` prefix (what it had) left
    the session at 0, level with the proxy and the client it must stay off; asked for
    10, the session is at 10, and the process serves."""
    niced = CollectProcess(tmp_path / "niced.log", str(tmp_path / "a"), nice=10)
    try:
        plain = CollectProcess(tmp_path / "plain.log", str(tmp_path / "b"))
        try:
            assert _niceness_of(niced.pid) == _niceness_of(plain.pid) + 10
        finally:
            plain.stop()
    finally:
        niced.stop()
