"""One GRPO step of the lab: the engine samples a group per prompt with its own numerics and
(possibly stale) weights, the fp32 trainer recomputes π_old under its current weights and takes
decoupled PPO-clip updates with the configured correction on π_old/μ; μ, π, H and the rollout
weights' fp32 log-probs go to the `Tap`. Imports torch: lab-only code.

Task: copy. A prompt is `prompt_len` ids drawn from the vocabulary; the response has the same
length; the reward is the share of positions where the response repeats the prompt's id (exact
match per position). A random policy scores 1/vocab; a solved one scores 1.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from benchmarks.collapse_lab.configs import LabConfig
from timwatch.monitor.core.masks import estr_keep_mask
from timwatch.monitor.trainer.logprobs import logprobs_and_entropy_from_logits
from timwatch.monitor.trainer.losses import ppo_clip_token_loss
from timwatch.sidecar.demo.tinylm import TinyLM, _Block

__all__ = ["LabTrainer", "StepLog"]

FP8 = torch.float8_e4m3fn


@dataclass
class StepLog:
    step: int
    reward: float
    grad_norm: float
    entropy: float
    mismatch_kl: float
    mask_ratio: float


def _fp8_round(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled float8 e4m3 round trip (448 is e4m3's largest finite value)."""
    scale = w.abs().max().clamp(min=1e-12) / 448.0
    return (w / scale).to(FP8).to(torch.float32) * scale


