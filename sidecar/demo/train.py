"""The demo's RL loop, one step at a time: rollout in the engine's precision with weights ``lag``
versions old, ``updates`` Adam steps of the fp32 trainer with the ESTR PPO loss, and the step's
μ, π, H, versions and logp_old handed to the `Tap`. Imports torch: demo-only code.

Every step is complete when `DemoTrainer.step` returns (its batch is queued on the tap), so a
loop interrupted between two calls leaves only whole steps behind.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from timwatch.monitor.trainer.logprobs import logprobs_and_entropy_from_logits
from timwatch.monitor.trainer.losses import estr_ppo_loss
from timwatch.sidecar.demo.tinylm import TinyLM

__all__ = ["DTYPES", "PROMPT_LEN", "DemoTrainer"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROMPT_LEN = 4


class DemoTrainer:
    """The tiny LM (trainer, fp32), its engine copy (``precision``) and the weight history that
    the lag needs; `step` runs one RL step and returns that step's mean reward.

    ``token_drift`` (default 0: none) injects a tokenization round-trip bug for labelled runs
    (``benchmarks/diagnosis_runs.py``): that share of response tokens reaches the trainer as
    another id, so π and logp_old are computed on tokens the engine never sampled, as after a
    detokenize → retokenize that does not round-trip.
    """

    def __init__(
        self, *, precision: str, lag: int, batch: int, max_new_tokens: int, updates: int,
        lr: float, seed: int, threads: int, token_drift: float = 0.0,
    ) -> None:  # fmt: skip
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.lag, self.batch, self.updates = lag, batch, updates
        self.max_new_tokens = max_new_tokens
        self.token_drift = token_drift
        self.model = TinyLM(seed=seed, max_len=PROMPT_LEN + max_new_tokens)
        self.engine = copy.deepcopy(self.model).to(DTYPES[precision]).eval()
        self.old = copy.deepcopy(self.model).eval()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.history = {0: copy.deepcopy(self.model.state_dict())}
        self.gen = torch.Generator().manual_seed(seed + 1)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _retokenized(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` as the trainer sees it: with ``token_drift``, some response ids shifted."""
        if self.token_drift <= 0:
            return full
        drift = torch.rand(full.shape, generator=self.gen) < self.token_drift
        drift[:, :PROMPT_LEN] = False
        return torch.where(drift, (full + 1) % self.model.vocab, full)

    def step(self, step: int, tap: Any) -> float:
        model, batch, new = self.model, self.batch, self.max_new_tokens
        behaviour = max(0, step - self.lag)
        self.engine.load_state_dict(self.history[behaviour])  # cast to the engine's dtype
        self.old.load_state_dict(self.history[behaviour])
        prompt = torch.randint(0, model.vocab, (batch, PROMPT_LEN), generator=self.gen)
        lengths = torch.randint(max(1, new // 4), new + 1, (batch,), generator=self.gen)
        roll = self.engine.generate(prompt, new, self.gen)
        tokens, mu = roll.tokens, roll.logp
        full = self._retokenized(torch.cat([prompt, tokens], dim=1))
        mask = torch.arange(new)[None, :] < lengths[:, None]
        with torch.no_grad():
            logp_old, h_old = logprobs_and_entropy_from_logits(
                self.old(full)[:, PROMPT_LEN - 1 : -1], tokens
            )
        target = (tokens % 8 == 0).float()
        reward = (target * mask).sum(1) / lengths
        adv = ((reward - reward.mean()) / (reward.std() + 1e-6))[:, None].expand_as(mu)
        pi0 = h0 = None
        for _ in range(self.updates):
            pi, h = logprobs_and_entropy_from_logits(model(full)[:, PROMPT_LEN - 1 : -1], tokens)
            if pi0 is None:
                pi0, h0 = pi.detach(), h.detach()
            loss, _ = estr_ppo_loss(pi, logp_old, adv, mask, mu, h_old)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        self.history[step + 1] = copy.deepcopy(model.state_dict())
        self.history.pop(step - self.lag, None)
        assert pi0 is not None and h0 is not None
        cu = torch.zeros(batch + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=cu[1:])
        n = int(cu[-1])
        tap.report(
            step, cu_seqlens=cu, logp_rollout=mu[mask], logp_train=pi0[mask], entropy=h0[mask],
            loss_mask=torch.ones(n, dtype=torch.int8), token_ids=tokens[mask],
            token_ids_train=full[:, PROMPT_LEN:][mask],
            versions=torch.full((n,), behaviour, dtype=torch.int64),
            logp_old=logp_old[mask], policy_version=step,
        )  # fmt: skip
        return float(reward.mean())
