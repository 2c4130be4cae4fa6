"""Several proxies behind one router: a trainer report joins wherever its records were captured.

One proxy is one Python process on one core, so a busy node runs N of them behind a router
(HAProxy round robin, SGLang's router) that sends each ``/generate`` wherever it likes. Each
proxy holds only the records it captured. With ``--peer URL`` (repeatable; the proxy's own
``--listen`` address is skipped, so every proxy can be given the same list) the proxy that
receives a trainer report joins what it holds, then asks every peer at once, in one request
each, for the rest: ``POST /timwatch/v1/peer/take {"keys": [rid | token_ids, ...]}``. A peer
pops what it holds and answers the records (`encode_records`); the receiving proxy joins them
and forwards the report as one batch, as a single proxy would. What no reachable peer holds
stays pending, is asked for again on each sweep, and after ``--report-ttl`` is counted in
``unjoined_samples`` by the receiving proxy alone (once, not once per proxy).

A peer that is down or slower than ``--peer-timeout`` counts as holding nothing for that try
(``errors`` in `PeerClient.stats`); the report path never fails because of it. Records a peer
popped but whose answer never arrived are gone with the answer, and their samples end up in
``unjoined_samples``: counted, never silently dropped.

The take answer is safetensors (the batch wire format, ``application/octet-stream``): per
record ``j`` the tensors ``j.output_ids``, ``j.logp`` and, when present, ``j.input_ids``,
``j.entropy_lower``, ``j.entropy_tail``; the records' other fields as JSON in the metadata
under ``records``. It is read with `monitor.core.safetensors_codec`, which trusts no header.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from safetensors.numpy import save

from ....monitor.core.safetensors_codec import decode
from ..capture import CaptureStore
from ..records import RolloutRecord

__all__ = ["TAKE_PATH", "PeerClient", "decode_records", "encode_records", "take_records"]

log = logging.getLogger(__name__)

TAKE_PATH = "/timwatch/v1/peer/take"
_SCALARS = (
    "finish_reason",
    "weight_version",
    "entropy_source",
    "created",
    "engine",
    "sampling",
    "logprobs_mode",
)
_ARRAYS = (
    ("output_ids", "<i8"),
    ("logp", "<f8"),
    ("input_ids", "<i8"),
    ("entropy_lower", "<f8"),
    ("entropy_tail", "<f8"),
)


def encode_records(records: Sequence[tuple[int, RolloutRecord]]) -> bytes:
    """``(index in the request, record)`` pairs as the take answer's bytes."""
    heads: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    for j, (i, rec) in enumerate(records):
        heads.append({"i": i, "rid": rec.rid, "runs": rec.runs})
        heads[-1].update({k: getattr(rec, k) for k in _SCALARS})
        for name, dtype in _ARRAYS:
            if (arr := getattr(rec, name)) is not None:
                arrays[f"{j}.{name}"] = np.ascontiguousarray(arr, dtype)
    return bytes(save(arrays, metadata={"records": json.dumps(heads)}))


def decode_records(data: bytes) -> list[tuple[int, RolloutRecord]]:
    """Inverse of `encode_records`; raises ``ValueError`` on bytes it did not produce."""
    arrays, meta = decode(data)
    if "records" not in meta:
        raise ValueError("take answer: no records in its metadata")
    out: list[tuple[int, RolloutRecord]] = []
    for j, h in enumerate(json.loads(meta["records"])):
        own: dict[str, Any] = {name: arrays.pop(f"{j}.{name}", None) for name, _ in _ARRAYS}
        rec = RolloutRecord(
            rid=str(h["rid"]),
            runs=tuple((label, int(count)) for label, count in h["runs"]),
            **own,
            **{k: h[k] for k in _SCALARS},
        )
        out.append((int(h["i"]), rec))
    if arrays:
        raise ValueError(f"take answer has tensors of no record: {sorted(arrays)[:3]}")
    return out


def parse_keys(body: Any) -> list[str | list[int]]:
    """The ``keys`` of a take request; raises ``ValueError`` naming the first bad one."""
    keys = body.get("keys") if isinstance(body, dict) else None
    if not isinstance(keys, list):
        raise ValueError("keys must be a list of rids or token-id lists")
    for i, key in enumerate(keys):
        ok = (isinstance(key, str) and key) or (
            isinstance(key, list)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in key)
        )
        if not ok:
            raise ValueError(f"keys[{i}] must be a rid or a list of token ids")
    return keys


def take_records(
    capture: CaptureStore, keys: Sequence[str | list[int]]
) -> list[tuple[int, RolloutRecord]]:
    """Pop from ``capture`` every record one of ``keys`` names: (index of its key, record)."""
    out: list[tuple[int, RolloutRecord]] = []
    for i, key in enumerate(keys):
        rec = capture.pop_by_rid(key) if isinstance(key, str) else capture.pop_by_tokens(key)
        if rec is not None:
            out.append((i, rec))
    return out


def _address(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/").lower()


class PeerClient:
    """The `Joiner`'s ``peers``: asks every peer at once for the records of a key list.

    Returns ``({index: record}, surplus)``; a key two peers answered (equal token ids captured
    twice) keeps the first record, the others are surplus (the joiner stores them locally)."""

    def __init__(
        self, urls: Sequence[str], *, timeout_s: float = 5.0, self_url: str | None = None
    ) -> None:
        me = _address(self_url) if self_url else None
        self.urls = list(dict.fromkeys(u.rstrip("/") for u in urls if _address(u) != me))
        self.timeout_s = timeout_s
        # several reports (trainer ranks) may fan out at once: 4 takes in flight per peer
        self._pool = ThreadPoolExecutor(4 * max(1, len(self.urls)), thread_name_prefix="peer-take")
        self._lock = threading.Lock()
        self._stats = {u: {"requests": 0, "errors": 0, "taken": 0} for u in self.urls}
        self._last_error: dict[str, str] = {}

    def __call__(
        self, keys: list[str | list[int]]
    ) -> tuple[dict[int, RolloutRecord], list[RolloutRecord]]:
        found: dict[int, RolloutRecord] = {}
        surplus: list[RolloutRecord] = []
        if not keys or not self.urls:
            return found, surplus
        body = json.dumps({"keys": keys}).encode()
        for got in self._pool.map(lambda u: self._take(u, body), self.urls):
            for i, rec in got:
                if i in found or not 0 <= i < len(keys):
                    surplus.append(rec)
                else:
                    found[i] = rec
        return found, surplus

    def _take(self, url: str, body: bytes) -> list[tuple[int, RolloutRecord]]:
        try:
            got = decode_records(_post(url + TAKE_PATH, body, self.timeout_s))
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
            with self._lock:
                self._stats[url]["requests"] += 1
                self._stats[url]["errors"] += 1
                self._last_error[url] = f"{type(exc).__name__}: {exc}"[:200]
            log.warning("peer %s: take failed: %s", url, exc)
            return []
        with self._lock:
            self._stats[url]["requests"] += 1
            self._stats[url]["taken"] += len(got)
        return got

    def stats(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {u: {**s, "last_error": self._last_error.get(u)} for u, s in self._stats.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _post(url: str, body: bytes, timeout_s: float) -> bytes:
    """POST ``body`` as JSON to ``url`` on a connection of its own (a take is one request per
    trainer report, from a worker thread); the answer's body, or ``OSError`` unless 200."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"peer must be an http:// URL, got {url!r}")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    try:
        conn.request("POST", parts.path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise OSError(f"{resp.status} {resp.reason}")
    return data
