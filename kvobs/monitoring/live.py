"""Check the mixin against a live Prometheus, and start a throwaway one to check against.

- :func:`check_live` evaluates every dashboard panel query (Grafana variables replaced by
  match-all values) and every recording-rule expression through Prometheus' HTTP API and
  reports which returned data, which returned nothing and which errored.
- :func:`start_prometheus` runs the ``prometheus`` binary (Debian's package) with a generated
  config scraping the given targets, in a temporary directory; :meth:`PrometheusProcess.stop`
  ends it by its PID.

Standard library only (urllib, subprocess), so it runs wherever the testbed runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvobs._net import free_port
from kvobs._proc import stop_process_group, yield_cpu
from kvobs.monitoring import dashboards, rules
from kvobs.monitoring.config import COLON_RESTORING_RELABEL, DEFAULT, MonitoringConfig

__all__ = [
    "check_live",
    "start_prometheus",
    "prometheus_config",
    "PrometheusProcess",
    "LiveReport",
    "QueryResult",
    "instant_query",
    "wait_for_data",
    "substitute_variables",
]

# Grafana's built-in interval variables and what to put in their place.
_INTERVAL_VARS = ("__rate_interval", "__interval", "__range")


def substitute_variables(expr: str, interval: str = "1m") -> str:
    """Replace Grafana variables: intervals by ``interval``, template variables by ``.*``.

    >>> substitute_variables('rate(x{job=~"$job", engine=~"${engine}"}[$__rate_interval])')
    'rate(x{job=~".*", engine=~".*"}[1m])'
    """

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return interval if name in _INTERVAL_VARS else ".*"

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", replace, expr)


@dataclass
class QueryResult:
    source: str  # "panel" | "recording"
    name: str  # panel title / refId, or record name
    expr: str  # as evaluated
    status: str  # "data" | "empty" | "error"
    series: int = 0
    error: str = ""

    @property
    def has_data(self) -> bool:
        return self.status == "data"


@dataclass
class LiveReport:
    results: list[QueryResult] = field(default_factory=list)

    def by_status(self, status: str) -> list[QueryResult]:
        return [r for r in self.results if r.status == status]

    @property
    def with_data(self) -> list[QueryResult]:
        return self.by_status("data")

    @property
    def empty(self) -> list[QueryResult]:
        return self.by_status("empty")

    @property
    def errors(self) -> list[QueryResult]:
        return self.by_status("error")

    def to_dict(self) -> dict:
        return {
            "results": [r.__dict__ for r in self.results],
            "counts": {s: len(self.by_status(s)) for s in ("data", "empty", "error")},
        }


def instant_query(base_url: str, expr: str, timeout: float = 10.0) -> list[dict]:
    """Run one instant query; raise ``RuntimeError`` with Prometheus' error text on failure."""
    url = f"{base_url.rstrip('/')}/api/v1/query"
    data = urllib.parse.urlencode({"query": expr}).encode()
    try:
        with urllib.request.urlopen(url, data=data, timeout=timeout) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        try:
            body = json.load(error)
        except ValueError:
            raise RuntimeError(f"HTTP {error.code}") from error
    if body.get("status") != "success":
        raise RuntimeError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
    result = body["data"]["result"]
    return result if isinstance(result, list) else [result]


def _evaluate(base_url: str, source: str, name: str, expr: str) -> QueryResult:
    try:
        samples = instant_query(base_url, expr)
    except (RuntimeError, OSError) as error:
        return QueryResult(source, name, expr, "error", error=str(error))
    return QueryResult(source, name, expr, "data" if samples else "empty", len(samples))


