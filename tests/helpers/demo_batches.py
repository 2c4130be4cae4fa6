"""The demo's real RL loop (`timwatch.sidecar.demo.train.DemoTrainer`) driven in process, each
step's batch written as a file instead of posted: ``ROOT/RUN/step-00000.safetensors`` (or
``.json``), the directory layout ``timwatch gate --batches`` reads. Nothing is injected: the
mismatch is the engine copy's precision against the fp32 trainer, as in ``timwatch demo``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from timwatch.monitor.core.batch import Batch
from timwatch.monitor.core.jsoncodec import dumps

__all__ = ["TINY", "write_demo_run"]

#: the smallest settings that still give every headline metric (tests/unit/test_compare_seeds)
TINY = {"batch": 8, "max_new_tokens": 16, "updates": 1, "lr": 3e-4, "threads": 1}


class _FileTap:
    def __init__(self, folder: Path, fmt: str) -> None:
        self.folder, self.fmt = folder, fmt

    def report(self, step: int, **arrays: Any) -> bool:
        meta = {k: arrays.pop(k) for k in ("policy_version", "batch_id") if k in arrays}
        batch = Batch.from_arrays(step=step, **meta, **arrays)
        name = self.folder / f"step-{step:05d}.{self.fmt}"
        if self.fmt == "safetensors":
            name.write_bytes(batch.to_safetensors())
        else:
            name.write_bytes(dumps(batch.to_json()))
        return True


def write_demo_run(
    root: Path, run: str, *, seed: int, steps: int, precision: str = "bf16", lag: int = 0,
    fmt: str = "safetensors", **settings: Any,
) -> Path:  # fmt: skip
    """Train ``steps`` demo steps and write their batches under ``root/run``; returns it."""
    from timwatch.sidecar.demo.train import DemoTrainer

    folder = root / run
    folder.mkdir(parents=True, exist_ok=True)
    trainer = DemoTrainer(precision=precision, lag=lag, seed=seed, **{**TINY, **settings})
    tap = _FileTap(folder, fmt)
    for step in range(steps):
        trainer.step(step, tap)
    return folder
