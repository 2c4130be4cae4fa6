"""The bounded-memory JSON batch scanner agrees with orjson bit for bit, across chunk
boundaries, and refuses what a batch never holds by field and index."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timwatch.monitor.core import jsonscan
from timwatch.monitor.core.errors import BatchError
from timwatch.monitor.core.jsonscan import scan_batch

floats = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1e-308, 1.7976931348623157e308, 1e22]
)
ints = st.integers(-(2**63), 2**63 - 1)
spaces = st.sampled_from(["", " ", "\n", "\t ", " \r\n "])


def _dump(values: list[Any], sep: str, style: int) -> str:
    if style == 0:  # compact, as orjson writes (orjson itself refuses ints beyond 64 bits)
        return json.dumps(values, separators=(",", ":"))
    if style == 1:
        return json.dumps(values)
    return "[" + sep + ("," + sep).join(repr(v) for v in values) + sep + "]"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.lists(floats | ints.map(float) | st.integers(-(10**30), 10**30), max_size=60),
    sep=spaces,
    style=st.integers(0, 2),
    chunk=st.sampled_from([8, 33, 1 << 20]),
)
def test_floats_equal_orjson_bit_for_bit(
    values: list[Any], sep: str, style: int, chunk: int
) -> None:
    text = _dump(values, sep, style)
    old = jsonscan.CHUNK
    jsonscan.CHUNK = chunk
    try:
        got = scan_batch(f'{{"logp_rollout": {text}}}'.encode())
    finally:
        jsonscan.CHUNK = old
    want = np.array(orjson.loads(text), dtype=np.float64)
    assert np.array_equal(got["logp_rollout"].view(np.int64), want.view(np.int64))


@settings(max_examples=100, deadline=None)
@given(values=st.lists(ints, max_size=40), sep=spaces, chunk=st.sampled_from([5, 64, 1 << 20]))
def test_ints_exact(values: list[int], sep: str, chunk: int) -> None:
    text = "[" + sep + ("," + sep).join(map(str, values)) + sep + "]"
    old = jsonscan.CHUNK
    jsonscan.CHUNK = chunk
    try:
        got = scan_batch(f'{{"token_ids":{text}}}'.encode())["token_ids"]
    finally:
        jsonscan.CHUNK = old
    assert got.dtype == np.int64 and got.tolist() == values


def test_metadata_and_nulls() -> None:
    out = scan_batch(b' {"step": 3, "batch_id": "a\\u00e9", "versions": null, "entropy": []} ')
    assert out["step"] == 3 and out["batch_id"] == "a\u00e9" and "versions" not in out
    assert out["entropy"].shape == (0,)
    nan = scan_batch(b'{"entropy": [1, NaN, -Infinity]}')["entropy"]
    assert np.isnan(nan[1]) and nan[2] == -np.inf


@pytest.mark.parametrize(
    ("body", "field", "index"),
    [
        (b"", "body", None),
        (b"\xef\xbb\xbf{}", "body", None),
        (b"[1]", "body", None),
        (b"{} x", "body", None),
        (b'{"step": 1,}', "body", None),
        (b'{"step": 1 "x": 2}', "body", None),
        (b'{"bogus": 1}', "bogus", None),
        (b'{"step": 1, "step": 2}', "step", None),
        (b'{"step": [[[[1]]]]}', "step", None),
        (b'{"logp_rollout": [1, [2]]}', "logp_rollout", 1),
        (b'{"logp_rollout": [1, "x"]}', "logp_rollout", 1),
        (b'{"logp_rollout": [1, true]}', "logp_rollout", 1),
        (b'{"logp_rollout": [1, null]}', "logp_rollout", 1),
        (b'{"logp_rollout": [1,,2]}', "logp_rollout", 1),
        (b'{"logp_rollout": [1, 2,]}', "logp_rollout", 2),
        (b'{"logp_rollout": [+1]}', "logp_rollout", 0),
        (b'{"logp_rollout": 5}', "logp_rollout", None),
        (b'{"logp_rollout": {"a": 1}}', "logp_rollout", None),
        (b'{"logp_rollout": [1, 2', "logp_rollout", None),
        (b'{"token_ids": [1, 2.5]}', "token_ids", 1),
        (b'{"token_ids": [1, 1e30]}', "token_ids", 1),
        (b'{"versions": [0, 9223372036854775808]}', "versions", 1),
        (b'{"versions": [0, -9223372036854775809]}', "versions", 1),
        (b'{"cu_seqlens": [0, 123456789012345678901234567890]}', "cu_seqlens", 1),
        (b'{"batch_id": "\xff"}', "batch_id", None),
        (b'{"batch_id": "\\ud800"}', "batch_id", None),
        (b'{"entropy_source": "abc}', "body", None),
        (b"[" * 100_000, "body", None),
        (b'{"logp_rollout":' + b"[" * 100_000, "logp_rollout", None),
    ],
)
def test_refusals_name_field_and_index(body: bytes, field: str, index: int | None) -> None:
    with pytest.raises(BatchError) as info:
        scan_batch(body)
    assert info.value.field == field, str(info.value)
    assert info.value.index == index, str(info.value)


_BODY = json.dumps(
    {
        "step": 3, "batch_id": "b-1", "policy_version": 4, "entropy_source": "topk",
        "cu_seqlens": [0, 2, 5], "logp_rollout": [-0.5, -1.25, -2.0, -0.125, -3.0],
        "logp_train": [-0.5, -1.0, -2.5, -0.25, -3.5], "entropy": [0.5, 1.0, 0.0, 2.0, 1e-3],
        "loss_mask": [1, 1, 0, 1, 1], "token_ids": [5, 6, 7, 8, 9], "versions": [4, 4, 3, 4, 4],
    }
).encode()  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    pos=st.integers(0, len(_BODY) - 1),
    byte=st.sampled_from(list(b'[]{}",:-+.eE0123456789 \x00\xff\\tnNI')),
    cut=st.integers(0, 40),
    insert=st.booleans(),
)
def test_mutated_bodies_give_a_batch_or_a_batch_error(
    pos: int, byte: int, cut: int, insert: bool
) -> None:
    from timwatch.monitor.core.batch import Batch

    data = bytearray(_BODY)
    if insert:
        data.insert(pos, byte)
    else:
        data[pos] = byte
    data = data[: len(data) - cut]
    try:
        batch = Batch.from_json_bytes(bytes(data))
    except BatchError as err:
        assert err.field and str(err)
    else:  # what the scanner accepts, the standard parser reads the same way
        want = Batch.from_json(json.loads(bytes(data)))
        for name, arr in want.arrays().items():
            assert np.array_equal(batch.arrays()[name], arr)
        assert batch.metadata() == want.metadata()
