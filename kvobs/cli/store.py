"""kvobs store: maintain the embedded span store."""

from __future__ import annotations

import click

from kvobs.cli._common import console
from kvobs.render import print_problems
from kvobs.sources.store import compact


@click.group("store")
def group():
    """Embedded span store maintenance."""


@group.command("compact")
@click.argument("store_dir", type=click.Path(exists=True, file_okay=False))
def compact_command(store_dir):
    """Move live OTLP-JSON segments of STORE_DIR into indexed parquet, each file with its
    turn rows (what kvobs report reads; written too for files compacted without them)."""
    moved, problems = compact(store_dir)
    out = console()
    out.print(f"compacted {moved} spans into {store_dir}/compacted")
    print_problems(out, problems)
