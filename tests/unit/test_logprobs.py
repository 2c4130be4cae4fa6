"""Chunked log-probs and entropy: exactness against naive and float64 references, gradients, and
an honest peak-memory check by recording every tensor the computation allocates."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from timwatch.monitor.trainer.logprobs import logprobs_and_entropy_from_logits


def naive(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels[..., None].long()).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def reference64(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """Independent float64 reference: explicit max-shifted softmax, no log_softmax."""
    z = logits.double() / temperature
    z = z - z.max(dim=-1, keepdim=True).values
    p = z.exp() / z.exp().sum(-1, keepdim=True)
    logp_all = torch.log(p)
    logp = logp_all.gather(-1, labels[..., None].long()).squeeze(-1)
    entropy = -(torch.where(p > 0, p * logp_all, torch.zeros_like(p))).sum(-1)
    return logp, entropy


def test_hand_computed_cases() -> None:
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)], [5.0, 5.0]])
    labels = torch.tensor([0, 1, 1])
    logp, h = logprobs_and_entropy_from_logits(logits, labels, chunk_size=2)
    expected_lp = [-math.log(2), math.log(0.75), -math.log(2)]
    expected_h = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2)]
    assert logp.tolist() == pytest.approx(expected_lp, abs=1e-7)
    assert h.tolist() == pytest.approx(expected_h, abs=1e-7)
    # temperature 2 on logits [0, 2 log 3] is the second row at T = 1
    logp_t, h_t = logprobs_and_entropy_from_logits(
        torch.tensor([[0.0, 2 * math.log(3.0)]]), torch.tensor([1]), temperature=2.0
    )
    assert logp_t.item() == pytest.approx(math.log(0.75), abs=1e-7)
    assert h_t.item() == pytest.approx(expected_h[1], abs=1e-7)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 40),
    vocab=st.integers(2, 64),
    chunk=st.integers(1, 50),
    temperature=st.floats(0.3, 3.0),
    scale=st.floats(0.05, 8.0),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    batched=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_equals_naive(
    tokens: int,
    vocab: int,
    chunk: int,
    temperature: float,
    scale: float,
    dtype: torch.dtype,
    batched: bool,
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=g) * scale).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    if batched and tokens % 2 == 0:
        logits, labels = logits.reshape(2, tokens // 2, vocab), labels.reshape(2, tokens // 2)
    logp, h = logprobs_and_entropy_from_logits(logits, labels, temperature, chunk_size=chunk)
    ref_lp, ref_h = naive(logits, labels, temperature)
    assert logp.dtype == torch.float32 and logp.shape == labels.shape == h.shape
    torch.testing.assert_close(logp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    lp64, h64 = reference64(logits, labels, temperature)
    torch.testing.assert_close(logp.double(), lp64, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), h64, atol=2e-5, rtol=1e-5)
    assert bool((h >= -1e-6).all()) and bool((h <= math.log(vocab) + 1e-5).all())


def test_float64_logits_stay_float64_and_exact() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(33, 17, generator=g, dtype=torch.float64) * 4
    labels = torch.randint(0, 17, (33,), generator=g)
    logp, h = logprobs_and_entropy_from_logits(logits, labels, 0.9, chunk_size=5)
    ref_lp, ref_h = reference64(logits, labels, 0.9)
    assert logp.dtype == torch.float64
    torch.testing.assert_close(logp, ref_lp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(h, ref_h, atol=1e-12, rtol=1e-12)


def test_minus_inf_logits_give_finite_entropy() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")], [1.0, 2.0, 3.0, 4.0]])
    labels = torch.tensor([2, 3])
    logp, h = logprobs_and_entropy_from_logits(logits, labels, chunk_size=1)
    assert logp[0].item() == pytest.approx(-math.log(2), abs=1e-7)
    assert h[0].item() == pytest.approx(math.log(2), abs=1e-7)
    ref_lp, ref_h = reference64(logits, labels, 1.0)
    torch.testing.assert_close(h.double(), ref_h, atol=1e-6, rtol=0)
    # a label on a -inf logit has log-prob -inf, reported as such
    lp_bad, _ = logprobs_and_entropy_from_logits(logits, torch.tensor([1, 0]))
    assert lp_bad[0].item() == float("-inf")


def test_gradcheck_both_outputs() -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(13, 9, generator=g, dtype=torch.float64) * 2).requires_grad_()
    y = torch.randint(0, 9, (13,), generator=g)
    assert torch.autograd.gradcheck(lambda t: logprobs_and_entropy_from_logits(t, y, 0.7, 4), (x,))
    assert torch.autograd.gradcheck(
        lambda t: logprobs_and_entropy_from_logits(t, y, 1.0, 3)[0], (x,)
    )
    assert torch.autograd.gradcheck(
        lambda t: logprobs_and_entropy_from_logits(t, y, 1.3, 5)[1], (x,)
    )


def test_bf16_gradient_matches_naive_autograd() -> None:
    g = torch.Generator().manual_seed(3)
    base = (torch.randn(2, 24, 40, generator=g) * 3).bfloat16()
    labels = torch.randint(0, 40, (2, 24), generator=g)
    w_lp, w_h = torch.randn(2, 24, generator=g), torch.randn(2, 24, generator=g)
    x1 = base.clone().requires_grad_()
    lp, h = logprobs_and_entropy_from_logits(x1, labels, 0.8, chunk_size=7)
    ((lp * w_lp).sum() + (h * w_h).sum()).backward()
    x2 = base.clone().requires_grad_()
    rlp, rh = naive(x2, labels, 0.8)
    ((rlp * w_lp).sum() + (rh * w_h).sum()).backward()
    assert x1.grad is not None and x2.grad is not None and x1.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x1.grad.float(), x2.grad.float(), atol=2e-2, rtol=2e-2)


class AllocationRecorder(TorchDispatchMode):
    """Records (bytes, dtype) of every storage an op creates (views and in-place ops excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        seen = {t.untyped_storage().data_ptr() for t in inputs}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.allocations.append((t.untyped_storage().nbytes(), t.dtype))
        return out

    def largest(self, dtype: torch.dtype) -> int:
        return max((b for b, d in self.allocations if d == dtype), default=0)


def test_never_allocates_full_float32_logits() -> None:
    tokens, vocab, chunk = 512, 1000, 32
    logits = (torch.randn(tokens, vocab) * 2).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    full_f32 = tokens * vocab * 4
    chunk_f32 = chunk * vocab * 4

    rec = AllocationRecorder()
    with rec:
        lp, h = logprobs_and_entropy_from_logits(logits, labels, 0.9, chunk_size=chunk)
    assert 0 < rec.largest(torch.float32) <= chunk_f32
    assert max(b for b, _ in rec.allocations) <= chunk_f32

    rec_bw = AllocationRecorder()
    with rec_bw:
        (lp.sum() + h.sum()).backward()
    assert 0 < rec_bw.largest(torch.float32) <= chunk_f32
    # the only full-size allocation is the gradient itself, in the logits' own dtype
    big = [(b, d) for b, d in rec_bw.allocations if b > chunk_f32]
    assert big == [(tokens * vocab * 2, torch.bfloat16)]

    # the recorder does see a full float32 copy when one is made (the naive path)
    rec_naive = AllocationRecorder()
    with rec_naive:
        naive(logits.detach(), labels, 0.9)
    assert rec_naive.largest(torch.float32) >= full_f32


@pytest.mark.parametrize(
    ("logits", "labels", "kwargs", "message"),
    [
        (torch.zeros(4, 5), torch.zeros(3, dtype=torch.long), {}, "labels shape"),
        (torch.zeros(4, 5), torch.zeros(4), {}, "integer tensor"),
        (torch.zeros(4, 5, dtype=torch.long), torch.zeros(4, dtype=torch.long), {}, "float16"),
        (torch.zeros(5), torch.zeros((), dtype=torch.long), {}, "tokens, vocab"),
        (torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), {"temperature": 0.0}, "temperature"),
        (torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), {"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_input_is_named(
    logits: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        logprobs_and_entropy_from_logits(logits, labels, **kwargs)
