"""The stream reader's C code (``_cstream.c``: de-chunking and the delta-frame scan), when it
was built, and the switch between it and the numba code it mirrors.

``pip install`` compiles ``_cstream.c`` where a C compiler and Python's headers are found
(setup.py marks it optional: an install without them still succeeds). Where it is missing, or
``TIMWATCH_NATIVE=0`` is set, `cstream` answers None and the callers run their numba twins,
which give the same answers (tests/unit/test_cstream.py). With ``TIMWATCH_NATIVE=1`` a missing
build is an error at the first call instead (CI sets it, so a build that failed cannot pass
unnoticed as the numba path).
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["built", "cstream", "use_native"]

try:
    from . import _cstream as _built  # type: ignore[attr-defined]
except ImportError:  # built without a compiler: the numba twins
    _built = None

_REQUIRED = os.environ.get("TIMWATCH_NATIVE", "") == "1"
_use: ModuleType | None = None if os.environ.get("TIMWATCH_NATIVE", "") == "0" else _built


def built() -> bool:
    """Whether the C module was compiled at install."""
    return _built is not None


def cstream() -> ModuleType | None:
    """The C module when it is built and switched on, else None (the numba twins run)."""
    if _REQUIRED and _built is None:
        raise RuntimeError("TIMWATCH_NATIVE=1, but timwatch's C stream reader was not built")
    return _use


def use_native(on: bool) -> bool:
    """Switch the C code on (when built) or off in this process (tests, A/B measurements);
    returns whether it was on before."""
    global _use
    before = _use is not None
    _use = _built if on else None
    return before
