"""Scale out on real parts: three `timwatch serve` replicas on one PostgreSQL behind HAProxy,
Prometheus scraping each replica and remote-writing to VictoriaMetrics, one replica killed with
SIGKILL mid-load and restarted.

Everything is a Debian package run for real (`haproxy`, `postgresql`, `prometheus`,
`victoria-metrics`), configured from the committed deploy/scaleout/ files (tests/helpers/
scaleout.py says what changes: addresses, 1 s intervals, rules × 1/60 by alerts/override.py).
16 producers (8 ranks of a drifting run, 8 of a healthy one) post a batch per step each through
the balancer, so every step is spread over the replicas; every fifth batch is posted again
straight to another replica (it must replay); producers retry transport errors and 5xx as the
tap does. Checked:

- history: every acknowledged batch is stored exactly once, nothing else is; each step holds
  its 8 batches and its row equals the row of all 8 merged;
- the additive exposition: each replica runs with ``--replica-id`` (as deploy/scaleout does),
  so its counters are kept in the store in each batch's transaction and the killed replica,
  restarted under the same id, continues from what it had committed: at quiescence
  VictoriaMetrics' and Prometheus' ``sum by (run)`` of every additive series equal the totals
  recomputed from the batches the store holds, exactly for integer samples and to 1e-9 relative
  for float sums, and the restart is no counter reset (``resets()`` is 0);
- every dashboard panel query returns data for both runs from VictoriaMetrics as it does from
  Prometheus;
- the drift alerts fire for the drifting run and no alert ever fires for the healthy one.
"""

from __future__ import annotations

import math
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy import create_engine, select

from tests.helpers.pg import fresh_database
from tests.helpers.procs import REPO, ServerProc, free_port, server_env
from tests.helpers.scaleout import (
    SCALEOUT,
    Ack,
    Producer,
    additive_mismatches,
    additive_samples,
    haproxy_config,
    prometheus_config,
)
from tests.helpers.stack import BatchPlan, Proc, scaled_rule_files, wait_for
from tests.helpers.wire import as_batch, norm
from timwatch.dashboards import queries
from timwatch.monitor.core.accumulator import Accumulator
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.store import Store
from timwatch.monitor.store.models import BatchRecord, StepDetail

DRIFT, HEALTHY = "so-drift", "so-healthy"
PLANS = {
    # k3 KL ≈ σ²/2 = 0.03 from the first step (KLHigh at 0.01), 2 retokenized ids, lag 8
    DRIFT: BatchPlan(sigma0=math.sqrt(0.06), id_mismatches=2, version_lag=8, n_seq=4,
                     seq_len=64, prompt_len=8),
    HEALTHY: BatchPlan(sigma0=0.006, version_lag=1, n_seq=4, seq_len=64, prompt_len=8),
}  # fmt: skip
RANKS = 8
STEP_PERIOD_S = 1.0
KILL_AT_S, RESTART_AFTER_S = 12.0, 4.0
MIN_LOAD_S = 30.0  # the producers run at least this long
DRIFT_ALERTS = {"TimwatchMismatchKLHigh", "TimwatchTokenIdDrift", "TimwatchStalenessHigh"}
ALERTS_BY_S = 90.0
RATE_INTERVAL = "10s"
VICTIM = "timwatch-2"


