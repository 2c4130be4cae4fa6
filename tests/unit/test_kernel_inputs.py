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


# Run in a fresh interpreter (numba's on-disk cache loads what it has, but a dispatcher's
# signatures start empty), so a signature this test finds was added by the batch that followed.
_EVERY_PATH = r"""
import json, struct
import numpy as np
from tests.helpers.batches import random_batch
from timwatch.monitor.core import engine, fastmath, kernels, kernels_seq, kernels_walk
from timwatch.monitor.core.batch import Batch

def dispatchers():
    for mod in (kernels, kernels_seq, kernels_walk, fastmath):
        for name, obj in vars(mod).items():
            if hasattr(obj, "signatures") and getattr(obj, "__module__", "") == mod.__name__:
                yield f"{mod.__name__}.{name}", obj

def body(arrays, wire):
    # safetensors by hand: numpy has no bfloat16, so BF16 is the top half of the float32 bits
    header, parts, at = {"__metadata__": {"step": "1", "policy_version": "99"}}, [], 0
    for name, a in arrays.items():
        kind = wire.get(name)
        if kind == "BF16":
            raw = (np.asarray(a, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        elif kind == "BOOL" or a.dtype.kind == "b":
            kind = "BOOL"
            raw = np.asarray(a).astype(bool).tobytes()
        else:
            kind = {"f": "F", "i": "I", "u": "U"}[a.dtype.kind] + str(8 * a.dtype.itemsize)
            raw = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": kind, "shape": [len(a)], "data_offsets": [at, at + len(raw)]}
        parts.append(raw)
        at += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(parts)

engine.warm_up()
before = {name: len(d.signatures) for name, d in dispatchers()}
rng = np.random.default_rng(5)
raw = random_batch(rng, n_seq=8, max_len=40, optional="all", extreme_masked=False)
a = {k: v for k, v in raw.arrays.items() if k != "logp_teacher"}
f32 = {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in a.items()}
paths = {}
paths["json"] = Batch.from_json(raw.json_roundtrip())
for name, arrays, wire in [
    ("st-f64", a, {}),
    ("st-f32-bool", f32, {"loss_mask": "BOOL"}),
    ("st-bf16", a, {k: "BF16" for k in ("logp_rollout", "logp_train", "entropy", "logp_old")}),
    ("st-f16-i32", {**{k: v.astype(np.float16) if v.dtype.kind == "f" else v for k, v in a.items()},
                    "cu_seqlens": a["cu_seqlens"].astype(np.int32)}, {}),
]:
    paths[name] = Batch.from_safetensors(body(arrays, wire))
readonly = {}
for k, v in f32.items():
    readonly[k] = v.copy()
    readonly[k].flags.writeable = False
paths["readonly"] = Batch.from_arrays(**readonly, policy_version=99)
misaligned = dict(f32)
for k in ("logp_rollout", "logp_train", "entropy"):
    buf = np.zeros(4 * len(f32[k]) + 1, np.uint8)
    misaligned[k] = np.frombuffer(buf.data, np.float32, len(f32[k]), offset=1)
paths["misaligned"] = Batch.from_arrays(**misaligned)
# the batch keeps them as they came, so the kernel's own alignment check is what is tested
assert not paths["misaligned"].logp_rollout.flags.aligned
n = 1 << 18  # past the size where the kernel runs on several threads
cu = np.array([0, n // 3, n // 2, n], np.int32)
big = dict(cu_seqlens=cu, logp_rollout=np.full(n, -1.0, np.float32),
           logp_train=np.full(n, -1.1, np.float32), entropy=np.full(n, 0.5, np.float32),
           loss_mask=np.ones(n, bool))
paths["threads"] = Batch.from_arrays(**big)
added = {}
for path, batch in paths.items():
    engine.accumulate(batch, threads=2)
    now = {name: len(d.signatures) for name, d in dispatchers()}
    added[path] = sorted(k for k in now if now[k] > before.get(k, 0))
    before = now
print(json.dumps(added))
"""


def test_every_input_path_runs_the_kernels_warm_up_compiled() -> None:
    """A server compiles its kernels before it listens (`engine.warm_up`); a batch whose arrays
    numba types differently (read-only safetensors views, int32 offsets, bool masks, misaligned
    or bf16-decoded floats, the threaded path) would compile a new specialisation inside the
    request instead: over a minute on a cold cache, past a trainer's 30 s timeout."""
    import subprocess
    import sys

    from tests.helpers.procs import REPO

    out = subprocess.run(
        [sys.executable, "-c", _EVERY_PATH], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    added = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(added) == 8
    assert added == {path: [] for path in added}
