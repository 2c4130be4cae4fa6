"""Exact rows of the engine on a fixed set of awkward batches, for the bit-identity test.

The fixture `tests/fixtures/engine_rows_<rev>.json` holds, for every batch of `parity_cases()`,
the metric row and the accumulator state of the engine at git revision <rev>, every float as
`float.hex()`, so a comparison is bit for bit. Regenerate it (or check it) with

    .venv/bin/python tests/helpers/engine_rows.py --rev e8c9d4d

which exports that revision with `git archive` into a temporary folder and runs this file there
in a subprocess with the exported tree first on `PYTHONPATH` (so `import timwatch` loads the old
engine), on the batches built by this checkout's `tests/helpers/batches.py`.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_REV = "e8c9d4d"
FIXTURE = ROOT / "tests" / "fixtures" / f"engine_rows_{FIXTURE_REV}.json"


def _batches_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "_parity_batches", Path(__file__).with_name("batches.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _bench_like(n_tokens: int, n_seq: int, seed: int, dtype: Any) -> dict[str, Any]:
    """The benchmark's batch law (benchmarks/metrics_throughput.py) at a smaller size."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=0.0, sigma=0.8, size=n_seq)
    lengths = np.maximum(1, np.round(lengths / lengths.sum() * n_tokens)).astype(np.int64)
    lengths[-1] += n_tokens - lengths.sum()
    cu = np.concatenate([[0], np.cumsum(lengths)])
    low = rng.random(n_tokens) < 0.7
    entropy = np.where(low, rng.exponential(0.003, n_tokens), rng.lognormal(-0.5, 1.0, n_tokens))
    mu = -np.abs(rng.normal(0.0, 1.0, n_tokens)) * np.minimum(entropy, 4.0) - 1e-5
    sigma = np.sqrt(2e-3 * (entropy + 0.01))
    pi = np.minimum(mu + rng.normal(0.0, 1.0, n_tokens) * sigma, 0.0)
    mask = np.ones(n_tokens, dtype=np.uint8)
    for s in np.flatnonzero(lengths > 64)[::3]:
        a = cu[s] + rng.integers(0, lengths[s] - 32)
        mask[a : a + 32] = 0
    return {
        "cu_seqlens": cu,
        "logp_rollout": mu.astype(dtype),
        "logp_train": pi.astype(dtype),
        "entropy": entropy.astype(dtype),
        "loss_mask": mask,
    }


