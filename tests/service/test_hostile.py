"""Every hostile input is a counted 4xx that names the field, and the server stays up.

One real ``timwatch serve`` per store (SQLite, PostgreSQL), shared by the module. Each case is
sent as JSON and, where the format can say it, as safetensors; for each: the status is 4xx
(never ≥ 500), the message names the field, ``timwatch_rejected_batches_total{reason}`` went up
by exactly one, ``/healthz`` answers 200, and a valid batch still ingests at the end. Query
parameters out of range are 422s naming the parameter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.hostile_bodies import ACCEPTED_EDGES, BIG, CASES, Case, js
from tests.helpers.pg import fresh_database
from tests.helpers.procs import ServerProc, free_port, server_env

# ---- servers -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp(f"hostile-{request.param}")
    with ExitStack() as stack:
        if request.param == "postgresql":
            db = stack.enter_context(fresh_database("tw_hostile"))
        else:
            db = f"sqlite:///{tmp / 'hostile.db'}"
        srv = ServerProc(
            db=db, port=free_port(), args=[], env=server_env(None), log=tmp / "server.log"
        )
        stack.callback(srv.stop)
        yield srv.start()


def rejected(client: httpx.Client) -> dict[str, float]:
    # only the counter's lines go to the parser: the whole exposition, twice per case, was a
    # third of this module's CPU
    lines = client.get("/metrics").text.splitlines()
    text = "".join(f"{x}\n" for x in lines if x.startswith("timwatch_rejected_batches_total"))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "timwatch_rejected_batches_total":
                out[s.labels["reason"]] = s.value
    return out


def _post(client: httpx.Client, case: Case) -> httpx.Response:
    return client.post(
        f"/v1/runs/{case.run}/batches", content=case.body, headers={"Content-Type": case.ctype}
    )


# ---- tests -------------------------------------------------------------------------------


def test_enough_cases() -> None:
    assert len(CASES) >= 60 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input_is_a_counted_4xx(server: ServerProc, case: Case) -> None:
    with server.client() as client:
        before = rejected(client)
        r = _post(client, case)
        assert 400 <= r.status_code < 500 and r.status_code == case.status, (r.status_code, r.text)
        detail = r.json()
        if case.field is not None:
            assert detail.get("field") == case.field, detail
        after = rejected(client)
        assert after["validation"] == before["validation"] + 1, (before, after)
        assert {k: v for k, v in after.items() if k != "validation"} == {
            k: v for k, v in before.items() if k != "validation"
        }
        assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("name", "body", "ctype"), ACCEPTED_EDGES, ids=[e[0] for e in ACCEPTED_EDGES]
)
def test_range_edges_are_accepted(server: ServerProc, name: str, body: bytes, ctype: str) -> None:
    with server.client() as client:
        r = client.post(
            f"/v1/runs/edges-{name}/batches", content=body, headers={"Content-Type": ctype}
        )
        assert r.status_code == 200, r.text
        row = r.json()["row"]
        impossible = 1 if "impossible" in name else 0
        assert row["tokens"] == 4 - impossible
        assert row["impossible_tokens"] == impossible


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/v1/runs/hostile/steps/1e30", "step"),
        (f"/v1/runs/hostile/steps/{BIG}", "step"),
        ("/v1/runs/hostile/steps/-1", "step"),
        (f"/v1/runs/hostile/metrics?last={10**30}", "last"),
        ("/v1/runs/hostile/metrics?last=0", "last"),
        ("/v1/runs/hostile/metrics?last=1e30", "last"),
        (f"/v1/runs/hostile/metrics?from_step={BIG}", "from_step"),
        ("/v1/runs/hostile/metrics?from_step=1e30", "from_step"),
        (f"/v1/runs/hostile/metrics?to_step={BIG}", "to_step"),
        ("/v1/runs/hostile/metrics?to_step=-1", "to_step"),
        (f"/v1/runs/hostile/events?limit={BIG}", "limit"),
        ("/v1/runs/hostile/events?limit=0", "limit"),
    ],
)
def test_query_parameters_out_of_range_are_422(server: ServerProc, path: str, param: str) -> None:
    with server.client() as client:
        r = client.get(path)
        assert r.status_code == 422, r.text
        assert any(param in e["loc"] for e in r.json()["detail"]), r.text
        assert client.get("/healthz").status_code == 200


def test_step_at_int64_max_is_queryable(server: ServerProc) -> None:
    with server.client() as client:
        r = client.post("/v1/runs/edge-max/batches", content=js(step=BIG - 1, batch_id=None))
        assert r.status_code == 200, r.text
        assert client.get(f"/v1/runs/edge-max/steps/{BIG - 1}").status_code == 200
        r = client.get(f"/v1/runs/edge-max/metrics?from_step={BIG - 1}&last=1")
        assert r.status_code == 200 and r.json()["steps"] == [BIG - 1], r.text


def test_zz_a_valid_batch_still_ingests(server: ServerProc) -> None:
    with server.client() as client:
        r = client.post("/v1/runs/hostile/batches", content=js(batch_id=None))
        assert r.status_code == 200, r.text
        assert r.json()["row"]["tokens"] == 4
        assert client.get("/healthz").status_code == 200
    assert "Traceback" not in Path(server.log).read_text(errors="replace")
