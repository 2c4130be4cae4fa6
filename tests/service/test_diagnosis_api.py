"""``GET /v1/runs/{run}/diagnosis`` against a real server: batches with a known dominant cause
are ingested, the diagnosis ranks that cause first with its evidence, the prefill-probe run is
read when it exists, the window parameters bound it, and bad requests answer 401/404/422."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.diagnosis_batches import labelled_batch
from tests.helpers.procs import ServerProc
from tests.helpers.wire import fresh_run
from timwatch.monitor.diagnosis import CAUSES

STEPS = 8


def ingest(c: httpx.Client, run: str, kind: str, steps: int = STEPS) -> None:
    for step in range(steps):
        r = c.post(f"/v1/runs/{run}/batches", json=labelled_batch(kind, step))
        assert r.status_code == 200, r.text


def test_stale_run_ranks_staleness_first_and_reads_its_probe(shared_server: ServerProc) -> None:
    run = fresh_run("diag-stale")
    with shared_server.client() as c:
        ingest(c, run, "stale")
        r = c.get(f"/v1/runs/{run}/diagnosis")
        assert r.status_code == 200, r.text
        d = r.json()
        assert (d["run"], d["from_step"], d["to_step"], d["steps"]) == (run, 0, STEPS - 1, STEPS)
        first = d["causes"][0]
        assert first["cause"] == "staleness", d["causes"]
        assert first["score"] >= 0.5
        assert {e["metric"] for e in first["evidence"]} >= {"staleness_kl", "version_lag_mean"}
        names = [x["cause"] for x in d["causes"]] + [x["cause"] for x in d["not_checked"]]
        assert sorted(names) == sorted(CAUSES)
        assert "decode_vs_prefill" in {x["cause"] for x in d["not_checked"]}
        # a probe run: decode vs prefill of the same engine, now checked
        ingest(c, f"{run}-prefill-probe", "drift", steps=3)
        d = c.get(f"/v1/runs/{run}/diagnosis").json()
        probe = next(x for x in d["causes"] if x["cause"] == "decode_vs_prefill")
        assert probe["evidence"][0]["metric"] == f"{run}-prefill-probe:mismatch_kl"


def test_token_drift_ranks_tokenization_first_and_the_window_bounds_it(
    shared_server: ServerProc,
) -> None:
    run = fresh_run("diag-drift")
    with shared_server.client() as c:
        ingest(c, run, "drift")
        d = c.get(f"/v1/runs/{run}/diagnosis", params={"from_step": 2, "to_step": 5}).json()
        assert (d["from_step"], d["to_step"], d["steps"]) == (2, 5, 4)
        first = d["causes"][0]
        assert first["cause"] == "tokenization", d["causes"]
        assert "of 4 steps" in first["verdict"]
        assert first["evidence"][0]["steps"] == [2, 5]
        empty = c.get(f"/v1/runs/{run}/diagnosis", params={"from_step": 100}).json()
        assert empty["steps"] == 0 and empty["causes"] == []


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"from_step": -1}, "from_step"),
        ({"to_step": "x"}, "to_step"),
        ({"to_step": 2**63}, "to_step"),
    ],
)
def test_bad_parameters_answer_422_naming_them(
    shared_server: ServerProc, params: dict[str, object], field: str
) -> None:
    run = fresh_run("diag-bad")
    with shared_server.client() as c:
        ingest(c, run, "drift", steps=1)
        r = c.get(f"/v1/runs/{run}/diagnosis", params=params)
        assert r.status_code == 422 and field in r.text
        r = c.get(f"/v1/runs/{run}/diagnosis", params={"from_step": 3, "to_step": 1})
        assert r.status_code == 422 and "from_step 3 is after to_step 1" in r.json()["detail"]


def test_unknown_run_is_404_and_reads_need_the_token(shared_server: ServerProc) -> None:
    with shared_server.client() as c:
        r = c.get("/v1/runs/no-such-run-diag/diagnosis")
        assert r.status_code == 404 and "not found" in r.json()["detail"]
    with httpx.Client(base_url=shared_server.url) as anon:
        assert anon.get("/v1/runs/no-such-run-diag/diagnosis").status_code == 401


def test_openapi_documents_the_route(shared_server: ServerProc) -> None:
    with shared_server.client() as c:
        spec = c.get("/openapi.json").json()
    op = spec["paths"]["/v1/runs/{run}/diagnosis"]["get"]
    assert {"200", "401", "404", "422", "503"} <= set(op["responses"])
    assert {p["name"] for p in op["parameters"]} >= {"run", "from_step", "to_step"}
