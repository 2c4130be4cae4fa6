"""The incremental ``/metrics`` renderer answers byte for byte what a full ``prometheus_client``
render answers for the same state, after any sequence of observe / reject / evict, and re-renders
only the runs that changed; ``/metrics`` and ``/healthz`` need no thread of the shared pool."""

from __future__ import annotations

import random
import time

import anyio
import anyio.to_thread
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.batches import random_batch
from tests.helpers.inproc import InProcessApp
from timwatch.monitor.core.accumulator import Accumulator
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.jsoncodec import dumps
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.service.exporter import make_registry, render
from timwatch.monitor.service.exposition import Exposition
from timwatch.monitor.service.runs import REJECT_REASONS, RunRegistry


def _accs(n: int) -> list[Accumulator]:
    rng = np.random.default_rng(11)
    out = []
    for i in range(n):
        raw = random_batch(rng, n_seq=3, optional="all" if i % 2 else "none")
        out.append(accumulate(Batch.from_arrays(**raw.from_arrays_kwargs())))
    return out


def _observe(runs: RunRegistry, run: str, acc: Accumulator, step: int) -> None:
    runs.observe(run, acc, derive_row(acc).to_dict(), step)


def _samples(text: bytes) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return [
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    ]


def test_empty_registry_renders_like_the_full_render() -> None:
    runs = RunRegistry()
    assert Exposition(runs).render() == render(make_registry(runs))


def test_random_observe_reject_evict_sequences_match_the_full_render() -> None:
    accs = _accs(6)
    rnd = random.Random(5)
    runs = RunRegistry(ttl=50.0)
    expo, full = Exposition(runs), make_registry(runs)
    names = ["a", "b.2", 'quote"d', "back\\slash", "z-run", "new\nline", "m:1", "ü"]
    for i in range(120):
        op = rnd.random()
        if op < 0.6:
            _observe(runs, rnd.choice(names), rnd.choice(accs), rnd.randrange(5))
        elif op < 0.75:
            runs.reject(rnd.choice(REJECT_REASONS))
        else:  # evict every run idle more than a random age, in a virtual future
            runs.evict(time.monotonic() + rnd.choice([0.0, 49.0, 51.0]))
        if rnd.random() < 0.5:
            got, want = expo.render(), render(full)
            assert got == want, f"step {i}"
            assert _samples(got) == _samples(want)
    assert expo.render() == render(full)


def test_only_changed_runs_are_rendered_and_evicted_runs_drop_out() -> None:
    accs = _accs(2)
    runs = RunRegistry(ttl=3600.0)
    for r in range(200):
        _observe(runs, f"run-{r:03d}", accs[r % 2], r)
    expo = Exposition(runs)
    first = expo.render()
    assert expo.rendered_runs == 200
    assert expo.render() == first and expo.rendered_runs == 0
    _observe(runs, "run-007", accs[0], 500)
    _observe(runs, "run-150", accs[1], 501)
    runs.reject("overloaded")
    text = expo.render()
    assert expo.rendered_runs == 2
    assert text == render(make_registry(runs))
    assert 'timwatch_rejected_batches_total{reason="overloaded"} 1.0' in text.decode()
    # a run evicted and re-created between two scrapes is re-rendered, not served stale
    runs._runs.pop("run-003")  # what evict() does, without waiting for the TTL
    _observe(runs, "run-003", accs[1], 0)
    assert expo.render() == render(make_registry(runs)) and expo.rendered_runs == 1
    runs.evict(float("inf"))
    assert expo.render() == render(make_registry(runs))
    assert b'run="' not in expo.render()


def test_metrics_and_healthz_answer_with_every_worker_thread_taken(app: InProcessApp) -> None:
    """What ingests blocked on a stuck store do to the shared AnyIO threadpool, done directly:
    every token of its limiter is held. /metrics (own thread) and /healthz (memory) answer."""
    holders = [object() for _ in range(200)]

    async def take_all() -> int:
        limiter = anyio.to_thread.current_default_thread_limiter()
        for h in holders[: int(limiter.total_tokens)]:
            await limiter.acquire_on_behalf_of(h)
        return int(limiter.total_tokens)

    async def give_back(n: int) -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()
        for h in holders[:n]:
            limiter.release_on_behalf_of(h)

    with app.client() as c:
        assert c.post("/v1/runs/r1/batches", content=dumps(_raw_json(1))).status_code == 200
        taken = app.portal.call(take_all)
        try:
            assert taken >= 1
            metrics = c.get("/metrics")
            health = c.get("/healthz")
        finally:
            app.portal.call(give_back, taken)
        assert c.get("/v1/runs").status_code == 200  # the pool works again
    assert metrics.status_code == 200 and 'timwatch_batches_total{run="r1"} 1.0' in metrics.text
    assert health.status_code == 200 and health.json()["status"] == "ok"


def _raw_json(seed: int) -> object:
    return random_batch(np.random.default_rng(seed), n_seq=3, optional="none").to_json_obj()
