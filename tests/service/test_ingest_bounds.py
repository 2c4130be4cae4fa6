"""What ingest bounds besides the batch (docs/reference/api.md): run tags (count and size, the
count checked against the run's stored tags in the batch's transaction) and the
``Timwatch-Tap-Dropped`` header (a live per-run counter). Against a real ``timwatch serve``;
the merged-tag limit on SQLite and PostgreSQL; the refusals of one malformed value each in an
in-process app (`app`, a fresh store per case, no process to start)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.helpers.inproc import InProcessApp
from tests.helpers.procs import ServerProc
from tests.helpers.wire import counters, post, raw_batch
from timwatch.monitor.core.tags import MAX_TAG_KEY, MAX_TAG_VALUE, MAX_TAGS

Factory = Callable[..., ServerProc]
VALIDATION = "timwatch_rejected_batches_total{reason=validation}"
HEADER = "Timwatch-Tap-Dropped"


def exposition(c: httpx.Client) -> dict[str, float]:
    return counters(c.get("/metrics").text)


def run_tags(c: httpx.Client, run: str) -> dict[str, str] | None:
    for r in c.get("/v1/runs").json()["runs"]:
        if r["run"] == run:
            return dict(r["tags"])
    return None


def post_tags(c: httpx.Client, run: str, seed: int, tags: list[str], **kw: Any) -> httpx.Response:
    raw = raw_batch(seed, step=seed, batch_id=f"b{seed}")
    return post(c, run, raw, "safetensors", tag=tags, **kw)  # type: ignore[no-any-return]


def test_tags_at_the_limit_pass_and_one_more_is_refused_whole(
    server_factory: Factory, db_url: str
) -> None:
    srv = server_factory(db=db_url)
    half = [f"k{i}=v{i}" for i in range(MAX_TAGS // 2)]
    rest = [f"k{i}=v{i}" for i in range(MAX_TAGS // 2, MAX_TAGS)]
    with srv.client() as c:
        assert post_tags(c, "tags", 1, half).status_code == 200
        assert post_tags(c, "tags", 2, rest).status_code == 200  # merged: exactly the limit
        assert len(run_tags(c, "tags") or {}) == MAX_TAGS
        before = exposition(c)
        over = post_tags(c, "tags", 3, ["k0=new", "extra=1"])  # 65 after merging
        after = exposition(c)
        step3 = c.get("/v1/runs/tags/steps/3")
        tags = run_tags(c, "tags")
        changed = post_tags(c, "tags", 4, ["k0=changed"])  # no new key: still at the limit
        too_many = post_tags(c, "fresh", 5, [f"t{i}=x" for i in range(MAX_TAGS + 1)])
        fresh = run_tags(c, "fresh")
    assert over.status_code == 422, over.text
    assert over.json()["field"] == "tag" and "'extra'" in over.json()["detail"]
    assert str(MAX_TAGS) in over.json()["detail"]
    assert after[VALIDATION] == before[VALIDATION] + 1
    assert after["timwatch_batches_total{run=tags}"] == before["timwatch_batches_total{run=tags}"]
    assert step3.status_code == 404
    assert tags is not None and tags["k0"] == "v0" and "extra" not in tags
    assert changed.status_code == 200, changed.text
    assert too_many.status_code == 422 and f"'t{MAX_TAGS}'" in too_many.json()["detail"]
    assert fresh is None  # the refused first batch did not create the run


@pytest.mark.parametrize(
    ("tag", "named"),
    [
        ("k" * (MAX_TAG_KEY + 1) + "=v", "tag key"),
        ("a b=v", "'a b'"),
        ("ü=v", "'ü'"),
        ("=v", "''"),
        ("novalue", "'novalue'"),
        ("k=" + "v" * (MAX_TAG_VALUE + 1), "tag 'k'"),
        ("k=line\nbreak", "tag 'k'"),
        ("k=nul\x00", "tag 'k'"),
    ],
    ids=["long-key", "space", "non-ascii", "empty-key", "no-equals", "long-value", "newline",
         "nul"],
)  # fmt: skip
def test_a_malformed_tag_is_422_naming_it(app: InProcessApp, tag: str, named: str) -> None:
    with app.client() as c:
        before = exposition(c)
        r = post_tags(c, "bad-tag", 1, [tag])
        after = exposition(c)
        runs = c.get("/v1/runs").json()["runs"]
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "tag" and named in r.json()["detail"], r.json()
    assert after[VALIDATION] == before[VALIDATION] + 1
    assert runs == []


def test_tags_at_the_size_limits_pass(server: ServerProc) -> None:
    key, value = "K" * MAX_TAG_KEY, "ü" * MAX_TAG_VALUE
    with server.client() as c:
        r = post_tags(c, "sizes", 1, [f"{key}={value}", "a.b:c-d_e=", "x=y=z"])
        tags = run_tags(c, "sizes")
    assert r.status_code == 200, r.text
    assert tags == {key: value, "a.b:c-d_e": "", "x": "y=z"}


def send(c: httpx.Client, run: str, raw: Any, dropped: str) -> httpx.Response:
    """POST `raw` as safetensors with the ``Timwatch-Tap-Dropped`` header."""
    headers = {"Content-Type": "application/x-safetensors", HEADER: dropped}
    return c.post(f"/v1/runs/{run}/batches", content=raw.to_safetensors_bytes(), headers=headers)


def test_tap_dropped_header_adds_up_on_new_batches_only(server: ServerProc) -> None:
    a, b = raw_batch(1, step=1, batch_id="a"), raw_batch(2, step=2, batch_id="b")
    with server.client() as c:
        first, second = send(c, "tap", a, "3"), send(c, "tap", b, "4")
        replay = send(c, "tap", a, "5")
        limit = send(c, "edge", a, str(2**31))
        assert post(c, "plain", a).status_code == 200
        expo = exposition(c)
    assert first.status_code == second.status_code == limit.status_code == 200, limit.text
    assert replay.json()["replayed"] is True
    assert expo["timwatch_tap_dropped_batches_total{run=tap}"] == 7
    assert expo["timwatch_tap_dropped_batches_total{run=edge}"] == 2**31
    assert expo["timwatch_tap_dropped_batches_total{run=plain}"] == 0
    log = server.output()
    assert "run tap: the tap reports 3 batches dropped" in log
    assert "reports 5 batches" not in log  # the replay was not counted


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", str(2**31 + 1), "", "0x10", "1e3"])
def test_a_malformed_tap_dropped_header_is_422_naming_it(app: InProcessApp, value: str) -> None:
    raw = raw_batch(3, step=1, batch_id="h")
    with app.client() as c:
        before = exposition(c)
        r = send(c, "hdr", raw, value)
        after = exposition(c)
        runs = c.get("/v1/runs").json()["runs"]
    assert r.status_code == 422, r.text
    assert r.json()["field"] == HEADER and HEADER in r.json()["detail"]
    assert after[VALIDATION] == before[VALIDATION] + 1
    assert runs == []
