"""One vLLM answer (a JSON object) as members and values, for `proxy.vllm.edit` to read and cut.

Where the C reader is built, `SpanTree` holds the spans its structural walk gives
(`native.walk`, down to each choice's ``logprobs`` members): only the values read are parsed,
by orjson from their spans, a chat answer's per-token log-probs are gathered in C
(`native`'s ``member_values``), and members are cut in place, every other byte the
upstream's. Without it, and for a small answer nothing is cut from (`tree_of`), `ObjectTree`
holds orjson's objects for the whole answer and writes the answer again when a member is cut.
Both answer every question alike (tests/unit/test_cstream.py); a node is a row of the walk or
an object, opaque to callers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from ....monitor.core.errors import NotFast, WireError
from .. import native

__all__ = ["Tree", "SpanTree", "ObjectTree", "tree_of"]

Node = Any


class Tree:
    """The questions `edit_answer` asks of an answer; the root node is `root`."""

    root: Node = None

    def member(self, node: Node, key: str) -> Node | None:
        """The node of ``node``'s member ``key``; None when absent (or ``node`` is no object)."""
        raise NotImplementedError

    def value(self, node: Node | None) -> Any:
        """The value at ``node`` as Python objects (None for None)."""
        raise NotImplementedError

    def is_null(self, node: Node | None) -> bool:
        """Whether ``node`` is absent or JSON ``null``."""
        raise NotImplementedError

    def items(self, node: Node) -> list[Node] | None:
        """The items of the array at ``node``; None when it is no array."""
        raise NotImplementedError

    def column(self, node: Node, key: str) -> list[Any] | None:
        """Each object's value of member ``key`` in the array at ``node``; None when it is not
        an array of objects that all have that member with a scalar value."""
        raise NotImplementedError

    def cut(self, nodes: list[Node]) -> bytes:
        """The answer with the value at each of ``nodes`` set to ``null``."""
        raise NotImplementedError


class SpanTree(Tree):
    """The C walk's spans of one answer's bytes."""

    def __init__(self, buf: bytes) -> None:
        rows = native.walk(buf, 4, 2).tolist()  # down to choices[i].logprobs' members
        if not rows:
            raise NotFast("not one JSON object")
        self.buf, self.root = buf, 0
        self.spans = [(r[4], r[5]) for r in rows]
        self.members: dict[tuple[int, bytes], int] = {}
        self.children: dict[int, list[int]] = {}
        for i, (parent, _d, ks, ke, _vs, _ve, _ix) in enumerate(rows):
            if ks >= 0:
                self.members[(parent, buf[ks:ke])] = i
            elif parent >= 0:
                self.children.setdefault(parent, []).append(i)

    def member(self, node: Node, key: str) -> Node | None:
        return self.members.get((node, key.encode()))

    def _bytes(self, node: int) -> bytes:
        lo, hi = self.spans[node]
        return self.buf[lo:hi]

    def value(self, node: Node | None) -> Any:
        if node is None:
            return None
        try:
            return orjson.loads(self._bytes(node))
        except orjson.JSONDecodeError:
            raise NotFast("not JSON") from None

    def is_null(self, node: Node | None) -> bool:
        return node is None or self._bytes(node) == b"null"

    def items(self, node: Node) -> list[Node] | None:
        if self.buf[self.spans[node][0]] != 0x5B:
            return None
        return self.children.get(node, [])

    def column(self, node: Node, key: str) -> list[Any] | None:
        count, text = native.member_values(self.buf, self.spans[node][0], key.encode())
        if count < 0:
            return None
        try:
            values = orjson.loads(text)
        except orjson.JSONDecodeError:
            raise WireError(f"{key}: not JSON") from None
        return values if isinstance(values, list) else None

    def cut(self, nodes: list[Node]) -> bytes:
        out, at = [], 0
        for lo, hi in sorted(self.spans[n] for n in nodes):
            out += [self.buf[at:lo], b"null"]
            at = hi
        out.append(self.buf[at:])
        return b"".join(out)


class _Obj:
    """An object node: the value and where it sits (its container and key), for `cut`."""

    __slots__ = ("value", "parent", "key")

    def __init__(self, value: Any, parent: Any, key: Any) -> None:
        self.value, self.parent, self.key = value, parent, key


class ObjectTree(Tree):
    """orjson's objects of one whole answer."""

    def __init__(self, buf: bytes) -> None:
        try:
            doc = orjson.loads(buf)
        except orjson.JSONDecodeError:
            raise NotFast("not one JSON object") from None
        if not isinstance(doc, dict):
            raise NotFast("not one JSON object")
        self.doc = doc
        self.root = _Obj(doc, None, None)

    def member(self, node: Node, key: str) -> Node | None:
        obj = node.value
        return _Obj(obj[key], obj, key) if isinstance(obj, dict) and key in obj else None

    def value(self, node: Node | None) -> Any:
        return None if node is None else node.value

    def is_null(self, node: Node | None) -> bool:
        return node is None or node.value is None

    def items(self, node: Node) -> list[Node] | None:
        arr = node.value
        return [_Obj(v, arr, i) for i, v in enumerate(arr)] if isinstance(arr, list) else None

    def column(self, node: Node, key: str) -> list[Any] | None:
        arr = node.value
        if not isinstance(arr, list) or not all(
            isinstance(t, dict) and key in t and not isinstance(t[key], (str, list, dict))
            for t in arr
        ):
            return None
        return [t[key] for t in arr]

    def cut(self, nodes: list[Node]) -> bytes:
        for n in nodes:
            n.parent[n.key] = None
        return orjson.dumps(self.doc)


SMALL_BYTES = 4096


def tree_of(buf: bytes, *, cut: bool) -> Tree:
    """The answer's tree: the C walk's where the C reader is on, except for an answer under
    `SMALL_BYTES` nothing is cut from, which orjson parses whole in less time (only a cut needs
    spans; `benchmarks/vllm_proxy_throughput.py --profile` times both by size)."""
    if native.cstream() is None or (not cut and len(buf) < SMALL_BYTES):
        return ObjectTree(buf)
    return SpanTree(buf)


def ints(tree: Tree, node: Node, where: str) -> np.ndarray:
    """The token ids at ``node``."""
    value = tree.value(node)
    if not isinstance(value, list):
        raise WireError(f"{where}: expected a list of token ids (send return_token_ids: true)")
    try:
        return np.array(value, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise WireError(f"{where}: token ids must be ints") from None
