"""The batch content digest: equal content gives equal digests across wire formats and
dtypes; every change of a value, a field or the metadata changes it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.digest import DIGEST_CHARS, batch_digest


def _batch(n: int = 6, **over: object) -> Batch:
    rng = np.random.default_rng(0)
    fields: dict[str, object] = {
        "cu_seqlens": [0, 2, n],
        "logp_rollout": -rng.random(n).astype(np.float32),
        "logp_train": -rng.random(n).astype(np.float32),
        "entropy": rng.random(n).astype(np.float32),
        "loss_mask": np.ones(n, dtype=np.uint8),
        "token_ids": np.arange(n),
        "step": 3,
        "batch_id": "b",
    }
    fields.update(over)
    return Batch.from_arrays(**fields)  # type: ignore[arg-type]


def test_digest_is_hex_of_fixed_length() -> None:
    d = batch_digest(_batch())
    assert len(d) == DIGEST_CHARS and int(d, 16) >= 0


def test_json_safetensors_and_float64_agree() -> None:
    b = _batch()
    via_json = Batch.from_json(b.to_json())
    via_st = Batch.from_safetensors(b.to_safetensors())
    wide = _batch(logp_rollout=b.logp_rollout.astype(np.float64))
    assert batch_digest(b) == batch_digest(via_json) == batch_digest(via_st) == batch_digest(wide)


def test_batch_id_is_not_content() -> None:
    assert batch_digest(_batch(batch_id="x")) == batch_digest(_batch(batch_id="y"))


def test_metadata_and_fields_change_it() -> None:
    base = batch_digest(_batch())
    assert batch_digest(_batch(step=4)) != base
    assert batch_digest(_batch(policy_version=1)) != base
    assert batch_digest(_batch(entropy_source="rollout")) != base
    assert batch_digest(_batch(token_ids=None)) != base
    assert batch_digest(_batch(cu_seqlens=[0, 3, 6])) != base
    # the same values under another field name
    b = _batch()
    assert batch_digest(_batch(token_ids=None, token_ids_train=b.token_ids)) != base


def test_float64_not_representable_in_float32_is_kept_wide() -> None:
    b = _batch()
    x = b.logp_rollout.astype(np.float64)
    y = x.copy()
    y[0] = np.nextafter(y[0], -np.inf)  # differs only below float32 resolution
    assert batch_digest(_batch(logp_rollout=x)) != batch_digest(_batch(logp_rollout=y))


@settings(max_examples=200, deadline=None)
@given(
    i=st.integers(min_value=0, max_value=5),
    field=st.sampled_from(["logp_rollout", "logp_train", "entropy", "loss_mask", "token_ids"]),
)
def test_any_single_value_change_changes_it(i: int, field: str) -> None:
    b = _batch()
    arr = np.array(getattr(b, field), copy=True)
    if field == "loss_mask":
        arr[i] = 1 - arr[i]
    elif field == "token_ids":
        arr[i] = arr[i] + 1
    elif field == "entropy":
        arr[i] = arr[i] + np.float32(0.25)
    else:
        arr[i] = arr[i] - np.float32(0.25)
    assert batch_digest(_batch(**{field: arr})) != batch_digest(b)


def _reference_digest(b: Batch) -> str:
    """The tree hash written out plainly: chunk leaves, field nodes, the batch root."""
    import hashlib

    from timwatch.monitor.core.digest import CHUNK_BYTES

    root = hashlib.blake2b(digest_size=16)
    root.update(
        f"step={b.step};policy_version={b.policy_version};"
        f"entropy_source={b.entropy_source};".encode()
    )
    for name, arr in b.arrays().items():
        if name == "loss_mask":
            canon = arr.astype(np.uint8)
        elif arr.dtype.kind == "f":
            narrow = arr.astype(np.float32)
            canon = narrow if (narrow.astype(np.float64) == arr).all() else arr
        else:
            canon = arr.astype(np.int64)
        data = canon.tobytes()
        node = hashlib.blake2b(f"{name}:{canon.dtype.str}:{len(canon)};".encode(), digest_size=16)
        for i in range(0, max(len(data), 1), CHUNK_BYTES):
            node.update(hashlib.blake2b(data[i : i + CHUNK_BYTES], digest_size=16).digest())
        root.update(node.digest())
    return root.hexdigest()


def test_matches_the_plain_tree_hash_small_and_multi_chunk() -> None:
    rng = np.random.default_rng(5)
    n = 700_000  # float64 fields of 5.6 MB: two chunks each, hashed in the thread pool
    big = Batch.from_arrays(
        cu_seqlens=[0, n // 2, n],
        logp_rollout=-rng.random(n),
        logp_train=-rng.random(n),
        entropy=rng.random(n).astype(np.float32),
        loss_mask=np.ones(n, dtype=np.uint8),
        token_ids=rng.integers(0, 50_000, n),
        step=2,
    )
    assert batch_digest(big) == _reference_digest(big)
    assert batch_digest(_batch()) == _reference_digest(_batch())
    late = big.logp_rollout.copy()
    late[-1] -= 0.5  # in the second chunk of its field
    assert batch_digest(_batch_like(big, logp_rollout=late)) != batch_digest(big)


def _batch_like(b: Batch, **over: object) -> Batch:
    fields: dict[str, object] = {**b.arrays(), "step": b.step}
    fields.update(over)
    return Batch.from_arrays(**fields)  # type: ignore[arg-type]
