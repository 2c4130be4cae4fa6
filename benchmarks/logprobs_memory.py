"""Chunked vs naive log-prob + entropy: largest single allocation and wall time, same run.

Run: python benchmarks/logprobs_memory.py [--tokens 4096 --vocab 32000 --chunk 512]
The largest allocation is recorded by intercepting every aten op (TorchDispatchMode), so it is
exact on CPU where torch.cuda.max_memory_allocated is not available.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from timwatch.monitor.trainer.logprobs import logprobs_and_entropy_from_logits

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402


class Largest(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest_f32 = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                if t.untyped_storage().data_ptr() not in seen:
                    self.largest_f32 = max(self.largest_f32, t.untyped_storage().nbytes())
        return out


def naive(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp_all = torch.log_softmax(logits.float(), dim=-1)
    return lp_all.gather(1, labels[:, None]).squeeze(1), -(lp_all.exp() * lp_all).sum(-1)


def run(fn: Any, logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Wall time of forward+backward (best of 3, no interception), then the largest allocation."""
    times = []
    for _ in range(3):
        x = logits.clone().requires_grad_()
        t0 = time.perf_counter()
        lp, h = fn(x, labels)
        (lp.sum() + h.sum()).backward()
        times.append(time.perf_counter() - t0)
    x = logits.clone().requires_grad_()
    rec = Largest()
    with rec:
        lp, h = fn(x, labels)
        (lp.sum() + h.sum()).backward()
    return min(times), rec.largest_f32


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=512)
    bench_json.add_argument(p)
    a = p.parse_args()
    torch.manual_seed(0)
    logits = (torch.randn(a.tokens, a.vocab) * 3).bfloat16()
    labels = torch.randint(0, a.vocab, (a.tokens,))
    t_naive, m_naive = run(naive, logits, labels)
    t_chunk, m_chunk = run(
        lambda x, y: logprobs_and_entropy_from_logits(x, y, chunk_size=a.chunk), logits, labels
    )
    mib = 2**20
    print(f"tokens={a.tokens} vocab={a.vocab} chunk={a.chunk} bf16 logits, forward+backward")
    print(f"naive   : {t_naive:.3f} s, largest float32 allocation {m_naive / mib:9.1f} MiB")
    print(f"chunked : {t_chunk:.3f} s, largest float32 allocation {m_chunk / mib:9.1f} MiB")
    print(
        f"memory ratio naive/chunked {m_naive / m_chunk:.1f}x, time ratio {t_chunk / t_naive:.2f}"
    )
    bench_json.write(
        a.json, "logprobs_memory",
        {"chunked: largest float32 allocation, MiB": m_chunk / mib,
         "naive: largest float32 allocation, MiB": m_naive / mib},
        {"naive / chunked memory": m_naive / m_chunk, "chunked / naive time": t_chunk / t_naive},
        note=f"{a.tokens} tokens, vocabulary {a.vocab}, chunk {a.chunk}, bf16 logits, "
        "forward and backward",
    )  # fmt: skip


if __name__ == "__main__":
    main()
