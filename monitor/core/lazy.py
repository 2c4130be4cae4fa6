"""Lazy re-exports for package roots (PEP 562): a name is imported on first use, so importing
a package never loads what its users do not touch (numba, FastAPI, torch). A name whose module
needs an extra that is not installed raises ModuleNotFoundError (same ``name``) whose message
says which extra to install."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from .extras import with_hint

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for `package` that imports ``exports[name]`` (a module path) and
    returns its attribute `name`; any other name raises AttributeError as usual."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            return getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as exc:
            raise with_hint(exc, f"{package}.{name}") from exc

    return __getattr__
