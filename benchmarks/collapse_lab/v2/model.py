"""Lab v2's causal transformer: pre-LN blocks, learned positions, untied output head, a full
causal forward for the trainer and a KV-cache prefill/decode for the engine.

Invariants: `LM.forward` on ``ids`` equals, position by position, `LM.prefill` followed by
`LM.decode` one id at a time (up to the float rounding of the parameters' dtype); with
``order_chunks`` > 1 the output head and the MLP's down-projection sum their contraction in that
many chunks in reverse order, a batch-independent-kernel stand-in that only reorders fp32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LM", "ModelConfig"]

Cache = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 2048
    d: int = 128
    layers: int = 2
    heads: int = 4
    max_len: int = 96


def _reordered(x: torch.Tensor, lin: nn.Linear, chunks: int) -> torch.Tensor:
    if chunks <= 1:
        return lin(x)
    k = x.shape[-1]
    step = -(-k // chunks)
    out = None
    for s in reversed(range(0, k, step)):
        part = x[..., s : s + step] @ lin.weight[:, s : s + step].T
        out = part if out is None else out + part
    assert out is not None
    return out if lin.bias is None else out + lin.bias


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(
        self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None, chunks: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k = torch.cat([cache[0], k], 2)
            v = torch.cat([cache[1], v], 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None and t > 1)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + _reordered(F.gelu(self.fc(self.ln2(x))), self.down, chunks)
        return x, (k, v)


class LM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Embedding(cfg.max_len, cfg.d)
        self.blocks = nn.ModuleList(_Block(cfg.d, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        self.order_chunks = 1

    def _run(
        self, ids: torch.Tensor, start: int, cache: Cache | None
    ) -> tuple[torch.Tensor, Cache]:
        x = self.tok(ids) + self.pos.weight[start : start + ids.shape[1]]
        new: Cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if cache is None else cache[i], self.order_chunks)
            new.append(kv)
        return _reordered(self.ln(x), self.head, self.order_chunks), new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, len, vocab]`` of a causal pass over ``ids``."""
        return self._run(ids, 0, None)[0]

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Cache]:
        """Logits of the last position and the KV cache of ``ids``."""
        logits, cache = self._run(ids, 0, None)
        return logits[:, -1], cache

    def decode(self, ids: torch.Tensor, pos: int, cache: Cache) -> tuple[torch.Tensor, Cache]:
        """Logits after one more id per row (``ids`` ``[batch]`` at position ``pos``)."""
        logits, cache = self._run(ids[:, None], pos, cache)
        return logits[:, 0], cache
