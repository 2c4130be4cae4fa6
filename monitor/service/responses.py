"""What several routes answer with: the JSON response, bit-packed keep masks, metric names."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import TypedDict

import numpy as np
from fastapi.responses import Response

from ..core.jsoncodec import dumps

__all__ = ["EncodedMasks", "encode_masks", "json_response", "metric_column", "split_list"]


class EncodedMasks(TypedDict):
    """Keep masks on the wire: ``data[policy]`` is base64 of the little-endian packed bits."""

    n: int
    encoding: str
    data: dict[str, str]


def json_response(
    obj: object, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """`obj` encoded by `jsoncodec.dumps` (numpy arrays and NaN → ``null`` included)."""
    return Response(dumps(obj), status_code=status, media_type="application/json", headers=headers)


def metric_column(name: str) -> str:
    """``mask_ratio.estr`` / ``mask_ratio[estr]`` / ``mask_ratio_estr`` → ``mask_ratio_estr``."""
    n = name.strip()
    for prefix in ("mask_ratio", "seq_reject_ratio"):
        for open_, close in ((".", ""), ("[", "]"), ("{", "}")):
            if n.startswith(prefix + open_) and n.endswith(close):
                return f"{prefix}_{n[len(prefix) + 1 : len(n) - len(close)]}"
    return n


def encode_masks(masks: Mapping[str, np.ndarray], n: int) -> EncodedMasks:
    """Bit-pack keep masks: ``np.packbits(mask, bitorder="little")`` in base64."""
    return {
        "n": n,
        "encoding": "packbits-little-base64",
        "data": {
            name: base64.b64encode(
                np.packbits(np.asarray(m, bool), bitorder="little").tobytes()
            ).decode()
            for name, m in masks.items()
        },
    }


def split_list(value: str | None) -> list[str]:
    """A comma-separated query value → its non-empty, stripped items."""
    return [p.strip() for p in (value or "").split(",") if p.strip()]
