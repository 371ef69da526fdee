"""kvobs report / tune / whatif: fleet-wide views over every turn of a source.

Heavy imports (the fleet package, matplotlib) happen inside the commands so that
``kvobs diagnose`` start-up stays fast.
"""

from __future__ import annotations

import sys

import click

from kvobs.cli._common import (
    EXIT_OK,
    console,
    fail_input,
    fail_on_option,
    fleet_exit_status,
    load_source,
    print_source_problems,
    slo_option,
    source_option,
    sources_option,
    stored_turn_rows_of_sources,
)
from kvobs.render import byte_size, duration, fault_count, number, plural, to_json, total_seconds
from kvobs.settings import MIN_CACHED_TOKEN_DELTA


def _labelled(source: str, read_slo, prefill_rate, machine_readable: bool = False):
    from kvobs._memory import keep_freed_memory
    from kvobs._progress import progress
    from kvobs.fleet import fleet_turns
    from kvobs.sources import SourceError

    keep_freed_memory()

    span_source = load_source(source)
    try:
        # A large store reads for seconds to minutes: a spinner on a terminal's stderr.
        with progress("reading spans into turns"):
            turns = fleet_turns(span_source)
    except (SourceError, OSError) as error:
        fail_input(str(error))
    if turns.empty:
        print_source_problems(span_source.problems, machine_readable)
        fail_input(f"no turns in {source}")
    return span_source, turns


