"""Random ragged packed batches for the engine tests.

The generators build plain numpy arrays (no monitor import) so the same object feeds both the
engine (through ``Batch.from_arrays`` / ``from_json`` / ``from_safetensors``) and the independent
reference in ``reference.py``. They deliberately produce the awkward cases the acceptance list of
issue 2 names: empty and single-token sequences, fully masked sequences, masked positions that
carry huge (but valid, finite) values which must not leak into any statistic, zero entropy,
|δ| up to 50, 8k-token sequences, FP16-like |δ| ≈ 1e-4, and every optional field present or absent.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

__all__ = [
    "FLOAT_FIELDS",
    "INT_FIELDS",
    "OPTIONAL_FIELDS",
    "RawBatch",
    "fp16_like_batch",
    "random_batch",
    "random_batches",
    "split_at",
]

FLOAT_FIELDS = ("logp_rollout", "logp_train", "entropy", "logp_old", "logp_teacher")
INT_FIELDS = ("cu_seqlens", "loss_mask", "token_ids", "token_ids_train", "versions")
OPTIONAL_FIELDS = ("token_ids", "token_ids_train", "versions", "logp_old", "logp_teacher")
ENTROPY_SOURCES = ("rollout", "topk", "trainer")


@dataclasses.dataclass
class RawBatch:
    """A packed batch as plain arrays plus the metadata of docs/reference/batch.md (absent optionals
    are missing keys)."""

    arrays: dict[str, np.ndarray]
    step: int = 0
    batch_id: str | None = None
    policy_version: int | None = None
    entropy_source: str = "trainer"

    @property
    def num_tokens(self) -> int:
        return int(self.arrays["logp_rollout"].shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.arrays["cu_seqlens"].shape[0] - 1)

    def meta(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "batch_id": self.batch_id,
            "policy_version": self.policy_version,
            "entropy_source": self.entropy_source,
        }

    def from_arrays_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Batch.from_arrays`` (copies, so the engine cannot alias us)."""
        kw: dict[str, Any] = {k: v.copy() for k, v in self.arrays.items()}
        kw.update(self.meta())
        return kw

    def to_json_obj(self) -> dict[str, Any]:
        """JSON layout of docs/reference/batch.md: field lists plus top-level metadata (None
        metadata left out)."""
        obj: dict[str, Any] = {k: v.tolist() for k, v in self.arrays.items()}
        for k, v in self.meta().items():
            if v is not None:
                obj[k] = v
        return obj

    def to_safetensors_bytes(self) -> bytes:
        """Safetensors layout built with the safetensors library itself (metadata as strings)."""
        from safetensors.numpy import save

        meta = {k: str(v) for k, v in self.meta().items() if v is not None}
        return save({k: np.ascontiguousarray(v) for k, v in self.arrays.items()}, metadata=meta)

    def json_roundtrip(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.to_json_obj()))


def _lengths(rng: np.random.Generator, n_seq: int, max_len: int, long_prob: float) -> np.ndarray:
    kinds = rng.choice(4, size=n_seq, p=[0.08, 0.15, 0.77 - long_prob, long_prob])
    lengths = np.empty(n_seq, dtype=np.int64)
    for i, k in enumerate(kinds):
        if k == 0:
            lengths[i] = 0
        elif k == 1:
            lengths[i] = 1
        elif k == 2:
            lengths[i] = rng.integers(2, max_len + 1)
        else:
            lengths[i] = rng.integers(1024, 8193)
    if lengths.sum() == 0:
        lengths[rng.integers(n_seq)] = rng.integers(1, max_len + 1)
    return lengths


def _loss_mask(rng: np.random.Generator, lengths: np.ndarray) -> np.ndarray:
    parts = []
    for n in lengths:
        kind = rng.choice(3, p=[0.1, 0.5, 0.4])
        if kind == 0:  # fully masked sequence (all prompt / tool tokens)
            m = np.zeros(n, dtype=np.int64)
        elif kind == 1:  # prompt prefix then response
            m = np.ones(n, dtype=np.int64)
            m[: rng.integers(0, n + 1)] = 0
        else:  # interleaved tool / template tokens
            m = (rng.random(n) < 0.8).astype(np.int64)
        parts.append(m)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _deltas(rng: np.random.Generator, n: int, fp16: bool, wild: float) -> np.ndarray:
    if fp16:
        return rng.normal(0.0, 1e-4, n)
    kind = rng.choice(5, size=n, p=[0.55 - wild, 0.2, 0.2, wild, 0.05])
    d = np.where(kind == 0, rng.normal(0.0, 0.01, n), 0.0)
    d = np.where(kind == 1, rng.normal(0.0, 1e-4, n), d)
    d = np.where(kind == 2, rng.normal(0.0, 1.0, n), d)
    d = np.where(kind == 3, rng.uniform(-50.0, 50.0, n), d)
    return d  # kind 4: exactly zero


def _entropy(rng: np.random.Generator, n: int) -> np.ndarray:
    kind = rng.choice(4, size=n, p=[0.15, 0.45, 0.3, 0.1])
    h = np.where(kind == 1, rng.exponential(0.02, n), 0.0)
    h = np.where(kind == 2, rng.exponential(1.0, n), h)
    return np.where(kind == 3, rng.uniform(0.0, 12.0, n), h)


