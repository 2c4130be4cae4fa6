"""What an import costs a trainer: wall time and resident memory of ``import timwatch.sidecar.tap``
in fresh interpreters, against baselines measured in the same run.

    python benchmarks/import_cost.py [--rounds 7]

Each figure is the median over ``--rounds`` fresh processes. "after numpy" starts from an
interpreter that has already imported numpy, as every trainer has (torch imports it); "cold"
starts from nothing. Baselines: ``import numpy``, ``import httpx`` (what the tap used to ship
with), and ``import timwatch.monitor.core.engine`` (the numba kernel the tap used to load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass

import bench_json

PROBE = """
import json, resource, sys, time
pre = {pre!r}
for m in pre:
    __import__(m)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
__import__({module!r})
dt = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
heavy = [m for m in ("numba", "fastapi", "torch", "httpx", "sqlalchemy") if m in sys.modules]
print(json.dumps({{"s": dt, "mb": (r1 - r0) / 1024, "heavy": heavy}}))
"""

CASES = [
    ("timwatch.sidecar.tap", ["numpy"], "tap, after numpy"),
    ("timwatch.sidecar.tap", [], "tap, cold"),
    ("numpy", [], "baseline: numpy, cold"),
    ("httpx", ["numpy"], "baseline: httpx, after numpy"),
    ("timwatch.monitor.core.engine", ["numpy"], "baseline: numba engine, after numpy"),
]


@dataclass(frozen=True)
class Cost:
    s: float
    mb: float
    heavy: list[str]


def measure(module: str, pre: list[str], rounds: int) -> Cost:
    runs = []
    for _ in range(rounds):
        out = subprocess.run(
            [sys.executable, "-c", PROBE.format(pre=pre, module=module)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        runs.append(json.loads(out.stdout))
    return Cost(
        s=statistics.median(r["s"] for r in runs),
        mb=statistics.median(r["mb"] for r in runs),
        heavy=runs[0]["heavy"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    bench_json.add_argument(ap)
    args = ap.parse_args()
    results = {label: measure(m, pre, args.rounds) for m, pre, label in CASES}
    print(f"{'import':40} {'time':>9} {'RSS':>9}  heavy modules loaded")
    for label, r in results.items():
        heavy = ", ".join(r.heavy) or "-"
        print(f"{label:40} {r.s * 1000:7.1f}ms {r.mb:7.1f}MB  {heavy}")
    tap = results["tap, after numpy"]
    ratios = {}
    for base in ("baseline: httpx, after numpy", "baseline: numba engine, after numpy"):
        b = results[base]
        print(
            f"tap vs {base.split(': ')[1]}: {b.s / tap.s:.1f}× less time, "
            f"{b.mb - tap.mb:.1f} MB less"
        )
        ratios[f"{base.split(': ')[1]} time / tap time"] = b.s / tap.s
        ratios[f"{base.split(': ')[1]} RSS - tap RSS, MB"] = b.mb - tap.mb
    rows = [
        {
            "import": label,
            "time, ms": r.s * 1e3,
            "RSS, MB": r.mb,
            "heavy modules": ", ".join(r.heavy) or "-",
        }
        for label, r in results.items()
    ]
    bench_json.write(
        args.json,
        "import_cost",
        {"tap after numpy, ms": tap.s * 1e3, "tap after numpy, MB": tap.mb},
        ratios,
        rows,
        note=f"median of {args.rounds} fresh interpreters per row",
    )


if __name__ == "__main__":
    main()
