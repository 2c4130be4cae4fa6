"""Prometheus exposition (docs/reference/prometheus.md): promtool-clean, additive, exact against the
engine; the real app's /metrics is read in process (`tests.helpers.inproc`)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.batches import RawBatch, random_batch
from tests.helpers.clock import FakeClock
from tests.helpers.inproc import InProcessApp
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import dumps
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.service.exporter import make_registry, render
from timwatch.monitor.service.runs import RunRegistry

SAFETENSORS = {"Content-Type": "application/x-safetensors"}


def raw_batch(seed: int, step: int, batch_id: str | None = None) -> RawBatch:
    raw = random_batch(np.random.default_rng(seed), n_seq=10, optional="all")
    return dataclasses.replace(raw, step=step, batch_id=batch_id)


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict[str, Any], name: str, **labels: str) -> float:
    for fam in fams.values():
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise KeyError(f"{name}{labels}")


def promtool_check(text: str) -> None:
    assert shutil.which("promtool"), "promtool is required (Debian package prometheus)"
    p = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0 and not p.stdout.strip() and not p.stderr.strip(), p.stdout + p.stderr


def test_real_exposition_is_promtool_clean_and_exact(app: InProcessApp) -> None:
    raws = [raw_batch(s, step=s, batch_id=f"b{s}") for s in range(3)]
    accs = [accumulate(Batch.from_arrays(**r.from_arrays_kwargs())) for r in raws]
    with app.client() as c:
        for r in raws:
            c.post("/v1/runs/run-a/batches", content=r.to_safetensors_bytes(), headers=SAFETENSORS)
        c.post("/v1/runs/run.b:2/batches", content=dumps(raws[0].to_json_obj()))
        c.post("/v1/runs/run-a/batches", content=b"{}")  # validation reject
        c.post(f"/v1/runs/{quote(chr(34) + 'x' + chr(10), safe='')}/batches", content=b"{}")
        text = c.get("/metrics").text
        last_row = c.get("/v1/runs/run-a/steps/2").json()["row"]
    promtool_check(text)
    fams = families(text)
    total = accs[0].merge(accs[1]).merge(accs[2])
    run = {"run": "run-a"}
    assert sample(fams, "timwatch_tokens_total", **run) == total.tokens
    assert sample(fams, "timwatch_sequences_total", **run) == total.sequences
    assert sample(fams, "timwatch_batches_total", **run) == 3
    for name, attr in (
        ("timwatch_token_kl", "sum_k3"),
        ("timwatch_token_log_ratio_squared", "sum_log_ratio_sq"),
        ("timwatch_token_entropy", "sum_entropy"),
        ("timwatch_token_is_ratio", "sum_is_ratio"),
        ("timwatch_token_is_ratio_squared", "sum_is_ratio_sq"),
    ):
        assert sample(fams, f"{name}_count", **run) == total.tokens
        assert sample(fams, f"{name}_sum", **run) == pytest.approx(getattr(total, attr), rel=1e-15)
    for name, attr, count in (
        ("timwatch_token_tis_weight", "sum_tis_weight", total.tokens),
        ("timwatch_token_prob_abs_diff", "sum_prob_abs_diff", total.tokens),
        ("timwatch_seq_training_log_ppl", "sum_training_log_ppl", total.sequences),
        ("timwatch_seq_rollout_log_ppl", "sum_rollout_log_ppl", total.sequences),
        ("timwatch_seq_training_ppl", "sum_training_ppl", total.sequences),
        ("timwatch_seq_rollout_ppl", "sum_rollout_ppl", total.sequences),
        ("timwatch_seq_log_ppl_diff", "sum_log_ppl_diff", total.sequences),
        ("timwatch_seq_ppl_ratio", "sum_ppl_ratio", total.sequences),
        ("timwatch_seq_is_weight", "sum_seq_is_weight", total.sequences),
    ):
        assert sample(fams, f"{name}_count", **run) == count
        assert sample(fams, f"{name}_sum", **run) == pytest.approx(getattr(total, attr), rel=1e-15)
    # the mean of a per-sequence summary is the row's metric over the same sequences
    mean_lp = sample(fams, "timwatch_seq_training_log_ppl_sum", **run) / total.sequences
    assert mean_lp == pytest.approx(derive_row(total).training_log_ppl, rel=1e-15)
    low = sample(fams, "timwatch_is_ratio_low_tokens_total", **run)
    assert low == total.is_ratio_low_tokens
    for side, n in total.seq_is_ratio_out_of_bounds.items():
        got = sample(fams, "timwatch_seq_is_ratio_out_of_bounds_sequences_total", run="run-a",
                     side=side)  # fmt: skip
        assert got == n
    assert {p for p in total.masked_tokens} >= {"token_k1", "seq_max_k3"}
    for policy, n in total.masked_tokens.items():
        assert sample(fams, "timwatch_masked_tokens_total", run="run-a", policy=policy) == n
    for hist, buckets in (
        ("timwatch_token_abs_log_ratio", total.abs_log_ratio_buckets()),
        ("timwatch_token_estr_score", total.estr_score_buckets()),
    ):
        got = [
            (s.labels["le"], s.value)
            for s in fams[hist].samples
            if s.name == f"{hist}_bucket" and s.labels["run"] == "run-a"
        ]
        assert [v for _, v in got] == [float(n) for _, n in buckets]
        assert got[-1][0] == "+Inf" and got[-1][1] == total.tokens
        assert sample(fams, f"{hist}_count", **run) == total.tokens
    assert sample(fams, "timwatch_step", **run) == 2
    assert sample(fams, "timwatch_mismatch_kl", **run) == last_row["mismatch_kl"]
    for policy, v in last_row["mask_ratio"].items():
        assert sample(fams, "timwatch_mask_ratio", run="run-a", policy=policy) == v
    assert sample(fams, "timwatch_tokens_total", run="run.b:2") == accs[0].tokens
    assert sample(fams, "timwatch_rejected_batches_total", reason="validation") == 2
    assert sample(fams, "timwatch_last_batch_timestamp_seconds", **run) <= time.time()
    assert "x\n" not in text and 'run="\\"' not in text


def test_idle_runs_leave_the_exposition(app_factory: Callable[..., InProcessApp]) -> None:
    clock = FakeClock()
    with app_factory(run_ttl=60.0, clock=clock).client() as c:
        raw = raw_batch(7, step=1)
        assert c.post("/v1/runs/ttl/batches", content=dumps(raw.to_json_obj())).status_code == 200
        assert 'run="ttl"' in c.get("/metrics").text
        clock.advance(60.0)  # idle for the TTL exactly: still exported
        assert 'run="ttl"' in c.get("/metrics").text
        clock.advance(0.5)
        text = c.get("/metrics").text
        history = c.get("/v1/runs/ttl/metrics", params={"names": "tokens"}).json()
    assert 'run="ttl"' not in text
    assert history["steps"] == [1]  # eviction is about /metrics only
    promtool_check(text)


def test_empty_exposition_is_clean_and_has_rejection_counters() -> None:
    text = render(make_registry(RunRegistry())).decode()
    promtool_check(text)
    fams = families(text)
    for reason in ("validation", "too_large", "unauthorized", "store_unavailable"):
        assert sample(fams, "timwatch_rejected_batches_total", reason=reason) == 0


def test_null_gauges_are_left_out_not_zero() -> None:
    runs = RunRegistry()
    raw = random_batch(np.random.default_rng(3), n_seq=4, optional="none")
    acc = accumulate(Batch.from_arrays(**raw.from_arrays_kwargs()))
    row = derive_row(acc).to_dict()
    assert row["version_lag_max"] is None
    runs.observe("plain", acc, row, 0)
    text = render(make_registry(runs)).decode()
    promtool_check(text)
    assert "timwatch_version_lag_max{" not in text
    assert 'timwatch_mismatch_kl{run="plain"}' in text