def _edge_arrays() -> dict[str, Any]:
    """Empty sequences first, last and between; length-1 sequences; fully masked sequences;
    δ exactly 0, ±1e-2 (the series switch), ±20 (the clamp) and past it; −0.0 log-probs;
    zero and huge entropy; many equal scores (top-k ties)."""
    lengths = [0, 1, 0, 3, 1500, 0, 1, 7, 1100, 2, 0, 64, 1, 0]
    n = sum(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rng = np.random.default_rng(7)
    mu = -rng.exponential(1.0, n)
    d = np.full(n, 1e-3)  # equal δ and entropy: equal scores across most of the batch
    h = np.full(n, 0.25)
    special = [0.0, 1e-2, -1e-2, np.nextafter(1e-2, 0), 20.0, -20.0, 20.5, -35.0, 1e-300]
    pos = rng.choice(n, size=200, replace=False)
    d[pos] = np.resize(special, 200)
    h[pos[::7]] = 0.0
    h[pos[1::11]] = 40.0
    mu = mu - np.maximum(d, 0.0)
    pi = mu + d
    mu[pos[::13]] = -0.0
    pi[pos[::13]] = np.where(d[pos[::13]] == 0.0, -0.0, pi[pos[::13]])
    mask = np.ones(n, dtype=np.int64)
    mask[cu[8] : cu[9]] = 0  # one long fully masked sequence
    mask[cu[3] : cu[4]] = 0
    mask[rng.random(n) < 0.1] = 0
    return {"cu_seqlens": cu, "logp_rollout": mu, "logp_train": pi, "entropy": h, "loss_mask": mask}


def parity_cases() -> list[tuple[str, dict[str, Any], dict[str, Any], int, str]]:
    """(name, Batch.from_arrays keyword arguments, PolicyParams overrides, threads, source)."""
    bm = _batches_module()
    cases: list[tuple[str, dict[str, Any], dict[str, Any], int, str]] = []
    cases.append(("bench_f32", _bench_like(200_000, 400, 1, np.float32), {}, 1, "arrays"))
    cases.append(("bench_f64_2threads", _bench_like(300_000, 600, 2, np.float64), {}, 2, "arrays"))
    rng = np.random.default_rng(11)
    for i in range(6):
        raw = bm.random_batch(rng, n_seq=int(rng.integers(1, 60)), max_len=3000, long_prob=0.2)
        cases.append((f"random_{i}", raw.from_arrays_kwargs(), {}, 1, "arrays"))
    raw = bm.random_batch(rng, n_seq=40, max_len=2000, long_prob=0.3, optional="all")
    cases.append(("all_optional", raw.from_arrays_kwargs(), {}, 1, "arrays"))
    cases.append(("all_optional_json", raw.from_arrays_kwargs(), {}, 1, "json"))
    raw = bm.random_batch(rng, n_seq=30, max_len=2500, long_prob=0.3, optional="none")
    custom = {"tau": 0.5, "eps": 1e-3, "tis_c": 1.5, "icepop_low": 0.8, "icepop_high": 1.25}
    cases.append(("custom_params", raw.from_arrays_kwargs(), custom, 1, "arrays"))
    raw = bm.fp16_like_batch(np.random.default_rng(5), n_seq=40, max_len=3000)
    cases.append(("fp16", raw.from_arrays_kwargs(), {}, 1, "arrays"))
    for n in (1, 3, 5, 8, 1023, 1025):
        cases.append((f"tiny_{n}", _bench_like(n, 1, 100 + n, np.float64), {}, 1, "arrays"))
    cases.append(("edges", _edge_arrays(), {}, 1, "arrays"))
    fully = _edge_arrays()
    fully["loss_mask"] = np.zeros_like(fully["loss_mask"])
    cases.append(("fully_masked", fully, {}, 1, "arrays"))
    return cases


def hexify(value: Any) -> Any:
    """JSON-safe copy with every float as float.hex() (exact, and NaN/inf survive)."""
    if isinstance(value, dict):
        return {str(k): hexify(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [hexify(v) for v in value]
    if isinstance(value, np.ndarray):
        return hexify(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return "f:" + float(value).hex() if math.isfinite(value) else "f:" + str(float(value))
    return value


def current_rows() -> dict[str, Any]:
    """Row and accumulator state of the `timwatch` that is imported, for every parity case."""
    from timwatch.monitor.core.batch import Batch
    from timwatch.monitor.core.engine import accumulate
    from timwatch.monitor.core.masks import PolicyParams
    from timwatch.monitor.core.row import derive_row

    out: dict[str, Any] = {}
    for name, kwargs, overrides, threads, source in parity_cases():
        if source == "json":
            obj = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
            batch = Batch.from_json({k: v for k, v in obj.items() if v is not None})
        else:
            batch = Batch.from_arrays(**kwargs)
        acc = accumulate(batch, PolicyParams(**overrides), threads=threads)
        out[name] = {"row": hexify(derive_row(acc).to_dict()), "state": hexify(acc.to_state())}
    return out


def _rows_key(rev: str) -> str:
    """What `rows_at(rev)` depends on besides the revision's own code: this file and the
    `toolchain` (imported here, not at the top: this file also runs as a script in the old
    revision's tree)."""
    from tests.helpers.kernel_ir import toolchain

    parts = [rev, Path(__file__).read_text(encoding="utf-8"), *toolchain()]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def rows_at(rev: str) -> dict[str, Any]:
    """`current_rows()` computed by the engine of git revision `rev` (run in a subprocess, its
    numba compiling from scratch: ~11 s), kept in tests/helpers/__pycache__ under `_rows_key`
    (a revision's code never changes, so only the machine and toolchain can)."""
    saved = Path(__file__).resolve().parent / "__pycache__" / f"engine_rows-{_rows_key(rev)}.json"
    try:
        cached: dict[str, Any] = json.loads(saved.read_text(encoding="utf-8"))
        return cached
    except (OSError, ValueError):
        pass
    with tempfile.TemporaryDirectory(prefix="timwatch-rev-") as tmp:
        archive = Path(tmp) / "rev.tar"
        subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), rev],
            check=True,
        )
        tree = Path(tmp) / "tree"
        with tarfile.open(archive) as tar:
            tar.extractall(tree, filter="tar")
        env = {**os.environ, "PYTHONPATH": str(tree), "NUMBA_CACHE_DIR": str(Path(tmp) / "nc")}
        proc = subprocess.run(
            [sys.executable, __file__, "--emit"],
            env=env,
            check=False,
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"the engine at {rev} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    saved.parent.mkdir(exist_ok=True)
    tmp_path = saved.with_suffix(f".{os.getpid()}.tmp")
    tmp_path.write_text(proc.stdout, encoding="utf-8")
    os.replace(tmp_path, saved)  # atomic: two workers may write it at once
    return result


def fields_at(rev: str) -> dict[str, Any]:
    """What a row and an accumulator state held at git revision `rev`, read from that revision's
    own definitions (`git show`, parsed, not imported): the `MetricRow` and `Accumulator` fields,
    the lengths of the fsum/fext/cnt vectors (`layout.F/M/C.size`), the policy names and the
    `PolicyParams` fields."""

    def tree(path: str) -> ast.Module:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return ast.parse(text)

    def cls(mod: ast.Module, name: str) -> ast.ClassDef:
        return next(n for n in mod.body if isinstance(n, ast.ClassDef) and n.name == name)

    def annotated(mod: ast.Module, name: str) -> tuple[str, ...]:
        body = cls(mod, name).body
        return tuple(s.target.id for s in body if isinstance(s, ast.AnnAssign)
                     and isinstance(s.target, ast.Name))  # fmt: skip

    def constant(body: list[ast.stmt], name: str) -> Any:
        for s in body:
            if isinstance(s, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in s.targets
            ):
                return ast.literal_eval(s.value)
        raise KeyError(name)

    layout = tree("monitor/core/layout.py")
    masks = tree("monitor/core/masks.py")
    token = constant(masks.body, "TOKEN_POLICIES")
    sequence = constant(masks.body, "SEQUENCE_POLICIES")
    return {
        "row": annotated(tree("monitor/core/row.py"), "MetricRow"),
        "state": annotated(tree("monitor/core/accumulator.py"), "Accumulator"),
        "sizes": {
            v: constant(cls(layout, c).body, "size")
            for c, v in (("F", "fsum"), ("M", "fext"), ("C", "cnt"))
        },  # fmt: skip
        "policies": tuple(token) + tuple(sequence),
        "sequence_policies": tuple(sequence),
        "params": annotated(masks, "PolicyParams"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rev", default=FIXTURE_REV)
    ap.add_argument("--emit", action="store_true", help="print the imported engine's rows")
    args = ap.parse_args()
    if args.emit:
        import timwatch

        assert not str(Path(timwatch.__file__).resolve()).startswith(str(ROOT)), timwatch.__file__
        json.dump(current_rows(), sys.stdout)
        return
    rows = rows_at(args.rev)
    path = ROOT / "tests" / "fixtures" / f"engine_rows_{args.rev}.json"
    lines = [f"{json.dumps(k)}: {json.dumps(rows[k], sort_keys=True)}" for k in sorted(rows)]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one line per batch
    print(f"wrote {path.relative_to(ROOT)}: {len(rows)} batches")


if __name__ == "__main__":
    main()
