"""A stream through the SGLang proxy's two relays, as `proxy.http.forward.forward_planned` picks
them: a changed request's frames restored one by one (`proxy.sglang.stream.relay_stream`); an
unchanged one's reads passed on as they came and each then fed to `stream_capture`, closed at
the end (what `proxy.http.relay.UpstreamStream` does with its sink)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from timwatch.sidecar.proxy.sglang.answers import Capturer
from timwatch.sidecar.proxy.sglang.stream import relay_stream, stream_capture
from timwatch.sidecar.proxy.sglang.wire import RequestPlan


async def relayed(cap: Capturer, plan: RequestPlan, chunks: AsyncIterator[bytes]) -> bytes:
    """The client's bytes of the stream ``chunks`` (the records go to ``cap``)."""
    if plan.changed:
        return b"".join([c async for c in relay_stream(cap, plan, chunks)])
    reads, out = stream_capture(cap, plan), []
    try:
        async for chunk in chunks:
            out.append(chunk)
            reads(chunk)
    finally:
        reads.close()
    return b"".join(out)
