"""The kernel reads its inputs in place, so one batch must give the same bits whatever arrays
carry it: float32 or float64 (equal values), mixed dtypes, strided views, a length that leaves
a short last chunk (staged) of any size."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.engine_rows import _bench_like, hexify
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.engine import accumulate
from timwatch.monitor.core.masks import PolicyParams
from timwatch.monitor.core.row import derive_row


def _bits(kwargs: dict[str, np.ndarray]) -> str:
    acc = accumulate(Batch.from_arrays(**kwargs), PolicyParams(), threads=1)
    return json.dumps(hexify({"row": derive_row(acc).to_dict(), "state": acc.to_state()}))


@pytest.mark.parametrize("n", [3000, 2048 + 8, 2048 + 15, 2048 + 16, 2048 + 17, 1024 + 40])
def test_float32_float64_mixed_and_strided_inputs_give_the_same_bits(n: int) -> None:
    base = _bench_like(n, 7, 40 + n, np.float32)
    want = _bits(base)
    as64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in base.items()}
    assert _bits(as64) == want
    mixed = {**base, "logp_train": base["logp_train"].astype(np.float64)}
    assert _bits(mixed) == want
    strided = dict(base)
    for k in ("logp_rollout", "logp_train", "entropy"):
        wide = np.zeros(2 * n, dtype=np.float64)
        wide[::2] = base[k]
        strided[k] = wide[::2]
    assert not strided["entropy"].flags.c_contiguous
    assert _bits(strided) == want
