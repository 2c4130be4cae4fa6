"""The ingest logic and the policy-parameter model without HTTP: `ingest_batch` against a real
SQLite store and a `RunRegistry`; `params` against `PolicyParams` itself."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.batches import RawBatch, random_batch
from timwatch.monitor.client import decode_masks
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.errors import ApiError
from timwatch.monitor.core.jsoncodec import dumps, loads
from timwatch.monitor.core.masks import POLICIES, PolicyParams, keep_masks
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.service.ingest import SAFETENSORS, ingest_batch
from timwatch.monitor.service.params import (
    PolicyQuery,
    apply_query,
    policy_names,
    policy_parameters,
)
from timwatch.monitor.service.runs import RunRegistry
from timwatch.monitor.store import Store

PARAMS = PolicyParams()


def norm(obj: Any) -> Any:
    return loads(dumps(obj))


def raw_batch(seed: int, *, step: int = 1, batch_id: str | None = "b") -> RawBatch:
    raw = random_batch(np.random.default_rng(seed), n_seq=8, optional="all")
    return dataclasses.replace(raw, step=step, batch_id=batch_id)


def as_batch(raw: RawBatch) -> Batch:
    return Batch.from_arrays(**raw.from_arrays_kwargs())


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'ingest.db'}")
    yield s
    s.close()


def ingest(store: Store, runs: RunRegistry, run: str, raw: RawBatch, **kw: Any) -> dict[str, Any]:
    return ingest_batch(store, runs, run, dumps(raw.to_json_obj()), "", params=PARAMS, **kw)


def test_new_batch_is_stored_observed_and_answered_like_the_engine(store: Store) -> None:
    runs = RunRegistry()
    raw = raw_batch(1, step=4)
    answer = ingest(store, runs, "r1", raw, tags={"model": "7b"})
    expected = norm(derive_row(accumulate(as_batch(raw))).to_dict())
    assert (answer["run"], answer["step"], answer["batch_id"]) == ("r1", 4, "b")
    assert answer["replayed"] is False
    assert norm(answer["row"]) == expected == norm(answer["step_row"])
    assert store.count_batches("r1") == 1
    assert norm(store.get_step("r1", 4)["row"]) == expected  # type: ignore[index]
    [live] = runs.snapshot()
    assert (live.run, live.step) == ("r1", 4)
    assert live.acc.tokens == accumulate(as_batch(raw)).tokens > 0
    assert [r["run"] for r in store.list_runs()] == ["r1"]


def test_replay_answers_the_stored_batch_and_changes_nothing(store: Store) -> None:
    runs = RunRegistry()
    raw = raw_batch(2)
    first = ingest(store, runs, "r", raw)
    again = ingest(store, runs, "r", raw)
    assert again["replayed"] is True
    assert {**norm(again), "replayed": False} == norm(first)
    assert store.count_batches("r") == 1
    [live] = runs.snapshot()
    assert live.acc.batches == 1 and live.acc.tokens == accumulate(as_batch(raw)).tokens


def test_batches_without_id_are_never_replays(store: Store) -> None:
    runs = RunRegistry()
    raw = raw_batch(3, batch_id=None)
    assert not ingest(store, runs, "r", raw)["replayed"]
    second = ingest(store, runs, "r", raw)
    assert not second["replayed"] and second["step_row"]["batches"] == 2
    assert store.count_batches("r") == 2


def test_json_and_safetensors_bodies_give_the_same_answer(store: Store) -> None:
    raw = raw_batch(4, batch_id=None)
    runs = RunRegistry()
    j = ingest_batch(store, runs, "j", dumps(raw.to_json_obj()), "application/json", params=PARAMS)
    st = ingest_batch(
        store, runs, "s", raw.to_safetensors_bytes(), f"{SAFETENSORS}; x=1", params=PARAMS
    )
    assert norm(j["row"]) == norm(st["row"])


def test_masks_come_with_new_batches_and_replays(store: Store) -> None:
    runs = RunRegistry()
    raw = raw_batch(5)
    tight = PolicyParams(tau=0.05)
    want = keep_masks(as_batch(raw), ["estr", "seq_mis"], tight)
    answers = [
        ingest_batch(
            store, runs, "m", dumps(raw.to_json_obj()), "", params=tight, masks=["estr", "seq_mis"]
        )
        for _ in range(2)
    ]
    assert [a["replayed"] for a in answers] == [False, True]
    for a in answers:
        got = decode_masks(a["masks"])
        assert sorted(got) == ["estr", "seq_mis"]
        for name in got:
            np.testing.assert_array_equal(got[name], want[name])
    assert not want["estr"].all()  # tau=0.05 really masks something
    assert "masks" not in ingest(store, runs, "no-masks", raw_batch(6))


@pytest.mark.parametrize(
    ("run", "body", "ctype", "status", "field"),
    [
        ("bad run/id", None, "", 422, "run"),
        ("r", b"{not json", "application/json", 422, "body"),
        ("r", b"{}", "text/plain", 415, None),
    ],
)
def test_refused_batches_store_and_count_nothing(
    store: Store, run: str, body: bytes | None, ctype: str, status: int, field: str | None
) -> None:
    runs = RunRegistry()
    data = body if body is not None else dumps(raw_batch(7).to_json_obj())
    with pytest.raises(ApiError) as info:
        ingest_batch(store, runs, run, data, ctype, params=PARAMS)
    err = info.value
    assert err.status == status and err.extra.get("field") == field
    assert err.reason == "validation"  # the app's handler counts it, the function does not
    assert runs.rejected()["validation"] == 0 and len(runs) == 0
    assert store.list_runs() == []


def test_nan_literal_reaches_validation_and_is_named_with_its_index(store: Store) -> None:
    obj = raw_batch(8).to_json_obj()
    obj["logp_train"][3] = float("nan")
    body = json.dumps(obj).encode()  # writes NaN literally: not strict JSON
    with pytest.raises(ApiError) as info:
        ingest_batch(store, RunRegistry(), "r", body, "application/json", params=PARAMS)
    assert info.value.status == 422
    assert (info.value.extra["field"], info.value.extra["index"]) == ("logp_train", 3)


def test_policy_parameters_list_every_field_of_policy_params() -> None:
    listed = policy_parameters()
    fields = dataclasses.fields(PolicyParams)
    assert [p.name for p in listed] == [f.name for f in fields]
    for p, f in zip(listed, fields, strict=True):
        assert p.default == getattr(PARAMS, f.name)
        assert (p.policy, p.help) == (f.metadata["policy"], f.metadata["help"])
        assert p.policy in POLICIES and p.help
    model_fields = PolicyQuery.model_fields
    assert list(model_fields) == [p.name for p in listed]
    assert all(model_fields[p.name].description == p.help for p in listed)


def test_query_overrides_only_what_it_names_and_refuses_bad_values() -> None:
    base = PolicyParams(tau=0.7)
    assert apply_query(base, PolicyQuery()) == base
    assert apply_query(base, PolicyQuery(icepop_high=3.0)) == dataclasses.replace(
        base, icepop_high=3.0
    )
    for bad, named in (({"eps": -1.0}, "eps"), ({"seq_mis_low": 9.0}, "seq_mis_low")):
        with pytest.raises(ApiError) as info:
            apply_query(base, PolicyQuery(**bad))
        assert info.value.status == 422 and named in info.value.detail


def test_policy_names() -> None:
    assert policy_names("all") == list(POLICIES)
    assert policy_names(" estr, tis ,") == ["estr", "tis"]
    assert policy_names(None) == []
    with pytest.raises(ApiError, match="unknown policy 'nope'"):
        policy_names("estr,nope")
