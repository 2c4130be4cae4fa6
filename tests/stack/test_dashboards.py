"""Dashboards as code, `timwatch dashboards push` and Grafana provisioning.

Grafana itself is not installable on this machine (no Debian package, no network beyond PyPI),
so `push_dashboards` is tested against a small HTTP server implementing the four Grafana API
endpoints grafana-client calls here (GET/POST /api/folders, POST /api/dashboards/db), with
Grafana's answer shapes and its refusal to replace an existing uid without `overwrite`.
PromQL validity is checked against a real Prometheus (Debian package) with nothing to scrape:
a parse error answers 400, a valid query answers 200 with an empty result.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `dashboards/` is a top-level directory, not an installed package
    sys.path.insert(0, str(ROOT))

from tests.helpers.names import COUNTERS, FAMILY_OF, GAUGES, HISTOGRAMS, SUMMARIES  # noqa: E402
from timwatch.dashboards import iter_panel_queries, load_dashboards, queries, substitute  # noqa: E402
from timwatch.monitor.cli.dashboards import dashboards_app, load_dashboard, push_dashboards  # noqa: E402

DASHBOARD_DIR = ROOT / "dashboards"
UIDS = {"timwatch-run", "timwatch-fleet", "timwatch-estr"}

UNITS = {"none", "sci", "short", "percentunit", "ops", "s"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return [p for p in out if p["type"] != "row"]


@pytest.fixture(scope="module")
def dashboards() -> list[dict[str, Any]]:
    return load_dashboards(DASHBOARD_DIR)


# ---------------------------------------------------------------- generation


def test_regenerated_json_is_byte_identical_to_committed() -> None:
    from timwatch.dashboards.generate import render_all

    rendered = render_all()
    files = [*DASHBOARD_DIR.glob("*.json"), DASHBOARD_DIR / "panels.md"]
    committed = {p.name: p.read_text(encoding="utf-8") for p in files}
    assert set(rendered) == set(committed), "stale or missing dashboard files"
    for name, text in rendered.items():
        assert text == committed[name], (
            f"{name} is stale: run python -m timwatch.dashboards.generate"
        )


def test_generate_check_mode_detects_a_stale_file(tmp_path: Path) -> None:
    from timwatch.dashboards.generate import main, render_all

    for name, text in render_all().items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert main(["--out", str(tmp_path), "--check"]) == 0
    path = tmp_path / "timwatch-run.json"
    path.write_text(path.read_text().replace("Mismatch KL", "Mismatch KL!", 1))
    assert main(["--out", str(tmp_path), "--check"]) == 1


def test_dashboards_have_expected_uids_and_variables(dashboards: list[dict[str, Any]]) -> None:
    assert {d["uid"] for d in dashboards} == UIDS
    for d in dashboards:
        assert (DASHBOARD_DIR / f"{d['uid']}.json").exists()
        variables = {v["name"]: v for v in d["templating"]["list"]}
        run = variables["run"]
        assert run["type"] == "query"
        assert run["query"] == "label_values(timwatch_tokens_total, run)"
        assert run["multi"] and run["includeAll"] and run["allValue"] == ".*"
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        assert "timwatch" in d["tags"]


def test_every_panel_has_description_unit_datasource_and_targets(
    dashboards: list[dict[str, Any]],
) -> None:
    for d in dashboards:
        panels = _panels(d)
        assert len(panels) >= 6, d["uid"]
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{d['uid']}: duplicate panel ids"
        for p in panels:
            where = f"{d['uid']} / {p['title']}"
            desc = p.get("description", "")
            assert "Healthy:" in desc and "\n" not in desc, where
            assert p["fieldConfig"]["defaults"].get("unit") in UNITS, where
            assert p["datasource"] == DATASOURCE, where
            assert p["targets"], where
            ref_ids = [t["refId"] for t in p["targets"]]
            assert len(ref_ids) == len(set(ref_ids)), where
            for t in p["targets"]:
                assert t["expr"].strip() and t["legendFormat"], where
                assert t["datasource"] == DATASOURCE, where
            assert 0 < p["gridPos"]["w"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, where


def test_queries_use_only_spec_metrics_and_cover_all_of_them(
    dashboards: list[dict[str, Any]],
) -> None:
    used_families = set()
    for d in dashboards:
        for p in _panels(d):
            for t in p["targets"]:
                names = re.findall(r"\btimwatch_\w+", t["expr"])
                assert names, f"{d['uid']} / {p['title']}: no timwatch metric"
                for name in names:
                    assert name in FAMILY_OF, (
                        f"{d['uid']} / {p['title']}: {name} not an exported family"
                    )
                    used_families.add(FAMILY_OF[name])
                # Every selector is filtered by the run variable, except the service-wide
                # rejection counter, which has no run label (monitor/service/exporter.py).
                for name, sel in re.findall(r"\b(timwatch_\w+)(\{[^}]*\})?", t["expr"]):
                    if name == "timwatch_rejected_batches_total":
                        assert "run" not in sel, t["expr"]
                    else:
                        assert sel.startswith('{run=~"$run"'), t["expr"]
    assert used_families == set(COUNTERS + GAUGES + SUMMARIES + HISTOGRAMS)


def test_specific_panels(dashboards: list[dict[str, Any]]) -> None:
    by_uid = {d["uid"]: d for d in dashboards}
    heat = [p for p in _panels(by_uid["timwatch-estr"]) if p["type"] == "heatmap"]
    assert len(heat) == 1 and heat[0]["targets"][0]["format"] == "heatmap"
    assert "timwatch_token_estr_score_bucket" in heat[0]["targets"][0]["expr"]
    table = [p for p in _panels(by_uid["timwatch-fleet"]) if p["type"] == "table"][0]
    assert table["options"]["sortBy"] == [{"desc": True, "displayName": "Mismatch KL"}]
    sort = [t for t in table["transformations"] if t["id"] == "sortBy"][0]
    assert sort["options"]["sort"] == [{"desc": True, "field": "Mismatch KL"}]
    assert all(t["instant"] and t["format"] == "table" for t in table["targets"])
    run_exprs = [e for _, _, e in iter_panel_queries(by_uid["timwatch-run"])]
    for q in ("0.5", "0.9", "0.99"):
        assert any(e.startswith(f"histogram_quantile({q}, sum by (le, run)") for e in run_exprs)


# ---------------------------------------------------------------- query listing


def test_substitute_handles_grafana_variable_forms() -> None:
    values = {"run": "a|b", "__rate_interval": "2m"}
    assert substitute('x{run=~"$run"}[$__rate_interval]', values) == 'x{run=~"a|b"}[2m]'
    assert substitute('x{run=~"${run}"}', values) == 'x{run=~"a|b"}'
    assert substitute('x{run=~"${run:regex}"}', values) == 'x{run=~"a|b"}'
    with pytest.raises(KeyError, match=r"\$nope"):
        substitute("rate(x[$nope])", values)


def test_iter_panel_queries_walks_collapsed_rows_and_substitutes() -> None:
    dash = {
        "uid": "u",
        "panels": [
            {"type": "timeseries", "title": "top", "targets": [{"expr": "a[$__interval]"}]},
            {
                "type": "row",
                "title": "r",
                "collapsed": True,
                "panels": [
                    {
                        "type": "stat",
                        "title": "inner",
                        "targets": [{"expr": 'b{run=~"$run"}[$__range]'}, {"expr": ""}],
                    }
                ],
            },
        ],
    }
    got = iter_panel_queries(dash, run="r1|r2", interval="30s", range_="6h")
    assert got == [("u", "top", "a[30s]"), ("u", "inner", 'b{run=~"r1|r2"}[6h]')]


def test_queries_lists_every_target_without_template_variables(
    dashboards: list[dict[str, Any]],
) -> None:
    listed = queries(DASHBOARD_DIR, run="demo", rate_interval="30s")
    n_targets = sum(len(p["targets"]) for d in dashboards for p in _panels(d))
    assert len(listed) == n_targets
    assert {uid for uid, _, _ in listed} == UIDS
    for _, _, expr in listed:
        assert "$" not in expr
        assert '{run=~"demo"' in expr or "timwatch_rejected_batches_total[30s]" in expr


# ---------------------------------------------------------------- real Prometheus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def prometheus_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "the Debian 'prometheus' package must be installed"
    tmp = tmp_path_factory.mktemp("prom")
    (tmp / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
    port = _free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "prometheus exited during startup"
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready after 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_prometheus_rejects_invalid_promql(prometheus_url: str) -> None:
    # Control: the check below can fail.
    r = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": "sum by (run) (rate(x[1m])"})
    assert r.status_code == 400 and r.json()["errorType"] == "bad_data"


def test_every_panel_query_is_valid_promql(prometheus_url: str) -> None:
    listed = queries(DASHBOARD_DIR, run="run-a|run-b", rate_interval="1m")
    assert listed
    with httpx.Client(base_url=prometheus_url, timeout=10) as client:
        for uid, title, expr in listed:
            r = client.get("/api/v1/query", params={"query": expr})
            assert r.status_code == 200, f"{uid} / {title}: {expr}\n{r.text}"
            assert r.json()["status"] == "success"


# ---------------------------------------------------------------- push


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
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    result = CliRunner().invoke(dashboards_app, ["push", "--grafana-url", url, "--token", "t"])
    assert result.exit_code == 1
    assert f"cannot reach Grafana at {url}" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    result = CliRunner().invoke(dashboards_app, ["push", "--grafana-url", url, "--file", str(bad)])
    assert result.exit_code == 2
    assert "bad.json: a dashboard must be a JSON object" in result.output


# ---------------------------------------------------------------- provisioning


def test_grafana_provisioning_files() -> None:
    prov = ROOT / "deploy" / "grafana" / "provisioning"
    ds_doc = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    assert ds_doc["apiVersion"] == 1
    (ds,) = ds_doc["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    assert ds["url"].startswith("http")
    # The dashboards' datasource variable defaults to the provisioned uid.
    for d in load_dashboards(DASHBOARD_DIR):
        var = next(v for v in d["templating"]["list"] if v["name"] == "datasource")
        assert var["current"]["value"] == ds["uid"]

    dash_doc = yaml.safe_load((prov / "dashboards" / "timwatch.yml").read_text())
    assert dash_doc["apiVersion"] == 1
    (provider,) = dash_doc["providers"]
    assert provider["type"] == "file" and provider["folder"] == "timwatch"
    path = provider["options"]["path"]
    assert path.startswith("/")
    # The documented volume mounts put the committed dashboards/ at the provider's path.
    readme = (ROOT / "deploy" / "grafana" / "README.md").read_text()
    assert f"./dashboards:{path}:ro" in readme
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in readme
    assert {p.stem for p in DASHBOARD_DIR.glob("*.json")} == UIDS
