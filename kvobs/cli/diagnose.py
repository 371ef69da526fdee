"""kvobs diagnose CONVERSATION_ID."""

from __future__ import annotations

import sys

import click

from kvobs.cli._common import (
    console,
    exit_status,
    fail_input,
    load_source,
    print_source_problems,
    slo_option,
    sources_option,
    stored_turn_rows_of_sources,
    unreadable_turn_rows,
)
from kvobs.cli._exit import allow_quick_exit
from kvobs.diagnose import AmbiguousConversation, UnknownConversation, diagnose
from kvobs.render import print_diagnosis, to_json
from kvobs.sources.otlp_json import OtlpJsonSource
from kvobs.sources.store import StoreSource


@click.command("diagnose")
@click.argument("conversation_id")
@sources_option
@slo_option
@click.option(
    "--prefill-rate",
    type=float,
    default=None,
    help="P compute rate in tokens/s (default: measured from the conversation).",
)
@click.option(
    "--decode-token-time",
    "decode_token_s",
    type=float,
    default=None,
    help="Typical decode seconds per output token (default: measured from the "
    "conversation). The live classifier says which rate and time it used.",
)
@click.option(
    "--tenant",
    default=None,
    metavar="DIGEST",
    help="Tenant digest (as spans carry it) when several tenants use the id.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def command(conversation_id, sources, read_slo, prefill_rate, decode_token_s, tenant, as_json):
    """Classify every turn of CONVERSATION_ID and explain it.

    Exit status: 0 healthy, 1 a turn has a fault verdict, 2 usage/input error
    (including an unknown conversation id), 3 evidence incomplete.

    Several --source (the stores of sharded classifiers): the spans of the one whose
    classified turn rows hold the conversation's latest turn are read.
    """
    source = sources[0] if len(sources) == 1 else _holder(conversation_id, sources, tenant)
    span_source = load_source(source)
    try:
        result = diagnose(
            span_source, conversation_id, read_slo, prefill_rate, tenant, decode_token_s
        )
    except UnknownConversation as unknown:
        print_source_problems(span_source.problems, machine_readable=True)
        hint = f"; near matches: {', '.join(unknown.near)}" if unknown.near else ""
        scope = f" for tenant {unknown.tenant}" if unknown.tenant is not None else ""
        fail_input(f"unknown conversation id {unknown.conversation_id!r}{scope} in {source}{hint}")
    except AmbiguousConversation as ambiguous:
        print_source_problems(span_source.problems, machine_readable=True)
        fail_input(
            f"conversation id {ambiguous.conversation_id!r} is used by "
            f"{len(ambiguous.tenants)} tenants ({', '.join(ambiguous.tenants)}); "
            f"they are separate conversations: pass --tenant DIGEST"
        )
    if as_json:
        click.echo(to_json(result.to_dict()))
        print_source_problems(result.problems, machine_readable=True)
    else:  # the problems printed after the table
        print_diagnosis(console(), result)
    if isinstance(span_source, (StoreSource, OtlpJsonSource)):  # files read, nothing held
        allow_quick_exit()
    sys.exit(exit_status(result.verdicts))


def _holder(conversation_id: str, sources: tuple[str, ...], tenant: str | None) -> str:
    """Which of several classifiers' stores holds the conversation: the one with its
    latest turn row (``TurnRowsUnion.source_of``, as report's drill-down commands name)."""
    from kvobs.sources import SourceError

    rows = stored_turn_rows_of_sources(sources)
    assert rows is not None  # several sources: each holds turn rows, or it exited
    joined = " + ".join(sources)
    try:
        held = rows.latest_of([conversation_id])[conversation_id]
    except (SourceError, OSError) as error:
        unreadable_turn_rows(sources, error)
    if not [t for t in held if tenant is None or t.get("tenant") == tenant]:
        scope = f" for tenant {tenant}" if tenant is not None else ""
        fail_input(
            f"unknown conversation id {conversation_id!r}{scope} in the classified turn rows "
            f"of {joined} (a conversation with no final turn yet is in its classifier's "
            "memory: GET /conversations/ID)"
        )
    holder = rows.source_of(conversation_id, joined)
    click.echo(f"reading the spans of {holder}, which holds its latest turn", err=True)
    return holder