def _check_since(ctx, param, value: str | None) -> str | None:
    """Bad input exits 2 naming what is accepted, before any span is read."""
    if value is None:
        return None
    from kvobs.fleet.since import parse_since

    try:
        parse_since(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return value


@click.command("report")
@sources_option
@slo_option
@click.option(
    "--prefill-rate",
    type=float,
    default=None,
    help="P compute rate in tokens/s (default: measured).",
)
@click.option(
    "--since",
    default=None,
    callback=_check_since,
    help="Only turns since: a duration back from the newest turn (90s, 30min, "
    "1h30m, 7d: pandas Timedelta syntax) or an ISO-8601 instant (UTC unless "
    "it names a zone).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write an HTML report with plots to this file (needs matplotlib).",
)
@click.option("--conversation", default=None, help="Conversation for the HTML waterfall.")
@fail_on_option
def report_command(
    sources, read_slo, prefill_rate, since, as_json, html_file, conversation, fail_on
):
    """Fleet report: verdict mix, reuse, bytes, TTFT, latency, recompute and D memory, by
    turn index and prompt length, and the phases that cost the fleet most (turn 1
    apart). A source that holds classified turn rows (``kvobs collect``'s turn store, a
    ClickHouse database with its turn table) is read as turn rows, in batches; any other
    as spans (docs/fleet.md)."""
    stored = stored_turn_rows_of_sources(sources)
    source = " + ".join(sources)
    if stored is not None:
        _report_from_turn_rows(
            stored, source, read_slo, prefill_rate, since, as_json, html_file, fail_on
        )
        return
    from kvobs.fleet import build_report

    if html_file:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail_input("--html draws its plots with matplotlib: pip install 'kvobs[fleet]'")
    from kvobs.fleet.report import add_trace_ids

    span_source, turns = _labelled(source, read_slo, prefill_rate, as_json)
    report, labelled = build_report(turns, source, since, prefill_rate, read_slo)
    drill = report.extras["drill_down"]
    add_trace_ids(drill, span_source)
    if html_file:
        from kvobs.fleet.html import render_html

        with open(html_file, "w", encoding="utf-8") as handle:
            handle.write(render_html(report, labelled, conversation))
    if as_json:
        click.echo(to_json({**report.to_dict(), "drill_down": drill}))
    else:
        _print_report(report, html_file)
    print_source_problems(span_source.problems, machine_readable=as_json)
    sys.exit(fleet_exit_status(report.verdicts, fail_on))


def _report_from_turn_rows(
    rows, source, read_slo, prefill_rate, since, as_json, html_file, fail_on
):
    """``kvobs report`` over classified turn rows (``kvobs.fleet.turn_report``): the
    classifier's verdicts as stored, never classified again; memory stays flat."""
    from kvobs._memory import return_freed_memory
    from kvobs.fleet.turn_report import DEGRADED, turn_row_report

    return_freed_memory()
    if prefill_rate is not None or read_slo is not None:
        fail_input(
            "--prefill-rate and --read-slo re-classify turns; the turn rows in "
            f"{source} were classified as they arrived: read their spans to re-classify"
        )
    if html_file:
        fail_input(f"--html: {DEGRADED['html']}")
    try:
        report = turn_row_report(rows, source, since)
    except OSError as error:
        fail_input(str(error))
    if not report.turns:
        fail_input(f"no turns in {source}")
    drill = report.extras["drill_down"]
    if as_json:
        click.echo(
            to_json(
                {**report.to_dict(), "drill_down": drill, "degraded": report.extras["degraded"]}
            )
        )
    else:
        _print_report(report, None)
        console().print(
            "from turn rows: " + "; ".join(f"{k}: {v}" for k, v in DEGRADED.items()),
            highlight=False,
        )
    sys.exit(fleet_exit_status(report.verdicts, fail_on))


# The report's table columns: (header, cell of a metrics row): all of them when the
# terminal has room, else without _REPORT_WIDE, else without the p95s too (verdict
# mixes print under the table).
_REPORT_COLUMNS = (
    ("n", lambda row: f"{row['turns']:,}"),
    ("remote-hit", lambda row: _pct(row["remote_hit_ratio"])),
    ("faults", lambda row: f"{fault_count(row['verdicts']):,}"),
    ("TTFT p50", lambda row: duration(row["ttft_p50_s"])),
    ("TTFT p95", lambda row: duration(row["ttft_p95_s"])),
    ("latency p50", lambda row: duration(row["latency_p50_s"])),
    ("latency p95", lambda row: duration(row["latency_p95_s"])),
)
_REPORT_WIDE = (
    ("bytes read", lambda row: byte_size(row["bytes_read"])),
    ("reused tok", lambda row: f"{row['reused_tokens']:,}"),
    ("host-hit", lambda row: _pct(row["host_hit_ratio"])),
    ("host tok", lambda row: f"{row['host_reused_tokens']:,}"),
    ("recomputed tok", lambda row: f"{row['recomputed_tokens']:,}"),
    ("no TTFT", lambda row: f"{row['ttft_unmeasured_turns']:,}"),
)


def _print_report(report, html_file) -> None:
    from kvobs import semconv as sc
    from kvobs.render import compact_table, widest_fitting

    out = console()
    tag = " [bold yellow](SYNTHETIC data)[/]" if report.synthetic else ""
    out.print(
        f"source {report.source}: {plural(report.conversations, 'conversation')}, "
        f"{plural(report.turns, 'turn')}{tag}; prefill rate "
        f"{_num(report.prefill_tokens_per_s)} tokens/s"
    )
    rows = [("1", "all", report.first_turn), ("2+", "all", report.later_turns)]
    rows += [
        (row["turn_bucket"], "all", row) for row in report.by_turn if row["turn_bucket"] != "1"
    ]
    order = {bucket: i for i, bucket in enumerate(sc.PROMPT_BUCKET_VALUES)}
    rows += [
        ("2+", row["prompt_bucket"], row)
        for row in sorted(report.by_prompt, key=lambda row: order.get(row["prompt_bucket"], 99))
    ]

    def table(columns):
        headers = ["turns", "prompt", *(header for header, _ in columns)]
        built = compact_table("by turn index and prompt length", headers, frozenset(headers[2:]))
        for scope, prompt, row in rows:
            built.add_row(scope, prompt, *(cell(row) for _, cell in columns))
        return built

    narrow = tuple(c for c in _REPORT_COLUMNS if not c[0].endswith("p95"))
    out.print(
        widest_fitting(
            out, [table(_REPORT_COLUMNS + _REPORT_WIDE), table(_REPORT_COLUMNS), table(narrow)]
        )
    )
    for scope, prompt, row in rows:
        mix = ", ".join(
            f"{verdict} {n:,} ({n / row['turns']:.0%})" for verdict, n in row["verdicts"].items()
        )
        out.print(f"verdicts, turns {scope}, prompt {prompt}: {mix}", highlight=False)
    for scope, title in (("first_turn", "turn 1"), ("later_turns", "later turns")):
        out.print(_phase_table(report.phases[scope], title))
    memory = report.memory
    out.print(
        f"D memory held for reuse: {memory['block_seconds_held']:,.0f} block-s over "
        f"{plural(memory['exports'], 'export')}; {_pct(memory['read_share_of_blocks'])} "
        f"of exported blocks were ever read; "
        f"{memory['block_seconds_never_read']:,.0f} block-s held for nothing"
        + (f"; {number(memory['gib_hours_held'])} GiB-h" if memory.get("gib_hours_held") else ""),
        highlight=False,
    )
    out.print(_retention_line(report.retention), highlight=False)
    _print_follow_up(out, report.extras["drill_down"])
    if html_file:
        out.print(f"HTML report written to {html_file}")


def _print_follow_up(out, drill) -> None:
    """The faulty and slow turns to follow up (``kvobs.fleet.report.drill_down``), then
    the command that explains each conversation's turns."""
    from rich.markup import escape

    from kvobs.render import compact_table, widest_fitting

    rows = drill["rows"]
    out.print(
        f"turns to follow up: {plural(drill['fault_turns'], 'turn')} with a fault "
        f"verdict, {plural(drill['slow_turns'], 'slow turn')} (healthy, latency at or "
        "above its scope's p95)" + ("" if rows else ": none"),
        highlight=False,
    )
    if not rows:
        return

    def cause(row) -> str:
        share = row["top_cause_share"]
        return (row["top_cause"] or "-") + (
            f" {share:.0%}" if row["top_cause"] and share is not None else ""
        )

    columns = [
        ("", lambda row: row["kind"]),
        ("conversation", lambda row: escape(row["conversation_id"])),
        ("turn", lambda row: str(row["turn"])),
        ("verdict", lambda row: row["verdict"]),
        ("latency", lambda row: duration(row["latency_s"])),
        ("top cause", cause),
        ("trace id", lambda row: row["trace_id"] or "-"),
    ]

    def table(shown):
        built = compact_table(
            "faulty and slow turns", [h for h, _ in shown], frozenset({"turn", "latency"})
        )
        for row in rows:
            built.add_row(*(cell(row) for _, cell in shown))
        return built

    # Narrow terminals: without the trace id, then without the cause too.
    out.print(widest_fitting(out, [table(columns), table(columns[:-1]), table(columns[:-2])]))
    hidden = (drill["fault_turns"] + drill["slow_turns"]) - len(rows)
    if hidden:
        out.print(
            f"{plural(hidden, 'more turn')} not listed: kvobs turns --source SOURCE "
            "--format csv lists every turn",
            highlight=False,
        )
    out.print("explain them (verdict, evidence, remedy, phases):", highlight=False)
    for command in dict.fromkeys(row["command"] for row in rows):
        out.print(f"  {escape(command)}", highlight=False, soft_wrap=True)


def _retention_line(retention) -> str:
    """Retention cost in each place and what it bought, in one line."""
    device, host = retention["device"], retention["host"]
    held = (
        f"{number(device['gib_hours'])} GiB-h"
        if device["gib_hours"] is not None
        else f"{device['block_seconds']:,.0f} block-s"
    )
    line = (
        f"retention cost: D {held} for {plural(device['tokens_served'], 'token')} read "
        f"later; host tier {number(host['gib_hours'])} GiB-h (evicted copies) for "
        f"{plural(host['tokens_served'], 'token')} loaded later"
    )
    if host["copies_still_held"]:
        line += (
            f"; {plural(host['copies_still_held'], 'host copy', 'host copies')} still "
            f"held (>= {number(host['byte_seconds_still_held_at_least'] / 2**30 / 3600)}"
            " GiB-h)"
        )
    return line


def _phase_table(section, title):
    """One scope's ranked phases (those some turn spent time in), then the unmeasured
    rest."""
    from rich.table import Table

    table = Table(
        title=f"where the time went, {title}: "
        f"{plural(section['timed_turns'], 'turn')} "
        f"with a latency, {total_seconds(section['latency_s'])} in all "
        "(phases ranked by total)"
    )
    for header in ("#", "phase", "total", "share", "p50", "p95", "slowest in"):
        table.add_column(header, justify="left" if header == "phase" else "right")
    spent = [row for row in section["phases"] if row["total_s"] or row["slowest_turns"]]
    for rank, row in enumerate(spent, 1):
        table.add_row(
            str(rank),
            row["phase"],
            total_seconds(row["total_s"]),
            _pct(row["share"]),
            duration(row["p50_s"]),
            duration(row["p95_s"]),
            f"{row['slowest_turns']:,}",
        )
    if section["unmeasured_turns"]:
        table.add_row(
            "",
            f"unmeasured ({plural(section['unmeasured_turns'], 'turn')})",
            total_seconds(section["unmeasured_s"]),
            _pct(section["unmeasured_share"]),
            "",
            "",
            "",
        )
    return table


@click.command("tune")
@source_option
@click.option(
    "--prefill-rate",
    type=float,
    default=None,
    help="P compute rate in tokens/s (default: measured).",
)
@click.option(
    "--target",
    type=float,
    default=0.95,
    show_default=True,
    help="Recommended TTL reaches this share of the best hit ratio on the grid.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def tune_command(source, prefill_rate, target, as_json):
    """Recommend kv_recompute_threshold, decoder_kv_blocks_ttl and the proxy entry
    lifetime from measured reads, prefill rate and gaps; shows the arithmetic. A source
    of classified turn rows is replayed from them, in batches (docs/fleet.md)."""
    from kvobs.fleet.confidence import interval_text

    stored = _turn_rows(source, prefill_rate)
    if stored is not None:
        from kvobs.fleet.turn_replay import tune_rows

        result, trust, _ = _from_rows(source, lambda: tune_rows(stored, target))
    else:
        from kvobs.fleet import label_turns, tune
        from kvobs.fleet.confidence import confidence

        _, turns = _labelled(source, None, prefill_rate)
        labelled, _ = label_turns(turns, prefill_rate)
        result = tune(labelled, target, prefill_rate)
        trust = confidence(labelled, result)
    if as_json:
        click.echo(to_json({**result.to_dict(), "confidence": trust.to_dict()}))
        sys.exit(EXIT_OK)
    from rich.table import Table

    out = console()
    for line in result.arithmetic:
        out.print(line, highlight=False)
    interval = trust.break_even_interval
    out.print(
        f"sample: {trust.reads:,} reads (read-cost fit), {trust.later_turns:,} later "
        f"turns (TTL replay)"
        + (
            f"; break-even {interval_text(interval)} (bootstrap over "
            + (
                f"a sample of {trust.bootstrap_reads:,} of {trust.bootstrap_of:,} reads)"
                if trust.bootstrap_reads < trust.bootstrap_of
                else "reads)"
            )
            if interval
            else ""
        )
        + f"; confidence [bold]{trust.level}[/]",
        highlight=False,
    )
    for warning in trust.warnings:
        out.print(f"[yellow]warning:[/] {warning}", highlight=False)
    table = Table(title="TTL candidates (replayed over the recorded turns)")
    for header in ("TTL s", "reuse window s", "hits", "hit ratio", "block-s held"):
        table.add_column(header, justify="right")
    for row in result.ttl_table:
        mark = " *" if row["ttl_s"] == result.recommended_ttl_s else ""
        table.add_row(
            f"{row['ttl_s']:.0f}{mark}",
            f"{row['reuse_window_s']:.0f}",
            f"{row['hits']:,}",
            _pct(row["hit_ratio"]),
            f"{row['block_seconds']:,.0f}",
        )
    out.print(table)
    sys.exit(EXIT_OK)


@click.command("whatif")
@source_option
@click.option(
    "--ttl",
    type=float,
    default=None,
    help="decoder_kv_blocks_ttl to replay (s); with --placement: as recorded unless given.",
)
@click.option(
    "--threshold",
    type=int,
    default=None,
    help="kv_recompute_threshold to replay; with --placement: as recorded unless given.",
)
@click.option(
    "--placement",
    is_flag=True,
    help="Compare keeping each conversation's KV on D, in the host tier "
    "instead, or in both: retention cost and reuse for the same turns.",
)
@click.option(
    "--min-cached-token-delta",
    type=int,
    default=int(MIN_CACHED_TOKEN_DELTA.default),
    show_default=True,
    help="With --placement: the router's gate for the host path (llm-d's "
    "minCachedTokenDelta): fewer extra tokens cached there, P recomputes.",
)
@click.option(
    "--proxy-lifetime",
    type=float,
    default=None,
    help="Proxy entry lifetime (s) every proxy replays with (default: each as "
    "recorded, its entries moving with the TTL as the kvobs proxy derives "
    "them: TTL less its --expiry-margin).",
)
@click.option(
    "--prefill-rate",
    type=float,
    default=None,
    help="P compute rate in tokens/s (default: measured).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def whatif_command(
    source, ttl, threshold, placement, min_cached_token_delta, proxy_lifetime, prefill_rate, as_json
):
    """Replay recorded turns under another TTL and threshold: predicted verdict mix, hits
    and memory against what happened. With --placement: the same turns had their KV
    been kept on D, in the host tier, or both."""
    if not placement:
        for name, value in (("--ttl", ttl), ("--threshold", threshold)):
            if value is None:
                raise click.UsageError(f"Missing option '{name}' (or give --placement).")
    stored = _turn_rows(source, prefill_rate)
    if stored is not None:
        from kvobs.fleet.turn_replay import PLACEMENT_UNAVAILABLE, whatif_rows

        if placement:
            fail_input(f"--placement on the turn rows of {source}: {PLACEMENT_UNAVAILABLE}")
        result = _from_rows(source, lambda: whatif_rows(stored, ttl, threshold, proxy_lifetime))
    else:
        from kvobs.fleet import label_turns, whatif

        _, turns = _labelled(source, None, prefill_rate)
        labelled, _ = label_turns(turns, prefill_rate)
        if placement:
            _placement(labelled, min_cached_token_delta, ttl, threshold, prefill_rate, as_json)
        result = whatif(labelled, ttl, threshold, proxy_lifetime, prefill_rate)
    if as_json:
        click.echo(to_json(result.to_dict()))
        sys.exit(EXIT_OK)
    from rich.table import Table

    from kvobs.semconv import VERDICT_VALUES

    out = console()
    table = Table(title=f"what if TTL {ttl:.0f} s, threshold {threshold} (later turns)")
    for header in ("", "recorded", "predicted"):
        table.add_column(header, justify="right")
    actual, predicted = result.actual, result.predicted
    for verdict in VERDICT_VALUES:
        a, p = actual["verdicts"].get(verdict, 0), predicted["verdicts"].get(verdict, 0)
        if a or p:
            table.add_row(verdict, f"{a:,}", f"{p:,}")
    table.add_row(
        "remote-hit ratio", _pct(actual["remote_hit_ratio"]), _pct(predicted["remote_hit_ratio"])
    )
    table.add_row(
        "reused tokens", f"{actual['reused_tokens']:,}", f"{predicted['reused_tokens']:,}"
    )
    table.add_row(
        "computed tokens", f"{actual['computed_tokens']:,}", f"{predicted['computed_tokens']:,}"
    )
    table.add_row(
        "D block-s held",
        f"{actual['block_seconds_held']:,.0f}",
        f"{predicted['block_seconds_held']:,.0f}",
    )
    out.print(table)
    out.print(f"{result.changed_turns:,} turns change verdict")
    sys.exit(EXIT_OK)


def _turn_rows(source: str, prefill_rate):
    """The classified turn rows ``source`` holds (``stored_turn_rows``), else None: then
    it is read as spans. ``--prefill-rate`` re-classifies, which turn rows cannot."""
    from kvobs.live.turn_rows import stored_turn_rows

    stored = stored_turn_rows(source)
    if stored is not None and prefill_rate is not None:
        fail_input(
            "--prefill-rate re-classifies turns; the turn rows in "
            f"{source} were classified as they arrived (at the rate they store): read "
            "their spans to re-classify"
        )
    return stored


def _from_rows(source: str, compute):
    """A replay over turn rows, with bounded memory; exits 2 on a store it cannot read
    or one without turns."""
    from kvobs._memory import return_freed_memory
    from kvobs.fleet.turn_replay import NoTurns

    return_freed_memory()
    try:
        return compute()
    except OSError as error:
        fail_input(str(error))
    except NoTurns:
        fail_input(f"no turns in {source}")


def _placement(labelled, delta, ttl, threshold, prefill_rate, as_json) -> None:
    from rich.table import Table

    from kvobs.fleet.placement import PLACES, placement
    from kvobs.semconv import VERDICT_VALUES

    result = placement(labelled, delta, ttl, threshold, prefill_rate)
    if as_json:
        click.echo(to_json(result.to_dict()))
        sys.exit(EXIT_OK)
    out = console()
    columns = {"recorded": result.recorded, **result.places}
    table = Table(
        title=f"where the KV waits: {result.later_turns:,} later turns "
        f"(host gate minCachedTokenDelta {delta:,} tokens)"
    )
    for header in ("", "recorded", *(f"keep on {p}" for p in PLACES)):
        table.add_column(header, justify="right")
    for verdict in VERDICT_VALUES:
        counts = [c["verdicts"].get(verdict, 0) for c in columns.values()]
        if any(counts):
            table.add_row(verdict, *(f"{n:,}" for n in counts))
    for key, label in (
        ("turns_served_by_device", "turns served by D"),
        ("turns_served_by_host", "turns served by the host tier"),
        ("tokens_served_by_device", "tokens served by D"),
        ("tokens_served_by_host", "tokens served by the host tier"),
    ):
        table.add_row(label, *(f"{c[key]:,}" for c in columns.values()))
    for key, label in (
        ("device_block_seconds", "D block-s held"),
        ("device_gib_hours", "D GiB-h held"),
        ("host_byte_seconds", "host byte-s held"),
        ("host_gib_hours", "host GiB-h held"),
    ):
        table.add_row(
            label,
            *(
                _num(c.get(key)) if "block" in key or "byte" in key else _gib(c.get(key))
                for c in columns.values()
            ),
        )
    out.print(table)
    out.print(
        f"bytes per token {_num(result.bytes_per_token)}, tokens per D block "
        f"{_num(result.tokens_per_block)}; host-tier evictions "
        f"{result.host_evictions}",
        highlight=False,
    )
    sys.exit(EXIT_OK)


def _gib(value) -> str:
    return "-" if value is None else f"{value:,.4g}"


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value) -> str:
    return "-" if value is None else f"{value:,.0f}"
