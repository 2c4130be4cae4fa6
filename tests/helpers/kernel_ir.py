"""Reference-count operations in the LLVM IR of the compiled workers, for
``tests/unit/test_kernel_refcounts.py``.

IR can be read only from code compiled in the process that reads it (code loaded from numba's
cache has none, and a worker called only from compiled code gets its signatures by being
compiled), so the reading is done by this module run as a script, in a fresh process:

    python -m tests.helpers.kernel_ir [--warm-up] [OUT]

It compiles every worker of `WORKERS` (with ``--warm-up``, first the warm-ups
``scripts/test.sh`` runs to fill numba's cache before the tests: the same compilation, read once
instead of done twice), then prints, or writes to ``OUT``, ``{name: {"nrt": bool, "ops": [count
per signature]}}``. A worker whose IR cannot be read (its code came from the cache: a module
without a function definition) is left out, so a reader knows to compile again with an empty
cache (``NUMBA_CACHE_DIR``).

A complete reading (every worker's IR) is also kept under `ir_key` in ``__pycache__`` next to
this file (`saved` / `save`): IR is a function of the workers' sources, the interpreter, numba,
llvmlite, the host CPU and numba's settings, and the key hashes all of them (every source file
of the folders the workers live in), so a saved reading is the one a fresh compilation of the
same tree gives; an edit anywhere in those folders reads the IR again.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import platform
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["REFOP", "WORKERS", "compile_workers", "complete", "ir_key", "read_ir", "save", "saved"]

ROOT = Path(__file__).resolve().parents[2]
_SAVED = Path(__file__).resolve().parent / "__pycache__"

WORKERS: list[tuple[str, str]] = [
    ("timwatch.monitor.core.kernels", "_vector_phase"),
    ("timwatch.monitor.core.kernels_walk", "walk_chunk"),
    ("timwatch.monitor.core.kernels_walk", "fold_fine"),
    ("timwatch.monitor.core.kernels_seq", "verl_segment"),
    ("timwatch.monitor.core.kernels_seq", "top_k"),
]
REFOP = re.compile(r"call void @NRT_(incref|decref)\b")


def compile_workers() -> None:
    """Call what compiles every worker of `WORKERS`: the engine in its float32 specialisation
    only (its float64 one is the same code; compiling both doubles the ~70 s this takes)."""
    from timwatch.monitor.core import engine

    n = 4
    f32 = np.full(n, -0.5, dtype=np.float32)
    tiny = engine.Batch.from_arrays(
        cu_seqlens=np.array([0, 2, n]), logp_rollout=f32, logp_train=f32 + np.float32(0.1),
        entropy=np.full(n, 0.3, dtype=np.float32), loss_mask=np.ones(n, dtype=np.uint8),
        versions=np.zeros(n, np.int64), policy_version=0, logp_old=np.full(n, -0.45),
    )  # fmt: skip
    engine.accumulate(tiny, threads=1)


def read_ir(workers: list[tuple[str, str]] = WORKERS) -> dict[str, dict[str, Any]]:
    """Each worker's ``nrt`` option and reference-count operations per signature (none: the
    worker was not compiled); a worker whose code came from the cache is left out."""
    out: dict[str, dict[str, Any]] = {}
    for module, name in workers:
        worker = getattr(importlib.import_module(module), name)
        with warnings.catch_warnings():
            # numba warns, and answers a module without code, for code loaded from its cache
            warnings.simplefilter("ignore")
            irs = [worker.inspect_llvm(sig) for sig in worker.signatures]
        if all("define " in ir for ir in irs):
            ops = [len(REFOP.findall(ir)) for ir in irs]
            out[name] = {"nrt": worker.targetoptions.get("_nrt", True), "ops": ops}
    return out


def toolchain() -> list[Any]:
    """What compiled code depends on besides its source: the Python, numba and llvmlite versions,
    the machine, the host CPU's name and features, and the ``NUMBA_*`` settings but the cache's
    (JSON-serialisable, for a cache key)."""
    import llvmlite
    import llvmlite.binding as llvm
    import numba

    settings = {
        k: v for k, v in os.environ.items() if k.startswith("NUMBA_") and k != "NUMBA_CACHE_DIR"
    }
    return [
        sys.version,
        platform.machine(),
        numba.__version__,
        llvmlite.__version__,
        llvm.get_host_cpu_name(),
        llvm.get_host_cpu_features().flatten(),
        sorted(settings.items()),
    ]


def ir_key(workers: list[tuple[str, str]] = WORKERS) -> str:
    """SHA-256 of what the workers' IR depends on: every ``.py`` file of the folders they live
    in (``monitor/core``, ``sidecar/proxy``, …) and this file, and the `toolchain`."""
    folders = sorted({ROOT.joinpath(*module.split(".")[1:3]) for module, _ in workers})
    files = sorted(f for folder in folders for f in folder.rglob("*.py")) + [Path(__file__)]
    h = hashlib.sha256()
    for f in files:
        data = f.read_bytes()
        h.update(f"{f.relative_to(ROOT)}\0{len(data)}\0".encode())
        h.update(data)
    h.update(json.dumps([*toolchain(), workers]).encode())
    return h.hexdigest()


def complete(result: dict[str, Any], workers: list[tuple[str, str]] = WORKERS) -> bool:
    """Whether `result` holds the IR of every worker."""
    return all(result.get(name, {}).get("ops") for _, name in workers)


def saved() -> dict[str, Any] | None:
    """The complete reading saved under the current `ir_key`, if there is one."""
    path = _SAVED / f"kernel_ir-{ir_key()}.json"
    try:
        result: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return result if complete(result) else None


def save(result: dict[str, Any]) -> None:
    """Keep a complete `result` under the current `ir_key` (atomically; others are removed)."""
    if not complete(result):
        return
    _SAVED.mkdir(exist_ok=True)
    name = f"kernel_ir-{ir_key()}.json"
    for old in _SAVED.glob("kernel_ir-*.json"):
        if old.name != name:
            old.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=_SAVED, prefix=".kernel_ir-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, _SAVED / name)


def main(argv: list[str]) -> None:
    warm = "--warm-up" in argv
    args = [a for a in argv if a != "--warm-up"]
    compile_workers()
    if warm:
        from timwatch.monitor.core.engine import warm_up

        warm_up()
    result = read_ir()
    save(result)
    text = json.dumps(result)
    if args:
        with open(args[0], "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
