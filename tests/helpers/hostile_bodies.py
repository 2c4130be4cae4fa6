"""Hostile request bodies for the ingest API: one valid base batch (JSON and safetensors) and
every way to break it, each a `Case` naming the field the 4xx must name; plus the range-edge
bodies that must be accepted. Shared by the service's hostile-input tests.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

BIG = 2**63
BASE: dict[str, Any] = {
    "step": 4,
    "batch_id": "hostile-base",
    "policy_version": 9,
    "entropy_source": "trainer",
    "cu_seqlens": [0, 3, 5],
    "logp_rollout": [-0.11, -2.3, -0.02, -0.7, -1.2],
    "logp_train": [-0.12, -2.1, -0.02, -0.69, -1.25],
    "entropy": [0.4, 1.9, 0.05, 0.8, 1.1],
    "loss_mask": [0, 1, 1, 1, 1],
    "token_ids": [17, 29871, 13, 450, 1576],
    "token_ids_train": [17, 29871, 13, 450, 1576],
    "versions": [9, 9, 9, 8, 9],
}
ST_DTYPE = {"F64": "<f8", "I64": "<i8", "U64": "<u8", "F16": "<f2", "U8": "u1", "BOOL": "u1"}


@dataclass(frozen=True)
class Case:
    """One hostile request: the body, its content type, the field its refusal must name."""

    name: str
    body: bytes
    field: str | None
    ctype: str = "application/json"
    status: int = 422
    run: str = "hostile"


# ---- building bodies ---------------------------------------------------------------------


def js(**changes: Any) -> bytes:
    obj = copy.deepcopy(BASE)
    for k, v in changes.items():
        if v is DROP:
            obj.pop(k)
        else:
            obj[k] = v
    return json.dumps(obj).encode()


DROP = object()


def at(field: str, index: int, value: Any) -> list[Any]:
    values = list(BASE[field])
    values[index] = value
    return values


def raw_st(tensors: dict[str, tuple[str, list[int], bytes]], meta: dict[str, Any]) -> bytes:
    """A safetensors file written by hand: (dtype, shape, raw bytes) per tensor, so headers can
    lie about offsets, shapes and dtypes."""
    header: dict[str, Any] = {"__metadata__": meta} if meta else {}
    blob, pos = b"", 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        blob += data
        pos += len(data)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + blob


def st_tensors(**over: Any) -> dict[str, tuple[str, list[int], bytes]]:
    out = {}
    for name, values in BASE.items():
        if not isinstance(values, list):
            continue
        dtype = "F64" if name.startswith(("logp", "entropy")) else "I64"
        out[name] = (dtype, [len(values)], np.asarray(values, dtype=ST_DTYPE[dtype]).tobytes())
    for name, spec in over.items():
        if spec is DROP:
            out.pop(name)
        elif isinstance(spec, tuple) and len(spec) == 3:
            out[name] = spec
        else:
            dtype, values = spec
            with np.errstate(over="ignore"):  # F16 of -1e5 is -inf on purpose
                data = np.asarray(values).astype(ST_DTYPE[dtype]).tobytes()
            out[name] = (dtype, [len(values)], data)
    return out


def st_meta(**over: Any) -> dict[str, Any]:
    meta = {k: str(v) for k, v in BASE.items() if not isinstance(v, list)}
    meta.update(over)
    return meta


def st(meta: dict[str, Any] | None = None, **over: Any) -> bytes:
    return raw_st(st_tensors(**over), st_meta() if meta is None else meta)


def with_header(body: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body[8 + n :]


ST = "application/x-safetensors"


def both(name: str, field: str, json_body: bytes, st_body: bytes | None) -> list[Case]:
    cases = [Case(f"json-{name}", json_body, field)]
    if st_body is not None:
        cases.append(Case(f"st-{name}", st_body, field, ST))
    return cases


def _cases() -> list[Case]:
    c: list[Case] = []
    # framing and encoding
    c += [
        Case("json-empty-body", b"", "body"),
        Case("json-bom", b"\xef\xbb\xbf" + js(), "body"),
        Case("json-garbage", np.random.default_rng(1).bytes(64).replace(b"{", b"x"), "body"),
        Case("json-top-level-array", b"[1, 2, 3]", "body"),
        Case("json-deep-nesting", b"[" * 200_000 + b"]" * 200_000, "body"),
        Case(
            "json-deep-in-field", js()[:-1] + b', "logp_old": ' + b"[" * 50_000 + b"}", "logp_old"
        ),
        Case("json-deep-in-step", b'{"step": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001, "step"),
        Case("json-truncated", js()[:60], "body"),
        Case("json-trailing-data", js() + b" {}", "body"),
        Case("json-duplicate-key", js()[:-1] + b', "entropy": [1, 1, 1, 1, 1]}', "entropy"),
        Case(
            "json-invalid-utf8-batch-id",
            js(batch_id="X").replace(b'"X"', b'"\xff\xfe"'),
            "batch_id",
        ),
        Case("json-lone-surrogate", js(batch_id="X").replace(b'"X"', b'"\\ud800"'), "batch_id"),
        Case("json-unknown-field", js(logp_ref=[0.0] * 5), "logp_ref"),
        Case(
            "json-nan-literal", js(logp_rollout=at("logp_rollout", 2, float("nan"))), "logp_rollout"
        ),
        Case("json-infinity-literal", js(entropy=at("entropy", 1, float("inf"))), "entropy"),
        Case(
            "json-1e400",
            # +inf: -1e400 (-inf) on one side alone is an impossible token, accepted below
            js(logp_train=at("logp_train", 0, -0.123456)).replace(b"-0.123456", b"1e400"),
            "logp_train",
        ),
        Case("wrong-content-type", js(), None, "text/plain", 415),
        Case("st-empty-body", b"", "body", ST),
        Case("st-garbage", np.random.default_rng(2).bytes(64), "body", ST),
        Case("st-header-longer-than-body", struct.pack("<Q", 10**9) + st()[8:], "body", ST),
        Case("st-header-not-json", struct.pack("<Q", 4) + b"{{{{", "body", ST),
        Case("st-header-deep", struct.pack("<Q", 4000) + b"[" * 2000 + b"]" * 2000, "body", ST),
        Case("st-header-not-object", struct.pack("<Q", 2) + b"[]", "body", ST),
        Case("st-truncated", st()[:-7], "versions", ST),
        Case("st-bad-request-json-body", js(), "body", ST),
    ]
    # safetensors header lies
    good = st()

    def overlap(h: dict[str, Any]) -> None:
        h["logp_train"]["data_offsets"] = list(h["logp_rollout"]["data_offsets"])

    def neg_shape(h: dict[str, Any]) -> None:
        h["entropy"]["shape"] = [-5]

    def bad_size(h: dict[str, Any]) -> None:
        h["entropy"]["shape"] = [4]

    def two_d(h: dict[str, Any]) -> None:
        h["entropy"]["shape"] = [5, 1]

    def past_end(h: dict[str, Any]) -> None:
        h["versions"]["data_offsets"][1] += 800

    def dtype(name: str) -> Callable[[dict[str, Any]], None]:
        def edit(h: dict[str, Any]) -> None:
            h["logp_rollout"]["dtype"] = name

        return edit

    c += [
        Case("st-overlapping-offsets", with_header(good, overlap), "logp_train", ST),
        Case("st-negative-shape", with_header(good, neg_shape), "entropy", ST),
        Case("st-shape-times-dtype-not-bytes", with_header(good, bad_size), "entropy", ST),
        Case("st-two-dimensional", with_header(good, two_d), "entropy", ST),
        Case("st-offset-past-end", with_header(good, past_end), "versions", ST),
        Case("st-dtype-f8", with_header(good, dtype("F8_E4M3")), "logp_rollout", ST),
        Case("st-dtype-c64", with_header(good, dtype("C64")), "logp_rollout", ST),
        Case("st-dtype-not-a-string", with_header(good, dtype(7)), "logp_rollout", ST),  # type: ignore[arg-type]
        Case("st-bool-byte-2", st(loss_mask=("BOOL", [0, 1, 2, 1, 1])), "loss_mask", ST),
        Case("st-meta-not-strings", st(meta=st_meta(step=4)), "__metadata__", ST),
        Case("st-meta-key-nul", st(meta=st_meta(**{"st\x00ep": "1"})), "__metadata__", ST),
        Case("st-meta-unknown-key", st(meta=st_meta(color="red")), "color", ST),
        Case("st-unknown-tensor", st(logp_ref=("F64", [0.0] * 5)), "logp_ref", ST),
        # both sides -inf: δ is undefined (one side alone is an impossible token, accepted)
        Case(
            "st-f16-overflow-inf",
            st(logp_rollout=("F16", [-1e5] * 5), logp_train=("F16", [-1e5] * 5)),
            "logp_rollout",
            ST,
        ),
    ]
    # per-field types, required fields, lengths
    for name, values in BASE.items():
        if isinstance(values, list):
            c.append(Case(f"json-{name}-not-a-list", js(**{name: "abc"}), name))
            c.append(Case(f"json-{name}-object", js(**{name: {"a": 1}}), name))
    for name in ("cu_seqlens", "logp_rollout", "logp_train", "entropy", "loss_mask"):
        c += both(f"missing-{name}", name, js(**{name: DROP}), st(**{name: DROP}))
    c += both("entropy-short", "entropy", js(entropy=[0.4] * 4), st(entropy=("F64", [0.4] * 4)))
    c += both("token-ids-long", "token_ids", js(token_ids=[1] * 6), st(token_ids=("I64", [1] * 6)))
    empty = {k: [] for k, v in BASE.items() if isinstance(v, list)} | {"cu_seqlens": [0]}
    c += both(
        "empty-arrays",
        "logp_rollout",
        js(**empty),
        st(**{k: ("F64" if k.startswith(("logp", "ent")) else "I64", v) for k, v in empty.items()}),
    )
    c += [
        Case("json-string-element", js(logp_rollout=at("logp_rollout", 1, "x")), "logp_rollout"),
        Case("json-bool-token-id", js(token_ids=at("token_ids", 3, True)), "token_ids"),
        Case("json-null-entropy", js(entropy=at("entropy", 2, None)), "entropy"),
        Case("json-list-element", js(versions=at("versions", 0, [9])), "versions"),
    ]
    # cu_seqlens
    for label, cu in (
        ("start-1", [1, 3, 5]),
        ("decreasing", [0, 3, 2, 5]),
        ("end-short", [0, 3, 4]),
        ("single", [0]),
        ("negative", [0, -1, 5]),
        ("int64-max-plus-1", [0, BIG, 5]),
    ):
        st_cu = ("U64", cu) if label == "int64-max-plus-1" else ("I64", cu)
        c += both(f"cu-{label}", "cu_seqlens", js(cu_seqlens=cu), st(cu_seqlens=st_cu))
    c += both(
        "cu-float",
        "cu_seqlens",
        js(cu_seqlens=[0, 3.0, 5]),
        st(cu_seqlens=("F64", [0.0, 2.5, 5.0])),
    )
    # loss_mask values
    for label, v in (("two", 2), ("minus-one", -1), ("half", 0.5)):
        st_mask = ("F64", at("loss_mask", 2, v))
        c += both(
            f"mask-{label}", "loss_mask", js(loss_mask=at("loss_mask", 2, v)), st(loss_mask=st_mask)
        )
    # step / policy_version at every range edge
    for key in ("step", "policy_version"):
        for label, v in (
            ("minus-1", -1),
            ("2^63", BIG),
            ("2^64", 2**64),
            ("1e30", 1e30),
            ("fraction", 2.5),
            ("string", "3"),
            ("bool", True),
        ):
            st_value = str(v) if label not in ("string", "bool") else None
            st_body = st(meta=st_meta(**{key: st_value})) if st_value is not None else None
            c += both(f"{key}-{label}", key, js(**{key: v}), st_body)
    # integer arrays out of range
    c += both(
        "versions-2^63",
        "versions",
        js(versions=at("versions", 1, BIG)),
        st(versions=("U64", at("versions", 1, BIG))),
    )
    c += both("versions-below-int64", "versions", js(versions=at("versions", 1, -BIG - 1)), None)
    c += both(
        "versions-lag-overflow",
        "versions",
        js(versions=at("versions", 4, -BIG)),
        st(versions=("I64", at("versions", 4, -BIG))),
    )
    c += both(
        "token-ids-2^63",
        "token_ids",
        js(token_ids=at("token_ids", 0, BIG)),
        st(token_ids=("U64", at("token_ids", 0, BIG))),
    )
    c += both("token-ids-1e30", "token_ids", js(token_ids=at("token_ids", 0, 1e30)), None)
    c += both(
        "token-ids-fraction",
        "token_ids",
        js(token_ids=at("token_ids", 0, 2.5)),
        st(token_ids=("F64", at("token_ids", 0, 2.5))),
    )
    c += both(
        "token-ids-negative",
        "token_ids_train",
        js(token_ids_train=at("token_ids_train", 0, -1)),
        st(token_ids_train=("I64", at("token_ids_train", 0, -1))),
    )
    # text
    for label, v in (
        ("nul", "a\x00b"),
        ("unit-sep", "a\x1fb"),
        ("del", "a\x7f"),
        ("c1", "a\x85"),
        ("empty", ""),
        ("too-long", "x" * 257),
    ):
        c += both(f"batch-id-{label}", "batch_id", js(batch_id=v), st(meta=st_meta(batch_id=v)))
    c += both("batch-id-number", "batch_id", js(batch_id=5), None)
    c += both(
        "entropy-source-nul",
        "entropy_source",
        js(entropy_source="trainer\x00"),
        st(meta=st_meta(entropy_source="trainer\x00")),
    )
    c += both("entropy-source-unknown", "entropy_source", js(entropy_source="engine"), None)
    # float values and bounds on kept tokens
    for label, field, i, v in (
        ("positive-logp", "logp_train", 1, 0.5),
        ("logp-minus-1e308", "logp_rollout", 1, -1e308),
        ("logp-below-floor", "logp_old", 2, -100000.5),
        ("teacher-below-floor", "logp_teacher", 3, -1e6),
        ("entropy-negative", "entropy", 3, -0.1),
        ("entropy-1e308", "entropy", 1, 1e308),
        ("entropy-above-ceiling", "entropy", 4, 1000.5),
    ):
        base = BASE.get(field, BASE["logp_rollout"])
        values = list(base)
        values[i] = v
        c += both(label, field, js(**{field: values}), st(**{field: ("F64", values)}))
    # run ids
    for label, run in (
        ("nul", "a%00b"),
        ("dot-start", ".run"),
        ("too-long", "r" * 129),
        ("space", "a%20b"),
    ):
        c.append(Case(f"run-{label}", js(), "run", run=run))
    return c


CASES = _cases()
BF16_LOGP = (np.asarray(BASE["logp_rollout"], "<f4").view("<u4") >> 16).astype("<u2").tobytes()
ACCEPTED_EDGES: list[tuple[str, bytes, str]] = [
    ("step-int64-max", js(step=BIG - 1, batch_id=None), "application/json"),
    (
        "policy-version-int64-max",
        js(policy_version=BIG - 1, versions=[0] * 5, batch_id=None),
        "application/json",
    ),
    (
        "logp-at-floor",
        js(logp_rollout=at("logp_rollout", 1, -1e5), batch_id=None),
        "application/json",
    ),
    ("entropy-at-ceiling", js(entropy=at("entropy", 1, 1e3), batch_id=None), "application/json"),
    (
        "masked-padding",
        js(logp_rollout=at("logp_rollout", 0, -1e308), batch_id=None),
        "application/json",
    ),
    ("st-f16", st(meta=st_meta(batch_id="f16"), logp_rollout=("F16", BASE["logp_rollout"])), ST),
    ("st-bf16", st(meta=st_meta(batch_id="bf16"), logp_rollout=("BF16", [5], BF16_LOGP)), ST),
    ("st-u8-mask", st(meta=st_meta(batch_id="u8"), loss_mask=("U8", BASE["loss_mask"])), ST),
    (
        "json-minus-1e400-impossible",
        js(logp_train=at("logp_train", 2, -0.123456), batch_id=None).replace(
            b"-0.123456", b"-1e400"
        ),
        "application/json",
    ),
    # one side -inf (F16 overflow), the other finite: an impossible token, counted not refused
    (
        "st-f16-impossible-token",
        st(meta=st_meta(batch_id="imp"), logp_rollout=("F16", at("logp_rollout", 2, -1e5))),
        ST,
    ),
    ("st-bool-mask", st(meta=st_meta(batch_id="bool"), loss_mask=("BOOL", BASE["loss_mask"])), ST),
]
