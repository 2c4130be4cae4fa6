"""Token log-probabilities and entropies from logits, one row chunk at a time.

A trainer that needs π_t and H_t for every response token holds `[tokens, vocab]` logits, usually
in bf16. The obvious `torch.log_softmax(logits.float() / T, -1)` allocates a float32 copy of the
whole matrix (for 32k tokens × 152k vocab that is 19 GiB), and autograd keeps it alive until the
backward pass. This module never does: the forward pass upcasts one chunk of rows at a time, keeps
only per-token results, and the backward pass recomputes each chunk's softmax from the original
logits. Peak extra memory is two float32 chunks (`chunk_size × vocab`) plus per-token vectors.

Gradients flow to the logits through both outputs (log-prob and entropy), so the entropy can be
used as a regulariser as well as for the ESTR mask; callers that only need the entropy for the mask
simply `.detach()` it and pay nothing for it in the backward pass.

This module imports torch and is meant for trainer-side code only; the monitor service never
imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["DEFAULT_CHUNK_SIZE", "logprobs_and_entropy_from_logits"]

DEFAULT_CHUNK_SIZE = 1024

# exp(x) is exactly 0 in float32 below about -103.9 and in float64 below about -745.1, so clamping
# log-probabilities at -1e4 before forming p·log p changes no term of the entropy sum, and keeps
# 0 · (-inf) = NaN out of it when the logits carry -inf (masked vocabulary entries).
_LOGP_FLOOR = -1.0e4


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.float32
    raise TypeError(f"logits must be float16, bfloat16, float32 or float64, got {dtype}")


def _chunk_logp(rows: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """A fresh `dtype` copy of `rows / T` (never a view of the caller's logits)."""
    z = rows.to(dtype, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, _ = logits.shape
        dtype = _compute_dtype(logits.dtype)
        logp = torch.empty(n, dtype=dtype, device=logits.device)
        entropy = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            z = _chunk_logp(logits[start:stop], temperature, dtype)
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[start:stop] = chunk_lse
            logp[start:stop] = z.gather(1, labels[start:stop, None]).squeeze(1) - chunk_lse
            # H = lse - Σ p z = -Σ p (z - lse); the shifted form cancels no two large numbers.
            z.sub_(chunk_lse[:, None]).clamp_(min=_LOGP_FLOOR)
            p = torch.exp(z)
            entropy[start:stop] = -(p.mul_(z)).sum(dim=-1)
            del z, p
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(lse)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None]:
        logits, labels, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        temperature: float = ctx.temperature
        chunk_size: int = ctx.chunk_size
        n, _ = logits.shape
        dtype = lse.dtype
        grad = torch.empty_like(logits)
        g_lp = grad_logp if grad_logp is not None else torch.zeros_like(lse)
        g_h = grad_entropy if grad_entropy is not None else torch.zeros_like(lse)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            sl = slice(start, stop)
            # With q = log p: ∂logp_label/∂z_j = 1[j = label] - p_j and ∂H/∂z_j = -p_j (q_j + H).
            q = _chunk_logp(logits[sl], temperature, dtype)
            q.sub_(lse[sl, None]).clamp_(min=_LOGP_FLOOR)
            p = torch.exp(q)
            q.add_(entropy[sl, None]).mul_(g_h[sl, None]).add_(g_lp[sl, None]).mul_(p).neg_()
            q.scatter_add_(1, labels[sl, None], g_lp[sl, None].to(dtype))
            if temperature != 1.0:
                q.div_(temperature)
            grad[sl].copy_(q)
            del q, p
        return grad, None, None, None


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label and entropy of each row of `softmax(logits / temperature)`.

    `logits` is `[tokens, vocab]` with `labels` `[tokens]`, or `[batch, seq, vocab]` with `labels`
    `[batch, seq]`; both outputs have the labels' shape. Accepts float16, bfloat16, float32 and
    float64 logits; results are float32 (float64 for float64 logits). Each chunk of `chunk_size`
    rows is upcast on its own, so no full-size float32 copy of the logits is ever made. Both
    outputs are differentiable with respect to `logits`.

    A `[batch, seq, vocab]` tensor that is not contiguous is reshaped with `reshape`, which copies
    it once in its own dtype; pass contiguous logits to avoid that.
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("logits and labels must be torch tensors")
    if logits.dim() not in (2, 3):
        raise ValueError(
            "logits must be [tokens, vocab] or [batch, seq, vocab], "
            f"got shape {tuple(logits.shape)}"
        )
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits on {logits.device}")
    if not (temperature > 0.0) or temperature != temperature:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _compute_dtype(logits.dtype)
    out_shape = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).to(torch.int64)
    logp, entropy = _ChunkedLogprobEntropy.apply(
        flat_logits, flat_labels, float(temperature), int(chunk_size)
    )
    return logp.reshape(out_shape), entropy.reshape(out_shape)
