"""`proxy.native._cstream`, the stream reader's C code, against the numba code it mirrors
(`deltascan._scan_deltas`): answer for answer on generated streams, cut anywhere and with bytes
changed anywhere, and on hand-written cases whose answers are worked out here. (`test_deltascan.py`
runs all its tests on both too; `test_dechunk.py` compares the C de-chunker with llhttp.)"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.readers import require_c
from tests.unit.test_deltascan import _LOGPS, _TEXTS, _frame
from timwatch.sidecar.proxy.jsonbytes.numbers import POW5
from timwatch.sidecar.proxy.sglang import deltascan


@pytest.fixture(scope="module", autouse=True)
def _c_built() -> None:
    require_c()


def _c() -> Any:
    from timwatch.sidecar.proxy.native import _cstream  # type: ignore[attr-defined]

    return _cstream


def _numba_scan(buf: bytes, small: int) -> tuple[Any, ...]:
    return _plain(*deltascan.scan_deltas_numba(np.frombuffer(buf, np.uint8), small))


def _c_scan(buf: bytes, small: int) -> tuple[Any, ...]:
    """The C scan on arrays of exactly the size it may fill (not `deltascan`'s kept scratch
    arrays), so the sanitized build sees their bounds too."""
    n = len(buf)
    rows = np.empty((n // 64 + 2, 7), np.int64)
    ids, vals = np.empty(n // 10 + 1, np.int64), np.empty(n // 10 + 1, np.float64)
    r, used, count, stopped = _c().scan_deltas(buf, small, rows, ids, vals, POW5)
    if used < 0:
        return _plain(rows[:0], -1, ids[:0], vals[:0], False)
    return _plain(rows[:r], used, ids[:count], vals[:count], stopped)


def _plain(rows: Any, used: int, ids: Any, vals: Any, stopped: bool) -> tuple[Any, ...]:
    return rows.tolist(), int(used), ids.tolist(), vals.view(np.int64).tolist(), bool(stopped)


def test_a_hand_written_stream_reads_as_worked_out() -> None:
    """Three deltas and a last frame: one row for the three (start 0, end where the last frame
    starts, kind 1, index 0, total 3, count 3, at 0), their ids and log-probs as written."""
    frames = [_frame(1, 4, "a", "-0.5", 7), _frame(2, 4, "b", "-1e-05", 12)]
    frames += [_frame(3, 4, "c", "-3.0000000000000004", 345), _frame(4, 4, "d", "-2", 6)]
    raw = b"".join(frames)
    last = len(raw) - len(frames[3])
    rows, used, ids, bits, stopped = _c_scan(raw, 4096)
    assert (used, stopped, ids) == (last, True, [7, 12, 345])
    assert rows == [[0, last, 1, 0, 3, 3, 0]]
    want = [-0.5, -1e-05, -3.0000000000000004]
    assert bits == [struct.unpack("<q", struct.pack("<d", v))[0] for v in want]


_FRAMES = st.lists(
    st.tuples(
        st.sampled_from(_TEXTS + ["", "output_token_logprobs", "finish_reason"]),
        st.one_of(st.sampled_from(_LOGPS), st.floats(-1e6, 0.0).map(repr)),
        st.integers(0, 10**12),
        st.one_of(st.none(), st.none(), st.integers(0, 2)),  # a batch sample's "index"
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=300, deadline=None)
@given(_FRAMES, st.data())
def test_generated_streams_cut_and_changed_anywhere_read_as_numba_reads_them(
    frames: list[tuple[str, str, int, int | None]], data: st.DataObject
) -> None:
    n = len(frames)
    raw = b"".join(
        _frame(i + 1, n, t, lp, tid, index=idx) for i, (t, lp, tid, idx) in enumerate(frames)
    )
    start = data.draw(st.integers(0, len(raw)))
    cut = data.draw(st.integers(start, len(raw)))
    buf = bytearray(raw[start:cut])
    for _ in range(data.draw(st.integers(0, 3))):
        if buf:
            at = data.draw(st.integers(0, len(buf) - 1))
            buf[at] = data.draw(st.sampled_from(b'\n"{}[],:0123456789.-eEnfio_t '))
    small = data.draw(st.sampled_from([4096, 600, 64]))
    assert _c_scan(bytes(buf), small) == _numba_scan(bytes(buf), small)


def _c_dechunk(reads: list[bytes]) -> list[tuple[bytes, list[int]]]:
    state, out = np.zeros(5, np.int64), []
    for data in reads:
        out.append((_c().dechunk(data, state), state.tolist()))
    return out


def test_dechunk_by_hand() -> None:
    """``5\\r\\nhello\\r\\n3;x\\r\\nabc\\r\\n0\\r\\n\\r\\n`` in two reads cut after the
    second size's digit. State: (phase, left, digits, size line start from the next read,
    bytes relayable). First read (11 bytes): in a size (phase 0) of 3 so far, one digit, its
    line began 1 byte back; a size of 3 is not the last chunk, so all 11 may go. Second read
    (14 bytes): done (phase 10), its last chunk's size line at 9, 5 bytes back from the end,
    so 9 may go."""
    reads = [b"5\r\nhello\r\n3", b";x\r\nabc\r\n0\r\n\r\n"]
    assert _c_dechunk(reads) == [(b"hello", [0, 3, 1, -1, 11]), (b"abc", [10, 0, 1, -5, 9])]


@pytest.mark.parametrize(
    "bad",
    [
        ("scan", (b"x", 4096, np.empty((1, 7), np.int64), np.empty(0), np.empty(1), POW5)),
        ("scan", (b"x" * 100, 4096, np.empty((3, 7)), np.empty(11), np.empty(11), POW5[:2])),
        ("dechunk", (b"1\r\nx\r\n", np.zeros(4, np.int64))),
        ("dechunk", (b"1\r\nx\r\n", np.zeros(5, np.int64).tobytes())),
    ],
)
def test_arrays_too_small_or_read_only_are_refused_not_overrun(bad: tuple[str, Any]) -> None:
    name, args = bad
    fn = _c().scan_deltas if name == "scan" else _c().dechunk
    with pytest.raises((ValueError, TypeError)):
        fn(*args)
