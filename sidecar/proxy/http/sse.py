"""Event streams as the proxies relay them: a body cut into its ``data: ...\\n\\n`` frames as
its bytes arrive (`relay_frames`), and the search for a frame's end (`terminator`, also used by
`proxy.sglang.stream.StreamReads`, which cuts an unchanged stream beside its relay).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

__all__ = ["relay_frames", "terminator"]


def terminator(buf: bytes | bytearray, start: int) -> int:
    """``buf.find(b"\\n\\n", start)`` at memchr speed: a one-byte ``find`` is a memchr, the
    two-byte one was not (a third of a cumulative stream's proxy time); compact JSON holds no
    raw newline, so the first newline found is almost always a frame's end."""
    n = len(buf)
    while True:
        cut = buf.find(b"\n", start)
        if cut < 0 or (cut + 1 < n and buf[cut + 1] == 10):
            return cut
        if cut + 1 >= n:
            return -1
        start = cut + 1


async def relay_frames(
    frame: Callable[[bytes], bytes], chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """``chunks`` cut into frames, each as ``frame`` gives it back: every frame complete in
    one read goes out in one write, a partial frame waits for its end, and the bytes of one
    the body ends in go out as they came. Each read is searched once: a frame arriving in many
    reads is held apart and costs one pass over its bytes, not one per read."""
    held = bytearray()  # the start of a frame still arriving (it holds no terminator)
    async for chunk in chunks:
        start, out = 0, []
        if held:
            if held[-1] == 10 and chunk[:1] == b"\n":
                start = 1  # the terminator straddles the two reads
            else:
                cut = terminator(chunk, 0)
                if cut < 0:
                    held += chunk
                    continue
                start = cut + 2
            held += chunk[:start]
            out.append(frame(bytes(held)))
            held.clear()
        cut = terminator(chunk, start)
        while cut >= 0:
            out.append(frame(chunk[start : cut + 2]))
            start = cut + 2
            cut = terminator(chunk, start)
        if start < len(chunk):
            held += chunk[start:]
        if out:
            yield out[0] if len(out) == 1 else b"".join(out)
    if held:
        yield bytes(held)
