"""`timwatch dashboards push` (API and CLI) against a stand-in for Grafana's HTTP API.

Grafana itself is not installable on this machine (no Debian package, no network beyond PyPI),
so `push_dashboards` is tested against a small HTTP server implementing the four Grafana API
endpoints grafana-client calls here (GET/POST /api/folders, POST /api/dashboards/db), with
Grafana's answer shapes and its refusal to replace an existing uid without `overwrite`. This
stand-in is no evidence of compatibility with a real Grafana by itself: the request shapes
follow grafana-client's own calls, and the dashboards' queries are checked against a real
Prometheus in test_dashboards.py.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `dashboards/` is a top-level directory, not an installed package
    sys.path.insert(0, str(ROOT))

from tests.helpers.procs import free_port  # noqa: E402
from timwatch.monitor.cli.dashboards import dashboards_app, load_dashboard, push_dashboards  # noqa: E402

DASHBOARD_DIR = ROOT / "dashboards"
UIDS = {"timwatch-run", "timwatch-fleet", "timwatch-estr"}


class FakeGrafana(ThreadingHTTPServer):
    """The slice of Grafana's HTTP API that `push_dashboards` uses, with Grafana's semantics."""

    def __init__(self, status: int = 200) -> None:
        super().__init__(("127.0.0.1", 0), _GrafanaHandler)
        self.forced_status = status
        self.requests: list[dict[str, Any]] = []
        self.folders: list[dict[str, Any]] = []
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _GrafanaHandler(BaseHTTPRequestHandler):
    server: FakeGrafana

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        srv = self.server
        with srv.lock:
            srv.requests.append(
                {
                    "method": method,
                    "path": self.path,
                    "auth": self.headers.get("Authorization"),
                    "body": body,
                }
            )
            if srv.forced_status != 200:
                return self._reply(srv.forced_status, {"message": "invalid API key"})
            if method == "GET" and self.path.split("?")[0] == "/api/folders":
                return self._reply(
                    200,
                    [{"id": f["id"], "uid": f["uid"], "title": f["title"]} for f in srv.folders],
                )
            if method == "POST" and self.path == "/api/folders":
                if any(f["title"] == body["title"] for f in srv.folders):
                    return self._reply(409, {"message": "a folder with that name already exists"})
                folder = {
                    "id": len(srv.folders) + 1,
                    "uid": f"f{len(srv.folders) + 1}x",
                    "title": body["title"],
                }
                srv.folders.append(folder)
                return self._reply(200, folder)
            if method == "POST" and self.path == "/api/dashboards/db":
                dash = body["dashboard"]
                uid = dash["uid"]
                if uid in srv.dashboards and not body.get("overwrite"):
                    return self._reply(
                        412, {"status": "name-exists", "message": "dashboard with uid exists"}
                    )
                if "folderUid" in body and body["folderUid"] not in {f["uid"] for f in srv.folders}:
                    return self._reply(400, {"message": "folder not found"})
                version = srv.dashboards.get(uid, {}).get("version", 0) + 1
                srv.dashboards[uid] = {
                    "version": version,
                    "folderUid": body.get("folderUid"),
                    "title": dash["title"],
                }
                return self._reply(
                    200,
                    {
                        "id": 7,
                        "uid": uid,
                        "status": "success",
                        "url": f"/d/{uid}/x",
                        "version": version,
                    },
                )
            return self._reply(404, {"message": "not found"})

    def do_GET(self) -> None:  # noqa: N802
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")


@pytest.fixture()
def grafana() -> Iterator[FakeGrafana]:
    server = FakeGrafana()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _committed_uids() -> list[str]:
    return [json.loads(p.read_text())["uid"] for p in sorted(DASHBOARD_DIR.glob("*.json"))]


def test_push_creates_folder_then_overwrites_by_uid(grafana: FakeGrafana) -> None:
    uids = push_dashboards(grafana.url, "tok-123", folder="timwatch")
    assert uids == _committed_uids() and set(uids) == UIDS
    methods_paths = [(r["method"], r["path"].split("?")[0]) for r in grafana.requests]
    assert methods_paths[:2] == [("GET", "/api/folders"), ("POST", "/api/folders")]
    assert grafana.requests[1]["body"] == {"title": "timwatch"}
    posts = [r for r in grafana.requests if r["path"] == "/api/dashboards/db"]
    assert len(posts) == 3
    for r, uid in zip(posts, uids, strict=True):
        assert r["auth"] == "Bearer tok-123"
        assert r["body"]["overwrite"] is True
        assert r["body"]["folderUid"] == "f1x"
        assert r["body"]["dashboard"]["uid"] == uid
        assert "id" not in r["body"]["dashboard"]
        assert (
            r["body"]["dashboard"]["panels"]
            == load_dashboard(DASHBOARD_DIR / f"{uid}.json")["panels"]
        )

    # Second push: the folder is found, not created again, and each uid is overwritten.
    grafana.requests.clear()
    assert push_dashboards(grafana.url, "tok-123", folder="timwatch") == uids
    assert not [
        r for r in grafana.requests if r["method"] == "POST" and r["path"] == "/api/folders"
    ]
    assert len(grafana.folders) == 1
    assert all(grafana.dashboards[u]["version"] == 2 for u in uids)


def test_push_without_folder_goes_to_general_and_only_named_files(
    grafana: FakeGrafana,
) -> None:
    file = DASHBOARD_DIR / "timwatch-fleet.json"
    assert push_dashboards(grafana.url, "t", files=[file]) == ["timwatch-fleet"]
    assert [r["path"] for r in grafana.requests] == ["/api/dashboards/db"]
    body = grafana.requests[0]["body"]
    assert "folderUid" not in body and body["overwrite"] is True


def test_push_refuses_bad_file_before_any_request(grafana: FakeGrafana, tmp_path: Path) -> None:
    good = DASHBOARD_DIR / "timwatch-run.json"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"title": "no uid"}))
    with pytest.raises(ValueError, match=r"bad\.json: dashboard field 'uid'"):
        push_dashboards(grafana.url, "t", files=[good, bad])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json: not valid JSON"):
        push_dashboards(grafana.url, "t", files=[broken])
    assert grafana.requests == []


def test_cli_push_reports_uids(grafana: FakeGrafana) -> None:
    result = CliRunner().invoke(
        dashboards_app,
        ["push", "--grafana-url", grafana.url, "--token", "tok", "--folder", "RL runs"],
    )
    assert result.exit_code == 0, result.output
    for uid in UIDS:
        assert f"pushed {uid} to folder 'RL runs'" in result.output
    assert grafana.folders[0]["title"] == "RL runs"


def test_cli_push_reports_grafana_errors() -> None:
    server = FakeGrafana(status=401)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = CliRunner().invoke(
            dashboards_app, ["push", "--grafana-url", server.url, "--token", "wrong"]
        )
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 1
    assert "Grafana answered 401" in result.output


def test_cli_push_reports_unreachable_grafana_and_bad_files(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(dashboards_app, ["push", "--grafana-url", url, "--token", "t"])
    assert result.exit_code == 1
    assert f"cannot reach Grafana at {url}" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    result = CliRunner().invoke(dashboards_app, ["push", "--grafana-url", url, "--file", str(bad)])
    assert result.exit_code == 2
    assert "bad.json: a dashboard must be a JSON object" in result.output
