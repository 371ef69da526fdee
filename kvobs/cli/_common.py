"""What every command shares: exit codes, the source option, the console."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NoReturn

import click

from kvobs.semconv import HEALTHY_VERDICTS, Verdict
from kvobs.sources import SOURCE_HELP, SourceError, SpanSource, open_source

from kvobs.cli._exit import (  # noqa: F401 (re-exported for the commands)
    EXIT_FAULT,
    EXIT_INPUT,
    EXIT_INSUFFICIENT,
    EXIT_INTERNAL,
    EXIT_OK,
    fail_input,
)

if TYPE_CHECKING:
    from rich.console import Console

    from kvobs.live.turnstore import TurnRows

# --fail-on of the fleet-wide commands (turns, report): what makes them exit non-zero.
FAIL_ON = ("never", "fault", "insufficient")
ENV_SOURCE = "KVOBS_SOURCE"


def source_option(function):
    return click.option(
        "--source",
        "-s",
        "source",
        envvar=ENV_SOURCE,
        required=True,
        show_envvar=True,
        help=SOURCE_HELP,
    )(function)


def sources_option(function):
    """``--source``, given once or more: several are read as one only where each holds
    classified turn rows (the stores of a sharded tier's classifiers)."""
    return click.option(
        "--source",
        "-s",
        "sources",
        envvar=ENV_SOURCE,
        required=True,
        multiple=True,
        show_envvar=True,
        help=SOURCE_HELP + " Given more than once: the classified turn rows of each (the stores of "
        "several classifiers, docs/live.md), read as one.",
    )(function)


def stored_turn_rows_of_sources(sources: tuple[str, ...]) -> TurnRows | None:
    """The classified turn rows the ``--source`` given hold (several read as one,
    ``TurnRowsUnion``); None where the one source holds spans only. A span source among
    several exits 2: spans are read from one source alone."""
    from kvobs.live.turn_rows import stored_turn_rows_of

    try:
        stored = stored_turn_rows_of(list(sources))
    except (SourceError, OSError, ImportError) as error:
        unreadable_turn_rows(sources, error)
    if stored is None and len(sources) > 1:
        fail_input(
            "several --source are read as one only when each holds classified turn rows "
            "(a classifier's turn store or ClickHouse turn table); read a span source alone"
        )
    return stored


def unreadable_turn_rows(sources: tuple[str, ...], error: Exception) -> NoReturn:
    fail_input(f"{' + '.join(sources)}: cannot read its classified turns: {error}")


def slo_option(function):
    return click.option(
        "--read-slo",
        type=float,
        default=None,
        help="Read-latency SLO in seconds; slower reads are slow-transfer.",
    )(function)


def load_source(location: str) -> SpanSource:
    """The one way every command opens ``--source`` (exit 2 when it cannot)."""
    try:
        return open_source(location)
    except (SourceError, OSError) as error:
        fail_input(str(error))


MAX_PROBLEMS_SHOWN = 20


def print_source_problems(problems: list[str], machine_readable: bool) -> None:
    """What reading the source skipped or repaired (a corrupt file, a duplicate span, a
    bad value): after the table, or on stderr when stdout is JSON or CSV. Every command
    reads the rest of a damaged source and says so here; a long list is cut short."""
    if not problems:
        return
    from rich.console import Console  # on use: a clean source's `--json` never needs rich

    out = Console(stderr=True) if machine_readable else console()
    shown = problems[:MAX_PROBLEMS_SHOWN]
    for problem in shown:
        out.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)
    if len(problems) > len(shown):
        out.print(
            f"[yellow]warning:[/] ... and {len(problems) - len(shown)} more problems",
            highlight=False,
        )


def fail_on_option(function):
    return click.option(
        "--fail-on",
        type=click.Choice(FAIL_ON),
        default="never",
        show_default=True,
        help="Exit 1 when a turn has a fault verdict (fault), also 3 when one is "
        "insufficient-evidence (insufficient); never: exit 0 whatever the verdicts, "
        "so that the command runs under `set -e`.",
    )(function)


def fleet_exit_status(verdicts: list[Verdict], fail_on: str) -> int:
    """``exit_status`` as far as ``--fail-on`` asks."""
    status = exit_status(verdicts)
    if fail_on == "never" or (fail_on == "fault" and status == EXIT_INSUFFICIENT):
        return EXIT_OK
    return status


def exit_status(verdicts: list[Verdict]) -> int:
    if any(v not in HEALTHY_VERDICTS and v is not Verdict.INSUFFICIENT_EVIDENCE for v in verdicts):
        return EXIT_FAULT
    if Verdict.INSUFFICIENT_EVIDENCE in verdicts:
        return EXIT_INSUFFICIENT
    return EXIT_OK


def console() -> Console:
    from rich.console import Console  # on use: `--json` output never needs rich

    return Console(width=200 if not sys.stdout.isatty() else None)
