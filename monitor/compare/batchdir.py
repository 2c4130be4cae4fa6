"""A run read from a directory of batch files, with no service: ``DIR/RUN/*.json`` and
``*.safetensors``, each one body that ``POST /v1/runs/{run}/batches`` accepts.

The files are read in name order and merged into their steps exactly as the service does
(`accumulate`, then `Store.record_batch` into a throw-away SQLite file), so a run read here
has the same series as the same batches posted to a server; the `StepSeries` is then read
with `load_series`, as ``diagnose`` reads it. Errors are one `InputError` naming the file:
a missing run folder, a folder with no batch file, a truncated or invalid batch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ..core.batch import Batch
from ..core.engine import accumulate
from ..core.errors import BatchError, InputError
from ..core.masks import PolicyParams
from ..core.row import derive_row
from ..diagnosis import StepSeries, load_series
from ..store import Store

__all__ = ["SUFFIXES", "batch_files", "load_batch_dir", "read_batch"]

SUFFIXES = (".json", ".safetensors")


def batch_files(root: str | Path, run: str) -> list[Path]:
    """The batch files of ``run`` under ``root``, in name order; `InputError` when none."""
    folder = Path(root) / run
    if not folder.is_dir():
        raise InputError("run", f"unknown run {run!r}: no folder {folder}")
    files = sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_file())
    if not files:
        raise InputError("run", f"run {run!r}: no *.json or *.safetensors batch file in {folder}")
    return files


def read_batch(path: Path) -> Batch:
    """One batch file; `InputError` naming the file, the field and the index of a bad one."""
    data = path.read_bytes()
    try:
        if path.suffix == ".safetensors":
            return Batch.from_safetensors(data)
        return Batch.from_json_bytes(data)
    except BatchError as e:
        at = "" if e.index is None else f" at index {e.index}"
        raise InputError(e.field, f"batch file {path}: {e.field}{at}: {e}") from None


def load_batch_dir(
    root: str | Path, run: str, from_step: int | None = None, to_step: int | None = None
) -> StepSeries:
    """``run``'s series from the batch files of ``root/run`` (see the module)."""
    files = batch_files(root, run)
    params = PolicyParams()
    with tempfile.TemporaryDirectory(prefix="timwatch-batches-") as tmp:
        store = Store(f"sqlite:///{tmp}/runs.db", sqlite_synchronous="OFF")
        try:
            for path in files:
                batch = read_batch(path)
                acc = accumulate(batch, params)
                row = derive_row(acc).to_dict()

                def respond(step_row: dict[str, Any], row: dict[str, Any] = row) -> dict[str, Any]:
                    return {"row": row}

                store.record_batch(
                    run, step=batch.step, batch_id=batch.batch_id, acc=acc,
                    tokens=batch.num_tokens, respond=respond,
                )  # fmt: skip
            return load_series(store, run, from_step, to_step)
        finally:
            store.close()
