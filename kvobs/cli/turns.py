"""kvobs turns: every turn of a source, filterable, as a table, JSON or CSV."""

from __future__ import annotations

import sys

import click
import pandas as pd

from kvobs.cli._common import (
    console,
    fail_input,
    fail_on_option,
    fleet_exit_status,
    load_source,
    print_source_problems,
    slo_option,
    sources_option,
    stored_turn_rows_of_sources,
    unreadable_turn_rows,
)
from kvobs.diagnose import all_turns
from kvobs.render import duration, to_json
from kvobs.semconv import VERDICT_VALUES, Verdict


@click.command("turns")
@sources_option
@slo_option
@click.option(
    "--verdict",
    "verdicts",
    multiple=True,
    type=click.Choice(VERDICT_VALUES),
    help="Only these verdicts.",
)
@click.option("--conversation", "conversations", multiple=True, help="Only these ids.")
@click.option(
    "--tenant",
    "tenants",
    multiple=True,
    metavar="DIGEST",
    help="Only these tenants (digests, as spans carry them).",
)
@click.option("--min-turn", type=int, default=None, help="Only turns with index >= this.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table")
@click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
@click.option(
    "--from-spans",
    is_flag=True,
    help="Classify the source's spans even where it holds the turns `kvobs "
    "collect` classified (a store's turns/, ClickHouse's turn table).",
)
@fail_on_option
def command(
    sources, read_slo, verdicts, conversations, tenants, min_turn, fmt, as_json, from_spans, fail_on
):
    """All turns with their verdicts (load the CSV or JSON into pandas).

    Where the source holds the live classifier's turns (kvobs collect's store directory,
    or ClickHouse with its --turn-store table) those are listed, each at its latest
    version, linked as the classifier linked them; --from-spans classifies the spans
    again instead. Several --source (the stores of sharded classifiers) are listed as
    one, each turn at its latest version over all of them."""
    fmt = "json" if as_json else fmt
    if from_spans and len(sources) > 1:
        fail_input("--from-spans classifies the spans of one --source: give one")
    source = " + ".join(sources)
    stored = None if from_spans else _stored_turns(sources)
    problems: list[str] = []
    if stored is not None:
        rows = stored
    else:
        span_source = load_source(source)
        rows = [t.to_dict() for t in all_turns(span_source, read_slo)]
        problems = span_source.problems
    if not rows:  # an empty or unreadable source: as report and diagnose, an input error
        print_source_problems(problems, machine_readable=fmt != "table")
        fail_input(f"no turns in {source}")
    rows = [
        r
        for r in rows
        if (not verdicts or r["verdict"] in verdicts)
        and (not conversations or r["conversation_id"] in conversations)
        and (not tenants or r["tenant"] in tenants)
        and (min_turn is None or r["turn"] >= min_turn)
    ]
    if fmt == "json":
        click.echo(to_json(rows))
    elif fmt == "csv":
        frame = pd.DataFrame(rows)
        for column in ("evidence", "phases", "unmeasured", "causes", "clock_skew"):
            if column in frame:  # nested values: one JSON cell each, on one line
                frame[column] = frame[column].map(lambda value: to_json(value, indent=None))
        click.echo(frame.to_csv(index=False), nl=False)
    else:
        out = console()
        from rich.table import Table

        table = Table()
        for header in (
            "conversation",
            "turn",
            "verdict",
            "N",
            "M",
            "read",
            "host",
            "TTFT",
            "latency",
            "slowest",
            "cause",
        ):
            table.add_column(header)
        for row in rows:
            cause = row["causes"][0]["cause"] if row["causes"] else None
            evidence = row["evidence"]
            # An engine with only the offloading connector has no P decision: its host
            # lookup names the prompt, and the host column what the tiers served.
            prompt = row["prompt_tokens"]
            if prompt is None:
                prompt = evidence.get("host_lookup_prompt_tokens")
            host = evidence.get("host_accepted_tokens")
            table.add_row(
                row["conversation_id"],
                str(row["turn"]),
                row["verdict"],
                str(prompt),
                str(row["candidate_tokens"]),
                str(row["read_outcome"]),
                "-" if host is None else f"{host} tok",
                duration(row["ttft_s"]),
                duration(row["latency_s"]),
                str(row["slowest_phase"]),
                str(cause),
            )
        out.print(table)
    print_source_problems(problems, machine_readable=fmt != "table")
    sys.exit(fleet_exit_status([Verdict(r["verdict"]) for r in rows], fail_on))


def _stored_turns(sources: tuple[str, ...]) -> list[dict] | None:
    """The live classifiers' turns at ``sources``, None where the one source holds none."""
    from kvobs.sources import SourceError

    turns = stored_turn_rows_of_sources(sources)
    if turns is None:
        return None
    try:
        rows = turns.latest()
    except (SourceError, OSError, ImportError) as error:
        unreadable_turn_rows(sources, error)
    click.echo(
        f"{len(rows)} turns as kvobs collect classified them in {turns.location} "
        "(--from-spans: classify the spans instead)",
        err=True,
    )
    print_source_problems(turns.problems, machine_readable=True)  # stderr, as above
    return rows
