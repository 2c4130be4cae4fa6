"""Figures already drawn, answered again for the same inputs.

Drawing is most of a report's time (100-700 ms per figure on a 2-core host, eight figures a
page), and a report asked again for a run whose steps in its range did not change (an alert's
link opened by several people, a page reloaded, a range outside the stored steps) draws the
same figures from the same inputs. `cached` keys a figure by a digest of its function's name
and arguments (NumPy arrays by dtype, shape and bytes, through pickle), so any change in what
the store answered is a new key; nothing has to be invalidated.

The cache holds at most `MAX_BYTES` of PNG data URIs, the least recently used dropped first.
It is thread-safe (the report route runs in FastAPI's threadpool); two threads drawing the same
new figure at once each draw it, and the second result replaces the first.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import wraps
from typing import Any, ParamSpec

__all__ = ["CACHE", "MAX_BYTES", "FigureCache", "cached", "key_of"]

MAX_BYTES = 32 << 20

P = ParamSpec("P")


class FigureCache:
    """Data URIs by key, at most ``max_bytes`` of them (a larger one is drawn, not kept);
    ``hits`` and ``misses`` count the lookups."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.hits = self.misses = 0
        self._items: OrderedDict[bytes, str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        """Bytes held."""
        return self._bytes

    def get_or_draw(self, key: bytes, draw: Callable[[], str]) -> str:
        with self._lock:
            got = self._items.get(key)
            if got is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return got
            self.misses += 1
        value = draw()  # outside the lock: other reports go on drawing meanwhile
        if len(value) > self.max_bytes:
            return value
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._items[key] = value
            self._bytes += len(value)
            while self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= len(dropped)
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
            self.hits = self.misses = 0


CACHE = FigureCache()


def key_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The digest of a figure function's name and arguments."""
    blob = pickle.dumps((name, args, sorted(kwargs.items())), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.blake2b(blob, digest_size=16).digest()


def cached(fn: Callable[P, str]) -> Callable[P, str]:
    """``fn`` (a figure drawn into a data URI) answered from `CACHE` for inputs seen before."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> str:
        try:
            key = key_of(fn.__qualname__, args, dict(kwargs))
        except (pickle.PicklingError, TypeError, AttributeError):
            return fn(*args, **kwargs)  # inputs without a digest: drawn, not kept
        return CACHE.get_or_draw(key, lambda: fn(*args, **kwargs))

    return wrapper
