"""`proxy.native._cstream`, the proxies' C reader, against the orjson fallback: the delta scan
reads what orjson reads frame by frame, on generated streams cut anywhere and with bytes changed
anywhere; the whole capture gives the fallback's records and refusals; de-chunking gives the
same body however the bytes are cut; the structural walk's spans are the values orjson reads.
(`test_dechunk.py` compares the C de-chunker with llhttp.)
Hand-written cases have their answers worked out here."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.readers import reader, require_c
from tests.unit.test_deltascan import _LOGPS, _TEXTS, _captured, _frame, _stream
from timwatch.sidecar.proxy import native


@pytest.fixture(scope="module", autouse=True)
def _c_built() -> None:
    require_c()


def _c() -> Any:
    from timwatch.sidecar.proxy.native import _cstream  # type: ignore[attr-defined]

    return _cstream


def _bits(values: Any) -> list[int]:
    return np.asarray(values, dtype=np.float64).view(np.int64).tolist()


def _c_scan(buf: bytes, small: int) -> tuple[Any, ...]:
    """The C scan on arrays of exactly the size it may fill (not `native`'s kept scratch
    arrays), so the sanitized build sees their bounds too."""
    n = len(buf)
    rows = np.empty((n // 64 + 2, 7), np.int64)
    ids, vals = np.empty(n // 10 + 1, np.int64), np.empty(n // 10 + 1, np.float64)
    r, used, count, stopped = _c().scan_deltas(buf, small, rows, ids, vals, native.POW5)
    if used < 0:
        return [], -1, [], [], False
    return rows[:r].tolist(), int(used), ids[:count].tolist(), _bits(vals[:count]), bool(stopped)


def _orjson_deltas(buf: bytes) -> list[tuple[int, int, int]]:
    """(id, log-prob bits, total) of each frame of ``buf``, read by orjson; ValueError where a
    frame is not one unfinished one-token delta orjson reads."""
    out = []
    for frame in buf.split(b"\n\n")[:-1]:
        meta = orjson.loads(frame.removeprefix(b"data: "))["meta_info"]
        ((lp, tid, _),) = meta["output_token_logprobs"]
        if meta["finish_reason"] is not None or not isinstance(lp, (int, float)):
            raise ValueError("not an unfinished delta")
        out.append((tid, _bits([lp])[0], meta["output_token_logprobs_length"]))
    return out


def _agrees_with_orjson(buf: bytes, small: int) -> None:
    """Every frame the C scan takes is one orjson reads to the same id, log-prob bits and
    total, unless orjson refuses the frame (the scan reads only its keys and list); the rows
    tile the bytes taken; a frame it stops at is a complete frame."""
    rows, used, ids, bits, stopped = _c_scan(buf, small)
    if used <= 0:
        assert rows == [] and ids == []
        return
    assert rows[0][0] == 0 and rows[-1][1] == used
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False))
    assert sum(r[5] for r in rows) == len(ids) and [r[6] for r in rows][0] == 0
    if stopped:
        assert b"\n\n" in buf[used:]
    try:
        want = _orjson_deltas(buf[:used])
    except (ValueError, KeyError, TypeError, IndexError):
        return
    assert [(t, b) for t, b, _ in want] == list(zip(ids, bits, strict=True))
    ends = np.cumsum([r[5] for r in rows]) - 1
    assert [r[4] for r in rows] == [want[e][2] for e in ends]


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


def test_the_scan_reads_plain_deltas_and_stops_at_the_last_frame() -> None:
    raw = _stream(30)
    rows, used, ids, logps, stopped = native.scan_deltas(raw)
    last = raw.rindex(b"data: {")
    assert (used, stopped) == (last, True)
    assert rows.tolist() == [[0, last, 1, 0, 29, 29, 0]]  # one row for the 29 deltas
    want = _orjson_deltas(raw[:last])
    assert ids.tolist() == [w[0] for w in want]
    assert _bits(logps) == [w[1] for w in want]


@pytest.mark.parametrize(
    "raw",
    [
        b"".join(_frame(i, 9, "a", "-0.5", i, index=0) for i in range(1, 9)),  # a batch's chunks
        _stream(6).replace(b'"input_token_logprobs":[]', b'"output_top_logprobs":[[]]', 1),
        _stream(6).replace(b'"finish_reason":null', b'"finish_reason":null,"finish_reason":null'),
    ],
    ids=["index", "top-k", "key-twice"],
)
def test_reads_with_keys_it_does_not_read_are_declined(raw: bytes) -> None:
    """Every frame holds a key beyond the three the scan reads: none is taken."""
    rows, used, *_ = native.scan_deltas(raw)
    assert used <= 0 and not len(rows)


def test_a_frame_end_skipped_over_is_caught() -> None:
    """A frame far shorter than the one before: its end lies before where the search starts;
    the count of marks notices the merged frame, or the frames are read as they are."""
    long = _frame(1, 9, "x" * 900, "-1.5", 3)
    short = b"".join(_frame(i, 9, "", "-2.5", 4) for i in range(2, 6))
    raw = long + short
    rows, used, ids, _, _ = native.scan_deltas(raw)
    assert used == -1 or (used == len(raw) and len(ids) == 5)
    _agrees_with_orjson(raw, 4096)


def test_every_cut_of_a_stream_reads_as_orjson_reads_it() -> None:
    """A read ending at every byte of a 24-frame stream, starting at the first frames and the
    last: what the scan takes is what orjson reads, frame by frame."""
    raw = _stream(24)
    starts = [0] + [i + 2 for i in range(len(raw)) if raw.startswith(b"\n\n", i)][:-1]
    for start in starts[:3] + starts[-3:]:
        for cut in range(start, len(raw) + 1):
            _agrees_with_orjson(raw[start:cut], 4096)


_FLOAT_TOKENS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.integers(-(10**20), 10**20).map(str),
    st.tuples(st.integers(0, 10**18), st.integers(0, 40), st.booleans()).map(
        lambda t: f"{'-' if t[2] else ''}{t[0] // 10 ** t[1] if t[1] < 19 else 0}.{t[0]:0{t[1]}d}"
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_FLOAT_TOKENS, min_size=1, max_size=12))
def test_log_probs_in_streams_are_orjsons_floats_bit_for_bit(tokens: list[str]) -> None:
    tokens = [t.replace("inf", "1e400") for t in tokens]
    raw = b"".join(_frame(i + 1, 99, "t", tok, i) for i, tok in enumerate(tokens))
    _agrees_with_orjson(raw, 4096)
    _rows, used, *_ = native.scan_deltas(raw)
    if used == len(raw):  # every token taken: each is one orjson reads
        assert [float(t) for t in tokens] == [float(orjson.loads(t)) for t in tokens]


_FRAMES = st.lists(
    st.tuples(
        st.sampled_from(_TEXTS + ["", "output_token_logprobs", "finish_reason"]),
        st.one_of(st.sampled_from(_LOGPS + ["-5e-324", "-1.00000000000000000001"]),
                  st.floats(-1e6, 0.0).map(repr)),
        st.integers(0, 10**12),
    ),
    min_size=1,
    max_size=20,
)  # fmt: skip


def _generated(frames: list[tuple[str, str, int]]) -> bytes:
    n = len(frames)
    raw = b"".join(_frame(i + 1, n, t, lp, tid) for i, (t, lp, tid) in enumerate(frames))
    return raw + b"data: [DONE]\n\n"


@settings(max_examples=300, deadline=None)
@given(_FRAMES, st.data())
def test_generated_streams_cut_and_changed_anywhere_read_as_orjson_reads_them(
    frames: list[tuple[str, str, int]], data: st.DataObject
) -> None:
    raw = _generated(frames)
    start = data.draw(st.integers(0, len(raw)))
    cut = data.draw(st.integers(start, len(raw)))
    buf = bytearray(raw[start:cut])
    for _ in range(data.draw(st.integers(0, 3))):
        if buf:
            at = data.draw(st.integers(0, len(buf) - 1))
            buf[at] = data.draw(st.sampled_from(b'\n"{}[],:0123456789.-eEnfio_t '))
    _agrees_with_orjson(bytes(buf), data.draw(st.sampled_from([4096, 600, 64])))


def _frames_are_json(raw: bytes) -> bool:
    try:
        for frame in raw.split(b"\n\n")[:-1]:
            if frame.startswith(b"data: {"):
                orjson.loads(frame[6:])
    except orjson.JSONDecodeError:
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(_FRAMES, st.data())
def test_captures_on_both_readers_give_the_same_records_and_refusals(
    frames: list[tuple[str, str, int]], data: st.DataObject
) -> None:
    """A generated stream with digits changed anywhere (log-probs, ids, totals, weight-version
    spans: a number can become another, a negative id, a subnormal, or not JSON) and cut into
    reads anywhere, captured on the C reader and on the fallback: where every frame is still
    JSON, both refuse the sample (one wire error, nothing committed) or neither does, and the
    records are the same (ids and log-prob bits). (Where a change breaks a frame's JSON, the C
    scan, which reads only its keys and list, may still take it:
    `test_generated_streams_cut_and_changed_anywhere_read_as_orjson_reads_them` covers those.)"""
    buf = bytearray(_generated(frames))
    digits = [i for i, c in enumerate(buf) if 48 <= c <= 57]
    for _ in range(data.draw(st.integers(0, 2))):
        at = data.draw(st.sampled_from(digits))
        buf[at] = data.draw(st.sampled_from(b"0123456789-.eE"))
    raw = bytes(buf)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=4)))
    edges = [0, *cuts, len(raw)]
    reads = [raw[a:b] for a, b in zip(edges, edges[1:], strict=False)]
    with reader("c"):
        c_records, c_errors = _captured(reads)
    with reader("fallback"):
        f_records, f_errors = _captured(reads)
    if not _frames_are_json(raw):
        return
    assert c_errors == f_errors <= 1  # both refuse the sample once, or neither does
    assert [(r.output_ids.tolist(), _bits(r.logp)) for r in c_records] == [
        (r.output_ids.tolist(), _bits(r.logp)) for r in f_records
    ]


def _c_dechunk(reads: list[bytes]) -> tuple[bytes, int]:
    """The body the C pass gives for ``reads`` and its last phase (-1: an error)."""
    state, body = np.zeros(5, np.int64), []
    for data in reads:
        body.append(_c().dechunk(data, state))
        if state[0] == -1:
            break
    return b"".join(body), int(state[0])


def test_dechunk_by_hand() -> None:
    """``5\\r\\nhello\\r\\n3;x\\r\\nabc\\r\\n0\\r\\n\\r\\n`` in two reads cut after the
    second size's digit. State: (phase, left, digits, size line start from the next read,
    bytes relayable). First read (11 bytes): in a size (phase 0) of 3 so far, one digit, its
    line began 1 byte back; a size of 3 is not the last chunk, so all 11 may go. Second read
    (14 bytes): done (phase 10), its last chunk's size line at 9, 5 bytes back from the end,
    so 9 may go."""
    state, out = np.zeros(5, np.int64), []
    for data in (b"5\r\nhello\r\n3", b";x\r\nabc\r\n0\r\n\r\n"):
        out.append((_c().dechunk(data, state), state.tolist()))
    assert out == [(b"hello", [0, 3, 1, -1, 11]), (b"abc", [10, 0, 1, -5, 9])]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.binary(min_size=0, max_size=30), min_size=1, max_size=6),
    st.sampled_from([b"%x", b"%X", b"%x;ext=1", b"%04x"]),
    st.data(),
)
def test_chunked_bodies_cut_anywhere_give_their_data_and_changed_ones_the_same_answer(
    parts: list[bytes], size: bytes, data: st.DataObject
) -> None:
    """A chunked body cut into reads anywhere gives its chunks' data joined and ends done;
    with bytes changed, every cut gives what the whole body in one read gives (the body up to
    an error, and the error)."""
    wire = bytearray(b"".join((size % len(p)) + b"\r\n" + p + b"\r\n" for p in parts if p))
    wire += b"0\r\n\r\n"
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=4)))
    edges = [0, *cuts, len(wire)]

    def split(w: bytes) -> list[bytes]:
        return [w[a:b] for a, b in zip(edges, edges[1:], strict=False)]

    assert _c_dechunk(split(bytes(wire))) == (b"".join(parts), 10)
    for _ in range(data.draw(st.integers(1, 2))):
        at = data.draw(st.integers(0, len(wire) - 1))
        wire[at] = data.draw(st.sampled_from(b"\r\n0aF;x "))
    assert _c_dechunk(split(bytes(wire))) == _c_dechunk([bytes(wire)])


_JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _JSON, max_size=5), st.booleans(), st.data())
def test_walk_spans_are_the_values_orjson_reads(
    doc: dict[str, Any], spaced: bool, data: st.DataObject
) -> None:
    """Every row's span is a whole value orjson reads, its key the member's key, down to the
    depths asked; bytes changed anywhere give rows that are still whole values, or none."""
    raw = orjson.dumps(doc, option=orjson.OPT_INDENT_2 if spaced else 0)
    rows = native.walk(raw, 3, 3).tolist()
    assert rows and rows[0][4:6] == [raw.index(b"{"), len(raw.rstrip())]
    for parent, depth, ks, ke, vs, ve, index in rows[1:]:
        value = orjson.loads(raw[vs:ve])
        container = orjson.loads(raw[rows[parent][4] : rows[parent][5]])
        assert depth == rows[parent][1] + 1 <= 3
        if ks >= 0:
            assert container[orjson.loads(raw[ks - 1 : ke + 1])] == value
        else:
            assert container[index] == value
    bad = bytearray(raw)
    at = data.draw(st.integers(0, len(bad) - 1))
    bad[at] = data.draw(st.sampled_from(b'"{}[],:\\ x1'))
    for _parent, _depth, _ks, _ke, vs, ve, _index in native.walk(bytes(bad), 3, 3).tolist()[1:]:
        assert ve > vs


@pytest.mark.parametrize(
    "bad",
    [
        ("scan", (b"x", 4096, np.empty((1, 7), np.int64), np.empty(0), np.empty(1), native.POW5)),
        ("scan", (b"x" * 100, 4096, np.empty((3, 7)), np.empty(11), np.empty(11), native.POW5[:2])),
        ("triples", (b"[[-1.5,2,null]]", 0, np.empty(1, np.int64), np.empty(2), native.POW5)),
        ("triples", (b"[]", 3, np.empty(1, np.int64), np.empty(1), native.POW5)),
        ("triples", (b"[]", 0, np.empty(1, np.int64), np.empty(1), native.POW5.tobytes()[:8])),
        ("walk", (b"{}", 4, 2, np.empty((1, 7), np.int64).tobytes())),
        ("member_values", (b"[]", 3, b"logprob")),
        ("dechunk", (b"1\r\nx\r\n", np.zeros(4, np.int64))),
        ("dechunk", (b"1\r\nx\r\n", np.zeros(5, np.int64).tobytes())),
    ],
)
def test_arrays_too_small_or_read_only_are_refused_not_overrun(bad: tuple[str, Any]) -> None:
    name, args = bad
    fn = getattr(_c(), {"scan": "scan_deltas"}.get(name, name))
    with pytest.raises((ValueError, TypeError)):
        fn(*args)


def _vllm_answers(
    kind: str, stream: bool, versions: bool, asks: bool = False
) -> tuple[list[bytes], Any]:
    """Every answer or frame payload the vLLM stand-in writes for a client that asked for
    neither log-probs nor ids (with ``asks``, for one that asked for both), and the proxy's
    plan for that client. Written once, so both readers see the same bytes (the stand-in
    stamps ``created`` with the clock)."""
    import sys

    from tests.helpers.procs import REPO
    from timwatch.sidecar.proxy.vllm.edit import plan_request

    sys.path.insert(0, str(REPO / "benchmarks"))
    import vllm_standin as standin

    client: dict[str, Any] = {"max_tokens": 40, "stream": stream}
    if asks:
        client.update(logprobs=True if kind == "chat" else 0, return_token_ids=True)
    if kind == "generate":
        params = {"max_tokens": 40, **({"logprobs": 0} if asks else {})}
        client = {"token_ids": [1, 2], "sampling_params": params, "stream": stream}
    plan = plan_request(kind, client)
    assert plan is not None and plan.changed is not asks
    req = standin.Req(kind, plan.body, b"r1", versions)
    if not stream:
        return [standin.answer(req)], plan
    return [f[6:-2] for f in standin.frames(req) if f.startswith(b"data: {")], plan


def _vllm_parts(payloads: list[bytes], plan: Any) -> list[Any]:
    """What `edit_answer` gives for each payload: client JSON and each choice's fields."""
    from timwatch.sidecar.proxy.vllm.edit import edit_answer

    out = []
    for payload in payloads:
        client_bytes, parts, info = edit_answer(payload, plan)
        out.append(orjson.loads(client_bytes))
        out.append({k: v for k, v in info.items() if k != "prompt_token_ids"})
        for p in parts:
            prompt = None if p.prompt is None else p.prompt.tolist()
            out.append((p.index, p.ids.tolist(), _bits(p.logps), p.finish_reason, prompt))
            out.append((p.spans, p.version, p.bare))
    return out


