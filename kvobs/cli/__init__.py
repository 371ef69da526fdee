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
import sys

import click

# command name -> "module:attribute". Loaded on use, so `kvobs diagnose` pays for what it
# needs only, and a command whose extra is not installed fails alone, with its hint.
COMMANDS = {
    "diagnose": "kvobs.cli.diagnose:command",
    "turns": "kvobs.cli.turns:command",
    "store": "kvobs.cli.store:group",
    "clickhouse": "kvobs.cli.clickhouse:group",
    "report": "kvobs.cli.report:report_command",
    "tune": "kvobs.cli.report:tune_command",
    "whatif": "kvobs.cli.report:whatif_command",
    "dashboards": "kvobs.cli.dashboards:dashboards_group",
    "proxy": "kvobs.cli.proxy:proxy_command",
    "testbed": "kvobs.cli.testbed:testbed_group",
    "collect": "kvobs.cli.collect:command",
    "demo": "kvobs.cli.testbed:demo_command",
}


ENV_DEBUG = "KVOBS_DEBUG"
EXIT_INTERNAL = 4


def _internal_error(error: Exception) -> "NoReturn":  # noqa: F821
    """A bug in kvobs: exit 4 with one line (a traceback with KVOBS_DEBUG=1), never the
    1 that means "a turn has a fault verdict"."""
    import os
    import traceback

    if os.environ.get(ENV_DEBUG):
        traceback.print_exc()
    click.echo(f"kvobs: internal error ({type(error).__name__}: {error}); please report it "
               f"with the command line (set {ENV_DEBUG}=1 for the traceback)", err=True)
    sys.exit(EXIT_INTERNAL)


class _LazyGroup(click.Group):
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
                from kvobs.cli._common import fail_input

                fail_input(str(error))
            if isinstance(error, (click.ClickException, click.exceptions.Exit)):
                raise
            if isinstance(error, OSError):  # a port in use, a file it cannot write
                from kvobs.cli._common import fail_input

                fail_input(str(error))
            _internal_error(error)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attribute = target.split(":")
        return getattr(importlib.import_module(module), attribute)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvobs")
def main() -> None:
    """Observability and diagnostics for vLLM P/D bidirectional KV transfer."""
