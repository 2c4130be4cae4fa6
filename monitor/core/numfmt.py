"""Numbers as a person reads them: three significant digits, one formatter for every measured
value the diagnosis and the incident report show.

`sig3` is ``format(x, ".3g")`` with the edge cases fixed: ``0.17254273745832444`` → ``0.173``,
``1.0833333333333333`` → ``1.08``, ``12345.6`` → ``1.23e+04`` (not ``12300``, which would claim
five significant digits), ``0.0`` and ``-0.0`` → ``0``, NaN → ``nan``, ±inf → ``inf`` /
``-inf``, None (no value) → ``n/a``. `pct3` is a share in percent, to three digits too:
``0.4234`` → ``42.3%``. Counts and step numbers are exact integers, not measurements: callers
print them as they are.
"""

from __future__ import annotations

import math

__all__ = ["pct3", "sig3"]


def sig3(x: float | None) -> str:
    """``x`` to three significant digits; ``n/a`` for None."""
    if x is None:
        return "n/a"
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    return f"{x:.3g}"


def pct3(share: float | None) -> str:
    """``share`` (1 is all) in percent to three significant digits; ``n/a`` for None."""
    return "n/a" if share is None else f"{sig3(100 * float(share))}%"
