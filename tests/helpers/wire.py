"""What the API tests send and read: batches in both wire formats, one-trip JSON normalisation,
the samples of a text exposition, and run ids unique to one test (for a shared server)."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import httpx
import numpy as np

from tests.helpers.batches import RawBatch, random_batch
from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.jsoncodec import dumps, loads

__all__ = ["SAFETENSORS", "as_batch", "counters", "fresh_run", "norm", "post", "raw_batch"]

SAFETENSORS = {"Content-Type": "application/x-safetensors"}


def norm(obj: Any) -> Any:
    """What a dict looks like after one trip through the wire."""
    return loads(dumps(obj))


def raw_batch(seed: int, *, step: int = 1, batch_id: str | None = "b", n_seq: int = 12) -> RawBatch:
    """A random batch with every optional field, at `step` under `batch_id`."""
    raw = random_batch(np.random.default_rng(seed), n_seq=n_seq, optional="all")
    return dataclasses.replace(raw, step=step, batch_id=batch_id)


def as_batch(raw: RawBatch) -> Batch:
    return Batch.from_arrays(**raw.from_arrays_kwargs())


def post(c: httpx.Client, run: str, raw: RawBatch, fmt: str = "json", **params: Any) -> Any:
    """POST `raw` to ``/v1/runs/RUN/batches`` as JSON or safetensors."""
    if fmt == "json":
        return c.post(f"/v1/runs/{run}/batches", content=dumps(raw.to_json_obj()), params=params)
    return c.post(
        f"/v1/runs/{run}/batches",
        content=raw.to_safetensors_bytes(),
        params=params,
        headers=SAFETENSORS,
    )


def counters(text: str) -> dict[str, float]:
    """Sample name + sorted labels → value of a text exposition (``name{k=v,...}``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def fresh_run(prefix: str) -> str:
    """A run id no other test (nor a rerun of this one) uses: ``PREFIX-<8 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
