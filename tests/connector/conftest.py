import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import _harness as h  # noqa: E402

from connector_instrumented import _scheduler_observer  # noqa: E402
from connector_instrumented._telemetry import SpanSink  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return h.write_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def spans(monkeypatch):
    capture = h.SpanCapture()
    monkeypatch.setattr(SpanSink, "_configure", lambda self, service: capture.factory(service))
    init = SpanSink.__init__

    def tracked_init(self, *args, **kwargs):  # spans() flushes every sink first
        init(self, *args, **kwargs)
        capture.sinks.append(self)

    monkeypatch.setattr(SpanSink, "__init__", tracked_init)
    monkeypatch.setattr(_scheduler_observer, "_WATCHDOG_PERIOD_S", 0.0)
    return capture
