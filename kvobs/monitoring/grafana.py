"""Put the generated dashboards into Grafana: HTTP import (grafana-client) or files.

The CLI (``kvobs dashboards``) only parses options and renders; the work is here so a
notebook or a deploy script can call it too.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from kvobs.monitoring.dashboards import DATASOURCE_VAR, build_dashboards, render
from kvobs.monitoring.config import DEFAULT, MonitoringConfig
from kvobs.semconv import EXEMPLAR_TRACE_ID


def map_datasource(dashboard: dict, datasource_uid: str | None) -> dict:
    """A copy whose ``datasource`` variable defaults to ``datasource_uid``.

    Panels keep referring to ``${datasource}``, so users can still switch data source.
    """
    board = copy.deepcopy(dashboard)
    if not datasource_uid:
        return board
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("name") == DATASOURCE_VAR and variable.get("type") == "datasource":
            variable["current"] = {
                "selected": True,
                "text": datasource_uid,
                "value": datasource_uid,
            }
    return board


def export_dashboards(
    directory: str | Path, datasource_uid: str | None = None, config: MonitoringConfig = DEFAULT
) -> list[Path]:
    """Write every dashboard as JSON into ``directory`` (for Grafana file provisioning)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, board in build_dashboards(config).items():
        path = out / name
        path.write_text(render(map_datasource(board, datasource_uid)))
        written.append(path)
    return written


def provisioning_provider(directory: str | Path, folder: str = "kvobs") -> str:
    """A Grafana dashboard-provider file pointing at ``directory`` (values JSON-quoted)."""
    return (
        "apiVersion: 1\n"
        "providers:\n"
        "  - name: kvobs\n"
        f"    folder: {json.dumps(folder)}\n"
        "    type: file\n"
        "    disableDeletion: false\n"
        "    allowUiUpdates: true\n"
        "    options:\n"
        f"      path: {json.dumps(str(Path(directory).resolve()))}\n"
    )


def datasource_provisioning(
    prometheus_url: str, config: MonitoringConfig = DEFAULT, name: str = "Prometheus (kvobs)"
) -> str:
    """A Grafana datasource provisioning file for the Prometheus the dashboards query,
    with exemplar trace links: an exemplar's ``trace_id`` label (the proxy sets it on its
    TTFT and latency histograms) opens ``config.trace_url``."""
    import yaml

    source: dict = {
        "name": name,
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "jsonData": {},
    }
    if config.trace_url:
        source["jsonData"]["exemplarTraceIdDestinations"] = [
            {"name": EXEMPLAR_TRACE_ID, "url": config.trace_url, "urlDisplayLabel": "Trace"}
        ]
    return yaml.safe_dump({"apiVersion": 1, "datasources": [source]}, sort_keys=False)


@dataclass(frozen=True)
class Imported:
    uid: str
    title: str
    url: str
    status: str
    version: int | None


def ensure_folder(api, title: str) -> str:
    """The uid of the folder titled ``title``, created when missing."""
    for folder in api.folder.get_all_folders():
        if folder.get("title") == title:
            return folder["uid"]
    return api.folder.create_folder(title)["uid"]


def import_dashboards(
    api,
    *,
    folder: str | None = None,
    overwrite: bool = False,
    datasource_uid: str | None = None,
    config: MonitoringConfig = DEFAULT,
) -> list[Imported]:
    """POST every dashboard to ``/api/dashboards/db`` through a ``GrafanaApi``."""
    folder_uid = ensure_folder(api, folder) if folder else None
    results = []
    for board in build_dashboards(config).values():
        body = {
            "dashboard": map_datasource(board, datasource_uid),
            "overwrite": overwrite,
            "message": "kvobs dashboards import",
        }
        if folder_uid:
            body["folderUid"] = folder_uid
        answer = api.dashboard.update_dashboard(body)
        results.append(
            Imported(
                answer.get("uid", board["uid"]),
                board["title"],
                answer.get("url", ""),
                answer.get("status", ""),
                answer.get("version"),
            )
        )
    return results


def connect(url: str, token: str | None = None, timeout: float = 10.0):
    """A ``GrafanaApi`` for ``url`` (user:password in the URL also works)."""
    from grafana_client import GrafanaApi

    return GrafanaApi.from_url(url, credential=token, timeout=timeout)
