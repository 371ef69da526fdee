"""``kvobs clickhouse init``: the turn view that lets a fleet report read one row per turn
instead of every span (docs/clickhouse.md)."""

from __future__ import annotations

import click

from kvobs.cli._common import fail_input, load_source
from kvobs.sources.clickhouse import (
    DEFAULT_TABLE,
    DIALECTS,
    ClickHouseSource,
    backfill_sql,
    turns_view_ddl,
)


@click.group("clickhouse", context_settings={"help_option_names": ["-h", "--help"]})
def group() -> None:
    """ClickHouse span tables written by the OpenTelemetry Collector's exporter."""


@group.command("init")
@click.option(
    "--source",
    "-s",
    "location",
    default=None,
    help="clickhouse://... or chdb:PATH (?table=T): create the view there. "
    "Without it, print the SQL (for clickhouse-client).",
)
@click.option(
    "--table",
    default=DEFAULT_TABLE,
    show_default=True,
    help="Span table the printed SQL reads (with --source: the URL's ?table=).",
)
@click.option(
    "--attributes",
    type=click.Choice(sorted(DIALECTS)),
    default="map",
    show_default=True,
    help="The printed SQL's attribute columns: the exporter's default Map, or "
    "JSON (its json: true option). With --source: read from the table.",
)
@click.option(
    "--backfill",
    is_flag=True,
    help="Also aggregate the spans already in the table. Only while nothing "
    "inserts into it: spans inserted meanwhile count twice, and kvobs then "
    "ignores the view.",
)
def init_command(location: str | None, table: str, attributes: str, backfill: bool) -> None:
    """Create the turn view of the span table: a materialized view that aggregates each
    turn's spans as the collector inserts them. kvobs report/tune/whatif read it when it
    holds every span, else the spans."""
    if location is None:
        dialect = DIALECTS[attributes]
        statements = turns_view_ddl(table, dialect) + (
            [backfill_sql(table, dialect)] if backfill else []
        )
        click.echo(";\n\n".join(statements) + ";")
        return
    source = load_source(location)
    if not isinstance(source, ClickHouseSource):
        fail_input(f"{location}: not a ClickHouse source")
    source.create_turns_view(backfill=backfill)
    click.echo(f"turn view of {source.table} at {source.location}: {_STATES[source.view_state()]}")


_STATES = {
    "turns": "complete; reports read it",
    "traces": "complete, but some spans lack keys their traces hold; reports read spans",
    "stale": "made by another kvobs version: drop it (both tables) and init again; "
    "reports read spans",
    "incomplete": "span counts differ (spans inserted before it: --backfill); reports read spans",
}
