"""The proxies' compiled code, made ready before a proxy listens: `warm_up` runs every
scanner an engine's proxy uses (numba compiles them, or loads its cache, now rather than in
the first client's request: ~10 s on a cold cache), then seals them all when the environment
asks (`timwatch.monitor.core.jitguard`), so a request whose bytes reach a scanner with types
the warm-up did not compile fails at once instead of compiling for seconds."""

from __future__ import annotations

from typing import Literal

from ...monitor.core.jitguard import seal_after_warm_up
from .jsonbytes import numbers as numparse
from .jsonbytes import scan
from .jsonbytes import span as jsonspan
from .sglang import deltascan
from .vllm import edit as vllm_edit

__all__ = ["warm_up"]


def warm_up(engine: Literal["sglang", "vllm"]) -> None:
    """Compile what `engine`'s proxy runs , then
    `seal_after_warm_up` over every compiled module of the proxies: a scanner one proxy never
    warms must not compile inside its requests either."""
    if engine == "sglang":
        deltascan.warm_up()
    else:
        vllm_edit.warm_up()
    seal_after_warm_up([deltascan, jsonspan, numparse, scan, vllm_edit])
