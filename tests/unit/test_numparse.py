"""Compiled log-prob parsing (`proxy.jsonbytes.numbers`) against orjson, bit for bit, and the key
search that skips a scanned list (`fastwire` holes).

Every float orjson reads, `triples_f64` must read to the same bits, or refuse; it may refuse
only what it documents (subnormals, > 19 significant digits, out-of-range exponents) and must
refuse every token that is not strict JSON.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timwatch.sidecar.proxy.jsonbytes.numbers import POW5, triples_f64
from timwatch.sidecar.proxy.sglang import fastwire
from timwatch.sidecar.proxy.sglang.fastwire import FastSample, value_span

TINY = 2.2250738585072014e-308  # the smallest normal double


def _read(tokens: list[bytes]) -> tuple[int, int, np.ndarray, np.ndarray, bytes]:
    buf = b"[" + b",".join(b"[%s,%d,null]" % (t, i) for i, t in enumerate(tokens)) + b"]"
    count, end, ids, logps = triples_f64(np.frombuffer(buf, np.uint8), 0, POW5)
    return count, end, ids, logps, buf


def _bits(values: np.ndarray) -> list[int]:
    return values.view(np.int64).tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=40))
def test_every_double_reads_to_orjsons_bits_or_is_refused(values: list[float]) -> None:
    tokens = [orjson.dumps(v) for v in values]
    count, end, ids, logps, buf = _read(tokens)
    if any(0.0 < abs(v) < TINY for v in values):
        assert count == -1  # subnormal: orjson decides
        return
    assert (count, end) == (len(values), len(buf))
    assert ids.tolist() == list(range(len(values)))
    assert _bits(logps) == _bits(np.array([orjson.loads(t) for t in tokens], dtype=np.float64))


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
    + [b"12345678901234567890", b"0.1000000000000000000001", b"5e-324", b'"1"'],
)
def test_refuses_what_is_not_strict_json_or_not_exact_here(token: bytes) -> None:
    assert _read([token])[0] == -1


def test_refuses_other_triple_shapes() -> None:
    for buf in (b"[[-1.5,3]]", b'[[-1.5,3,"a"]]', b"[[-1.5,-3,null]]", b"[-1.5]", b"{}"):
        assert triples_f64(np.frombuffer(buf, np.uint8), 0, POW5)[0] == -1
    assert triples_f64(np.frombuffer(b"[]", np.uint8), 0, POW5)[:2] == (0, 2)


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
@pytest.mark.parametrize("logps", [[-0.5, -1.25, -3.0], [-0.5, 5e-324, -1.0]])
def test_answer_read_with_the_hole_equals_the_full_search(logps: list[float], prompt: bool) -> None:
    """A subnormal takes orjson's path; key searches that skip the log-prob list find what a
    search over the whole answer finds."""
    buf = _answer(logps, prompt)
    sample = FastSample()
    sample.take_answer(buf)
    hole = sample._hole_in(buf)
    assert hole is not None and buf[hole[0] : hole[1]].startswith(b"[[")
    for key in fastwire._BULK_KEYS + (b"output_token_logprobs_length", b"absent"):
        assert value_span(buf, key, hole=hole) == value_span(buf, key)
    record = sample.record(buf, fallback_prompt=[9], vocab_size=None)
    assert _bits(record.logp) == _bits(np.array(logps))
    assert record.output_ids.tolist() == [5, 6, 7]
    assert record.input_ids is not None
    assert record.input_ids.tolist() == ([1, 2, 3] if prompt else [9])
    assert (record.rid, record.finish_reason, record.runs) == ("r1", "length", (("default", 3),))
    assert sample._hole_in(bytes(bytearray(buf))) is None  # another buffer: searched whole


def test_warm_up_compiles_every_scanner_of_the_answer_path() -> None:
    """In a fresh interpreter, so nothing else compiled them first."""
    code = (
        "from timwatch.sidecar.proxy.jsonbytes import scan, numbers as numparse\n"
        "fns = (numparse.triples_f64, scan.scan_triples, scan.scan_rows, scan.scan_ints)\n"
        "assert not any(f.signatures for f in fns)\n"
        "numparse.warm_up()\n"
        "print([len(f.signatures) for f in fns])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[1, 1, 1, 1]"