@pytest.mark.parametrize("kind", ["completions", "chat", "generate"])
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_answers_edit_and_read_alike_on_both_readers(kind: str, stream: bool) -> None:
    """The C walk's in-place cuts and the fallback's answer written again are the same JSON;
    every choice's ids, log-prob bits, prompt and versions are the same."""
    payloads, plan = _vllm_answers(kind, stream, True)
    with reader("c"):
        c = _vllm_parts(payloads, plan)
    with reader("fallback"):
        f = _vllm_parts(payloads, plan)
    assert c == f and c


@pytest.mark.parametrize("kind", ["completions", "chat", "generate"])
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_answers_nothing_is_cut_from_read_alike_on_both_trees(
    kind: str, stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asked for log-probs and ids: on the C reader `tree_of` reads its answers
    under `SMALL_BYTES` (every stream chunk) with orjson; the walk's tree, forced, reads them
    the same, and on both the client's bytes are the upstream's (spaced after each comma, so
    an answer orjson wrote again would differ)."""
    from timwatch.sidecar.proxy.vllm import edit, tree

    compact, plan = _vllm_answers(kind, stream, True, asks=True)
    payloads = [p.replace(b',"', b', "') for p in compact]  # `,"` is never inside a string
    with reader("c"):
        for p in payloads:
            small = len(p) < tree.SMALL_BYTES
            assert isinstance(tree.tree_of(p, cut=False), tree.ObjectTree) is small
            assert isinstance(tree.tree_of(p, cut=True), tree.SpanTree)
        read = []
        for forced in (False, True):  # `tree_of`'s choice, then the walk's tree for every answer
            if forced:
                monkeypatch.setattr(edit, "tree_of", lambda buf, cut: tree.SpanTree(buf))
            read.append(_vllm_parts(payloads, plan))
            assert [edit.edit_answer(p, plan)[0] for p in payloads] == payloads
    assert read[0] == read[1] and read[0]
