"""After a warm-up, optionally forbid numba from compiling anything more.

A numba kernel compiles one specialisation per argument types (dtype, layout, read-only,
alignment). A process that compiled its kernels before serving (`engine.warm_up`) must never
meet types its warm-up did not cover: on a cold cache, compiling inside a request takes seconds
to a minute. With ``TIMWATCH_STRICT_WARMUP=1`` in the environment,
`seal_after_warm_up` turns that silent stall into an immediate ``TypeError`` naming the kernel
and the types, which the test suite sets for every server it starts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from types import ModuleType

__all__ = ["STRICT_ENV", "seal_after_warm_up"]

STRICT_ENV = "TIMWATCH_STRICT_WARMUP"


def seal_after_warm_up(modules: Iterable[ModuleType]) -> int:
    """If `STRICT_ENV` is ``1``, stop every numba dispatcher defined in `modules` from compiling
    new specialisations (those already compiled or loaded keep working). Returns how many were
    sealed (0 when the variable is unset)."""
    if os.environ.get(STRICT_ENV) != "1":
        return 0
    sealed = 0
    for mod in modules:
        for obj in vars(mod).values():
            if getattr(obj, "__module__", None) == mod.__name__ and hasattr(obj, "disable_compile"):
                if obj.signatures:
                    obj.disable_compile()
                else:  # never called from Python (inlined, or only called by other kernels)
                    obj._can_compile = False  # what disable_compile sets; it asserts a signature
                sealed += 1
    return sealed