def check_live(
    base_url: str, config: MonitoringConfig = DEFAULT, interval: str = "1m"
) -> LiveReport:
    """Evaluate every dashboard panel query and every recording rule expression."""
    report = LiveReport()
    for board in dashboards.build_dashboards(config).values():
        for title, ref_id, expr in dashboards.panel_queries(board):
            report.results.append(
                _evaluate(
                    base_url, "panel", f"{title} [{ref_id}]", substitute_variables(expr, interval)
                )
            )
    for recording in rules.recordings(config):
        report.results.append(_evaluate(base_url, "recording", recording.record, recording.expr))
    return report


# --------------------------------------------------------------------------- local Prometheus


@dataclass
class PrometheusProcess:
    pid: int
    url: str
    directory: Path
    owns_directory: bool
    _process: subprocess.Popen | None = None

    def log(self) -> str:
        path = self.directory / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop this Prometheus by its PID (SIGTERM, then SIGKILL) and clean up."""
        if self._process is not None:
            stop_process_group(self._process, timeout)
        if self.owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "PrometheusProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def prometheus_config(
    targets: dict[str, list[str]],
    scrape_interval: str = "1s",
    rule_files: list[str] | tuple[str, ...] = (),
    restore_colons: bool = True,
) -> dict:
    """A minimal Prometheus config: one scrape job per key, static targets ``host:port``.

    ``restore_colons`` adds :data:`~kvobs.monitoring.config.COLON_RESTORING_RELABEL` to
    every job, so ``vllm:*`` names survive prometheus_client's underscore escaping.
    """

    def job_config(job: str, hosts: list[str]) -> dict:
        config = {"job_name": job, "static_configs": [{"targets": list(hosts)}]}
        if restore_colons:
            config["metric_relabel_configs"] = [dict(COLON_RESTORING_RELABEL)]
        return config

    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [job_config(job, hosts) for job, hosts in targets.items()],
    }


def start_prometheus(
    targets: dict[str, list[str]],
    *,
    binary: str = "prometheus",
    scrape_interval: str = "1s",
    rule_files: tuple[str, ...] = (),
    port: int | None = None,
    directory: str | Path | None = None,
    ready_timeout: float = 30.0,
    restore_colons: bool = True,
    niceness: int = 0,
) -> PrometheusProcess:
    """Start ``prometheus`` scraping ``{job: ["host:port", ...]}``; wait until it is ready.
    ``niceness`` > 0 runs it below what it watches (a small box measuring latency)."""
    executable = shutil.which(binary)
    if executable is None:
        raise FileNotFoundError(f"{binary!r} not found (Debian: apt-get install prometheus)")
    owns = directory is None
    workdir = (
        Path(tempfile.mkdtemp(prefix="kvobs-prometheus-")) if directory is None else Path(directory)
    )
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "prometheus.yml"
    # JSON is valid YAML: no YAML dependency needed here.
    config_path.write_text(
        json.dumps(prometheus_config(targets, scrape_interval, rule_files, restore_colons))
    )
    port = port or free_port()
    log = open(workdir / "prometheus.log", "wb")
    process = subprocess.Popen(
        [
            executable,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=workdir,
        start_new_session=True,
    )
    log.close()
    if niceness:
        yield_cpu(process.pid, niceness)
    handle = PrometheusProcess(process.pid, f"http://127.0.0.1:{port}", workdir, owns, process)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            text = handle.log()
            handle.stop()
            raise RuntimeError(f"prometheus exited with {process.returncode}:\n{text[-2000:]}")
        try:
            with urllib.request.urlopen(f"{handle.url}/-/ready", timeout=1) as response:
                if response.status == 200:
                    return handle
        except OSError:
            pass
        time.sleep(0.2)
    text = handle.log()
    handle.stop()
    raise TimeoutError(f"prometheus not ready after {ready_timeout} s:\n{text[-2000:]}")


def wait_for_data(base_url: str, expr: str, timeout: float = 30.0) -> list[dict]:
    """Poll ``expr`` until it returns samples (e.g. until two scrapes make rate() work)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            samples = instant_query(base_url, expr)
        except (RuntimeError, OSError):
            samples = []
        if samples or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)
