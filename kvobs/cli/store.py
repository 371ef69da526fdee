"""kvobs store: maintain the embedded span store."""

from __future__ import annotations

import click

from kvobs.cli._common import console
from kvobs.render import print_problems
from kvobs.sources.store import QUIET_S, compact


@click.group("store")
def group():
    """Embedded span store maintenance."""


@group.command("compact")
@click.argument("store_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--quiet-for",
    "quiet_s",
    type=click.FloatRange(min=0),
    default=QUIET_S,
    show_default=True,
    metavar="SECONDS",
    help="Also take a kvobs writer's active segment not written for this long "
    "(sealed under the writer's lock: safe while it runs).",
)
@click.option(
    "--writers-stopped",
    is_flag=True,
    help="No writer runs any more (a copied store, a stopped Collector): take "
    "every live file, active ones included.",
)
def compact_command(store_dir, quiet_s, writers_stopped):
    """Move the live OTLP-JSON segments of STORE_DIR no writer appends to any more
    (rotated away, or idle: see --quiet-for) into indexed parquet, each file with its
    turn rows (what kvobs report reads; written too for files compacted without them).
    Safe while writers run, and after a crash: run it again."""
    from kvobs._progress import progress

    # Seconds to minutes for a fleet's hour of segments: a spinner on a terminal.
    with progress(f"compacting {store_dir}"):
        moved, problems = compact(store_dir, quiet_s, writers_stopped)
    out = console()
    out.print(f"compacted {moved} spans into {store_dir}/compacted")
    print_problems(out, problems)
