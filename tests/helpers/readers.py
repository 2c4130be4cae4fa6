"""The proxies' two readers, for test modules that must pass on both: the C reader
(`proxy.native`: de-chunking, delta scan, number parse) and the fallback that runs without it
(llhttp de-chunks, orjson parses). A module that imports `stream_reader` and sets
``pytestmark = pytest.mark.usefixtures("stream_reader")`` runs its tests once on each. Where
the C code was not built (no compiler at install), its half is skipped, except in CI or with
``TIMWATCH_NATIVE=1``, where it fails."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import httptools
import pytest

from timwatch.sidecar.proxy import native


def require_c() -> None:
    """Skip (fail in CI or with ``TIMWATCH_NATIVE=1``) where the C code was not built."""
    if not native.built():
        if os.environ.get("CI") or os.environ.get("TIMWATCH_NATIVE") == "1":
            pytest.fail("timwatch's C stream reader was not built (pip install -e . compiles it)")
        pytest.skip("timwatch's C stream reader was not built here (no C compiler at install)")


@contextmanager
def reader(kind: str) -> Iterator[None]:
    """The C reader (``"c"``) or the orjson fallback (``"fallback"``) switched on inside."""
    if kind == "c":
        require_c()
    before = native.use_native(kind == "c")
    try:
        yield
    finally:
        native.use_native(before)


@pytest.fixture(scope="module", params=["c", "fallback"])
def stream_reader(request: pytest.FixtureRequest) -> Iterator[str]:
    """The reader this module's tests run on, switched on for the module."""
    with reader(request.param):
        yield request.param


class _Body:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.done = False

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        self.done = True


def httptools_dechunk(reads: list[bytes]) -> tuple[bytes, bool] | str:
    """What llhttp (httptools) makes of a chunked body fed in ``reads``: the body and whether
    it ended, or ``"error"`` where it refused the framing (the fallback's de-chunking)."""
    got = _Body()
    parser = httptools.HttpResponseParser(got)
    parser.feed_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    try:
        for data in reads:
            parser.feed_data(data)
    except httptools.HttpParserError:
        return "error"
    return b"".join(got.parts), got.done
