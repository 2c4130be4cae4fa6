"""The whole stack, for real: timwatch serve → Prometheus → Alertmanager → a webhook.

Issue 5's integration acceptance: a real `timwatch serve` (temp SQLite), a real Prometheus
(Debian `prometheus`, config derived from deploy/prometheus.yml, 1 s scrape and evaluation, the
committed rules shortened only by alerts/override.py × 1/60) and a real Alertmanager (Debian
`prometheus-alertmanager`, config derived from deploy/alertmanager.yml) whose receivers post to
this test's own HTTP server. Two runs are fed until the checks hold (about 70 s, at most ~3 min):
one drifting into collapse (mismatch KL doubling every 15 s, four retokenized ids per batch,
rollouts 8 versions stale) and a healthy one (δ ~ N(0, 0.006²), identical ids, lag 1). The tests
check that every dashboard query returns data for both runs, that the collapse alerts fire for
the drifting run and nothing ever fires for the healthy one, and that the pages reach the pager
webhook while the drifting run's warnings are inhibited.

The rules see the production clock 60× faster: KLRising compares the last 30 s ("30 min") with
the minute ("hour") before. Waits are bounded; nothing here asserts how fast anything is.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers.procs import REPO, ServerProc, free_port
from tests.helpers.stack import (
    DEPLOY,
    BatchPlan,
    Feeder,
    Proc,
    Webhook,
    alertmanager_binary,
    alertmanager_config,
    prometheus_config,
    scaled_rule_files,
    wait_for,
)

if str(REPO) not in sys.path:  # `dashboards/` is a top-level directory, not an installed package
    sys.path.insert(0, str(REPO))

from timwatch.dashboards import queries  # noqa: E402

DRIFT = "it-collapse"
HEALTHY = "it-healthy"
PLANS = {
    # KL ≈ σ²/2 starts at 1e-3 (a typical bf16 run) and doubles every 30 steps (15 s at 2 steps/s)
    DRIFT: BatchPlan(sigma0=math.sqrt(2e-3), kl_doubling_steps=30, id_mismatches=4, version_lag=8),
    HEALTHY: BatchPlan(sigma0=0.006, version_lag=1),
}
STEP_PERIOD_S = 0.5
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval for a 1 s scrape: at least 4 scrapes
COLLAPSE_ALERTS = {
    "TimwatchMismatchKLHigh",
    "TimwatchMismatchKLRising",
    "TimwatchTokenIdDrift",
    "TimwatchStalenessHigh",
}
PAGE_ALERTS = {"TimwatchMismatchKLRising", "TimwatchTokenIdDrift"}
# Seconds after the first batch by which each check must hold. KLHigh is the slowest: the
# drifting KL crosses 1e-2 after ~50 s, the 10 s window lags ~5 s, then `for` 15 s.
PANELS_BY_S = 60
ALERTS_BY_S = 150
WEBHOOK_BY_S = 170


@dataclass
class Stack:
    server: ServerProc
    prometheus: Proc
    alertmanager: Proc
    webhook: Webhook
    feeder: Feeder
    started: float  # time.monotonic() of the first batch

    prom: str  # base URLs
    am: str

    def remaining(self, by_s: float) -> float:
        return max(1.0, self.started + by_s - time.monotonic())

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.prom}/api/v1/query", params={"query": expr}, timeout=10)
        assert r.status_code == 200, f"{expr}\n{r.text}"
        return list(r.json()["data"]["result"])

    def alerts(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.prom}/api/v1/alerts", timeout=10)
        return list(r.json()["data"]["alerts"])

    def rules(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.prom}/api/v1/rules", timeout=10)
        return [rule for g in r.json()["data"]["groups"] for rule in g["rules"]]

    def diagnostics(self) -> str:
        """Prometheus' rules and alerts, what was sent and received, and every process' log."""
        parts = [f"elapsed since first batch: {time.monotonic() - self.started:.0f} s"]
        try:
            rules = [
                {k: r.get(k) for k in ("name", "type", "health", "lastError", "state", "query")}
                for r in self.rules()
            ]
            parts += ["/api/v1/rules:", json.dumps(rules, indent=1)]
            parts += ["/api/v1/alerts:", json.dumps(self.alerts(), indent=1)]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            parts.append(f"Prometheus API unavailable: {e!r}")
        parts += [
            f"batches sent: {self.feeder.sent}; feeder errors: {self.feeder.errors[-10:]}",
            f"webhook received: {json.dumps(self.webhook.snapshot(), indent=1)[-6000:]}",
            f"timwatch log:\n{self.server.output()[-4000:]}",
            f"prometheus log:\n{self.prometheus.tail()}",
            f"alertmanager log:\n{self.alertmanager.tail()}",
        ]
        return "\n".join(parts)


def _server_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("TIMWATCH_TOKEN", "TIMWATCH_READ_TOKEN")
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    prom_port, am_port = free_port(), free_port()
    server = ServerProc(
        db=f"sqlite:///{tmp / 'timwatch.db'}",
        port=free_port(),
        args=[],
        env=_server_env(),
        log=tmp / "timwatch.log",
    )
    webhook = Webhook()
    am_dir, prom_dir = tmp / "alertmanager", tmp / "prometheus"
    am_dir.mkdir()
    prom_dir.mkdir()
    (am_dir / "alertmanager.yml").write_text(yaml.safe_dump(alertmanager_config(webhook.url)))
    prom_cfg = prometheus_config(
        timwatch=f"127.0.0.1:{server.port}",
        self_addr=f"127.0.0.1:{prom_port}",
        alertmanager=f"127.0.0.1:{am_port}",
        rule_files=scaled_rule_files(DEPLOY / "prometheus.yml", prom_dir),
    )
    (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg, sort_keys=False))
    alertmanager = Proc(
        "alertmanager",
        [
            alertmanager_binary(),
            f"--config.file={am_dir / 'alertmanager.yml'}",
            f"--storage.path={am_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{am_port}",
            "--cluster.listen-address=",
        ],
        am_dir / "alertmanager.log",
        f"http://127.0.0.1:{am_port}/-/ready",
    )
    prometheus = Proc(
        "prometheus",
        [
            "prometheus",
            f"--config.file={prom_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={prom_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        prom_dir / "prometheus.log",
        f"http://127.0.0.1:{prom_port}/-/ready",
    )
    feeder = Feeder(server.url, PLANS, as_json={HEALTHY}, period=STEP_PERIOD_S)
    try:
        webhook.thread.start()
        server.start()
        alertmanager.start()
        prometheus.start()
        # One refused batch: counted by reason end to end, and a short spike BadInput ignores.
        bad = httpx.post(
            f"{server.url}/v1/runs/{DRIFT}/batches",
            json={"cu_seqlens": [0, 2], "logp_rollout": [-1.0, -2.0], "logp_train": [-1.0],
                  "entropy": [1.0, 1.0], "loss_mask": [1, 1]},
            timeout=30,
        )  # fmt: skip
        assert bad.status_code == 422 and "logp_train" in bad.text, bad.text
        started = time.monotonic()
        feeder.start()
        yield Stack(
            server, prometheus, alertmanager, webhook, feeder, started,
            prom=f"http://127.0.0.1:{prom_port}", am=f"http://127.0.0.1:{am_port}",
        )  # fmt: skip
    finally:
        feeder.stop()
        prometheus.stop()
        alertmanager.stop()
        server.stop()
        webhook.shutdown()
        webhook.server_close()


def _value(result: list[dict[str, Any]], run: str) -> float:
    (series,) = [s for s in result if s["metric"].get("run") == run]
    return float(series["value"][1])


def test_every_dashboard_panel_query_returns_data_for_both_runs(stack: Stack) -> None:
    listed = queries(run=f"{DRIFT}|{HEALTHY}", rate_interval=RATE_INTERVAL)
    assert len(listed) >= 40 and {uid for uid, _, _ in listed} == {
        "timwatch-run",
        "timwatch-fleet",
        "timwatch-estr",
    }

    def check() -> tuple[bool, list[str]]:
        missing = []
        for uid, title, expr in listed:
            if "timwatch_scalar_" in expr:
                # the trainer-scalar panels: these runs send per-token batches only; a
                # scalars-only run's panels are checked in tests/stack/test_dashboards.py
                continue
            result = stack.query(expr)
            runs = {s["metric"]["run"] for s in result if "run" in s["metric"]}
            # Queries that keep a run label must show both runs; the others (ESTR heatmap by le,
            # rejections by reason, count of runs) must show something.
            if not result or (runs and runs != {DRIFT, HEALTHY}):
                missing.append(f"{uid} / {title}: {expr} -> runs {sorted(runs)}")
        return not missing, missing

    ok, missing = wait_for(check, stack.remaining(PANELS_BY_S), interval=2.0)
    assert ok, "panel queries without data:\n" + "\n".join(missing) + "\n" + stack.diagnostics()

    by_title = {(uid, title): expr for uid, title, expr in reversed(listed)}  # first target
    kl = stack.query(by_title[("timwatch-run", "Mismatch KL (k3)")])
    assert _value(kl, DRIFT) > 10 * _value(kl, HEALTHY) > 0, kl
    ids = stack.query(by_title[("timwatch-run", "Token-id drift")])
    n_response = PLANS[DRIFT].n_seq * (PLANS[DRIFT].seq_len - PLANS[DRIFT].prompt_len)
    assert _value(ids, DRIFT) == pytest.approx(PLANS[DRIFT].id_mismatches / n_response), ids
    assert _value(ids, HEALTHY) == 0.0, ids
    lag = stack.query(by_title[("timwatch-run", "Version lag max")])
    assert (_value(lag, DRIFT), _value(lag, HEALTHY)) == (8.0, 1.0), lag
    # The exporter lists every rejection reason from the start; only the one refused batch counts.
    rejected = stack.query("timwatch_rejected_batches_total")
    counts = {s["metric"]["reason"]: float(s["value"][1]) for s in rejected}
    assert counts["validation"] == 1.0 and sum(counts.values()) == 1.0, counts


def test_collapse_alerts_fire_for_the_drifting_run_and_nothing_for_the_healthy_one(
    stack: Stack,
) -> None:
    def check() -> tuple[bool, Any]:
        alerts = stack.alerts()
        healthy = [a for a in alerts if a["labels"].get("run") == HEALTHY]
        if healthy:  # pending counts too: stop at once and fail below
            return True, alerts
        firing = {
            a["labels"]["alertname"]
            for a in alerts
            if a["state"] == "firing" and a["labels"].get("run") == DRIFT
        }
        return COLLAPSE_ALERTS <= firing, alerts

    ok, alerts = wait_for(check, stack.remaining(ALERTS_BY_S))
    healthy = [a for a in alerts if a["labels"].get("run") == HEALTHY]
    assert not healthy, f"alerts for the healthy run:\n{stack.diagnostics()}"
    firing = {
        a["labels"]["alertname"]: a
        for a in alerts
        if a["state"] == "firing" and a["labels"].get("run") == DRIFT
    }
    assert ok and COLLAPSE_ALERTS <= set(firing), (
        f"not firing: {sorted(COLLAPSE_ALERTS - set(firing))}\n{stack.diagnostics()}"
    )
    for name in PAGE_ALERTS:
        assert firing[name]["labels"]["severity"] == "page"
    assert firing["TimwatchMismatchKLHigh"]["labels"]["severity"] == "warning"

    # Never pending or firing for the healthy run at any evaluation since the stack started:
    # Prometheus records every active alert in the ALERTS series.
    window = math.ceil(time.monotonic() - stack.started) + 10
    history = stack.query(f'max_over_time(ALERTS{{run="{HEALTHY}"}}[{window}s])')
    assert history == [], f"{history}\n{stack.diagnostics()}"
    assert stack.query(f'ALERTS{{run="{DRIFT}", alertstate="firing"}}'), stack.diagnostics()
    # Every rule evaluated cleanly.
    broken = [r for r in stack.rules() if r["health"] != "ok"]
    assert not broken, f"{broken}\n{stack.diagnostics()}"


def test_pages_reach_the_pager_webhook_and_warnings_are_inhibited(stack: Stack) -> None:
    def paged() -> set[str]:
        return {
            a["labels"]["alertname"]
            for a in stack.webhook.alerts("/pager")
            if a["status"] == "firing" and a["labels"].get("run") == DRIFT
        }

    ok, _ = wait_for(lambda: (PAGE_ALERTS <= paged(), None), stack.remaining(WEBHOOK_BY_S))
    assert ok, f"paged: {sorted(paged())}\n{stack.diagnostics()}"

    received = stack.webhook.alerts()
    assert {a["path"] for a in received} <= {"/pager", "/chat"}
    pager = [a for a in received if a["path"] == "/pager"]
    assert all(a["labels"]["severity"] == "page" for a in pager), pager
    assert all(a["labels"]["run"] == DRIFT for a in pager), pager
    assert not [a for a in received if a["labels"].get("run") == HEALTHY], received

    # deploy/alertmanager.yml mutes a run's warnings while a page for it fires: the drifting
    # run's warnings reached Alertmanager but are suppressed, and none reached the chat hook.
    r = httpx.get(f"{stack.am}/api/v2/alerts", timeout=10)
    warnings = [
        a
        for a in r.json()
        if a["labels"].get("run") == DRIFT and a["labels"].get("severity") == "warning"
    ]
    assert warnings, f"no warning of {DRIFT} in Alertmanager\n{stack.diagnostics()}"
    for a in warnings:
        assert a["status"]["state"] == "suppressed" and a["status"]["inhibitedBy"], a
    chat = [a for a in received if a["path"] == "/chat" and a["labels"].get("run") == DRIFT]
    assert not chat, chat


def test_configs_are_derived_from_deploy(tmp_path: Path) -> None:
    """The derived configs keep deploy/'s routing and rules; only addresses and clocks change."""
    am = alertmanager_config("http://127.0.0.1:1")
    original = yaml.safe_load((DEPLOY / "alertmanager.yml").read_text())
    assert am["inhibit_rules"] == original["inhibit_rules"]
    assert [r["matchers"] for r in am["route"]["routes"]] == [
        r["matchers"] for r in original["route"]["routes"]
    ]
    urls = {r["name"]: [w["url"] for w in r["webhook_configs"]] for r in am["receivers"]}
    assert urls == {"pager": ["http://127.0.0.1:1/pager"], "chat": ["http://127.0.0.1:1/chat"]}

    (rules,) = scaled_rule_files(DEPLOY / "prometheus.yml", tmp_path)
    scaled = [r for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]]
    by_name = {r.get("alert") or r["record"]: r for r in scaled}
    assert by_name["TimwatchMismatchKLHigh"]["for"] == "15s"
    assert "[1m] offset 30s" in by_name["timwatch:mismatch_kl:rate1h_offset30m"]["expr"]
