"""Dashboards as code and Grafana provisioning (`push` is in test_dashboard_push.py).

PromQL validity is checked against a real Prometheus (Debian package) with nothing to scrape:
a parse error answers 400, a valid query answers 200 with an empty result.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `dashboards/` is a top-level directory, not an installed package
    sys.path.insert(0, str(ROOT))

from tests.helpers.names import (  # noqa: E402
    COUNTERS,
    FAMILY_OF,
    GAUGES,
    HISTOGRAMS,
    SCALAR_GAUGES,
    SUMMARIES,
)
from tests.helpers.procs import free_port  # noqa: E402
from timwatch.dashboards import iter_panel_queries, load_dashboards, queries, substitute  # noqa: E402

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
    assert used_families == set(COUNTERS + GAUGES + SUMMARIES + HISTOGRAMS + SCALAR_GAUGES)


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


@pytest.fixture(scope="module")
def prometheus_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "the Debian 'prometheus' package must be installed"
    tmp = tmp_path_factory.mktemp("prom")
    (tmp / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
    port = free_port()
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


def test_scalar_panels_show_a_scalars_only_run_through_a_real_prometheus(
    tmp_path: Path, server_factory: Any
) -> None:
    """A real `timwatch serve` holding only trainer scalars, scraped by a real Prometheus: every
    query of the run dashboard's Trainer scalars row answers the posted values."""
    from tests.helpers.stack import Proc, wait_for
    from timwatch.monitor.client import TimwatchClient

    server = server_factory()
    with TimwatchClient(server.url) as c:
        c.post_scalars("sc-only", 3, {"actor/grad_norm": 0.75, "rollout_corr/k3_kl": 2e-3,
                       "critic/score/mean": 0.5, "actor/pg_loss": -0.1}, source="verl")  # fmt: skip
    binary = shutil.which("prometheus")
    assert binary, "the Debian 'prometheus' package must be installed"
    port = free_port()
    target = server.url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
        f"  - job_name: timwatch\n    static_configs:\n      - targets: ['{target}']\n"
    )
    prom = Proc(
        "prometheus",
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        tmp_path / "prometheus.log",
        f"http://127.0.0.1:{port}/-/ready",
    ).start()  # fmt: skip
    try:
        listed = [
            (title, expr)
            for uid, title, expr in queries(DASHBOARD_DIR, run="sc-only", rate_interval="1m")
            if uid == "timwatch-run" and "timwatch_scalar_" in expr
        ]
        assert len(listed) == 16

        def answers(expr: str) -> list[dict[str, Any]]:
            r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr})
            assert r.status_code == 200, r.text
            return list(r.json()["data"]["result"])

        grad = 'max by (run, source) (timwatch_scalar_grad_norm{run=~"sc-only"})'
        done, got = wait_for(lambda: (bool(a := answers(grad)), a), timeout=30, interval=0.5)
        assert done, prom.tail()
        assert got[0]["metric"] == {"run": "sc-only", "source": "verl"}
        assert float(got[0]["value"][1]) == 0.75
        expected = {"grad_norm": 0.75, "mismatch_kl": 2e-3, "reward_mean": 0.5, "loss": -0.1}
        for title, expr in listed:
            name = expr.split("timwatch_scalar_")[1].split("{")[0]
            result = answers(expr)
            if name in expected:
                assert [float(x["value"][1]) for x in result] == [expected[name]], title
            else:
                assert result == [], (title, expr)  # not posted: no series, never a 0
    finally:
        prom.stop()
