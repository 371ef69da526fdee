"""The ``kvobs`` command: one click group, one module per command.

Exit status (all commands):
  0  healthy: every turn's verdict is healthy
  1  at least one turn has a fault verdict
  2  usage or input error (bad option, unreadable source, unknown conversation id)
  3  no fault, but some turn is insufficient-evidence
"""

from __future__ import annotations

import click

from kvobs.cli import diagnose, store, turns


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvobs")
def main() -> None:
    """Observability and diagnostics for vLLM P/D bidirectional KV transfer."""


main.add_command(diagnose.command)
main.add_command(turns.command)
main.add_command(store.group)


def _register_optional() -> None:
    # Commands whose modules need the testbed or proxy extras register only when present.
    import importlib

    for module in ("kvobs.cli.testbed", "kvobs.cli.proxy", "kvobs.cli.dashboards",
                   "kvobs.cli.report"):
        try:
            loaded = importlib.import_module(module)
        except ImportError:
            continue
        for command in getattr(loaded, "COMMANDS", ()):
            main.add_command(command)


_register_optional()
