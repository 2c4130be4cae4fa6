"""The C reader's log-prob parse (``csrc/numbers.h``, `native.triples`) against Python's
``float()`` and orjson, both correctly rounded, bit for bit, and the key search that skips a
read list (`fastwire` holes).

Every token it accepts must read to the bits ``float()`` gives. It must accept every strict JSON
number with at most 19 significant digits, an exponent of at most 4 digits and a normal or zero
result, and refuse what it documents (subnormal or infinite results, more than 19 significant
digits, longer exponents) and every token that is not strict JSON: the caller then takes orjson.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.readers import require_c
from timwatch.sidecar.proxy import native
from timwatch.sidecar.proxy.sglang import fastwire
from timwatch.sidecar.proxy.sglang.fastwire import value_span
from timwatch.sidecar.proxy.sglang.wire import SampleState

TINY = sys.float_info.min  # the smallest normal double
_JSON_NUMBER = re.compile(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


@pytest.fixture(scope="module", autouse=True)
def _c_built() -> None:
    require_c()


def _read(tokens: list[bytes]) -> tuple[int, int, np.ndarray, np.ndarray, bytes]:
    buf = b"[" + b",".join(b"[%s,%d,null]" % (t, i) for i, t in enumerate(tokens)) + b"]"
    count, end, ids, logps = native.triples(buf, 0)
    return count, end, ids, logps, buf


def _bits(values: np.ndarray) -> list[int]:
    return np.asarray(values, dtype=np.float64).view(np.int64).tolist()


def _must_accept(token: bytes) -> bool:
    """Strict JSON, at most 19 significant digits, an exponent of at most 4 digits, a normal
    double or a zero written as one."""
    m = _JSON_NUMBER.fullmatch(token)
    if m is None:
        return False
    mantissa = (m.group(1) + (m.group(2) or b"")[1:]).lstrip(b"0")
    exponent = (m.group(3) or b"e0")[1:].lstrip(b"+-")
    value = float(token)
    return (
        len(mantissa) <= 19
        and len(exponent) <= 4
        and (not mantissa or TINY <= abs(value) < float("inf"))
    )


def _check(tokens: list[bytes]) -> None:
    count, end, ids, logps, buf = _read(tokens)
    if count < 0:
        assert not all(_must_accept(t) for t in tokens), tokens
        return
    assert all(_JSON_NUMBER.fullmatch(t) for t in tokens)
    assert (count, end, ids.tolist()) == (len(tokens), len(buf), list(range(len(tokens))))
    # orjson reads "-0" as the int 0: +0.0, where float() gives -0.0
    want = [float(orjson.loads(t)) for t in tokens]
    assert want == [float(t) for t in tokens]
    assert _bits(logps) == _bits(np.array(want))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=40))
def test_every_double_reads_to_its_bits_or_is_refused_as_subnormal(values: list[float]) -> None:
    tokens = [orjson.dumps(v) for v in values]
    count = _read(tokens)[0]
    assert (count == -1) == any(0.0 < abs(v) < TINY for v in values)
    _check(tokens)


_DECIMALS = st.builds(
    lambda sign, digits, point, exp, exp_sign, e: (
        sign
        + (digits[:point] or "0").lstrip("0").rjust(1, "0")
        + ("." + digits[point:] if digits[point:] else "")
        + (f"{e}{exp_sign}{exp}" if exp is not None else "")
    ).encode(),
    st.sampled_from(["", "-"]),
    st.text("0123456789", min_size=1, max_size=26),
    st.integers(0, 26),
    st.one_of(st.none(), st.integers(0, 400), st.sampled_from([307, 308, 309, 322, 323, 324, 343])),
    st.sampled_from(["", "+", "-"]),
    st.sampled_from(["e", "E"]),
)  # fmt: skip


@settings(max_examples=1500, deadline=None)
@given(_DECIMALS)
def test_generated_decimals_read_as_float_reads_them(token: bytes) -> None:
    """Decimal strings of up to 26 digits (17+ digit mantissas, leading and trailing zeros) with
    exponents up to and past both ends of the range (normal, subnormal, overflowing)."""
    _check([token])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2**53), st.integers(-1074, 971))
def test_doubles_written_to_17_digits_near_the_range_edges(m: int, e2: int) -> None:
    value = float(m) * 2.0**e2 if -1022 <= e2 + m.bit_length() <= 1024 else 1.0
    for token in (b"%.17g" % value, b"%.16e" % value, repr(value).encode()):
        _check([token.replace(b"inf", b"1e400")])


def test_float32_log_probs_as_sglang_writes_them() -> None:
    rng = np.random.default_rng(7)
    values = (-np.abs(rng.standard_normal(50_000)) * 10.0 ** rng.integers(-12, 3, 50_000)).astype(
        np.float32
    )
    tokens = [orjson.dumps(float(v)) for v in values]
    count, _, _, logps, _ = _read(tokens)
    assert count == len(tokens)
    assert _bits(logps) == _bits(values.astype(np.float64))


@pytest.mark.parametrize(
    ("token", "value"),
    [
        (b"9007199254740993", 9007199254740992.0),  # a tie: rounds to even
        (b"9007199254740995", 9007199254740996.0),
        (b"-0", 0.0),  # orjson reads an int, so +0.0
        (b"-0.0", -0.0),
        (b"1E5", 1e5),
        (b"-1.5e+3", -1500.0),
        (b"1e-5", 1e-5),
        (b"0.000123", 0.000123),
        (b"1.7976931348623157e308", 1.7976931348623157e308),
        (b"2.2250738585072014e-308", TINY),
        (b"-0.10000000149011612", -0.10000000149011612),
        (b"1234567890123456789", 1234567890123456789.0),  # 19 digits: read
        (b"0.000000000000000000000000000001", 1e-30),  # leading zeros are not significant
    ],
)
def test_hand_picked_tokens(token: bytes, value: float) -> None:
    count, _, _, logps, _ = _read([token])
    assert count == 1
    assert _bits(logps) == _bits(np.array([value]))
    assert _bits(logps) == _bits(np.array([float(orjson.loads(token))]))


@pytest.mark.parametrize(
    "token",
    [b"01", b"1.", b".5", b"-", b"1e", b"1e+", b"--1", b"+1", b"NaN", b"1.0e99999", b"1e400"]
    + [b"12345678901234567890", b"0.1000000000000000000001", b"5e-324", b'"1"', b"1e-400"],
)
def test_refuses_what_is_not_strict_json_or_not_exact_here(token: bytes) -> None:
    assert _read([token])[0] == -1


def test_refuses_other_triple_shapes() -> None:
    for buf in (b"[[-1.5,3]]", b'[[-1.5,3,"a"]]', b"[[-1.5,-3,null]]", b"[-1.5]", b"{}"):
        assert native.triples(buf, 0)[0] == -1
    assert native.triples(b"[]", 0)[:2] == (0, 2)
    assert native.triples(b'{"k":[[-2.5,7,null]]}', 5)[:2] == (1, 20)


def _answer(logps: list[float], prompt: bool) -> bytes:
    triples = ",".join(f"[{orjson.dumps(v).decode()},{i + 5},null]" for i, v in enumerate(logps))
    return (
        b'{"text":"ab","output_ids":[%s],"meta_info":{"id":"r1","finish_reason":'
        b'{"type":"length","length":%d},"weight_version":"default",'
        b'"input_token_logprobs":[],"output_token_logprobs":[%s],'
        b'"output_token_logprobs_length":%d,"weight_versions":[{"version":"default",'
        b'"start":0,"end":%d}]}%s}'
        % (
            ",".join(str(i + 5) for i in range(len(logps))).encode(),
            len(logps),
            triples.encode(),
            len(logps),
            len(logps),
            b',"prompt_token_ids":[1,2,3]' if prompt else b"",
        )
    )


@pytest.mark.parametrize("prompt", [True, False])
def test_answer_read_with_the_hole_equals_the_full_search(prompt: bool) -> None:
    """Key searches that skip the log-prob list find what a search over the whole answer
    finds."""
    logps = [-0.5, -1.25, -3.0]
    buf = _answer(logps, prompt)
    chunk, hole = fastwire.read_bytes(buf)
    assert hole is not None and buf[hole[0] : hole[1]].startswith(b"[[")
    for key in fastwire._BULK_KEYS + (b"output_token_logprobs_length", b"absent"):
        assert value_span(buf, key, hole=hole) == value_span(buf, key)
    sample = SampleState()
    sample.add(chunk, stream=False)
    meta = fastwire.small_meta(buf, hole)
    assert meta == fastwire.small_meta(buf)
    record = sample.record(meta, fallback_prompt=[9], vocab_size=None)
    assert _bits(record.logp) == _bits(np.array(logps))
    assert record.output_ids.tolist() == [5, 6, 7]
    assert record.input_ids is not None
    assert record.input_ids.tolist() == ([1, 2, 3] if prompt else [9])
    assert (record.rid, record.finish_reason, record.runs) == ("r1", "length", (("default", 3),))


def test_an_answer_with_a_subnormal_is_refused_for_the_object_path() -> None:
    with pytest.raises(fastwire.NotFast):
        fastwire.read_bytes(_answer([-0.5, 5e-324, -1.0], True))
