"""The scale-out stack of tests/stack/test_scaleout.py: configs derived from deploy/scaleout/,
producers that post through the balancer and retry as the tap does, and the expected exposition
of a set of batches.

HAProxy and Prometheus run the committed `deploy/scaleout/haproxy.cfg` and
`deploy/scaleout/prometheus.yml`; only addresses, check and scrape intervals (1 s, rules scaled
by `alerts/override.py`) and the remote-write deadline change, each replacement asserted to
apply so a change to the committed files cannot go unnoticed.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from tests.helpers.batches import RawBatch
from tests.helpers.stack import BatchPlan, make_batch
from timwatch.monitor.core.accumulator import Accumulator
from timwatch.monitor.service.exporter import TimwatchCollector
from timwatch.monitor.service.runs import RunRegistry, RunState

__all__ = [
    "SCALEOUT",
    "Ack",
    "Producer",
    "additive_samples",
    "additive_mismatches",
    "exposed_additive",
    "haproxy_config",
    "prometheus_config",
]

REPO = Path(__file__).resolve().parents[2]
SCALEOUT = REPO / "deploy" / "scaleout"
REPLICA_HEADER = "X-Timwatch-Replica"


def _sub(pattern: str, repl: str, text: str, count: int = 0) -> str:
    out, n = re.subn(pattern, repl, text, count=count, flags=re.M)
    assert n, f"deploy/scaleout/haproxy.cfg no longer has {pattern!r}"
    return out


def haproxy_config(listen: str, servers: dict[str, str]) -> str:
    """deploy/scaleout/haproxy.cfg with `servers` (name → host:port) behind `listen`, checks
    every 300 ms, and no Docker resolver."""
    text = (SCALEOUT / "haproxy.cfg").read_text(encoding="utf-8")
    text = _sub(r"^resolvers docker\n(    .*\n)+", "", text)
    text = _sub(r" resolvers docker", "", text)
    text = _sub(r"^    bind :8000$", f"    bind {listen}", text)
    text = _sub(r"check inter 2s", "check inter 300ms", text)
    text = _sub(r"^    server .*\n", "", text)
    lines = "".join(f"    server {name} {addr}\n" for name, addr in servers.items())
    return text.rstrip("\n") + "\n" + lines


def prometheus_config(
    targets: list[str], remote_write: str, rule_files: list[Path]
) -> dict[str, Any]:
    """deploy/scaleout/prometheus.yml scraping `targets` every second, remote-writing to
    `remote_write` within a second, with `rule_files` (scaled) and no Alertmanager."""
    doc = yaml.safe_load((SCALEOUT / "prometheus.yml").read_text(encoding="utf-8"))
    doc["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    doc["rule_files"] = [str(p) for p in rule_files]
    doc.pop("alerting")
    (job,) = [j for j in doc["scrape_configs"] if j["job_name"] == "timwatch"]
    assert len(job["static_configs"][0]["targets"]) == len(targets)
    job["static_configs"] = [{"targets": targets}]
    (rw,) = doc["remote_write"]
    assert rw["url"].endswith("/api/v1/write")
    rw["url"] = remote_write
    rw["queue_config"]["batch_send_deadline"] = "1s"
    return doc


@dataclass(frozen=True)
class Ack:
    """One batch's final 200: who answered, whether it was new there, and when."""

    run: str
    step: int
    rank: int
    batch_id: str
    replica: str
    replayed: bool
    at: float  # time.monotonic() of the answer
    tries: int


