"""`proxy.http.sse.relay_frames`, the frame cutter both proxies relay changed streams through:
whatever the reads, each frame goes through ``frame`` once, whole, every frame complete in one
read goes out in that read's one write, and the bytes a body ends in go out as they came."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from timwatch.sidecar.proxy.http.sse import relay_frames, terminator


def _relay(reads: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    seen: list[bytes] = []

    def frame(f: bytes) -> bytes:
        assert isinstance(f, bytes)
        seen.append(f)
        return f.upper()

    async def go() -> list[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            for read in reads:
                yield read

        return [out async for out in relay_frames(frame, chunks())]

    return asyncio.run(go()), seen


def _expected(reads: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """The writes, by the definition: per read, the frames whose end lies in it."""
    data = b"".join(reads)
    ends, at = [], 0
    while (cut := data.find(b"\n\n", at)) >= 0:
        ends.append(cut + 2)
        at = cut + 2
    frames, writes, start, pos, i = [], [], 0, 0, 0
    for read in reads:
        pos += len(read)
        out = []
        while i < len(ends) and ends[i] <= pos:
            frames.append(data[start : ends[i]])
            out.append(data[start : ends[i]].upper())
            start = ends[i]
            i += 1
        if out:
            writes.append(b"".join(out))
    if start < len(data):
        writes.append(data[start:])
    return writes, frames


def _split(data: bytes, rng: random.Random, most: int) -> list[bytes]:
    reads, at = [], 0
    while at < len(data):
        n = rng.randint(1, most)
        reads.append(data[at : at + n])
        at += n
    return reads


@pytest.mark.parametrize("seed", range(40))
def test_any_split_gives_the_frames_and_writes_the_definition_does(seed: int) -> None:
    rng = random.Random(seed)
    frames = []
    for i in range(rng.randint(0, 30)):
        size = rng.choice([1, 5, 40, 3000])
        body = bytes(rng.choice(b'ab{}[]",\n0') for _ in range(size)).replace(b"\n\n", b"\n ")
        frames.append(b"data: " + body.strip(b"\n") + b"%d\n\n" % i)
    data = b"".join(frames) + rng.choice([b"", b"data: [DONE]\n\n", b"data: cut", b"x\n"])
    reads = _split(data, rng, rng.choice([1, 3, 64, 5000]))
    assert _relay(reads) == _expected(reads)


def test_a_terminator_across_two_reads_and_a_frame_over_many() -> None:
    reads = [b"data: 1\n", b"\ndata: 2", b"2", b"2\n", b"\n", b"data: 3\n\ndata: 4\n\nda", b"ta"]
    writes, frames = _relay(reads)
    assert frames == [b"data: 1\n\n", b"data: 222\n\n", b"data: 3\n\n", b"data: 4\n\n"]
    assert writes == [b"DATA: 1\n\n", b"DATA: 222\n\n", b"DATA: 3\n\nDATA: 4\n\n", b"data"]


def test_terminator_is_find_of_a_blank_line() -> None:
    rng = random.Random(7)
    for _ in range(500):
        buf = bytes(rng.choice(b"\nab") for _ in range(rng.randint(0, 12)))
        start = rng.randint(0, len(buf))
        assert terminator(buf, start) == buf.find(b"\n\n", start)
        assert terminator(bytearray(buf), start) == buf.find(b"\n\n", start)
