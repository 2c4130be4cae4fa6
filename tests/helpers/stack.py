"""A real timwatch + Prometheus + Alertmanager stack on 127.0.0.1 for the integration test.

Both configs are derived by code from the committed `deploy/prometheus.yml` and
`deploy/alertmanager.yml`; only addresses, storage paths, the 1 s scrape/evaluation interval,
Alertmanager's grouping delays and the webhook URLs change. The rules are the committed ones,
shortened only through the documented test override `alerts/override.py` (every duration × 1/60,
so one minute of the production clock is one second here). The batches are synthetic packed
batches built with numpy: a run whose δ spread grows geometrically step after step (mismatch KL
doubling every 15 s, a few retokenized ids, stale rollouts) and a healthy run with small stable
noise.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import numpy as np
import yaml

from tests.helpers.batches import RawBatch
from tests.helpers.procs import answers_200, stop_process
from tests.helpers.scripts import load_script

__all__ = [
    "DEPLOY",
    "RULES",
    "TIME_FACTOR",
    "BatchPlan",
    "Feeder",
    "Proc",
    "Webhook",
    "alertmanager_binary",
    "alertmanager_config",
    "make_batch",
    "prometheus_config",
    "scaled_rule_files",
    "wait_for",
]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = REPO / "alerts" / "timwatch.rules.yml"
# alerts/README.md: "Use a 1 s scrape and evaluation interval with factor 1/60", ranges >= 4 scrapes
TIME_FACTOR = 1 / 60
MIN_RANGE = "4s"


def _load_override() -> ModuleType:
    return load_script(REPO / "alerts" / "override.py", "timwatch_rules_override")


def scaled_rule_files(prometheus_yml: Path, out_dir: Path) -> list[Path]:
    """Every rule file `prometheus_yml` names, written scaled into `out_dir` by the override."""
    override = _load_override()
    doc = yaml.safe_load(prometheus_yml.read_text(encoding="utf-8"))
    out = []
    for i, name in enumerate(doc["rule_files"]):
        src = (prometheus_yml.parent / name).resolve()
        out.append(
            override.write_scaled_rules(
                src, out_dir / f"{i}-{src.name}", TIME_FACTOR, min_range=MIN_RANGE
            )
        )
    return out


def prometheus_config(
    *, timwatch: str, self_addr: str, alertmanager: str, rule_files: list[Path]
) -> dict[str, Any]:
    """deploy/prometheus.yml pointed at the test's processes, with 1 s intervals."""
    doc = yaml.safe_load((DEPLOY / "prometheus.yml").read_text(encoding="utf-8"))
    doc["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    doc["rule_files"] = [str(p) for p in rule_files]
    (am,) = doc["alerting"]["alertmanagers"]
    am["static_configs"] = [{"targets": [alertmanager]}]
    targets = {"timwatch": timwatch, "prometheus": self_addr}
    for job in doc["scrape_configs"]:
        name = job["job_name"]
        if name not in targets:
            raise ValueError(f"deploy/prometheus.yml has job {name!r}; the test cannot place it")
        job["static_configs"] = [{"targets": [targets[name]]}]
        for key in ("scrape_interval", "scrape_timeout"):  # the 1 s globals apply
            job.pop(key, None)
    return doc


def alertmanager_config(webhook_base: str) -> dict[str, Any]:
    """deploy/alertmanager.yml with each receiver's webhook at `webhook_base/<receiver>` and
    second-scale grouping delays (routes, matchers and inhibition unchanged)."""
    doc = yaml.safe_load((DEPLOY / "alertmanager.yml").read_text(encoding="utf-8"))
    for receiver in doc["receivers"]:
        hooks = receiver.get("webhook_configs")
        if not hooks:
            raise ValueError(f"receiver {receiver['name']!r} has no webhook the test can replace")
        for hook in hooks:
            hook["url"] = f"{webhook_base}/{receiver['name']}"

    def shorten(route: dict[str, Any]) -> None:
        for key, value in (("group_wait", "1s"), ("group_interval", "2s")):
            if key in route:
                route[key] = value
        for child in route.get("routes", []):
            shorten(child)

    shorten(doc["route"])
    return doc


def alertmanager_binary() -> str:
    """Debian's `prometheus-alertmanager` installs the binary under that name."""
    path = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    assert path, "install the Debian package prometheus-alertmanager"
    return path


@dataclass
class Proc:
    """A subprocess with its output in a log file, ready when `ready_url` answers 200."""

    name: str
    cmd: list[str]
    log: Path
    ready_url: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Proc:
        out = self.log.open("ab")
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=out, cwd=self.log.parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            if answers_200(self.ready_url):
                return self
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


class Webhook(ThreadingHTTPServer):
    """Records every Alertmanager notification: ``(path, payload)``."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _WebhookHandler)
        self.lock = threading.Lock()
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.thread = threading.Thread(target=self.serve_forever, name="webhook", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def snapshot(self) -> list[tuple[str, dict[str, Any]]]:
        with self.lock:
            return list(self.received)

    def alerts(self, path: str | None = None) -> list[dict[str, Any]]:
        """Every alert of every notification (with the notification's status), optionally by
        receiver path such as ``/pager``."""
        return [
            {**alert, "notification_status": payload["status"], "path": p}
            for p, payload in self.snapshot()
            if path is None or p == path
            for alert in payload.get("alerts", [])
        ]


class _WebhookHandler(BaseHTTPRequestHandler):
    server: Webhook

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.received.append((self.path, json.loads(body)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


@dataclass(frozen=True)
class BatchPlan:
    """How a run's batches evolve with the step.

    δ ~ N(0, σ_step²) with σ_step = sigma0 · 2^(step / (2 · kl_doubling_steps)), capped at
    sigma_max: the mismatch KL (≈ σ²/2) doubles every `kl_doubling_steps` steps.
    """

    sigma0: float
    kl_doubling_steps: float = math.inf
    sigma_max: float = 1.0
    id_mismatches: int = 0  # response positions whose trainer token id differs
    version_lag: int = 0
    n_seq: int = 16
    seq_len: int = 128
    prompt_len: int = 16

    def sigma(self, step: int) -> float:
        return min(self.sigma0 * 2.0 ** (step / (2.0 * self.kl_doubling_steps)), self.sigma_max)


def make_batch(rng: np.random.Generator, plan: BatchPlan, step: int, run: str) -> RawBatch:
    """One packed batch of `plan` at `step` (fields of docs/reference/batch.md, every optional one
    present)."""
    n = plan.n_seq * plan.seq_len
    cu = np.arange(0, n + 1, plan.seq_len, dtype=np.int64)
    mask = np.ones((plan.n_seq, plan.seq_len), dtype=np.int64)
    mask[:, : plan.prompt_len] = 0
    mask = mask.reshape(-1)
    d = rng.normal(0.0, plan.sigma(step), n)
    base = -rng.uniform(0.05, 6.0, n)
    mu = base - np.maximum(d, 0.0)  # both log-probs stay <= 0 and differ by exactly δ
    pi = mu + d
    ids = rng.integers(0, 150_000, n, dtype=np.int64)
    ids_train = ids.copy()
    if plan.id_mismatches:
        where = rng.choice(np.flatnonzero(mask), plan.id_mismatches, replace=False)
        ids_train[where] = (ids_train[where] + 1) % 150_000
    policy_version = 100 + step
    arrays = {
        "cu_seqlens": cu,
        "logp_rollout": mu,
        "logp_train": pi,
        "entropy": rng.uniform(0.3, 2.5, n),
        "loss_mask": mask,
        "token_ids": ids,
        "token_ids_train": ids_train,
        "versions": np.full(n, policy_version - plan.version_lag, dtype=np.int64),
    }
    return RawBatch(
        arrays=arrays,
        step=step,
        batch_id=f"{run}-{step}",
        policy_version=policy_version,
        entropy_source="trainer",
    )


@dataclass
class Feeder:
    """A thread that POSTs one batch per run every `period` seconds until stopped.

    Runs in `as_json` travel as JSON, the others as safetensors, so both wire formats are used.
    """

    url: str
    plans: dict[str, BatchPlan]
    as_json: set[str]
    period: float = 0.5
    seed: int = 0
    sent: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Feeder:
        self.thread = threading.Thread(target=self._loop, name="feeder", daemon=True)
        self.thread.start()
        return self

    def _post(self, client: httpx.Client, run: str, raw: RawBatch) -> None:
        if run in self.as_json:
            r = client.post(f"/v1/runs/{run}/batches", json=raw.to_json_obj())
        else:
            r = client.post(
                f"/v1/runs/{run}/batches",
                content=raw.to_safetensors_bytes(),
                headers={"Content-Type": "application/x-safetensors"},
            )
        if r.status_code != 200:
            self.errors.append(f"{run} step {raw.step}: {r.status_code} {r.text[:300]}")

    def _loop(self) -> None:
        rng = np.random.default_rng(self.seed)
        step = 0
        next_tick = time.monotonic()
        with httpx.Client(base_url=self.url, timeout=30.0) as client:
            while not self.stop_event.is_set():
                for run, plan in self.plans.items():
                    try:
                        self._post(client, run, make_batch(rng, plan, step, run))
                        self.sent[run] = self.sent.get(run, 0) + 1
                    except httpx.HTTPError as e:
                        self.errors.append(f"{run} step {step}: {e!r}")
                step += 1
                next_tick += self.period
                self.stop_event.wait(max(0.0, next_tick - time.monotonic()))

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(30)


def wait_for(
    check: Callable[[], tuple[bool, Any]], timeout: float, interval: float = 1.0
) -> tuple[bool, Any]:
    """Call `check` (returning ``(done, info)``) until done or `timeout` s pass; the last pair."""
    deadline = time.monotonic() + timeout
    while True:
        done, info = check()
        if done or time.monotonic() >= deadline:
            return done, info
        time.sleep(interval)
