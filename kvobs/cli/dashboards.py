"""``kvobs dashboards``: import the generated Grafana dashboards, or export them as files.

Needs the ``dashboards`` extra (grafana-foundation-sdk, grafana-client); the commands say
so and exit 2 when it is missing, instead of disappearing from ``--help``.
"""

from __future__ import annotations

from typing import NoReturn

import click

from kvobs.cli._common import console, fail_input

ENV_GRAFANA_URL = "KVOBS_GRAFANA_URL"
ENV_GRAFANA_TOKEN = "KVOBS_GRAFANA_TOKEN"
ENV_DATASOURCE_UID = "KVOBS_GRAFANA_DATASOURCE_UID"


def _needs_extra(error: ImportError) -> NoReturn:
    fail_input(f"{error.name or error} is not installed: pip install 'kvobs[dashboards]'")


def _config_options(command):
    """``--config FILE`` and ``--set KEY=VALUE``: the monitoring knobs (thresholds, TTL,
    runbook URL, selectors) the dashboards are generated with."""
    command = click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override one monitoring knob, e.g. decode_ttl_seconds=300 (repeatable).",
    )(command)
    return click.option(
        "--config",
        "config_file",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="Monitoring config, YAML or TOML (deploy/monitoring.example.yaml).",
    )(command)


def _load_config(config_file: str | None, overrides: tuple[str, ...]):
    from kvobs.monitoring import config as settings

    try:
        return settings.load(config_file, overrides)
    except settings.ConfigError as error:
        fail_input(f"monitoring config: {error}")


@click.group("dashboards", context_settings={"help_option_names": ["-h", "--help"]})
def dashboards_group() -> None:
    """Grafana dashboards generated from kvobs/monitoring (see docs/dashboards.md)."""


@dashboards_group.command("import")
@click.option(
    "--url",
    required=True,
    envvar=ENV_GRAFANA_URL,
    show_envvar=True,
    help="Grafana base URL, e.g. http://localhost:3000.",
)
@click.option(
    "--token",
    envvar=ENV_GRAFANA_TOKEN,
    show_envvar=True,
    default=None,
    help="Service-account token (or put user:password in the URL).",
)
@click.option("--folder", default=None, help="Folder title; created when missing.")
@click.option(
    "--overwrite/--no-overwrite",
    default=False,
    show_default=True,
    help="Replace a dashboard with the same uid.",
)
@click.option(
    "--datasource-uid",
    envvar=ENV_DATASOURCE_UID,
    show_envvar=True,
    default=None,
    help="Prometheus data source uid the datasource variable defaults to.",
)
@_config_options
def import_command(
    url: str,
    token: str | None,
    folder: str | None,
    overwrite: bool,
    datasource_uid: str | None,
    config_file: str | None,
    overrides: tuple[str, ...],
) -> None:
    """Import every kvobs dashboard into the Grafana at --url."""
    config = _load_config(config_file, overrides)
    try:
        from grafana_client.client import GrafanaException

        from kvobs.monitoring import grafana
    except ImportError as error:
        _needs_extra(error)
    try:
        api = grafana.connect(url, token)
        results = grafana.import_dashboards(
            api, folder=folder, overwrite=overwrite, datasource_uid=datasource_uid, config=config
        )
    except ImportError as error:
        _needs_extra(error)
    except GrafanaException as error:
        fail_input(f"Grafana refused the import: {error}")
    except Exception as error:  # connection errors come from niquests/urllib3
        fail_input(f"cannot reach Grafana at {url}: {error}")
    out = console()
    for result in results:
        out.print(f"imported {result.uid} ({result.title}) {result.url}".rstrip(), highlight=False)


@dashboards_group.command("export")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--datasource-uid",
    envvar=ENV_DATASOURCE_UID,
    show_envvar=True,
    default=None,
    help="Prometheus data source uid the datasource variable defaults to.",
)
@click.option(
    "--provider",
    "provider_folder",
    default=None,
    metavar="FOLDER",
    help="Also write kvobs-provider.yaml, a Grafana provisioning provider for "
    "DIRECTORY that files the dashboards under FOLDER.",
)
@_config_options
def export_command(
    directory: str,
    datasource_uid: str | None,
    provider_folder: str | None,
    config_file: str | None,
    overrides: tuple[str, ...],
) -> None:
    """Write every kvobs dashboard as JSON into DIRECTORY (Grafana file provisioning)."""
    from pathlib import Path

    config = _load_config(config_file, overrides)
    try:
        from kvobs.monitoring import grafana

        paths = grafana.export_dashboards(directory, datasource_uid, config)
    except ImportError as error:
        _needs_extra(error)
    if provider_folder:
        provider = Path(directory) / "kvobs-provider.yaml"
        provider.write_text(grafana.provisioning_provider(directory, provider_folder))
        paths.append(provider)
    out = console()
    for path in paths:
        out.print(f"wrote {path}", highlight=False)


__all__ = ["dashboards_group"]