def _e5m2_round(w: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled float8 e5m2 round trip (2 mantissa bits; 57344 its largest finite)."""
    scale = w.abs().max().clamp(min=1e-12) / 57344.0
    return (w / scale).to(torch.float8_e5m2).to(torch.float32) * scale


def _int4_round(w: torch.Tensor) -> torch.Tensor:
    """Symmetric per-tensor int4 round trip: 15 levels, scale = max |w| / 7."""
    scale = w.abs().max().clamp(min=1e-12) / 7.0
    return (w / scale).round().clamp(-7, 7) * scale


_ROUNDING = {"fp8": _fp8_round, "e5m2": _e5m2_round, "int4": _int4_round}


def _processed(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs of the top-k then top-p truncated, renormalised distribution."""
    logp = F.log_softmax(logits.float(), dim=-1)
    if top_k > 0:
        kth = logp.topk(top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, -math.inf)
    if top_p < 1.0:
        srt, idx = logp.sort(dim=-1, descending=True)
        cum = srt.exp().cumsum(-1)
        drop = cum - srt.exp() > top_p
        logp = logp.scatter(-1, idx, srt.masked_fill(drop, -math.inf))
    return F.log_softmax(logp, dim=-1)


class LabTrainer:
    """The fp32 trainer, its engine copy and the weight history the lag needs."""

    def __init__(self, cfg: LabConfig, seed: int, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.cfg = cfg
        self.model = TinyLM(vocab=cfg.vocab, max_len=2 * cfg.prompt_len, seed=seed)
        dtype = torch.float32 if cfg.engine == "fp32" else torch.bfloat16
        self.engine = copy.deepcopy(self.model).to(dtype).eval()
        self.old = copy.deepcopy(self.model).eval()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.history = {0: copy.deepcopy(self.model.state_dict())}
        self.gen = torch.Generator().manual_seed(seed + 1)

    def _load_engine(self, state: dict[str, torch.Tensor]) -> None:
        rnd = _ROUNDING.get(self.cfg.engine)
        if rnd is not None:
            state = {k: rnd(v) if v.dim() == 2 else v for k, v in state.items()}
        self.engine.load_state_dict(state)

    @torch.no_grad()
    def _generate(self, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KV-cache decode in the engine's dtype; μ of the (processed) sampling distribution."""
        eng, cfg = self.engine, self.cfg
        b, p = prompt.shape
        caches: list[list[torch.Tensor] | None] = [None] * len(eng.blocks)
        tokens, logps = [], []
        nxt = prompt[:, 0]
        for pos in range(2 * p - 1):
            x = eng.tok(nxt[:, None]) + eng.pos.weight[pos]
            for i, block in enumerate(eng.blocks):
                x, caches[i] = cast(_Block, block).step(x, caches[i])
            if pos + 1 < p:
                nxt = prompt[:, pos + 1]
                continue
            logits = eng._logits(x[:, 0])
            if cfg.top_k > 0 or cfg.top_p < 1.0:
                logp = _processed(logits, cfg.top_k, cfg.top_p)
            else:
                logp = F.log_softmax(logits.float(), dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=self.gen)[:, 0]
            tokens.append(nxt)
            logps.append(logp.gather(1, nxt[:, None])[:, 0])
        return torch.stack(tokens, 1), torch.stack(logps, 1)

    def step(self, step: int, tap: Any) -> StepLog:
        cfg, model = self.cfg, self.model
        p = cfg.prompt_len
        behaviour = max(0, step - cfg.lag)
        self._load_engine(self.history[behaviour])
        self.old.load_state_dict(self.history[behaviour])
        prompts = torch.randint(0, cfg.vocab, (cfg.prompts, p), generator=self.gen)
        prompt = prompts.repeat_interleave(cfg.group, dim=0)
        tokens, mu = self._generate(prompt)
        full = torch.cat([prompt, tokens], dim=1)
        reward = (tokens == prompt).float().mean(1)
        grouped = reward.view(cfg.prompts, cfg.group)
        adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
        adv = adv.reshape(-1, 1).expand_as(mu)
        with torch.no_grad():
            # π_behav: fp32 under the rollout's weights (the tap's logp_old: timwatch splits
            # staleness from engine mismatch with it); π_old: fp32 under the current weights,
            # the proximal policy of decoupled PPO. The corrections see δ = π_old − μ, engine
            # mismatch and staleness together, as async RL trainers' rollout corrections do.
            behav, h_behav = logprobs_and_entropy_from_logits(self.old(full)[:, p - 1 : -1], tokens)
            old, h_old = logprobs_and_entropy_from_logits(model(full)[:, p - 1 : -1], tokens)
            if cfg.proximal == "behaviour":  # π_old is the rollout weights' fp32 recomputation
                old, h_old = behav, h_behav
        delta = old - mu
        keep = torch.ones_like(mu, dtype=torch.bool)
        weight = torch.ones_like(mu)
        if cfg.correction == "tis":
            weight = torch.exp(delta.clamp(max=20)).clamp(max=2.0)
        elif cfg.correction == "icepop":
            r = torch.exp(delta.clamp(-20, 20))
            keep = (r >= 0.5) & (r <= 5.0)
        elif cfg.correction == "estr":
            keep = estr_keep_mask(old, mu, h_old, tau=cfg.tau)
        pi0 = h0 = None
        grad_norm = 0.0
        for _ in range(cfg.updates):
            pi, h = logprobs_and_entropy_from_logits(model(full)[:, p - 1 : -1], tokens)
            if pi0 is None:
                pi0, h0 = pi.detach(), h.detach()
            per_token, _ = ppo_clip_token_loss(pi - old, adv)
            loss = (torch.where(keep, per_token * weight, 0.0)).sum() / per_token.numel()
            self.opt.zero_grad()
            loss.backward()
            grad_norm = max(
                grad_norm, float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
            )
            self.opt.step()
        self.history[step + 1] = copy.deepcopy(model.state_dict())
        self.history.pop(step - cfg.lag, None)
        assert pi0 is not None and h0 is not None
        n_seq, new = tokens.shape
        cu = torch.arange(0, (n_seq + 1) * new, new, dtype=torch.int64)
        n = n_seq * new
        tap.report(
            step, cu_seqlens=cu, logp_rollout=mu.reshape(-1), logp_train=pi0.reshape(-1),
            entropy=h0.reshape(-1), loss_mask=torch.ones(n, dtype=torch.int8),
            token_ids=tokens.reshape(-1), token_ids_train=full[:, p:].reshape(-1),
            versions=torch.full((n,), behaviour, dtype=torch.int64),
            logp_old=behav.reshape(-1), policy_version=step,
        )  # fmt: skip
        d = (pi0 - mu).double().clamp(-20, 20)
        return StepLog(
            step=step, reward=float(reward.mean()), grad_norm=grad_norm,
            entropy=float(h0.mean()), mismatch_kl=float((torch.expm1(d) - d).mean()),
            mask_ratio=float(1.0 - keep.float().mean()),
        )  # fmt: skip
