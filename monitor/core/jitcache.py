"""numba's on-disk cache for the kernels of this folder, keyed to their sources.

numba stamps a cached kernel with the modification time and size of the one file that defines
it, so a kernel whose helpers (inlined or called, from another module) were edited would load
its old compiled code. Every ``cache=True`` kernel defined in this folder is instead stamped with
a SHA-256 of its own module and of every module of this folder it imports, directly or through
another (relative imports, read from the sources): a kernel loaded from the cache is always the
compilation of the sources on disk. The cache files stay where numba puts them
(``NUMBA_CACHE_DIR`` when set, else ``__pycache__`` next to the source, else the user's cache
directory); a kernel defined elsewhere is cached by numba's own rules.

Kernel modules import `njit` from here, which registers the locator before their decorators
run. ``NUMBA_CACHE_LOCATOR_CLASSES`` replaces every locator, this one included.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path
from typing import Any

from numba import njit
from numba.core import caching

__all__ = ["njit", "source_key", "sources_of"]

_HERE = Path(__file__).resolve().parent
_IMPL: Any = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # numba < 0.63


@functools.cache
def _imported(path: Path) -> frozenset[Path]:
    """The modules of this folder that `path` imports relatively (``from .x import``,
    ``from . import x``)."""
    out: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                first = name.split(".")[0]
                for candidate in (_HERE / f"{first}.py", _HERE / first / "__init__.py"):
                    if candidate.is_file():
                        out.add(candidate)
    return frozenset(out)


def sources_of(path: Path) -> list[Path]:
    """`path` and every module of this folder it imports, transitively, sorted."""
    seen: set[Path] = set()
    todo = [path.resolve()]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(_imported(p) - seen)
    return sorted(seen)


@functools.cache
def source_key(path: str) -> str:
    """SHA-256 over the names and bytes of `sources_of` ``path`` (computed once per process)."""
    h = hashlib.sha256()
    for p in sources_of(Path(path)):
        data = p.read_bytes()
        h.update(f"{p.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


class SourceKeyedLocator(caching._CacheLocator):
    """numba's own locator for the function (same cache path and file names), with
    `source_key` as the stamp that decides whether a cached index is fresh."""

    def __init__(self, inner: Any, py_file: str) -> None:
        self._inner = inner
        self._py_file = py_file

    def ensure_cache_path(self) -> None:
        self._inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return str(self._inner.get_cache_path())

    def get_source_stamp(self) -> tuple[str, str]:
        return ("sha256-of-sources", source_key(self._py_file))

    def get_disambiguator(self) -> str:
        return str(self._inner.get_disambiguator())

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> SourceKeyedLocator | None:
        if not Path(py_file).is_file() or Path(py_file).resolve().parent != _HERE:
            return None
        for base in _IMPL._locator_classes:
            if base is cls:
                continue
            inner = base.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner, str(Path(py_file).resolve()))
        return None


if SourceKeyedLocator not in _IMPL._locator_classes:
    _IMPL._locator_classes.insert(0, SourceKeyedLocator)