@dataclass
class Producer:
    """One trainer rank of `run`: a batch per step every `period` s through the balancer, each
    retried on transport errors and 5xx (what the tap does) until answered 200. Every
    `replay_every`-th batch is posted again straight to another replica (same id, same
    content), which must answer ``replayed: true``."""

    balancer: str
    replicas: dict[str, str]  # name → base URL, for the replays
    run: str
    rank: int
    plan: BatchPlan
    period: float
    replay_every: int = 5
    batches: dict[str, RawBatch] = field(default_factory=dict)
    acks: list[Ack] = field(default_factory=list)
    replays: list[tuple[str, str, str, bool]] = field(default_factory=list)  # id, first, other, ok
    errors: list[str] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Producer:
        self.thread = threading.Thread(target=self._loop, name=f"{self.run}-{self.rank}")
        self.thread.daemon = True
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(120)

    def _send(self, client: httpx.Client, url: str, raw: RawBatch) -> httpx.Response:
        return client.post(
            f"{url}/v1/runs/{self.run}/batches",
            content=raw.to_safetensors_bytes(),
            headers={"Content-Type": "application/x-safetensors"},
        )

    def _post(self, client: httpx.Client, raw: RawBatch) -> Ack | None:
        delay = 0.05
        for tries in range(1, 200):
            try:
                r = self._send(client, self.balancer, raw)
                if r.status_code == 200:
                    body = r.json()
                    return Ack(
                        self.run, raw.step, self.rank, str(raw.batch_id),
                        r.headers.get(REPLICA_HEADER, "?"), bool(body["replayed"]),
                        time.monotonic(), tries,
                    )  # fmt: skip
                if r.status_code < 500:
                    self.errors.append(f"{raw.batch_id}: {r.status_code} {r.text[:200]}")
                    return None
            except httpx.TransportError:
                pass
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        self.errors.append(f"{raw.batch_id}: never acknowledged")
        return None

    def _replay(self, client: httpx.Client, raw: RawBatch, first: str) -> None:
        other = next(n for n in sorted(self.replicas) if n != first)
        try:
            r = self._send(client, self.replicas[other], raw)
            ok = r.status_code == 200 and r.json()["replayed"] is True
        except httpx.TransportError:
            return  # that replica is the one being killed: nothing was sent to compare
        self.replays.append((str(raw.batch_id), first, other, ok))

    def _loop(self) -> None:
        rng = np.random.default_rng([self.rank, zlib.crc32(self.run.encode())])
        step, next_tick = 0, time.monotonic()
        with httpx.Client(timeout=60.0) as client:
            while not self.stop_event.is_set():
                raw = make_batch(rng, self.plan, step, self.run)
                raw = dataclasses.replace(raw, batch_id=f"{self.run}-{step}-r{self.rank}")
                self.batches[str(raw.batch_id)] = raw
                ack = self._post(client, raw)
                if ack is not None:
                    self.acks.append(ack)
                    if step % self.replay_every == self.rank % self.replay_every:
                        self._replay(client, raw, ack.replica)
                step += 1
                next_tick += self.period
                self.stop_event.wait(max(0.0, next_tick - time.monotonic()))


Sample = tuple[str, tuple[tuple[str, str], ...]]  # name, sorted labels


def additive_samples(run: str, acc: Accumulator, tap_dropped: int = 0) -> dict[Sample, float]:
    """Every additive sample (counters, summaries, histograms) a replica holding `acc` (and
    `tap_dropped` tap drops) for `run` exports: ``(name, sorted labels) → value``."""
    state = RunState(run, acc, {}, 0, 0.0, 0.0, tap_dropped)
    out: dict[Sample, float] = {}
    for fam in TimwatchCollector(RunRegistry()).families([state], None):
        if fam.type not in ("counter", "summary", "histogram"):
            continue
        for s in fam.samples:
            if s.name.endswith("_created") or "run" not in s.labels:
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def exposed_additive(text: str) -> dict[Sample, float]:
    """The additive samples of runs in one replica's ``/metrics`` text, keyed like
    `additive_samples`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Sample, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type not in ("counter", "summary", "histogram"):
            continue
        for s in fam.samples:
            if s.name.endswith("_created") or "run" not in s.labels:
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def additive_mismatches(got: dict[Sample, float], want: dict[Sample, float]) -> list[Any]:
    """Where `got` differs from `want`: a missing or extra sample, an integer sample (``_total``,
    ``_count``, ``_bucket``) not exactly equal, a float ``_sum`` off by more than 1e-9 relative
    (the same batches added in another order). Empty when they agree."""
    out: list[Any] = [("missing", k) for k in want.keys() - got.keys()]
    out += [("extra", k) for k in got.keys() - want.keys()]
    for k in want.keys() & got.keys():
        a, b = got[k], want[k]
        if k[0].endswith("_sum"):
            if abs(a - b) > 1e-9 * max(abs(a), abs(b)) + 1e-12:
                out.append((k, a, b))
        elif a != b:
            out.append((k, a, b))
    return out
