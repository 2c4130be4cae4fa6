"""`timwatch analyze` as a user runs it, on the shipped example batches (the program in this
process: `tests.helpers.cli.timwatch`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import timwatch
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import analyze
from timwatch.monitor.core.masks import POLICIES, SEQUENCE_POLICIES, PolicyParams
from timwatch.monitor.core.row import SCALAR_METRICS

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "batch.json"


def test_json_output_is_one_object_keyed_by_spec_names() -> None:
    out = timwatch("analyze", str(EXAMPLE), "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)  # exactly one JSON document on stdout
    assert set(SCALAR_METRICS) <= set(row)
    assert set(row["mask_ratio"]) == set(POLICIES)
    assert set(row["seq_reject_ratio"]) == set(SEQUENCE_POLICIES)
    assert all(row["seq_reject_ratio"][p] is not None for p in SEQUENCE_POLICIES)
    want = analyze(Batch.from_json(json.loads(EXAMPLE.read_text()))).to_dict()
    assert row["mismatch_kl"] == pytest.approx(want["mismatch_kl"], rel=1e-12)
    assert row["mask_ratio"] == pytest.approx(want["mask_ratio"])


def test_safetensors_and_json_give_the_same_row() -> None:
    a = json.loads(timwatch("analyze", str(EXAMPLE), "--json").stdout)
    b = json.loads(timwatch("analyze", str(EXAMPLE.with_suffix(".safetensors")), "--json").stdout)
    assert a == b


def test_policy_parameters_are_overridable() -> None:
    tight = json.loads(timwatch("analyze", str(EXAMPLE), "--json", "--tau", "0.001").stdout)
    batch = Batch.from_json(json.loads(EXAMPLE.read_text()))
    want = analyze(batch, PolicyParams(tau=0.001)).to_dict()["mask_ratio"]["estr"]
    assert tight["mask_ratio"]["estr"] == pytest.approx(want)
    assert tight["mask_ratio"]["estr"] > 0.0  # the default τ rejects nothing in this example


def test_every_policy_parameter_reaches_the_engine() -> None:
    """The generated options are passed through: loosening Geo-RS and tightening KPop from the
    command line gives the same ratios as the engine with those parameters."""
    args = ("--geo-rs-low", "0.5", "--geo-rs-high", "2", "--kpop-phi", "0.001")
    row = json.loads(timwatch("analyze", str(EXAMPLE), "--json", *args).stdout)
    params = PolicyParams(geo_rs_low=0.5, geo_rs_high=2.0, kpop_phi=0.001)
    want = analyze(Batch.from_json(json.loads(EXAMPLE.read_text())), params).to_dict()
    default = analyze(Batch.from_json(json.loads(EXAMPLE.read_text()))).to_dict()
    for policy in ("geo_rs", "kpop"):
        assert row["mask_ratio"][policy] == pytest.approx(want["mask_ratio"][policy])
        assert row["mask_ratio"][policy] != default["mask_ratio"][policy]


def test_table_output_is_grouped_by_topic() -> None:
    out = timwatch("analyze", str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    for topic in ("KL", "IS ratio", "Sequence", "Entropy", "Masks", "Staleness"):
        assert topic in out.stdout
    assert "mismatch_kl" in out.stdout and "geo_rs" in out.stdout


def test_bad_input_exits_2_with_the_validation_message(tmp_path: Path) -> None:
    obj = json.loads(EXAMPLE.read_text())
    obj["logp_rollout"][7] = 0.5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(obj))
    out = timwatch("analyze", str(bad), "--json")
    assert out.returncode == 2
    assert out.stdout == ""
    assert "logp_rollout[7]" in out.stderr and "positive log-prob" in out.stderr
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(EXAMPLE.with_suffix(".safetensors").read_bytes()[:-10])
    out = timwatch("analyze", str(truncated))
    assert out.returncode == 2 and "truncated" in out.stderr
    out = timwatch("analyze", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and "missing.json" in out.stderr
