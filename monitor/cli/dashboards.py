"""Push timwatch's Grafana dashboards through the Grafana HTTP API (``timwatch dashboards push``).

File provisioning (``deploy/grafana/``) covers Grafana instances we deploy; this covers the ones
users already run. Dashboards are written by uid with ``overwrite: true`` so that a push is
idempotent and always leaves the committed version in place, whatever was edited in the UI.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from ...dashboards.queries import DASHBOARD_DIR

__all__ = [
    "DEFAULT_DASHBOARD_DIR",
    "dashboards_app",
    "default_dashboard_files",
    "load_dashboard",
    "push_dashboards",
]

#: The generated dashboards shipped in the package (``dashboards/*.json``).
DEFAULT_DASHBOARD_DIR = DASHBOARD_DIR

PUSH_MESSAGE = "timwatch dashboards push"


def default_dashboard_files() -> list[Path]:
    files = sorted(DEFAULT_DASHBOARD_DIR.glob("*.json"))
    if not files:
        raise FileNotFoundError(
            f"no dashboard JSON in {DEFAULT_DASHBOARD_DIR}; pass the files explicitly (--file)"
        )
    return files


def load_dashboard(path: Path) -> dict[str, Any]:
    """Read one dashboard JSON file (a bare dashboard or an export ``{"dashboard": {...}}``)."""
    from ..core.jsoncodec import loads  # orjson: depth-limited, no recursion

    try:
        data = loads(path.read_bytes())
    except ValueError as exc:  # also invalid UTF-8 and nesting past orjson's depth limit
        raise ValueError(f"{path}: not valid JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("dashboard"), dict):
        data = data["dashboard"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a dashboard must be a JSON object")
    for field in ("uid", "title"):
        if not isinstance(data.get(field), str) or not data[field]:
            raise ValueError(f"{path}: dashboard field {field!r} is missing or empty")
    # Grafana's numeric id is per instance; sending one from elsewhere would target the wrong
    # dashboard, so only the uid identifies what to overwrite.
    return {k: v for k, v in data.items() if k not in ("id", "version")}


def _ensure_folder(api: Any, title: str) -> str:
    """uid of the top-level folder called ``title``, creating it when missing."""
    from grafana_client.client import GrafanaClientError

    def find() -> str | None:
        for folder in api.folder.get_all_folders():
            if folder.get("title") == title:
                return str(folder["uid"])
        return None

    uid = find()
    if uid is not None:
        return uid
    try:
        return str(api.folder.create_folder(title)["uid"])
    except GrafanaClientError as exc:
        # Someone else created it between our lookup and our create.
        if exc.status_code in (409, 412):
            uid = find()
            if uid is not None:
                return uid
        raise


def push_dashboards(
    grafana_url: str,
    token: str | None,
    folder: str | None = None,
    files: Sequence[Path | str] | None = None,
    *,
    timeout: float = 10.0,
) -> list[str]:
    """Create or overwrite each dashboard by uid; return the uids Grafana confirmed, in order.

    ``token`` is a Grafana service-account token; ``None`` uses credentials embedded in
    ``grafana_url`` (``http://user:pass@host:3000``). ``folder`` is a folder title, created if
    missing; ``None`` means Grafana's General folder. All files are read and checked before the
    first request so that a bad file never leaves Grafana half-updated.
    """
    from grafana_client import GrafanaApi

    paths = [Path(f) for f in files] if files else default_dashboard_files()
    dashboards = [load_dashboard(p) for p in paths]
    api = GrafanaApi.from_url(grafana_url, credential=token or None, timeout=timeout)
    folder_uid = _ensure_folder(api, folder) if folder else None
    uids = []
    for dashboard in dashboards:
        payload: dict[str, Any] = {
            "dashboard": dashboard,
            "overwrite": True,
            "message": PUSH_MESSAGE,
        }
        if folder_uid is not None:
            payload["folderUid"] = folder_uid
        answer = api.dashboard.update_dashboard(payload)
        uids.append(str(answer.get("uid") or dashboard["uid"]))
    return uids


dashboards_app = typer.Typer(help="Grafana dashboards.", no_args_is_help=True)


@dashboards_app.callback()
def _dashboards() -> None:
    """Grafana dashboards (generated in dashboards/, provisioned by deploy/grafana/)."""


@dashboards_app.command("push")
def push(
    grafana_url: Annotated[
        str,
        typer.Option("--grafana-url", envvar="GRAFANA_URL", help="e.g. http://grafana:3000"),
    ],
    token: Annotated[
        str | None,
        typer.Option("--token", envvar="GRAFANA_TOKEN", help="Grafana service-account token"),
    ] = None,
    folder: Annotated[
        str | None, typer.Option("--folder", help="folder title, created if missing")
    ] = None,
    file: Annotated[
        list[Path] | None,
        typer.Option("--file", help="dashboard JSON to push (repeatable; default: all)"),
    ] = None,
) -> None:
    """Create or overwrite the timwatch dashboards in Grafana, by uid."""
    from grafana_client.client import GrafanaException
    from niquests.exceptions import RequestException

    try:
        uids = push_dashboards(grafana_url, token, folder=folder, files=file)
    except RequestException as exc:  # before OSError: niquests' errors subclass it
        typer.echo(f"error: cannot reach Grafana at {grafana_url}: {exc}", err=True)
        raise typer.Exit(1) from exc
    except GrafanaException as exc:
        typer.echo(f"error: Grafana answered {exc.status_code}: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    where = f"folder {folder!r}" if folder else "the General folder"
    for uid in uids:
        typer.echo(f"pushed {uid} to {where}")
