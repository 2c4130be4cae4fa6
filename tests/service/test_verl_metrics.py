"""The verl-parity metrics and rejection modes (issue 11) through every user-facing path: a real
server's metrics query and `/v1/masks`, and `timwatch analyze --json` as a subprocess."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.helpers.batches import random_batch
from tests.helpers.procs import ServerProc
from timwatch.monitor.client import decode_masks
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import dumps
from timwatch.monitor.core.masks import (
    VERL_SEQUENCE_POLICIES,
    VERL_TOKEN_POLICIES,
    PolicyParams,
    keep_masks,
)
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.store.models import VERL_COLUMNS

REPO = Path(__file__).resolve().parents[2]
NEW_POLICIES = (*VERL_TOKEN_POLICIES, *VERL_SEQUENCE_POLICIES)
NEW_COLUMNS = (
    *VERL_COLUMNS,
    *(f"mask_ratio_{p}" for p in NEW_POLICIES),
    *(f"seq_reject_ratio_{p}" for p in VERL_SEQUENCE_POLICIES),
)


def _raw(seed: int, step: int):  # type: ignore[no-untyped-def]
    raw = random_batch(np.random.default_rng(seed), n_seq=12)
    return dataclasses.replace(raw, step=step, batch_id=f"b{seed}")


def _flat(row: dict[str, object]) -> dict[str, object]:
    out = {k: row[k] for k in VERL_COLUMNS}
    out |= {f"mask_ratio_{p}": row["mask_ratio"][p] for p in NEW_POLICIES}  # type: ignore[index]
    out |= {
        f"seq_reject_ratio_{p}": row["seq_reject_ratio"][p]  # type: ignore[index]
        for p in VERL_SEQUENCE_POLICIES
    }
    return out


def test_metrics_query_serves_every_new_column(server: ServerProc) -> None:
    raws = [_raw(s, step=s) for s in (1, 2)]
    want = [_flat(derive_row(accumulate(Batch.from_arrays(**r.from_arrays_kwargs()))).to_dict())
            for r in raws]  # fmt: skip
    with server.client() as c:
        for r in raws:
            assert c.post("/v1/runs/v/batches", content=dumps(r.to_json_obj())).status_code == 200
        got = c.get("/v1/runs/v/metrics", params={"names": ",".join(NEW_COLUMNS)}).json()
        dotted = c.get("/v1/runs/v/metrics", params={"names": "mask_ratio.seq_max_k2"}).json()
    assert got["steps"] == [1, 2]
    for name in NEW_COLUMNS:
        assert got["series"][name] == [w[name] for w in want], name
    assert dotted["series"]["mask_ratio.seq_max_k2"] == [w["mask_ratio_seq_max_k2"] for w in want]
    assert any(v is not None and v > 0 for v in got["series"]["training_ppl"])


def test_masks_endpoint_serves_new_modes_with_their_parameters(server: ServerProc) -> None:
    raw = _raw(3, step=0)
    batch = Batch.from_arrays(**raw.from_arrays_kwargs())
    tight = PolicyParams(token_k1_lower=0.99, token_k1_upper=1.01, seq_max_k2_upper=1e-4)
    want = keep_masks(batch, list(NEW_POLICIES), tight)
    with server.client() as c:
        r = c.post(
            "/v1/masks",
            content=dumps(raw.to_json_obj()),
            params={
                "policies": ",".join(NEW_POLICIES),
                "token_k1_lower": 0.99,
                "token_k1_upper": 1.01,
                "seq_max_k2_upper": 1e-4,
            },
        )
        bad = c.post(
            "/v1/masks",
            content=dumps(raw.to_json_obj()),
            params={"policies": "token_k1", "token_k1_lower": 2.0, "token_k1_upper": 1.5},
        )
    assert r.status_code == 200, r.text
    got = decode_masks(r.json())
    assert set(got) == set(NEW_POLICIES)
    for name in NEW_POLICIES:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    on = batch.loss_mask == 1
    assert not got["token_k1"][on].all() and not got["seq_max_k2"][on].all()
    assert r.json()["params"]["token_k1_upper"] == 1.01
    assert bad.status_code == 422 and "token_k1_lower" in bad.text


def test_analyze_json_has_every_new_metric() -> None:
    example = REPO / "examples" / "batch.json"
    out = subprocess.run(
        [sys.executable, "-m", "timwatch", "analyze", str(example), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    for name in VERL_COLUMNS:
        assert name in row, name
        assert row[name] is None or math.isfinite(row[name]), name
    assert row["training_ppl"] >= 1.0 and row["rollout_ppl"] >= 1.0
    assert set(NEW_POLICIES) <= set(row["mask_ratio"])
    assert set(VERL_SEQUENCE_POLICIES) <= set(row["seq_reject_ratio"])
    want = derive_row(accumulate(Batch.from_json(json.loads(example.read_text())))).to_dict()
    assert _flat(row) == _flat(want)
