"""kvobs collect: receive OTLP/HTTP traces into a kvobs store, classifying every turn live."""

from __future__ import annotations

import logging

import click

from kvobs.cli._exit import fail_input
from kvobs.settings import DECODE_TTL

ENV_PEERS = "KVOBS_PEERS"


def _check_peers(ctx, param, value: tuple[str, ...]) -> tuple[str, ...]:
    """A peer is a base URL: a bad one exits 2 at start, not at the first lookup."""
    for url in value:
        if not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{url!r} is not an http:// or https:// URL")
    return value


@click.command("collect")
@click.option(
    "--store-dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Store directory: spans are appended under its spans/ folder, final "
    "classified turns under turns/.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=4318, show_default=True, type=int)
@click.option(
    "--classify/--no-classify",
    default=True,
    show_default=True,
    help="Classify every turn as its spans arrive (kvobs_turns_total on "
    "/metrics, /conversations/ID, turn rows under turns/).",
)
@click.option(
    "--decode-kv-ttl",
    type=click.FloatRange(min=1),
    default=DECODE_TTL.default,
    show_default=True,
    help="decoder_kv_blocks_ttl (s) of the decode engines: a conversation is "
    "held for twice this after its last span (a later turn can link to it "
    "only within the TTL).",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="Seconds a turn's classification must stay unchanged to be final (counted, written).",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    help="Seconds between classification passes.",
)
@click.option(
    "--turn-retention",
    type=click.FloatRange(min=3600),
    default=30 * 86400.0,
    show_default=True,
    help="Seconds final turn rows are kept (hourly partitions dropped whole).",
)
@click.option(
    "--turn-store",
    metavar="URL",
    default=None,
    help="Where final turn rows go instead of STORE_DIR/turns/: ClickHouse, "
    "clickhouse://[USER:PASSWORD@]HOST:8123/DB[?turn_table=T] or chdb:PATH "
    "(a ReplacingMergeTree table with a TTL of --turn-retention; default "
    "table kvobs_turn_rows). kvobs turns --source URL reads them.",
)
@click.option(
    "--read-slo",
    type=float,
    default=None,
    help="Read-latency SLO in seconds (slow-transfer above it).",
)
@click.option(
    "--peer",
    "peers",
    multiple=True,
    metavar="URL",
    envvar=ENV_PEERS,
    show_envvar=True,
    callback=_check_peers,
    help="Another classifier of a sharded tier (http://HOST:PORT; repeat it, or list "
    "them space-separated in the variable): GET /conversations/ID for a conversation "
    'this one does not hold asks them all (docs/live.md, "Several classifiers"). '
    "Listing this classifier itself is harmless.",
)
@click.option(
    "--peer-timeout",
    type=click.FloatRange(min=0.05),
    default=2.0,
    show_default=True,
    help="Seconds each peer's answer is waited for; one slower is named as unanswered.",
)
@click.option("--log-level", default="INFO", show_default=True)
def command(
    store_dir,
    host,
    port,
    classify,
    decode_kv_ttl,
    grace,
    interval,
    turn_retention,
    turn_store,
    read_slo,
    peers,
    peer_timeout,
    log_level,
):
    """Receive OTLP/HTTP traces into STORE_DIR and classify every turn live.

    Spans come in as POST /v1/traces (protobuf or JSON); every turn is classified as its
    spans arrive, with the turn pipeline of kvobs diagnose, always on (docs/live.md).

    Point the components (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://HOST:PORT/v1/traces,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf; vllm serve --otlp-traces-endpoint)
    or a Collector's otlphttp exporter here. Prometheus scrapes /metrics;
    GET /conversations/ID answers one conversation (JSON; /html for a page).
    """
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not classify:
        from kvobs.emit.collect import run

        run(store_dir, host, port)
        return
    from kvobs.live.service import LiveSettings, run

    turns = None
    if turn_store is not None:
        from kvobs.live.turn_rows import open_turn_rows
        from kvobs.sources import SourceError

        try:
            turns = open_turn_rows(turn_store, turn_retention)
        except (SourceError, ImportError) as error:
            fail_input(f"--turn-store {turn_store}: {error}")
    run(
        store_dir,
        host,
        port,
        LiveSettings(
            window_s=2 * decode_kv_ttl,
            grace_s=grace,
            interval_s=interval,
            turn_retention_s=turn_retention,
            read_slo_s=read_slo,
            peers=peers,
            peer_timeout_s=peer_timeout,
        ),
        turns,
    )
