"""The packed batch of docs/reference/batch.md: one validated, immutable object whatever the wire
format.

Everything downstream (engine, masks, store, exporter) trusts a `Batch`, so every check lives
here and every refusal names the field and the first bad index. Validation is vectorised: a
clean batch pays a few numpy passes, and only a bad one pays for locating its first bad index.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .batch_checks import (
    ENTROPY_MAX,
    ENTROPY_SOURCES,
    LOGP_MAX,
    LOGP_MIN,
    check_floats,
    check_int_range,
    check_kept_bounds,
    check_lag,
    check_metadata,
    first,
    parse_meta_strings,
)
from .errors import BatchError
from .extras import with_hint

__all__ = [
    "ENTROPY_MAX",
    "LOGP_MAX",
    "LOGP_MIN",
    "Batch",
    "BatchError",
    "ENTROPY_SOURCES",
    "FLOAT_FIELDS",
    "INT_FIELDS",
    "OPTIONAL_FIELDS",
    "REQUIRED_FIELDS",
    "NonFinitePolicy",
]

NonFinitePolicy = Literal["refuse", "drop"]

REQUIRED_FIELDS = ("cu_seqlens", "logp_rollout", "logp_train", "entropy", "loss_mask")
OPTIONAL_FIELDS = ("token_ids", "token_ids_train", "versions", "logp_old", "logp_teacher")
FLOAT_FIELDS = ("logp_rollout", "logp_train", "entropy", "logp_old", "logp_teacher")
INT_FIELDS = ("token_ids", "token_ids_train", "versions")
LOGP_FIELDS = ("logp_rollout", "logp_train", "logp_old", "logp_teacher")
META_FIELDS = ("step", "batch_id", "policy_version", "entropy_source")
_TOKEN_FIELDS = REQUIRED_FIELDS[1:] + OPTIONAL_FIELDS

FloatArray = npt.NDArray[np.floating[Any]]
IntArray = npt.NDArray[np.integer[Any]]


@dataclass(frozen=True, eq=False)
class Batch:
    """A validated packed batch: flat per-token arrays plus `cu_seqlens`.

    Float arrays keep their wire dtype (float32 or float64); the engine accumulates in float64.
    """

    cu_seqlens: npt.NDArray[np.int64]
    logp_rollout: FloatArray
    logp_train: FloatArray
    entropy: FloatArray
    loss_mask: npt.NDArray[np.uint8]
    token_ids: IntArray | None = None
    token_ids_train: IntArray | None = None
    versions: IntArray | None = None
    logp_old: FloatArray | None = None
    logp_teacher: FloatArray | None = None
    step: int = 0
    batch_id: str | None = None
    policy_version: int | None = None
    entropy_source: str = "trainer"
    nonfinite_tokens: int = 0
    impossible_tokens: int = 0
    #: positions of impossible tokens, the side that was -inf there (0: ``logp_rollout``,
    #: 1: ``logp_train``) and their loss_mask on the wire; `wire_arrays` puts them back
    impossible_at: npt.NDArray[np.int64] | None = None
    impossible_side: npt.NDArray[np.uint8] | None = None
    impossible_mask: npt.NDArray[np.uint8] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.logp_rollout.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.shape[0] - 1)

    def arrays(self) -> dict[str, np.ndarray]:
        """The present per-token arrays and `cu_seqlens`, by field name."""
        out: dict[str, np.ndarray] = {}
        for name in REQUIRED_FIELDS + OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def wire_arrays(self) -> dict[str, np.ndarray]:
        """`arrays` as the batch came in: impossible tokens get their -inf and loss_mask back,
        so a batch forwarded (the tap) is counted the same by the receiving monitor."""
        out = self.arrays()
        at = self.impossible_at
        if at is None or self.impossible_side is None or self.impossible_mask is None:
            return out
        side = self.impossible_side.astype(bool)
        for name, where in (("logp_rollout", ~side), ("logp_train", side)):
            arr = out[name].copy()
            arr[at[where]] = -np.inf
            out[name] = arr
        mask = out["loss_mask"].copy()
        mask[at] = self.impossible_mask
        out["loss_mask"] = mask
        return out

    def metadata(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "batch_id": self.batch_id,
            "policy_version": self.policy_version,
            "entropy_source": self.entropy_source,
        }

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_arrays(
        cls,
        *,
        nonfinite: NonFinitePolicy = "refuse",
        step: Any = 0,
        batch_id: Any = None,
        policy_version: Any = None,
        entropy_source: Any = "trainer",
        **arrays: Any,
    ) -> Batch:
        """Build from numpy arrays, torch tensors or sequences (copied to host if on a device)."""
        unknown = sorted(set(arrays) - set(REQUIRED_FIELDS + OPTIONAL_FIELDS))
        if unknown:
            raise BatchError(unknown[0], f"unknown field {unknown[0]!r}")
        converted = {
            name: _to_numpy(name, value) for name, value in arrays.items() if value is not None
        }
        meta = check_metadata(
            {
                "step": step,
                "batch_id": batch_id,
                "policy_version": policy_version,
                "entropy_source": entropy_source,
            }
        )
        return _validate(converted, meta, nonfinite)

    @classmethod
    def from_json(cls, obj: Any, *, nonfinite: NonFinitePolicy = "refuse") -> Batch:
        """Build from a decoded JSON object: per-token lists (or arrays) plus metadata keys."""
        if not isinstance(obj, Mapping):
            raise BatchError("body", "a batch must be a JSON object")
        unknown = sorted(set(obj) - set(REQUIRED_FIELDS + OPTIONAL_FIELDS + META_FIELDS))
        if unknown:
            raise BatchError(unknown[0], f"unknown field {unknown[0]!r:.60}")
        meta = check_metadata({k: obj.get(k) for k in META_FIELDS if k in obj})
        arrays = {
            name: _json_array(name, obj[name])
            for name in REQUIRED_FIELDS + OPTIONAL_FIELDS
            if obj.get(name) is not None
        }
        return _validate(arrays, meta, nonfinite)

    @classmethod
    def from_json_bytes(cls, data: bytes, *, nonfinite: NonFinitePolicy = "refuse") -> Batch:
        """Build from the bytes of a JSON body, parsed straight into arrays
        (`timwatch.monitor.core.jsonscan`: bounded memory, no recursion)."""
        try:
            from .jsonscan import scan_batch
        except ModuleNotFoundError as exc:  # orjson
            raise with_hint(exc, "Batch.from_json_bytes") from exc
        return cls.from_json(scan_batch(data), nonfinite=nonfinite)

    @classmethod
    def from_safetensors(cls, data: bytes, *, nonfinite: NonFinitePolicy = "refuse") -> Batch:
        """Build from safetensors bytes: tensor names are field names, metadata in the header
        (`timwatch.monitor.core.safetensors_codec` checks the framing and the dtypes)."""
        from .safetensors_codec import decode

        tensors, raw_meta = decode(data)
        unknown = sorted(set(tensors) - set(REQUIRED_FIELDS + OPTIONAL_FIELDS)) or sorted(
            set(raw_meta) - set(META_FIELDS)
        )
        if unknown:
            raise BatchError(unknown[0], f"unknown field {unknown[0]!r:.60}")
        meta = check_metadata(parse_meta_strings(raw_meta))
        return _validate(dict(tensors), meta, nonfinite)

    # ---- serialisation ------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.metadata().items() if v is not None}
        for name, value in self.arrays().items():
            out[name] = value.tolist()
        return out

    def to_safetensors(self) -> bytes:
        try:
            from safetensors.numpy import save
        except ModuleNotFoundError as exc:
            # the service's client sends it: [proxy] has safetensors too, but not the client
            raise with_hint(exc, "Batch.to_safetensors", "server") from exc
        meta = {k: str(v) for k, v in self.metadata().items() if v is not None}
        tensors = {name: np.ascontiguousarray(v) for name, v in self.wire_arrays().items()}
        return save(tensors, metadata=meta)


# ---- helpers ------------------------------------------------------------------------------


def _to_numpy(name: str, value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, without importing it
        tensor = value.detach()
        if str(tensor.dtype) in ("torch.bfloat16", "torch.float16"):
            tensor = tensor.float()
        value = tensor.cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise BatchError(name, f"{name} must be one-dimensional, got shape {arr.shape}")
    return arr


def _json_array(name: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):  # from jsonscan: already parsed and element-checked
        return value
    if not isinstance(value, list):
        raise BatchError(name, f"{name} must be a list, got {type(value).__name__}")
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        arr = np.asarray(value, dtype=object)
    integer = name in INT_FIELDS or name == "cu_seqlens"
    if arr.shape == (0,):
        return arr.astype(np.int64 if integer else np.float64)
    if arr.ndim == 1 and (arr.dtype.kind in "iub" or (arr.dtype.kind == "f" and not integer)):
        return arr
    for i, item in enumerate(value):  # slow path: only taken to name a bad element
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise BatchError(name, f"{name}[{i}] must be a number, got {item!r:.40}", i)
        if integer and isinstance(item, float):
            raise BatchError(name, f"{name}[{i}] = {item!r} must be an integer", i)
        if integer and not -(2**63) <= item < 2**63:
            raise BatchError(name, f"{name}[{i}] = {item} is outside int64", i)
    raise BatchError(name, f"{name} must be a flat list of numbers")


def _check_dtypes(arrays: dict[str, np.ndarray]) -> None:
    for name, arr in arrays.items():
        kind = arr.dtype.kind
        if name in FLOAT_FIELDS:
            ok = kind in "fiu"
            want = "numbers"
        elif name == "loss_mask":
            ok = kind in "iubf"  # float masks (verl's response_mask) are checked for 0/1 below
            want = "integers 0/1 or booleans"
        else:
            ok = kind in "iu"
            want = "integers"
        if not ok:
            if kind == "f" and name != "loss_mask":
                frac = arr != np.floor(arr)
                if frac.any():
                    i = first(frac)
                    raise BatchError(name, f"{name}[{i}] = {arr[i].item()!r} must be an integer", i)
            raise BatchError(name, f"{name} must hold {want}, got dtype {arr.dtype}")
        if kind in "iu" and name != "loss_mask":
            check_int_range(name, arr)


def _check_cu(cu: np.ndarray, n: int) -> None:
    if cu.shape[0] < 2:
        raise BatchError("cu_seqlens", "cu_seqlens needs at least 2 entries (n_seq + 1)")
    if cu[0] != 0:
        raise BatchError("cu_seqlens", f"cu_seqlens must start at 0, starts at {cu[0]}", 0)
    dec = cu[1:] < cu[:-1]
    if dec.any():
        i = first(dec) + 1
        raise BatchError(
            "cu_seqlens",
            f"cu_seqlens must be non-decreasing: cu_seqlens[{i}] = {cu[i]} < "
            f"cu_seqlens[{i - 1}] = {cu[i - 1]}",
            i,
        )
    if cu[-1] != n:
        raise BatchError(
            "cu_seqlens",
            f"cu_seqlens must end at {n} (the token count), ends at {cu[-1]}",
            cu.shape[0] - 1,
        )


def _impossible(mu: np.ndarray, pi: np.ndarray, mask: np.ndarray) -> tuple[int, np.ndarray | None]:
    """Positions where exactly one side gives the token probability 0 (a log-prob of -inf, the
    other finite): δ = ±∞, no ratio exists. They are taken out of the loss mask and out of
    every metric, not refused; the count is of those the batch had kept (``loss_mask`` = 1).
    Returns ``(count, positions)``, positions None when there are none."""
    if np.isfinite(mu).all() and np.isfinite(pi).all():
        return 0, None
    one = (np.isneginf(mu) & np.isfinite(pi)) | (np.isneginf(pi) & np.isfinite(mu))
    if not one.any():
        return 0, None
    return int(np.count_nonzero(one & (mask != 0))), one


def _validate(arrays: dict[str, np.ndarray], meta: dict[str, Any], nonfinite: str) -> Batch:
    for name in REQUIRED_FIELDS:
        if name not in arrays:
            raise BatchError(name, f"missing required field {name!r}")
    n = int(arrays["logp_rollout"].shape[0])
    if n == 0:
        raise BatchError("logp_rollout", "empty batch: logp_rollout has no tokens")
    _check_dtypes(arrays)
    for name in _TOKEN_FIELDS:
        if name in arrays and arrays[name].shape[0] != n:
            raise BatchError(
                name,
                f"{name} has {arrays[name].shape[0]} entries, expected {n} "
                "(the length of logp_rollout)",
            )
    cu = arrays["cu_seqlens"].astype(np.int64, copy=False)
    _check_cu(cu, n)
    mask = arrays["loss_mask"]
    if mask.dtype.kind != "b":
        bad = (mask != 0) & (mask != 1)
        if bad.any():
            i = first(bad)
            raise BatchError("loss_mask", f"loss_mask[{i}] = {mask[i]} is not 0 or 1", i)
    floats = {
        name: arrays[name] if arrays[name].dtype.kind == "f" else arrays[name].astype(np.float64)
        for name in FLOAT_FIELDS
        if name in arrays
    }
    impossible, one_sided = _impossible(floats["logp_rollout"], floats["logp_train"], mask)
    mask = mask.astype(np.uint8, copy=nonfinite == "drop" or one_sided is not None)
    where: dict[str, Any] = {}
    if one_sided is not None:
        at = np.flatnonzero(one_sided).astype(np.int64)
        where = {
            "impossible_at": at,
            "impossible_side": np.isneginf(floats["logp_train"][at]).astype(np.uint8),
            "impossible_mask": mask[at].copy(),
        }
        mask[one_sided] = 0
        for name in ("logp_rollout", "logp_train"):
            v = floats[name]  # the -inf side reads 0 (masked out: no metric reads it)
            floats[name] = np.where(one_sided & np.isneginf(v), 0.0, v).astype(v.dtype)
    dropped = 0
    if nonfinite == "drop":
        bad_any = np.zeros(n, dtype=bool)
        for arr in floats.values():
            bad_any |= ~np.isfinite(arr)
        dropped = int(bad_any.sum())
        if dropped:
            mask[bad_any] = 0
            floats = {k: np.where(bad_any, 0.0, v).astype(v.dtype) for k, v in floats.items()}
    elif nonfinite != "refuse":
        raise ValueError(f"nonfinite must be 'refuse' or 'drop', got {nonfinite!r}")
    keep = mask.view(np.bool_)
    for name, arr in floats.items():
        check_floats(name, arr)
        check_kept_bounds(name, arr, keep)
    for name in INT_FIELDS:
        if name in arrays and name != "versions" and arrays[name].min() < 0:
            i = first(arrays[name] < 0)
            raise BatchError(name, f"{name}[{i}] = {arrays[name][i]} is negative", i)
    ints = {
        name: arrays[name].astype(np.int64, copy=False) for name in INT_FIELDS if name in arrays
    }
    if "versions" in ints:
        check_lag(ints["versions"], meta.get("policy_version"))
    return Batch(
        cu_seqlens=cu,
        loss_mask=mask,
        nonfinite_tokens=dropped,
        impossible_tokens=impossible,
        **where,
        **floats,  # type: ignore[arg-type]
        **ints,  # type: ignore[arg-type]
        **meta,
    )
