"""The TRL plug-in's two pure functions on hand-made `_generate_and_score_completions` outputs:
`pack_grpo_batch` (what is reported) and `apply_estr` (what TRL's loss then multiplies in), and
that the module imports without trl or transformers (trl is not needed to run these)."""

from __future__ import annotations

import math
import subprocess
import sys

import torch

from tests.helpers.procs import REPO
from timwatch.monitor.core.batch import Batch
from timwatch.sidecar.integrations.trl import apply_estr, pack_grpo_batch

NAN = math.nan


def _output(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two completions padded to 4: row 0 has 3 tokens, row 1 has 2 (TRL pads on the right)."""
    return {
        "prompt_ids": torch.tensor([[5, 6], [0, 7]]),
        "prompt_mask": torch.tensor([[1, 1], [0, 1]]),
        "completion_ids": torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
        **extra,
    }


PI = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.25, -3.0, -9.0, -9.0]])
H = torch.tensor([[1.0, 0.5, 2.0, 0.0], [0.125, 1.5, 0.0, 0.0]])


def test_without_engine_logprobs_mu_is_pi_and_only_completion_tokens_are_sent() -> None:
    packed = pack_grpo_batch(_output(), PI, H)
    assert packed["cu_seqlens"].tolist() == [0, 3, 5]
    assert packed["token_ids"].tolist() == [11, 12, 13, 21, 22]
    assert packed["logp_train"].tolist() == [-1.0, -2.0, -0.5, -0.25, -3.0]
    assert torch.equal(packed["logp_rollout"], packed["logp_train"])
    assert packed["entropy"].tolist() == [1.0, 0.5, 2.0, 0.125, 1.5]
    assert packed["loss_mask"].tolist() == [1, 1, 1, 1, 1]
    Batch.from_arrays(**packed)  # a valid batch


def test_engine_logprobs_tool_mask_and_nan() -> None:
    mu = torch.tensor([[-1.5, NAN, -0.5, 0.0], [-0.25, -2.0, 0.0, 0.0]])
    tool = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # row 1's first token is tool output
    packed = pack_grpo_batch(_output(sampling_per_token_logps=mu, tool_mask=tool), PI, H)
    # row 1 still starts at its first token (interior zeros stay, with loss_mask 0)
    assert packed["cu_seqlens"].tolist() == [0, 3, 5]
    # the NaN (vLLM could not score it) leaves the mask, μ there is π
    assert packed["loss_mask"].tolist() == [1, 0, 1, 0, 1]
    assert packed["logp_rollout"].tolist() == [-1.5, -2.0, -0.5, -0.25, -2.0]
    Batch.from_arrays(**packed)


def test_estr_rejects_by_delta_squared_against_entropy() -> None:
    # δ = π − μ; keep iff δ² ≤ τ(H + ε), τ = 1, ε = 0.01
    mu = torch.tensor([[-1.5, NAN, -0.5, 0.0], [-0.25, -2.0, 0.0, 0.0]])
    out = _output(sampling_per_token_logps=mu)
    keep = apply_estr(out, PI, H, tau=1.0, eps=0.01)
    assert keep is not None
    # row 0: δ² 0.25 ≤ 1.01 keep; NaN kept; 0 ≤ 2.01 keep; padding δ² 81 > 0.01 rejected
    # row 1: 0 keep; δ² 1 ≤ 1.51 keep; padding δ² 81 rejected
    assert keep.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert out["tool_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    out = _output(sampling_per_token_logps=mu, tool_mask=torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))
    apply_estr(out, PI, H, tau=0.2, eps=0.01)  # 0.25 > 0.2·1.01 and 1 > 0.2·1.51: rejected
    assert out["tool_mask"].tolist() == [[0, 1, 1, 0], [0, 0, 0, 0]]
    assert apply_estr(_output(), PI, H, tau=1.0) is None  # no μ: TRL's loss unchanged


def test_module_imports_neither_trl_nor_transformers() -> None:
    code = (
        "import sys, timwatch.sidecar.integrations.trl as m;"
        "print(sorted(n for n in ('trl', 'transformers') if n in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
