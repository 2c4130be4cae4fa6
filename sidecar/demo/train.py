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

from ...monitor.trainer.logprobs import logprobs_and_entropy_from_logits
from ...monitor.trainer.losses import estr_ppo_loss
from .tinylm import TinyLM

__all__ = ["DTYPES", "PROMPT_LEN", "DemoTrainer"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: KV cache dtypes (``kv_dtype``): the compute dtypes and float8 e4m3
KV_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn}
PROMPT_LEN = 4
TEACHER_MIN_TEMPERATURE = 0.005


class DemoTrainer:
    """The tiny LM (trainer, fp32), its engine copy (``precision``) and the weight history that
    the lag needs; `step` runs one RL step and returns that step's mean reward.

    Response lengths are drawn uniformly from ``min_new_tokens`` (default: a quarter of
    ``max_new_tokens``) to ``max_new_tokens``. The keyword settings below default to the plain
    demo; the labelled runs of ``benchmarks/diagnosis_runs.py`` turn them on, one at a time:

    * ``token_drift`` (0: none) injects a tokenization round-trip bug: that share of response
      tokens reaches the trainer as another id, so π and logp_old are computed on tokens the
      engine never sampled, as after a detokenize → retokenize that does not round-trip.
    * ``rope_dtype`` (None: no rotary embedding) gives the LM rotary position embeddings and
      the engine computes their angles in that dtype (the trainer in fp32).
    * ``kv_dtype`` (None: the engine's dtype) stores the engine's decode KV cache in that dtype
      (``fp8``: float8 e4m3, scale 1.0, as ``--kv-cache-dtype fp8_e4m3`` does without
      calibrated scales).
    * ``teacher_decay`` (None: no teacher) adds an on-policy distillation teacher that scores
      every sampled token (``logp_teacher``, fp32): the initial weights, frozen, at the
      temperature ``max(teacher_decay ** step, TEACHER_MIN_TEMPERATURE)`` (1.0: a constant
      temperature 1). A decay below 1 is a teacher-temperature schedule annealed too far: the
      teacher turns near-deterministic. (The floor keeps log-probs above the batch's -1e5.)
    """

    def __init__(
        self, *, precision: str, lag: int, batch: int, max_new_tokens: int, updates: int,
        lr: float, seed: int, threads: int, token_drift: float = 0.0,
        rope_dtype: str | None = None, kv_dtype: str | None = None,
        teacher_decay: float | None = None, min_new_tokens: int | None = None,
    ) -> None:  # fmt: skip
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.lag, self.batch, self.updates = lag, batch, updates
        self.max_new_tokens = max_new_tokens
        shortest = max_new_tokens // 4 if min_new_tokens is None else min_new_tokens
        self.min_new_tokens = max(1, shortest)
        self.token_drift = token_drift
        self.model = TinyLM(
            seed=seed, max_len=PROMPT_LEN + max_new_tokens, rope=rope_dtype is not None
        )
        self.engine = copy.deepcopy(self.model).to(DTYPES[precision]).eval()
        if rope_dtype is not None:
            self.engine.rope_dtype = DTYPES[rope_dtype]
        if kv_dtype is not None:
            self.engine.kv_dtype = KV_DTYPES[kv_dtype]
        self.old = copy.deepcopy(self.model).eval()
        self.teacher_decay = teacher_decay
        self.teacher = None if teacher_decay is None else copy.deepcopy(self.model).eval()
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
        lengths = torch.randint(self.min_new_tokens, new + 1, (batch,), generator=self.gen)
        roll = self.engine.generate(prompt, new, self.gen)
        tokens, mu = roll.tokens, roll.logp
        full = self._retokenized(torch.cat([prompt, tokens], dim=1))
        mask = torch.arange(new)[None, :] < lengths[:, None]
        with torch.no_grad():
            logp_old, h_old = logprobs_and_entropy_from_logits(
                self.old(full)[:, PROMPT_LEN - 1 : -1], tokens
            )
            logp_teacher = self._teacher_logp(step, full, tokens)
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
            logp_teacher=None if logp_teacher is None else logp_teacher[mask],
        )  # fmt: skip
        return float(reward.mean())

    def _teacher_logp(
        self, step: int, full: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor | None:
        """The teacher's log-prob of every sampled token at its temperature of ``step`` (None
        without a teacher)."""
        if self.teacher is None or self.teacher_decay is None:
            return None
        temperature = max(self.teacher_decay**step, TEACHER_MIN_TEMPERATURE)
        logits = self.teacher(full)[:, PROMPT_LEN - 1 : -1].float() / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]