def random_batch(
    rng: np.random.Generator,
    *,
    n_seq: int | None = None,
    max_len: int = 48,
    long_prob: float = 0.0,
    optional: str = "random",
    fp16: bool = False,
    wild: float = 0.05,
    extreme_masked: bool = True,
) -> RawBatch:
    """One valid ragged batch.

    ``optional``: "random" (each optional field coin-flipped), "all" or "none"; ``wild``: share
    of tokens with δ uniform in [−50, 50] (past the ±20 clamp).
    """
    if n_seq is None:
        n_seq = int(rng.integers(1, 25))
    lengths = _lengths(rng, n_seq, max_len, long_prob)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(cu[-1])
    mask = _loss_mask(rng, lengths)

    d = _deltas(rng, n, fp16, wild)
    base = -rng.exponential(2.0, n)
    base = np.where(rng.random(n) < 0.05, 0.0, base)  # probability-one tokens
    mu = base - np.maximum(d, 0.0)
    pi = mu + d
    h = _entropy(rng, n)

    arrays: dict[str, np.ndarray] = {
        "cu_seqlens": cu,
        "logp_rollout": mu,
        "logp_train": pi,
        "entropy": h,
        "loss_mask": mask.astype(rng.choice([np.int64, np.int32, np.bool_])),
    }
    policy_version: int | None = None

    def want(p: float = 0.5) -> bool:
        return optional == "all" or (optional == "random" and rng.random() < p)

    if want():
        ids = rng.integers(0, 150_000, n).astype(np.int64)
        arrays["token_ids"] = ids
        if want(0.8):
            train = ids.copy()
            flip = rng.random(n) < 0.02
            train[flip] = (train[flip] + 1 + rng.integers(0, 10, int(flip.sum()))) % 150_000
            arrays["token_ids_train"] = train
    if want():
        pv = int(rng.integers(5, 100))
        ver = np.empty(n, dtype=np.int64)
        for s in range(n_seq):
            a, b = int(cu[s]), int(cu[s + 1])
            ver[a:b] = pv - int(rng.integers(0, 4))
            if b - a > 1 and rng.random() < 0.3:  # weights updated mid-sequence
                ver[int(rng.integers(a + 1, b)) : b] += 1
        arrays["versions"] = np.minimum(ver, pv)
        if want(0.8):
            policy_version = pv
    if want():
        arrays["logp_old"] = np.minimum(mu + rng.normal(0.0, 0.02, n), 0.0)
    if want():
        p = np.where(rng.random(n) < 0.3, rng.uniform(0.96, 1.0, n), rng.uniform(1e-4, 1.0, n))
        arrays["logp_teacher"] = np.log(p)

    if extreme_masked and n:
        # Huge but *valid* values on positions outside the loss mask: finite, log-probs <= 0,
        # entropy >= 0. Any leak turns a statistic into inf/NaN or drags it by orders of magnitude.
        off = np.flatnonzero(np.asarray(arrays["loss_mask"]) == 0)
        pick = off[rng.random(off.size) < 0.5]
        if pick.size:
            choice = rng.integers(0, 4, pick.size)
            mu, pi, h = mu.copy(), pi.copy(), h.copy()
            mu[pick] = np.where(choice == 0, -1e300, np.where(choice == 1, 0.0, -745.0))
            pi[pick] = np.where(choice == 1, -1e308, np.where(choice == 2, 0.0, -700.0))
            h[pick] = np.where(choice == 3, 1e300, 1e6)
            arrays["logp_rollout"], arrays["logp_train"], arrays["entropy"] = mu, pi, h
            for k in ("logp_old", "logp_teacher"):
                if k in arrays:
                    arrays[k] = arrays[k].copy()
                    arrays[k][pick] = -1e300
            if "token_ids" in arrays:
                arrays["token_ids"] = arrays["token_ids"].copy()
                arrays["token_ids"][pick] = 2**40  # and a mismatch nobody may count
            if "versions" in arrays:
                arrays["versions"] = arrays["versions"].copy()
                arrays["versions"][pick] = -(10**9)

    return RawBatch(
        arrays=arrays,
        step=int(rng.integers(0, 10_000)),
        batch_id=f"b-{int(rng.integers(0, 2**31))}" if rng.random() < 0.7 else None,
        policy_version=policy_version,
        entropy_source=str(rng.choice(ENTROPY_SOURCES)),
    )


def fp16_like_batch(rng: np.random.Generator, *, n_seq: int = 16, max_len: int = 400) -> RawBatch:
    """Every token with |δ| ≈ 1e-4 (an FP16 run): k3 ≈ δ²/2 ≈ 5e-9, where cancellation bites."""
    return random_batch(
        rng, n_seq=n_seq, max_len=max_len, optional="none", fp16=True, extreme_masked=True
    )


def random_batches(seed: int, count: int, **kw: Any) -> list[RawBatch]:
    rng = np.random.default_rng(seed)
    return [random_batch(rng, **kw) for _ in range(count)]


def split_at(raw: RawBatch, k: int) -> tuple[RawBatch, RawBatch]:
    """Split at the boundary before sequence ``k`` (a sequence never spans two batches)."""
    cu = raw.arrays["cu_seqlens"]
    cut = int(cu[k])
    halves = []
    for lo, hi, cu_part in ((0, cut, cu[: k + 1]), (cut, raw.num_tokens, cu[k:] - cut)):
        arrays = {
            key: (v[lo:hi].copy() if key != "cu_seqlens" else cu_part.copy())
            for key, v in raw.arrays.items()
        }
        halves.append(dataclasses.replace(raw, arrays=arrays))
    return halves[0], halves[1]
