"""A tiny causal transformer LM for `timwatch demo`: two numeric paths over the same weights.

* `TinyLM.generate` is the rollout engine: token-by-token decode with a KV cache, in whatever
  dtype the module is cast to (bf16 by default in the demo), sampling from the logits it computes
  and keeping μ = log-softmax of those logits at the sampled token.
* `TinyLM.forward` is the trainer: one full-sequence causal prefill (fp32 in the demo); π and H
  come from `timwatch.monitor.trainer.logprobs.logprobs_and_entropy_from_logits` on its logits.

The two paths run different kernels (a growing KV cache and per-step matmuls versus one masked
attention over the whole sequence) in different precisions, so their log-probs differ the way a
real engine's and trainer's do; nothing is added to either. The output layer multiplies the
logits by a state-dependent gain ``exp(a + b·tanh(h·u))`` so that next-token entropies span
roughly 0.01 to 5 nats from the start, as in real LMs (confident and uncertain positions).

Two engine settings that real engines have, off by default (the labelled runs of
``benchmarks/diagnosis_runs.py`` use them):

* ``rope=True`` adds rotary position embeddings (NeoX layout) to q and k, and ``rope_dtype`` is
  the dtype the rotary angles ``position × inv_freq`` are computed in (fp32 by default, as
  transformers and the serving engines force). In bf16 the angle's absolute error grows with the
  position (transformers PR #29285: "bfloat16 loses precision on long contexts"), so the decode
  drifts more the longer the response.
* ``kv_dtype`` stores the decode path's KV cache in that dtype (K and V rounded when written,
  read back in the compute dtype), like vLLM/SGLang ``--kv-cache-dtype fp8_e4m3`` with the
  default scale 1.0. The full-sequence prefill has no cache, so only decode sees the rounding.

Imports torch: demo-only code.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyLM", "Rollout"]

#: cos and sin of the rotary angles, ``[positions, head_dim / 2]``; None: no rotary embedding
Rot = tuple[torch.Tensor, torch.Tensor] | None


def _rotate(x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rot
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def _split(self, x: torch.Tensor, rot: Rot) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        if rot is not None:
            q, k = _rotate(q, rot), _rotate(k, rot)
        return q, k, v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
    ) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if causal:
            t = q.shape[-2]
            mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    def forward(self, x: torch.Tensor, rot: Rot = None) -> torch.Tensor:
        q, k, v = self._split(x, rot)
        att = self._attend(q, k, v, causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.ln2(x))

    def step(
        self, x: torch.Tensor, cache: list[torch.Tensor] | None, rot: Rot = None,
        kv_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        """One new position per row; ``cache`` holds [k, v] of the earlier positions, stored in
        ``kv_dtype`` (None: the compute dtype)."""
        q, k, v = self._split(x, rot)
        if kv_dtype is not None:
            k, v = k.to(kv_dtype).to(x.dtype), v.to(kv_dtype).to(x.dtype)
        if cache is not None:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        att = self._attend(q, k, v, causal=False)
        x = x + self.proj(att.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.ln2(x)), [k, v]


class Rollout:
    """What the engine returns: sampled tokens and μ per token, ``[batch, new_tokens]``."""

    def __init__(self, tokens: torch.Tensor, logp: torch.Tensor) -> None:
        self.tokens = tokens
        self.logp = logp


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int = 320, d: int = 64, layers: int = 2, heads: int = 4, max_len: int = 128,
        gain: tuple[float, float] = (0.9, 1.3), seed: int = 0, rope: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.max_len = vocab, max_len
        self.rope, self.head_dim = rope, d // heads
        #: the dtype the rotary angles are computed in; the decode path's KV cache dtype
        self.rope_dtype: torch.dtype = torch.float32
        self.kv_dtype: torch.dtype | None = None
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.gain_u = nn.Parameter(torch.randn(d, generator=g) * 2.0 / math.sqrt(d))
        self.gain_a, self.gain_b = gain
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            self.tok.weight.mul_(math.sqrt(d) * 0.5)
            self.pos.weight.mul_(math.sqrt(d) * 0.5)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.ln_f(h)
        gain = torch.exp(self.gain_a + self.gain_b * torch.tanh(h @ self.gain_u))
        return self.head(h) * gain.unsqueeze(-1)

    def _rot(self, positions: torch.Tensor, dtype: torch.dtype) -> Rot:
        """cos/sin of ``positions × inv_freq``, the product taken in `rope_dtype`."""
        if not self.rope:
            return None
        half = self.head_dim // 2
        inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
        ang = positions.to(self.rope_dtype)[:, None] * inv_freq.to(self.rope_dtype)[None, :]
        ang = ang.float()
        return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence prefill: logits ``[batch, T, vocab]`` for every position."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        rot = self._rot(positions, x.dtype)
        for block in self.blocks:
            x = block(x, rot)
        return self._logits(x)

    @torch.no_grad()
    def generate(
        self, prompt: torch.Tensor, new_tokens: int, generator: torch.Generator
    ) -> Rollout:
        """KV-cache decode: prefill the prompt position by position, then sample `new_tokens`."""
        b, p = prompt.shape
        caches: list[list[torch.Tensor] | None] = [None] * len(self.blocks)
        tokens, logps = [], []
        nxt = prompt[:, 0]
        for pos in range(p + new_tokens - 1):
            x = self.tok(nxt[:, None]) + self.pos.weight[pos]
            rot = self._rot(torch.tensor([pos]), x.dtype)
            for i, block in enumerate(self.blocks):
                x, caches[i] = cast(_Block, block).step(x, caches[i], rot, self.kv_dtype)
            if pos + 1 < p:
                nxt = prompt[:, pos + 1]
                continue
            logp = F.log_softmax(self._logits(x[:, 0]).float(), dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
            tokens.append(nxt)
            logps.append(logp.gather(1, nxt[:, None])[:, 0])
        return Rollout(torch.stack(tokens, 1), torch.stack(logps, 1))