@dataclass
class Scaleout:
    replicas: dict[str, ServerProc]
    db: str
    prom: str
    vm: str
    producers: list[Producer]
    killed_at: float = 0.0
    victim_last_scrape: dict[str, float] = field(default_factory=dict)  # run → batches
    alerts_seen: list[dict[str, Any]] = field(default_factory=list)
    panels: dict[str, list[str]] = field(default_factory=dict)  # backend → problems
    logs: list[Proc] = field(default_factory=list)

    def query(self, base: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        r = httpx.get(f"{base}/api/v1/query", params=params, timeout=30)
        assert r.status_code == 200, f"{expr}\n{r.text}"
        return list(r.json()["data"]["result"])

    def acks(self) -> list[Ack]:
        return [a for p in self.producers for a in p.acks]

    def summary(self) -> str:
        acks = self.acks()
        return (
            f"{len(acks)} batches acknowledged, {sum(a.tries > 1 for a in acks)} after a retry, "
            f"{sum(a.replayed for a in acks)} answered as replays; by replica "
            f"{dict(Counter(a.replica for a in acks))}; killed process last scraped "
            f"{self.victim_last_scrape}; replays posted to another replica "
            f"{sum(len(p.replays) for p in self.producers)}"
        )

    def diagnostics(self) -> str:
        parts = [f"producer errors: {[e for p in self.producers for e in p.errors][-10:]}"]
        parts += [f"{p.name} log:\n{p.tail(20)}" for p in self.logs]
        parts += [f"{n} log:\n{s.output()[-2000:]}" for n, s in self.replicas.items()]
        return "\n".join(parts)


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin")
    assert path, f"install the Debian package {name}"
    return path


def _panel_problems(s: Scaleout, base: str) -> list[str]:
    out = []
    for uid, title, expr in queries(run=f"{DRIFT}|{HEALTHY}", rate_interval=RATE_INTERVAL):
        if "timwatch_scalar_" in expr:
            # the trainer-scalar panels: this load sends per-token batches only; a scalars-only
            # run's panels are checked against Prometheus in tests/stack/test_dashboards.py
            continue
        result = s.query(base, expr)
        runs = {r["metric"]["run"] for r in result if "run" in r["metric"]}
        if not result or (runs and runs != {DRIFT, HEALTHY}):
            out.append(f"{uid} / {title}: runs {sorted(runs)}")
    return out


def _run_load(s: Scaleout, started: float) -> None:
    """Load, the kill and restart, alerts and panels while the load runs."""
    victim = s.replicas[VICTIM]
    time.sleep(max(0.0, started + KILL_AT_S - time.monotonic()))

    # the last batch count Prometheus scraped from this process: a scrape of a loaded replica
    # can miss its 1 s timeout, and the failed scrape's staleness marker hides the earlier
    # sample from an instant selector (a range selector skips the marker)
    batches = f'last_over_time(timwatch_batches_total{{instance="{victim.url[7:]}"}}[60s])'

    def scraped() -> tuple[bool, Any]:
        # the reset check below needs a batch count Prometheus took from this process
        got = s.query(s.prom, batches)
        return bool(got), got

    def victim_busy() -> tuple[bool, Any]:
        # mid-load: right after it answered a new batch (HAProxy may have taken it out for a
        # while after a 503 of a busy store: wait until it serves again)
        recent = [a for a in s.acks() if a.replica == VICTIM and not a.replayed
                  and a.at > time.monotonic() - 0.5]  # fmt: skip
        return bool(recent), len(recent)

    wait_for(scraped, 30.0, interval=0.5)
    wait_for(victim_busy, 30.0, interval=0.05)
    victim.kill9()
    s.killed_at = time.monotonic()
    wall_kill = time.time()
    time.sleep(RESTART_AFTER_S)
    victim.start()
    # what Prometheus last scraped from the killed process, per run
    for r in s.query(s.prom, batches, wall_kill):
        s.victim_last_scrape[r["metric"]["run"]] = float(r["value"][1])

    def alerts() -> tuple[bool, Any]:
        got = httpx.get(f"{s.prom}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        s.alerts_seen.extend(got)
        firing = {a["labels"]["alertname"] for a in got
                  if a["labels"].get("run") == DRIFT and a["state"] == "firing"}  # fmt: skip
        healthy = [a for a in got if a["labels"].get("run") == HEALTHY]
        return bool(healthy) or DRIFT_ALERTS <= firing, firing

    wait_for(alerts, max(1.0, started + ALERTS_BY_S - time.monotonic()), interval=1.0)

    def panels() -> tuple[bool, Any]:
        s.panels = {"prometheus": _panel_problems(s, s.prom), "vm": _panel_problems(s, s.vm)}
        return not any(s.panels.values()), s.panels

    wait_for(panels, 40.0, interval=2.0)
    time.sleep(max(0.0, started + MIN_LOAD_S - time.monotonic()))


@pytest.fixture(scope="module")
def scaleout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scaleout]:
    tmp = tmp_path_factory.mktemp("scaleout")
    with fresh_database("scaleout") as db:
        replicas = {
            f"timwatch-{k}": ServerProc(
                db,
                free_port(),
                ["--replica-id", f"timwatch-{k}"],
                server_env(None),
                tmp / f"r{k}.log",
            )
            for k in (1, 2, 3)
        }
        lb_port, prom_port, vm_port = free_port(), free_port(), free_port()
        (tmp / "haproxy.cfg").write_text(
            haproxy_config(f"127.0.0.1:{lb_port}",
                           {n: s.url[len("http://"):] for n, s in replicas.items()})
        )  # fmt: skip
        prom_dir = tmp / "prometheus"
        prom_dir.mkdir()
        cfg = prometheus_config(
            [s.url[len("http://") :] for s in replicas.values()],
            f"http://127.0.0.1:{vm_port}/api/v1/write",
            scaled_rule_files(SCALEOUT / "prometheus.yml", prom_dir),
        )
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        procs = [
            Proc("victoria-metrics", [
                _tool("victoria-metrics"), f"-storageDataPath={tmp / 'vm'}",
                f"-httpListenAddr=127.0.0.1:{vm_port}", "-search.latencyOffset=0s",
                "-search.disableCache", "-retentionPeriod=1d",
            ], tmp / "vm.log", f"http://127.0.0.1:{vm_port}/health"),
            Proc("prometheus", [
                _tool("prometheus"), f"--config.file={prom_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={prom_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ], tmp / "prometheus.log", f"http://127.0.0.1:{prom_port}/-/ready"),
            Proc("haproxy", [_tool("haproxy"), "-db", "-f", str(tmp / "haproxy.cfg")],
                 tmp / "haproxy.log", f"http://127.0.0.1:{lb_port}/healthz"),
        ]  # fmt: skip
        balancer = f"http://127.0.0.1:{lb_port}"
        producers = [
            Producer(balancer, {n: s.url for n, s in replicas.items()}, run, rank, plan,
                     STEP_PERIOD_S)
            for run, plan in PLANS.items() for rank in range(RANKS)
        ]  # fmt: skip
        s = Scaleout(replicas, db, f"http://127.0.0.1:{prom_port}",
                     f"http://127.0.0.1:{vm_port}", producers, logs=procs)  # fmt: skip
        try:
            for srv in replicas.values():
                srv.start()
            for p in procs:
                p.start()
            started = time.monotonic()
            for p in producers:
                p.start()
            try:
                _run_load(s, started)
            finally:
                for p in producers:
                    p.stop_event.set()
                for p in producers:
                    p.stop()
            print(s.summary())
            yield s
        finally:
            for p in procs:
                p.stop()
            for srv in replicas.values():
                srv.stop()


def _stored_acc(s: Scaleout, run: str) -> Accumulator:
    engine = create_engine(s.db)
    try:
        with engine.connect() as conn:
            states = conn.execute(
                select(StepDetail.state).where(StepDetail.run_id == run)
            ).scalars()
            acc = Accumulator()
            for state in states:
                acc = acc.merge(Accumulator.from_state(state))
        return acc
    finally:
        engine.dispose()


def test_producers_were_answered_and_replays_crossed_replicas(scaleout: Scaleout) -> None:
    s = scaleout
    errors = [e for p in s.producers for e in p.errors]
    assert not errors, errors[:10]
    acks = s.acks()
    assert len(acks) >= RANKS * len(PLANS) * 10, len(acks)  # 10 steps each at least
    by_replica = Counter(a.replica for a in acks)
    assert set(by_replica) == set(s.replicas), by_replica  # the balancer used every replica
    assert any(a.replica == VICTIM and a.at > s.killed_at for a in acks)  # restarted and used
    # killed under load: it was answering in the seconds before (a post in flight at that moment
    # gets a 502 from HAProxy and is retried; one not yet sent is redispatched by HAProxy)
    assert any(a.replica == VICTIM and s.killed_at - 2.0 < a.at < s.killed_at for a in acks)
    replays = [r for p in s.producers for r in p.replays]
    assert len(replays) >= 20 and all(first != other for _, first, other, _ in replays)
    assert all(ok for *_, ok in replays), [r for r in replays if not r[3]][:5]


def test_history_holds_every_acknowledged_batch_once(scaleout: Scaleout) -> None:
    s = scaleout
    acked = {a.batch_id for a in s.acks()}
    assert len(acked) == len(s.acks())  # one final answer per batch
    engine = create_engine(s.db)
    try:
        with engine.connect() as conn:
            stored = list(conn.execute(select(BatchRecord.batch_id)).scalars())
    finally:
        engine.dispose()
    assert len(stored) == len(set(stored))
    assert set(stored) == acked


def test_every_step_row_is_the_row_of_all_its_batches(scaleout: Scaleout) -> None:
    s = scaleout
    batches = {bid: raw for p in s.producers for bid, raw in p.batches.items()}
    steps: dict[tuple[str, int], list[str]] = {}
    for a in s.acks():
        steps.setdefault((a.run, a.step), []).append(a.batch_id)
    store = Store(s.db, migrate=False)
    try:
        complete = 0
        for (run, step), ids in sorted(steps.items()):
            got = store.get_step(run, step)
            assert got is not None and got["batches"] == len(ids), (run, step)
            acc = Accumulator()
            for bid in sorted(ids):
                acc = acc.merge(accumulate(as_batch(batches[bid])))
            want = norm(derive_row(acc).to_dict())
            assert set(want) == set(got["row"]), (run, step)
            for key, value in want.items():
                if isinstance(value, float):
                    assert got["row"][key] == pytest.approx(value, rel=1e-9, nan_ok=True), key
                elif not isinstance(value, dict | list):
                    assert got["row"][key] == value, (run, step, key)
            complete += len(ids) == RANKS
        assert complete >= 10
    finally:
        store.close()


def _backend_samples(s: Scaleout, base: str, names: set[str]) -> dict[Any, float]:
    out = {}
    for name in sorted(names):
        for r in s.query(base, f'sum by (run, policy, side, le) ({{__name__="{name}"}})'):
            labels = tuple(sorted(r["metric"].items()))
            out[(name, labels)] = float(r["value"][1])
    return out


def _stored_batches_acc(s: Scaleout, run: str) -> Accumulator:
    """The accumulator of every batch of `run` the store holds, recomputed from the content
    the producers posted (not from any total the service kept)."""
    batches = {bid: raw for p in s.producers for bid, raw in p.batches.items()}
    engine = create_engine(s.db)
    try:
        with engine.connect() as conn:
            ids = sorted(
                conn.execute(
                    select(BatchRecord.batch_id).where(BatchRecord.run_id == run)
                ).scalars()
            )
    finally:
        engine.dispose()
    acc = Accumulator()
    for bid in ids:
        acc = acc.merge(accumulate(as_batch(batches[bid])))
    return acc


def test_fleet_totals_in_victoriametrics_equal_the_store(scaleout: Scaleout) -> None:
    """Each replica runs with ``--replica-id`` and keeps its counters in the store, in each
    batch's transaction: the restarted replica continues from what it had committed, so at
    quiescence the fleet's sums equal the store exactly (integer samples; float sums to 1e-9
    relative), with nothing lost to the kill -9."""
    s = scaleout
    want: dict[Any, float] = {}
    for run in PLANS:
        want |= additive_samples(run, _stored_batches_acc(s, run))
    names = {name for name, _ in want}

    def settled() -> tuple[bool, Any]:
        got = _backend_samples(s, s.vm, names)
        return not additive_mismatches(got, want), got

    ok, vm = wait_for(settled, 60.0, interval=2.0)
    wrong = additive_mismatches(vm, want)
    assert ok, f"{len(wrong)} samples differ, e.g. {wrong[:5]}\n{s.diagnostics()}"
    prom = _backend_samples(s, s.prom, names)
    assert not additive_mismatches(prom, want)
    assert sum(not name.endswith("_sum") for name, _ in want) > 100  # every additive family
    # the store's own step states hold the same totals
    for run in PLANS:
        stored = additive_samples(run, _stored_acc(s, run))
        assert not additive_mismatches(stored, additive_samples(run, _stored_batches_acc(s, run)))
    # the restart was no counter reset: the restarted process exported at least what
    # Prometheus had last scraped from the killed one, and resets() over the load sees none
    victim = s.replicas[VICTIM].url[len("http://") :]
    assert s.victim_last_scrape, "Prometheus never scraped a batch count from the killed process"
    for base in (s.prom, s.vm):
        expr = f'timwatch_batches_total{{instance="{victim}"}}'
        now = {r["metric"]["run"]: float(r["value"][1]) for r in s.query(base, expr)}
        for run, before in s.victim_last_scrape.items():
            assert now[run] >= before > 0, (run, before, now)
        resets = s.query(base, f'resets(timwatch_batches_total{{instance="{victim}"}}[10m])')
        assert resets and all(float(r["value"][1]) == 0 for r in resets), resets


def test_every_panel_query_returns_data_from_victoriametrics_as_from_prometheus(
    scaleout: Scaleout,
) -> None:
    assert scaleout.panels == {"prometheus": [], "vm": []}, scaleout.diagnostics()


def test_drift_alerts_fire_and_the_healthy_run_stays_quiet(scaleout: Scaleout) -> None:
    seen = scaleout.alerts_seen
    healthy = [a for a in seen if a["labels"].get("run") == HEALTHY]
    assert not healthy, healthy[:3]
    firing = {a["labels"]["alertname"] for a in seen
              if a["labels"].get("run") == DRIFT and a["state"] == "firing"}  # fmt: skip
    assert DRIFT_ALERTS <= firing, f"{firing}\n{scaleout.diagnostics()}"


def test_the_configs_run_are_the_committed_ones() -> None:
    text = haproxy_config("127.0.0.1:1", {"a": "127.0.0.1:2"})
    assert "balance roundrobin" in text and "option httpchk GET /healthz" in text
    assert str(REPO) in str(SCALEOUT)
