"""What batch identity costs an ingest: `batch_digest` (the content digest every batch with a
``batch_id`` is stored and checked with) against `accumulate` (the metric kernel) on the same
batch, in one process, best of ``--repeat`` runs each. Prints milliseconds per batch, MB/s of
the batch's arrays as held in memory and the ratio digest / kernel. Bounded: a few seconds per size.

    python benchmarks/digest_cost.py [--tokens 65536,1048576] [--repeat 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_json  # noqa: E402

from tests.helpers.batches import random_batch  # noqa: E402
from timwatch.monitor.core.batch import Batch  # noqa: E402
from timwatch.monitor.core.digest import batch_digest  # noqa: E402
from timwatch.monitor.core.engine import accumulate  # noqa: E402


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def batch_of(tokens: int, seed: int = 0) -> Batch:
    """A random batch with every optional field and at least `tokens` tokens."""
    rng = np.random.default_rng(seed)
    n_seq = 16
    raw = random_batch(rng, n_seq=n_seq, optional="all")
    while raw.num_tokens < tokens:
        n_seq *= 2
        raw = random_batch(rng, n_seq=n_seq, optional="all")
    return Batch.from_safetensors(raw.to_safetensors_bytes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="65536,1048576", help="comma-separated batch sizes")
    ap.add_argument("--repeat", type=int, default=5)
    bench_json.add_argument(ap)
    args = ap.parse_args()
    rows: list[dict[str, object]] = []
    print(f"{'tokens':>9} {'digest ms':>10} {'MB/s':>7} {'kernel ms':>10} {'digest/kernel':>14}")
    for want in (int(t) for t in args.tokens.split(",")):
        batch = batch_of(want)
        accumulate(batch)  # compile and warm the kernels
        hashed = sum(
            np.asarray(getattr(batch, f)).nbytes
            for f in ("cu_seqlens", "logp_rollout", "logp_train", "entropy", "loss_mask",
                      "token_ids", "token_ids_train", "versions", "logp_old", "logp_teacher")
            if getattr(batch, f) is not None
        )  # fmt: skip
        d = best(lambda b=batch: batch_digest(b), args.repeat)
        k = best(lambda b=batch: accumulate(b), args.repeat)
        print(
            f"{batch.num_tokens:>9} {d * 1e3:>10.1f} {hashed / d / 1e6:>7.0f} {k * 1e3:>10.1f} "
            f"{d / k:>14.2f}"
        )
        rows.append(
            {
                "tokens": batch.num_tokens,
                "digest, ms": d * 1e3,
                "digest, MB/s": hashed / d / 1e6,
                "metric kernel, ms": k * 1e3,
                "digest / kernel": d / k,
            }
        )
    last = rows[-1]
    bench_json.write(
        args.json, "digest_cost",
        {f"digest of a {last['tokens']:,}-token batch, ms": last["digest, ms"]},
        {"digest / metric kernel, same batch": last["digest / kernel"]},
        rows, note=f"best of {args.repeat}; every optional field present",
    )  # fmt: skip


if __name__ == "__main__":
    main()
