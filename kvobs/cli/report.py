"""kvobs report / tune / whatif: fleet-wide views over every turn of a source.

Heavy imports (the fleet package, matplotlib) happen inside the commands so that
``kvobs diagnose`` start-up stays fast.
"""

from __future__ import annotations

import sys

import click

from kvobs.cli._common import (EXIT_OK, console, fail_input, fail_on_option,
                               fleet_exit_status, load_source, print_source_problems,
                               slo_option, source_option)
from kvobs.render import duration, to_json


def _labelled(source: str, read_slo, prefill_rate, machine_readable: bool = False):
    from kvobs.fleet import fleet_turns
    from kvobs.sources import SourceError

    span_source = load_source(source)
    try:
        turns = fleet_turns(span_source)
    except (SourceError, OSError) as error:
        fail_input(str(error))
    if turns.empty:
        print_source_problems(span_source.problems, machine_readable)
        fail_input(f"no turns in {source}")
    return span_source, turns


@click.command("report")
@source_option
@slo_option
@click.option("--prefill-rate", type=float, default=None,
              help="P compute rate in tokens/s (default: measured).")
@click.option("--since", default=None,
              help="Only turns since: a duration back from the newest turn (90s, 30m, 24h, "
                   "7d) or an ISO-8601 instant.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False), default=None,
              help="Also write an HTML report with plots to this file (needs matplotlib).")
@click.option("--conversation", default=None, help="Conversation for the HTML waterfall.")
@fail_on_option
def report_command(source, read_slo, prefill_rate, since, as_json, html_file, conversation,
                   fail_on):
    """Fleet report: verdict mix, reuse, bytes, TTFT, latency, recompute and D memory, by
    turn index and prompt length, and the phases that cost the fleet most (turn 1
    apart)."""
    from kvobs.fleet import build_report

    span_source, turns = _labelled(source, read_slo, prefill_rate, as_json)
    report, labelled = build_report(turns, source, since, prefill_rate, read_slo)
    if html_file:
        from kvobs.fleet.html import render_html

        with open(html_file, "w", encoding="utf-8") as handle:
            handle.write(render_html(report, labelled, conversation))
    if as_json:
        click.echo(to_json(report.to_dict()))
    else:
        _print_report(report, html_file)
    print_source_problems(span_source.problems, machine_readable=as_json)
    sys.exit(fleet_exit_status(report.verdicts, fail_on))


def _print_report(report, html_file) -> None:
    from rich.table import Table

    out = console()
    tag = " [bold yellow](SYNTHETIC data)[/]" if report.synthetic else ""
    out.print(f"source {report.source}: {report.conversations:,} conversations, "
              f"{report.turns:,} turns{tag}; prefill rate "
              f"{_num(report.prefill_tokens_per_s)} tokens/s")
    table = Table(title="by turn index and prompt length")
    for header in ("turns", "prompt", "n", "remote-hit", "bytes read", "reused tok",
                   "recomputed tok", "TTFT p50", "TTFT p95", "no TTFT", "latency p50",
                   "latency p95", "verdicts"):
        table.add_column(header, overflow="fold")

    def add(scope, prompt, row):
        verdicts = ", ".join(f"{k} {v}" for k, v in row["verdicts"].items())
        table.add_row(scope, prompt, f"{row['turns']:,}", _pct(row["remote_hit_ratio"]),
                      _bytes(row["bytes_read"]), f"{row['reused_tokens']:,}",
                      f"{row['recomputed_tokens']:,}", _ms(row["ttft_p50_s"]),
                      _ms(row["ttft_p95_s"]), f"{row['ttft_unmeasured_turns']:,}",
                      _ms(row["latency_p50_s"]), _ms(row["latency_p95_s"]), verdicts)

    add("1", "all", report.first_turn)
    add("2+", "all", report.later_turns)
    for row in report.by_turn:
        if row["turn_bucket"] != "1":
            add(row["turn_bucket"], "all", row)
    for row in report.by_prompt:
        add("2+", row["prompt_bucket"], row)
    out.print(table)
    for scope, title in (("first_turn", "turn 1"), ("later_turns", "later turns")):
        out.print(_phase_table(report.phases[scope], title))
    memory = report.memory
    out.print(f"D memory held for reuse: {memory['block_seconds_held']:,.0f} block-s over "
              f"{memory['exports']:,} exports; {_pct(memory['read_share_of_blocks'])} of "
              f"exported blocks were ever read; "
              f"{memory['block_seconds_never_read']:,.0f} block-s held for nothing"
              + (f"; {memory['gib_hours_held']:,.1f} GiB-h" if memory.get("gib_hours_held")
                 else ""))
    if html_file:
        out.print(f"HTML report written to {html_file}")


