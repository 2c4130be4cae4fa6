"""The trainer tap's parts without a network: the snapshot of report(), the wire body, the
byte-bounded queue and the drop log."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.batches import random_batch
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.digest import batch_digest
from timwatch.sidecar.tap.pool import MIN_POOLED, BufferPool
from timwatch.sidecar.tap.queue import DropLog, DropQueue, Item
from timwatch.sidecar.tap.snapshot import nbytes_of, snapshot, snapshot_bytes, to_numpy
from timwatch.sidecar.tap.wire import batch_id_for, encode


def joined(body: list[Any]) -> bytes:
    return b"".join(bytes(part) for part in body)


@pytest.mark.parametrize("seed", range(6))
def test_the_streamed_body_reads_back_as_the_same_batch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = random_batch(rng, n_seq=5, max_len=30, optional="all", extreme_masked=False)
    arrays = dict(raw.arrays)
    if seed % 2:  # float64 values and a bool mask take other dtypes through the same path
        arrays = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in arrays.items()}
        arrays["loss_mask"] = arrays["loss_mask"].astype(bool)
    batch = Batch.from_arrays(step=seed, policy_version=seed + 1, **arrays)
    bid = batch_id_for("tap-r2", batch)
    body, length = encode(batch, bid)
    data = joined(body)
    assert len(data) == length and int.from_bytes(data[:8], "little") % 8 == 0
    back = Batch.from_safetensors(data)
    assert back.batch_id == bid == f"tap-r2-s{seed}-{batch_digest(batch)[:24]}"
    assert (back.step, back.policy_version) == (seed, seed + 1)
    assert batch_digest(back) == batch_digest(batch)
    for name, value in batch.arrays().items():
        assert back.arrays()[name].dtype == value.dtype
        assert np.array_equal(back.arrays()[name], value)


def widened(value: Any) -> np.ndarray:
    """What the trainer's value means, half precision as float32 (torch's ``.float()``)."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().numpy()
    arr = np.asarray(value)
    return arr.astype(np.float32) if arr.dtype == np.float16 else arr


def test_a_snapshot_is_a_copy_with_the_trainers_values() -> None:
    base = torch.linspace(-3, 0, 64)
    cases: list[Any] = [
        base.bfloat16(),
        base.half(),
        base.clone().requires_grad_(True),
        base[::2],  # not contiguous
        base.numpy()[::3],
        (-np.arange(10, dtype=np.float16)),
        [0.0, -1.0, -2.0],
    ]
    pool = BufferPool(2**20)
    for value in cases:
        copy, device, _buf = snapshot(value, pool)
        assert device is None
        got = to_numpy(copy)
        assert np.array_equal(got, widened(value))
        assert got.dtype == (np.float64 if isinstance(value, list) else np.float32)
        known = nbytes_of(value)
        assert known is None or known == snapshot_bytes(copy)
        if isinstance(value, (torch.Tensor, np.ndarray)):  # mutating the source changes nothing
            before = got.copy()
            with torch.no_grad():
                value[...] = 0
            assert np.array_equal(to_numpy(copy), before)


def test_host_tensors_the_shipper_converts_keep_their_values() -> None:
    """Pinned copies of CUDA tensors (and tensors numpy cannot view) reach `to_numpy` as torch
    tensors: bf16 and fp16 become float32 exactly as ``.float()`` does, without torch kernels."""
    base = torch.linspace(-5, 0, 1000)
    for t in (base.bfloat16(), base.half(), base, torch.arange(7), torch.ones(5, dtype=torch.bool)):
        got = to_numpy(t)
        want = t.float().numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_pooled_copies_reuse_given_back_buffers_and_stay_bounded() -> None:
    pool = BufferPool(3 * MIN_POOLED)
    src = np.arange(MIN_POOLED // 4, dtype=np.float32)  # exactly MIN_POOLED bytes
    a, buf_a = pool.copy(src)
    assert buf_a is not None and np.array_equal(a, src) and a.dtype == src.dtype
    b, buf_b = pool.copy(src[::-1])  # no free buffer yet: a new one
    assert buf_b is not None and buf_b is not buf_a and np.array_equal(b, src[::-1])
    pool.give([buf_a])
    c, buf_c = pool.copy(src + 1)  # the given-back buffer, with the new values
    assert buf_c is buf_a and np.array_equal(c, src + 1)
    assert np.array_equal(b, src[::-1])  # a buffer still owned is never handed out
    small, none = pool.copy(src[:10])
    assert none is None and np.array_equal(small, src[:10])  # small arrays are not pooled
    pool.give([buf_b, buf_c, np.empty(2 * MIN_POOLED, np.uint8)])
    assert pool.free_bytes <= 3 * MIN_POOLED  # what does not fit is freed
    again, taken = pool.copy(np.zeros(MIN_POOLED // 8, np.float64))
    assert taken is not None and taken.nbytes <= 2 * again.nbytes + 4096


def item(nbytes: int, step: int = 0) -> Item:
    return Item(step, None, {}, {}, nbytes)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 50), max_size=40),
    max_items=st.integers(1, 6),
    max_bytes=st.integers(1, 120),
)
def test_the_queue_holds_both_bounds_and_drops_oldest_first(
    sizes: list[int], max_items: int, max_bytes: int
) -> None:
    q = DropQueue(max_items, max_bytes)
    kept: list[int] = []  # steps in the queue, oldest first, as a model
    for step, size in enumerate(sizes):
        dropped = q.put(item(size, step))
        if size > max_bytes:
            assert [d.step for d in dropped] == [step]
            continue
        model = [*kept, step]
        while len(model) > max_items or sum(sizes[s] for s in model) > max_bytes:
            model.pop(0)
        assert [d.step for d in dropped] == [s for s in [*kept, step] if s not in model]
        kept = model
        assert len(q) == len(kept) <= max_items
        assert q.nbytes == sum(sizes[s] for s in kept) <= max_bytes
    assert [q.pop().step for _ in range(len(q))] == kept and q.nbytes == 0


def test_the_drop_log_warns_once_per_interval_and_loses_no_count() -> None:
    now = [0.0]
    drops = DropLog(30.0, clock=lambda: now[0])
    said = [drops.add(1)]  # the first drop is logged at once
    for t in (1.0, 5.0, 29.0):
        now[0] = t
        said.append(drops.add(2))
    now[0] = 30.0
    said.append(drops.add(1))
    now[0] = 31.0
    said.append(drops.add(3))
    assert said == [1, None, None, None, 7, None]
    assert drops.take() == 3 and drops.take() == 0


def test_queue_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="queue_size"):
        DropQueue(0, 10)
    with pytest.raises(ValueError, match="max_queue_bytes"):
        DropQueue(1, 0)
