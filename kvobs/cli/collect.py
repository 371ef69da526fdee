"""kvobs collect: receive OTLP/HTTP traces (e.g. vLLM's own) into a kvobs store."""

from __future__ import annotations

import click


@click.command("collect")
@click.option("--store-dir", required=True, type=click.Path(file_okay=False),
              help="Store directory: spans are appended under its spans/ folder.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=4318, show_default=True, type=int)
def command(store_dir, host, port):
    """Receive OTLP/HTTP traces (POST /v1/traces, protobuf or JSON) into STORE_DIR.

    For engines that export with OTLP and no OpenTelemetry Collector at hand, e.g.
    vllm serve --otlp-traces-endpoint http://HOST:PORT/v1/traces with
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf. kvobs then correlates vLLM's own
    request spans with the turn (docs/timeline.md).
    """
    from kvobs.emit.collect import run

    run(store_dir, host, port)
