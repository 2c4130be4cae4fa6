"""One GRPO step of lab v2: the engine samples ``group`` responses per corpus prompt with its own
numerics and (possibly stale) weights; the fp32 trainer recomputes π_old (or, with
``proximal="rollout"``, takes μ as π_old) and takes ``updates`` PPO-clip updates (ε 0.2/0.28,
token-mean loss, gradient clipped at ``grad_clip``) with the configured correction on a trainer
recomputation over μ; μ, π, H and the rollout weights' fp32 log-probs go to the tap.

Invariants: the trainer's first-update π and H are what the tap receives as ``logp_train`` and
``entropy``; `Health` holds the step's trainer scalars (reward mean/std, the pre-clip gradient
norm, the policy entropy, response lengths, lr, clip fraction, loss, mismatch k3, share of
tokens the correction dropped or truncated). Responses have a fixed length (no end-of-sequence
id), so the length scalars are constant. Imports torch: lab-only code.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from timwatch.monitor.core.masks import (
    estr_keep_mask,
    icepop_keep_mask,
    tis_keep_mask,
    tis_weights,
)
from timwatch.monitor.trainer.logprobs import logprobs_and_entropy_from_logits
from timwatch.monitor.trainer.losses import k3, ppo_clip_token_loss

from .configs import V2Config
from .corpus import Corpus
from .engines import Engine
from .model import LM
from .pretrain import PretrainConfig, load_pretrained
from .reward import REWARDS

__all__ = ["Health", "V2Trainer"]


@dataclass
class Health:
    step: int
    reward: float
    reward_std: float
    grad_norm: float
    entropy: float
    response_len_mean: float
    response_len_max: float
    lr: float
    clip_fraction: float
    loss: float
    mismatch_kl: float
    mask_ratio: float


class V2Trainer:
    """The fp32 policy, its optimiser, its engine and the weight history the lag needs."""

    def __init__(
        self,
        cfg: V2Config,
        seed: int,
        pre: PretrainConfig | None = None,
        threads: int = 1,
        cache: Path | None = None,
    ) -> None:
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        pre = pre or PretrainConfig()
        state, self.pretrain_info = load_pretrained(pre, cache)
        self.cfg = cfg
        self.corpus = Corpus(pre.corpus)
        self.model = LM(pre.model)
        self.model.load_state_dict(state)
        self.engine = Engine(self.model, cfg.engine, cfg.top_k, cfg.top_p)
        self.behav = copy.deepcopy(self.model).eval()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.history = {0: copy.deepcopy(self.model.state_dict())}
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.rng = np.random.default_rng(seed + 2)

    def step(self, step: int, tap: Any) -> Health:
        cfg, model = self.cfg, self.model
        p = cfg.prompt_len
        behaviour = max(0, step - cfg.lag)
        self.engine.load(self.history[behaviour])
        prompts = torch.from_numpy(self.corpus.sample(cfg.prompts, p, self.rng))
        prompt = prompts.repeat_interleave(cfg.group, dim=0)
        tokens, mu = self.engine.generate(prompt, cfg.response, self.gen)
        full = torch.cat([prompt, tokens], dim=1)
        rew = REWARDS[cfg.reward](tokens)
        grouped = rew.view(cfg.prompts, cfg.group)
        adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
        adv = adv.reshape(-1, 1).expand_as(mu)
        with torch.no_grad():
            # π_behav: fp32 under the rollout's weights (the tap's logp_old, with which timwatch
            # splits staleness from engine mismatch); π_old: the proximal policy
            if behaviour == step:
                behav, h_behav = logprobs_and_entropy_from_logits(
                    model(full)[:, p - 1 : -1], tokens
                )
                old, h_old = behav, h_behav
            else:
                self.behav.load_state_dict(self.history[behaviour])
                behav, h_behav = logprobs_and_entropy_from_logits(
                    self.behav(full)[:, p - 1 : -1], tokens
                )
                if cfg.proximal == "current":
                    old, h_old = logprobs_and_entropy_from_logits(
                        model(full)[:, p - 1 : -1], tokens
                    )
                else:
                    old, h_old = behav, h_behav
        # the corrections compare that trainer recomputation with μ
        ref, h_ref = old, h_old
        if cfg.proximal == "rollout":  # no recompute: μ is π_old, the mismatch enters ρ itself
            old = mu.float()
        keep = torch.ones_like(mu, dtype=torch.bool)
        weight = torch.ones_like(mu)
        if cfg.correction == "tis":
            weight = tis_weights(ref, mu).float()
            dropped = float((~tis_keep_mask(ref, mu)).float().mean())  # truncated, not dropped
        else:
            if cfg.correction == "icepop":
                keep = icepop_keep_mask(ref, mu)
            elif cfg.correction == "estr":
                keep = estr_keep_mask(ref, mu, h_ref, tau=cfg.tau)
            dropped = float(1.0 - keep.float().mean())
        pi0 = h0 = None
        grad_norm, clip_frac, loss_v = 0.0, 0.0, 0.0
        for u in range(cfg.updates):
            pi, h = logprobs_and_entropy_from_logits(model(full)[:, p - 1 : -1], tokens)
            per_token, clipped = ppo_clip_token_loss(pi - old, adv)
            loss = torch.where(keep, per_token * weight, 0.0).sum() / per_token.numel()
            self.opt.zero_grad()
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
            self.opt.step()
            grad_norm = max(grad_norm, norm)
            if u == 0:
                pi0, h0, loss_v = pi.detach(), h.detach(), float(loss.detach())
            clip_frac += float(clipped.float().mean()) / cfg.updates
        self.history[step + 1] = copy.deepcopy(model.state_dict())
        self.history.pop(step - cfg.lag, None)
        assert pi0 is not None and h0 is not None
        n_seq, new = tokens.shape
        n = n_seq * new
        tap.report(
            step, cu_seqlens=torch.arange(0, n + 1, new, dtype=torch.int64),
            logp_rollout=mu.reshape(-1), logp_train=pi0.reshape(-1), entropy=h0.reshape(-1),
            loss_mask=torch.ones(n, dtype=torch.int8), token_ids=tokens.reshape(-1),
            token_ids_train=full[:, p:].reshape(-1),
            versions=torch.full((n,), behaviour, dtype=torch.int64),
            logp_old=behav.reshape(-1), policy_version=step,
        )  # fmt: skip
        return Health(
            step=step, reward=float(rew.mean()), reward_std=float(rew.std()),
            grad_norm=grad_norm, entropy=float(h0.mean()), response_len_mean=float(new),
            response_len_max=float(new), lr=float(self.opt.param_groups[0]["lr"]),
            clip_fraction=clip_frac, loss=loss_v,
            mismatch_kl=float(k3(pi0 - mu).mean()), mask_ratio=dropped,
        )  # fmt: skip
