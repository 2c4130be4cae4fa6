"""Lab v2's rollout engines: a copy of the policy that samples responses with a KV cache in its
own numerics and reports μ, the log-prob of each sampled id under the distribution it sampled.

Kinds: ``fp32`` (the matched control: the trainer's numerics, so μ equals the trainer's π up to
the decode-vs-prefill float order), ``order`` (fp32 whose output head and MLP down-projection sum
in a different order, as batch-size-dependent kernels do), ``bf16`` (weights, activations and KV
cache in bfloat16), ``fp8`` (bf16 engine whose linear weights are rounded to float8 e4m3 with a
per-tensor scale, as FP8 rollouts do), ``int4`` (bf16 engine whose linear weights are rounded to
symmetric int4 in groups of 128 inputs, as W4A16 rollouts do), ``int4t`` (the same with one
scale per tensor, lab v1's int4: far cruder than any shipped W4A16 kernel). Any kind with
``top_k`` > 0 or ``top_p`` < 1 samples the top-k then top-p processed distribution and reports
its log-probs (as engines returning processed log-probs do). Embeddings and norms are never rounded.
Invariant: `Engine.generate` is deterministic given the generator's state.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from .model import LM

__all__ = [
    "KINDS", "Engine", "fp8_round", "int4_group_round", "int4_tensor_round", "processed_logprobs",
]  # fmt: skip

KINDS = ("fp32", "order", "bf16", "fp8", "int4", "int4t")
INT4_GROUP = 128


def fp8_round(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled float8 e4m3 round trip (448 is e4m3's largest finite value)."""
    scale = w.abs().max().clamp(min=1e-12) / 448.0
    return (w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


def int4_group_round(w: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Symmetric int4 round trip per output row and group of ``group`` inputs: levels −7…7,
    scale = max |w| of the group / 7."""
    rows, cols = w.shape
    g = w.reshape(rows, -1, min(group, cols))
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 7.0
    return ((g / scale).round().clamp(-7, 7) * scale).reshape(rows, cols)


def int4_tensor_round(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 round trip with one scale for the whole tensor: levels −7…7, scale =
    max |w| / 7."""
    scale = w.abs().max().clamp(min=1e-12) / 7.0
    return (w / scale).round().clamp(-7, 7) * scale


def processed_logprobs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs of the top-k then top-p truncated, renormalised distribution (−inf outside)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    if top_k > 0:
        kth = logp.topk(top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, -math.inf)
    if top_p < 1.0:
        srt, idx = logp.sort(dim=-1, descending=True)
        p = srt.exp()
        drop = p.cumsum(-1) - p > top_p
        logp = logp.scatter(-1, idx, srt.masked_fill(drop, -math.inf))
    return F.log_softmax(logp, dim=-1)


def _linear_weight(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and not name.startswith(("tok.", "pos."))


class Engine:
    """The rollout copy of an `LM`; `load` takes fp32 trainer weights and applies its numerics."""

    def __init__(self, policy: LM, kind: str, top_k: int = 0, top_p: float = 1.0) -> None:
        if kind not in KINDS:
            raise ValueError(f"engine kind {kind!r} is not one of {KINDS}")
        self.kind, self.top_k, self.top_p = kind, top_k, top_p
        self.dtype = torch.float32 if kind in ("fp32", "order") else torch.bfloat16
        self.model = copy.deepcopy(policy).to(self.dtype).eval()
        self.model.order_chunks = 4 if kind == "order" else 1

    def load(self, state: dict[str, torch.Tensor]) -> None:
        rnd = {"fp8": fp8_round, "int4": int4_group_round, "int4t": int4_tensor_round}.get(
            self.kind
        )
        if rnd is not None:
            state = {k: rnd(v) if _linear_weight(k, v) else v for k, v in state.items()}
        self.model.load_state_dict(state)

    @torch.no_grad()
    def generate(
        self, prompt: torch.Tensor, new: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``new`` sampled ids per prompt row and μ of each, both ``[batch, new]``."""
        logits, cache = self.model.prefill(prompt)
        p = prompt.shape[1]
        tokens, logps = [], []
        for i in range(new):
            if self.top_k > 0 or self.top_p < 1.0:
                logp = processed_logprobs(logits, self.top_k, self.top_p)
            else:
                logp = F.log_softmax(logits.float(), dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
            tokens.append(nxt)
            logps.append(logp.gather(1, nxt[:, None])[:, 0])
            if i + 1 < new:
                logits, cache = self.model.decode(nxt, p + i, cache)
        return torch.stack(tokens, 1), torch.stack(logps, 1)
