"""The compiled loops over bytes and tokens hold no reference-count operation.

numba wraps every array in a reference-counted structure; a loop that passes an array to an
inlined helper (``byte_at(buf, i)``, ``_matches(buf, ...)``) may increment and decrement that
count, an atomic operation, on every call. Measured on this project's scanners: with those
operations `scan_deltas` took 4.4 ms per 4,096-token incremental stream and `triples_f64` 1.26
ms per 4,096-token answer; without them 1.5 ms and 0.29 ms (numba 0.65). The loops therefore
run in workers compiled with ``_nrt=False`` (allocation stays in thin wrappers), and this test
compiles each worker again, uncached, and reads its LLVM IR: a change that brings reference
counting back into a loop (a worker that allocates, or loses the option) fails here, not only
in a benchmark.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import numba
import numpy as np
import pytest

from timwatch.sidecar.proxy import scan

WORKERS: list[tuple[str, str]] = [
    ("timwatch.sidecar.proxy.deltascan", "_walk"),
    ("timwatch.sidecar.proxy.deltascan", "_marks"),
    ("timwatch.sidecar.proxy.deltascan", "_learn"),
    ("timwatch.sidecar.proxy.numparse", "triples_into"),
    ("timwatch.sidecar.proxy.scan", "_list_of_triples"),
    ("timwatch.sidecar.proxy.scan", "_rows_into"),
    ("timwatch.sidecar.proxy.scan", "_ints_into"),
    ("timwatch.sidecar.proxy.scan", "_mark_flags"),
    ("timwatch.sidecar.proxy.scan", "_frames_into"),
    ("timwatch.sidecar.proxy.jsonspan", "_walk_into"),
    ("timwatch.sidecar.proxy.jsonspan", "_member_numbers_into"),
    ("timwatch.sidecar.proxy.dechunk", "_dechunk"),
    ("timwatch.monitor.core.kernels", "_vector_phase"),
    ("timwatch.monitor.core.kernels_walk", "walk_chunk"),
    ("timwatch.monitor.core.kernels_walk", "fold_fine"),
    ("timwatch.monitor.core.kernels_seq", "verl_segment"),
    ("timwatch.monitor.core.kernels_seq", "top_k"),
]
_REFOP = re.compile(r"call void @NRT_(incref|decref)\b")

# Run in a subprocess with an empty numba cache: code loaded from the cache has no IR to read,
# and a worker called only from compiled code gets its signatures by being compiled.
_PROBE = """
import importlib, json, re, sys
import numpy as np
from timwatch.monitor.core import engine
from timwatch.sidecar.proxy import dechunk, deltascan, jsonspan, scan
deltascan.warm_up()
# the engine's float32 specialisation only (its float64 one is the same code; compiling both
# doubled this test's ~70 s of compilation)
n = 4
f32 = lambda v: np.full(n, v, dtype=np.float32)
tiny = engine.Batch.from_arrays(
    cu_seqlens=np.array([0, 2, n]), logp_rollout=f32(-0.5), logp_train=f32(-0.4),
    entropy=f32(0.3), loss_mask=np.ones(n, dtype=np.uint8), versions=np.zeros(n, np.int64),
    policy_version=0, logp_old=np.full(n, -0.45),
)
engine.accumulate(tiny, threads=1)
dechunk.Dechunker().feed(b"3\\r\\nabc\\r\\n0\\r\\n\\r\\n")
doc = jsonspan.u8(b'{"a":[{"k":1},{"k":2.5}],"b":"x"}')
jsonspan.walk(doc, 8, 8)
jsonspan.member_numbers(doc, 5, np.frombuffer(b"k", np.uint8).copy())
scan.scan_rows(np.frombuffer(b"[[[-1.5,2,null]]]", np.uint8), 0)
refop = re.compile(sys.argv[1])
out = {}
for module, name in json.loads(sys.argv[2]):
    worker = getattr(importlib.import_module(module), name)
    ops = [len(refop.findall(worker.inspect_llvm(sig))) for sig in worker.signatures]
    out[name] = {"nrt": worker.targetoptions.get("_nrt", True), "ops": ops}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probed() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="timwatch-nrt-") as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, _REFOP.pattern, json.dumps(WORKERS)],
            env={**os.environ, "NUMBA_CACHE_DIR": tmp},
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("name", [n for _, n in WORKERS])
def test_worker_loops_hold_no_reference_counting(probed: dict[str, Any], name: str) -> None:
    worker = probed[name]
    assert worker["nrt"] is False, f"{name} is compiled with NRT"
    assert worker["ops"], f"{name} was not compiled by the warm-up"
    assert not any(worker["ops"]), f"{name}: reference-count calls per signature {worker['ops']}"


def test_the_check_sees_reference_counting_where_it_is() -> None:
    """The same reading finds the operations in a loop compiled with NRT."""

    def loop(buf: np.ndarray) -> int:
        total = 0
        for i in range(buf.shape[0]):
            total += scan.byte_at(buf, i)
        return total

    counted = numba.njit(loop)
    buf = np.frombuffer(b"abc", np.uint8)
    assert counted(buf) == 97 + 98 + 99
    assert _REFOP.findall(counted.inspect_llvm(counted.signatures[0]))
