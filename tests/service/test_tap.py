"""The trainer tap (`Tap`) against a real `timwatch serve` process and a stand-in.

Happy paths talk to a real uvicorn server (conftest's ``server``). Failure modes the real server
cannot be made to produce on demand (503 with Retry-After, a monitor that hangs, a 5xx storm)
use `tests.helpers.tap_standin.StandIn`, a tiny ``http.server`` on loopback that records every
request it gets. Batch ids, restarts and close/finish: test_tap_ids.py; the byte-bounded queue
and drop reporting: test_tap_queue.py.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import torch

from tests.helpers.batches import random_batch
from tests.helpers.clock import FakeClock
from tests.helpers.procs import REPO, ServerProc
from tests.helpers.tap_standin import StandIn
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.digest import batch_digest
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import dumps, loads
from timwatch.monitor.core.row import derive_row
from timwatch.sidecar.tap import Tap
from timwatch.sidecar.tap.wire import batch_id_for


def norm(obj: Any) -> Any:
    return loads(dumps(obj))


def as_tap_sends(prefix: str = "tap-r0", **fields: Any) -> Batch:
    """The batch a tap with `prefix` sends for these fields, with its generated id."""
    plain = Batch.from_arrays(**fields)
    return Batch.from_arrays(**fields, batch_id=batch_id_for(prefix, plain))


def arrays_of(seed: int) -> dict[str, np.ndarray]:
    raw = random_batch(
        np.random.default_rng(seed), n_seq=6, max_len=40, optional="all", extreme_masked=False
    )
    return dict(raw.arrays)


# ---------------------------------------------------------------- stand-in monitor


def fast_tap(url: str, **kw: Any) -> Tap:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("max_backoff_s", 0.05)
    return Tap(url, "tap-run", **kw)


# ---------------------------------------------------------------- real server


def test_numpy_and_torch_batches_reach_the_history_with_the_engine_rows(
    server: ServerProc,
) -> None:
    a, b = arrays_of(1), arrays_of(2)
    pv = int(a["versions"].max()) + 2  # the trainer is two versions ahead of its oldest token
    tap = Tap(server.url, "taprun", rank=0)
    assert tap.report(3, **a, policy_version=pv)
    tb = {k: torch.from_numpy(v) for k, v in b.items()}
    tb["loss_mask"] = tb["loss_mask"].to(torch.bool)
    tb["logp_train"] = tb["logp_train"].to(torch.bfloat16)
    assert tap.report(4, **tb)
    assert tap.close(30)
    st = tap.stats()
    assert (st["sent"], st["refused"], st["failed"], st["dropped"]) == (2, 0, 0, 0)

    with server.client() as c:
        step3 = c.get("/v1/runs/taprun/steps/3").json()
        step4 = c.get("/v1/runs/taprun/steps/4").json()
    b3 = as_tap_sends(**a, step=3, policy_version=pv)
    expected3 = derive_row(accumulate(b3)).to_dict()
    assert step3["row"] == norm(expected3)
    # the bf16 trainer log-probs arrive as float32 values of the bf16 numbers
    b_bf16 = dict(b, logp_train=torch.from_numpy(b["logp_train"]).bfloat16().float().numpy())
    b4 = as_tap_sends(**b_bf16, step=4)
    expected4 = derive_row(accumulate(b4)).to_dict()
    assert step4["row"] == norm(expected4)


def test_caller_mutating_its_arrays_after_report_changes_nothing(server: ServerProc) -> None:
    a = arrays_of(3)
    original = {k: v.copy() for k, v in a.items()}
    t = {k: torch.from_numpy(v.copy()) for k, v in a.items()}
    tap = Tap(server.url, "mutate", rank=0)
    tap.report(1, **a)
    tap.report(2, **t)
    for v in a.values():  # the trainer reuses its buffers in place
        v[...] = 0
    for v in t.values():
        v.zero_()
    assert tap.close(30)
    with server.client() as c:
        for step in (1, 2):
            batch = as_tap_sends(**original, step=step)
            row = c.get(f"/v1/runs/mutate/steps/{step}").json()["row"]
            assert row == norm(derive_row(accumulate(batch)).to_dict())


def test_wrong_token_is_refused_once_and_never_retried(server_factory: Any) -> None:
    srv = server_factory(env={"TIMWATCH_TOKEN": "right"})
    tap = Tap(srv.url, "auth", token="wrong", backoff_s=0.01)
    tap.report(1, **arrays_of(4))
    tap.report(2, **arrays_of(5))
    assert tap.flush(30)
    st = tap.stats()
    assert (st["refused"], st["retries"], st["sent"]) == (2, 0, 0)
    assert st["refused_statuses"] == {401: 2}
    good = Tap(srv.url, "auth", token="right")
    good.report(1, **arrays_of(4))
    assert good.close(30) and good.stats()["sent"] == 1
    tap.close(1)


def test_atexit_flushes_what_the_process_reported(server: ServerProc, tmp_path: Any) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(
        "import numpy as np\n"
        "from timwatch.sidecar.tap import Tap\n"
        f"tap = Tap({server.url!r}, 'exiting')\n"
        "n = 50\n"
        "for step in range(5):\n"
        "    tap.report(step, cu_seqlens=np.array([0, 20, n]), logp_rollout=np.full(n, -1.0),\n"
        "               logp_train=np.full(n, -1.1), entropy=np.full(n, 0.5),\n"
        "               loss_mask=np.ones(n, np.int8))\n"
        "# no close(): the interpreter exits right after report() returned\n"
    )
    subprocess.run([sys.executable, str(script)], cwd=REPO, check=True, timeout=60)
    with server.client() as c:
        res = c.get("/v1/runs/exiting/metrics", params={"names": "tokens"}).json()
    assert res["steps"] == [0, 1, 2, 3, 4]
    assert res["series"]["tokens"] == [50] * 5


# ---------------------------------------------------------------- stand-in monitor


def test_503_and_500_are_retried_with_the_same_batch_id(stand_in: StandIn) -> None:
    stand_in.script = [(503, {"Retry-After": "0"}), (500, {}), (200, {})]
    tap = fast_tap(stand_in.url, token="tok", rank=3)
    tap.report(7, **arrays_of(6))
    assert tap.close(10)
    st = tap.stats()
    assert (st["sent"], st["retries"], st["failed"]) == (1, 2, 0)
    ids = [r["batch"].batch_id for r in stand_in.batches()]
    assert ids == [f"tap-r3-s7-{batch_digest(stand_in.batches()[0]['batch'])[:24]}"] * 3
    r = stand_in.batches()[0]
    assert r["path"] == "/v1/runs/tap-run/batches"
    assert r["headers"]["Content-Type"] == "application/x-safetensors"
    assert r["headers"]["Authorization"] == "Bearer tok"


def test_backoff_doubles_from_backoff_s_and_honours_retry_after(stand_in: StandIn) -> None:
    """The waits between tries, on an injected clock (none of them passes in real time):
    ``Retry-After`` raises a wait, ``max_backoff_s`` caps every one, and between those the wait
    doubles from ``backoff_s`` with jitter down to half."""
    stand_in.script = [
        (503, {"Retry-After": "7"}),
        (500, {}),
        (500, {}),
        (503, {"Retry-After": "3600"}),
        (200, {}),
    ]
    clock = FakeClock()
    tap = Tap(stand_in.url, "tap-run", backoff_s=1.0, max_backoff_s=8.0, clock=clock)
    tap.report(7, **arrays_of(6))
    assert tap.close(10)
    assert (tap.stats()["sent"], tap.stats()["retries"]) == (1, 4)
    first, second, third, capped = clock.waited
    assert first == 7.0  # Retry-After over a backoff of 0.5-1 s
    assert 1.0 <= second < 2.0 and 2.0 <= third < 4.0
    assert capped == 8.0


def test_4xx_is_refused_not_retried(stand_in: StandIn) -> None:
    stand_in.script = [(422, {}), (413, {})]
    tap = fast_tap(stand_in.url)
    tap.report(1, **arrays_of(1))
    tap.report(2, **arrays_of(2))
    tap.report(3, **arrays_of(3))
    assert tap.close(10)
    st = tap.stats()
    assert (st["refused"], st["sent"], st["retries"]) == (2, 1, 0)
    assert st["refused_statuses"] == {422: 1, 413: 1}
    assert len(stand_in.batches()) == 3


def test_full_queue_drops_the_oldest(stand_in: StandIn) -> None:
    stand_in.gate.clear()  # the monitor hangs: the first batch sits in flight
    tap = fast_tap(stand_in.url, queue_size=3)
    for step in range(8):
        assert tap.report(step, **arrays_of(step))
    st = tap.stats()
    # step 0 is in flight (or still queued if the shipper had not taken it yet)
    assert st["queue"] == 3 and st["reported"] == 8
    assert st["dropped"] == 8 - 3 - st["in_flight"]
    stand_in.gate.set()
    assert tap.close(10)
    steps = [r["batch"].step for r in stand_in.batches()]
    assert steps[-3:] == [5, 6, 7]
    assert tap.stats()["sent"] == len(steps) == 8 - tap.stats()["dropped"]


def test_unreachable_monitor_gives_up_after_retries_and_never_raises() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tap = fast_tap(f"http://127.0.0.1:{port}", max_retries=2)
    assert tap.report(1, **arrays_of(1))
    assert tap.flush(10)
    st = tap.stats()
    assert (st["failed"], st["retries"], st["sent"]) == (1, 2, 0)
    assert "Connect" in (st["last_error"] or "")
    tap.close(1)
    assert tap.report(2, **arrays_of(2)) is False  # closed: ignored, no exception


def test_bad_input_is_counted_never_raised(stand_in: StandIn) -> None:
    class Exploding:
        def __array__(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("boom")

    tap = fast_tap(stand_in.url)
    a = arrays_of(1)
    assert tap.report(1, **{**a, "logp_train": Exploding()}) is False
    bad = dict(a, logp_train=np.abs(a["logp_train"]) + 1.0)  # positive log-probs
    assert tap.report(2, **bad) is True
    short = dict(a, entropy=a["entropy"][:-1])
    assert tap.report(3, **short) is True
    assert tap.close(10)
    st = tap.stats()
    assert (st["errors"], st["invalid"], st["sent"]) == (1, 2, 0)
    assert "entropy" in (st["last_error"] or "")
    assert stand_in.batches() == []