def _phase_table(section, title):
    """One scope's ranked phases (those some turn spent time in), then the unmeasured
    rest."""
    from rich.table import Table

    table = Table(title=f"where the time went, {title}: {section['timed_turns']:,} turns "
                        f"with a latency, {_seconds(section['latency_s'])} in all "
                        "(phases ranked by total)")
    for header in ("#", "phase", "total", "share", "p50", "p95", "slowest in"):
        table.add_column(header, justify="left" if header == "phase" else "right")
    spent = [row for row in section["phases"] if row["total_s"] or row["slowest_turns"]]
    for rank, row in enumerate(spent, 1):
        table.add_row(str(rank), row["phase"], _seconds(row["total_s"]), _pct(row["share"]),
                      duration(row["p50_s"]), duration(row["p95_s"]),
                      f"{row['slowest_turns']:,}")
    if section["unmeasured_turns"]:
        table.add_row("", f"unmeasured ({section['unmeasured_turns']:,} turns)",
                      _seconds(section["unmeasured_s"]), _pct(section["unmeasured_share"]),
                      "", "", "")
    return table


@click.command("tune")
@source_option
@click.option("--prefill-rate", type=float, default=None,
              help="P compute rate in tokens/s (default: measured).")
@click.option("--target", type=float, default=0.95, show_default=True,
              help="Recommended TTL reaches this share of the best hit ratio on the grid.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def tune_command(source, prefill_rate, target, as_json):
    """Recommend kv_recompute_threshold, decoder_kv_blocks_ttl and the proxy entry
    lifetime from measured reads, prefill rate and gaps; shows the arithmetic."""
    from kvobs.fleet import label_turns, tune

    _, turns = _labelled(source, None, prefill_rate)
    labelled, _ = label_turns(turns, prefill_rate)
    result = tune(labelled, target, prefill_rate)
    if as_json:
        click.echo(to_json(result.to_dict()))
        sys.exit(EXIT_OK)
    from rich.table import Table

    out = console()
    for line in result.arithmetic:
        out.print(line, highlight=False)
    table = Table(title="TTL candidates (replayed over recorded gaps)")
    for header in ("TTL s", "reuse window s", "hits", "hit ratio", "block-s held"):
        table.add_column(header, justify="right")
    for row in result.ttl_table:
        mark = " *" if row["ttl_s"] == result.recommended_ttl_s else ""
        table.add_row(f"{row['ttl_s']:.0f}{mark}", f"{row['reuse_window_s']:.0f}",
                      f"{row['hits']:,}", _pct(row["hit_ratio"]), f"{row['block_seconds']:,.0f}")
    out.print(table)
    sys.exit(EXIT_OK)


@click.command("whatif")
@source_option
@click.option("--ttl", type=float, required=True, help="decoder_kv_blocks_ttl to replay (s).")
@click.option("--threshold", type=int, required=True, help="kv_recompute_threshold to replay.")
@click.option("--proxy-lifetime", type=float, default=None,
              help="Proxy entry lifetime (s); default TTL - 30.")
@click.option("--prefill-rate", type=float, default=None,
              help="P compute rate in tokens/s (default: measured).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def whatif_command(source, ttl, threshold, proxy_lifetime, prefill_rate, as_json):
    """Replay recorded turns under another TTL and threshold: predicted verdict mix, hits
    and memory against what happened."""
    from kvobs.fleet import label_turns, whatif

    _, turns = _labelled(source, None, prefill_rate)
    labelled, _ = label_turns(turns, prefill_rate)
    result = whatif(labelled, ttl, threshold, proxy_lifetime, prefill_rate)
    if as_json:
        click.echo(to_json(result.to_dict()))
        sys.exit(EXIT_OK)
    from rich.table import Table

    from kvobs.fleet.report import VERDICTS

    out = console()
    table = Table(title=f"what if TTL {ttl:.0f} s, threshold {threshold} (later turns)")
    for header in ("", "recorded", "predicted"):
        table.add_column(header, justify="right")
    actual, predicted = result.actual, result.predicted
    for verdict in VERDICTS:
        a, p = actual["verdicts"].get(verdict, 0), predicted["verdicts"].get(verdict, 0)
        if a or p:
            table.add_row(verdict, f"{a:,}", f"{p:,}")
    table.add_row("remote-hit ratio", _pct(actual["remote_hit_ratio"]),
                  _pct(predicted["remote_hit_ratio"]))
    table.add_row("reused tokens", f"{actual['reused_tokens']:,}",
                  f"{predicted['reused_tokens']:,}")
    table.add_row("computed tokens", f"{actual['computed_tokens']:,}",
                  f"{predicted['computed_tokens']:,}")
    table.add_row("D block-s held", f"{actual['block_seconds_held']:,.0f}",
                  f"{predicted['block_seconds_held']:,.0f}")
    out.print(table)
    out.print(f"{result.changed_turns:,} turns change verdict")
    sys.exit(EXIT_OK)


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f}ms"


def _seconds(value) -> str:
    """Totals: hours of fleet time, or milliseconds of a small source's."""
    if value is None:
        return "-"
    return f"{value:,.1f}s" if abs(value) >= 10 else duration(value)


def _num(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _bytes(value) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return str(value)


