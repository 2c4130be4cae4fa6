"""An AReaL 1.0.4 actor update on CPU with a tiny model, run through AReaL's own code.

Real AReaL: `PPOActorConfig`, `PPOActor.compute_advantages` / `_compute_advantages` (the roll of
the rollout's log-probs and loss mask, GAE), `PPOActor.ppo_update` / `_ppo_update` (statistics,
mini-batch split), `grpo_loss_fn`, `ppo_actor_loss_fn`, `stats_tracker`, and in the engine below
`split_padded_tensor_dict_into_mb_list` and `pack_tensor_dict`. Written here, because AReaL's
`FSDPEngine` needs a Hugging Face model, FSDP2 and a launcher: `TinyEngine` (the model is the
bigram logit table of tests/helpers/verl_tiny.py; `train_batch` splits, packs and calls the loss
the way `FSDPEngine.train_batch` / `_compute_logprobs_and_loss` do: packed 1-D log-probs and
entropy of the next token, `loss_fn(logprobs, entropy, mb, vocab_min_logits=…,
vocab_max_logits=…)` scaled by the micro-batch's share of the loss weight, then one SGD step),
and the rollout batch (what AReaL's rollout and `compute_logp` hand the trainer: `input_ids`,
`attention_mask`, `loss_mask`, the engine's `logprobs` per token, `rewards`, `prox_logp`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.helpers.verl_tiny import VOCAB, TinyModel

PROMPT = 3


class TinyEngine:
    """The parts of AReaL's `TrainEngine` that `PPOActor` calls, on a `TinyModel`."""

    def __init__(self, model: TinyModel, *, n_mbs: int = 2, version: int = 0) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        self.n_mbs = n_mbs
        self._version = version
        self.loss_calls = 0

    # the layout: one process
    data_parallel_rank = 0

    def is_data_parallel_head(self) -> bool:
        return True

    def train(self, mode: bool = True) -> TinyEngine:
        return self

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    def _logp_entropy(self, packed: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = packed["input_ids"]
        logits = self.model.table[ids].float()
        logp = torch.log_softmax(logits, dim=-1)
        labels = torch.roll(ids, shifts=-1)  # FSDPEngine: the next token of the packed stream
        chosen = logp.gather(-1, labels[:, None])[:, 0]
        return chosen, -(logp.exp() * logp).sum(-1)

    def train_batch(self, input_: dict[str, Any], loss_fn: Any, loss_weight_fn: Any) -> dict:
        from areal.api.cli_args import MicroBatchSpec
        from areal.utils.data import pack_tensor_dict, split_padded_tensor_dict_into_mb_list

        self.optimizer.zero_grad()
        mbs = split_padded_tensor_dict_into_mb_list(input_, MicroBatchSpec(n_mbs=self.n_mbs)).mbs
        packed = [pack_tensor_dict(mb) for mb in mbs]
        total = sum(float(loss_weight_fn(p)) for p in packed)
        for mb in packed:
            logprobs, entropy = self._logp_entropy(mb)
            logits = self.model.table[mb["input_ids"]].detach()
            self.loss_calls += 1
            loss = loss_fn(
                logprobs,
                entropy,
                mb,
                vocab_min_logits=logits.amin(-1),
                vocab_max_logits=logits.amax(-1),
            )
            (loss * float(loss_weight_fn(mb)) / total).backward()
        self.optimizer.step()
        return {"lr": 0.5}


def actor(engine: TinyEngine, **config: Any) -> Any:
    """AReaL's `PPOActor` with the decoupled loss (μ from the rollout, π_old recomputed)."""
    from areal.api.cli_args import PPOActorConfig
    from areal.trainer.ppo.actor import PPOActor

    settings: dict[str, Any] = {
        "experiment_name": "timwatch",
        "trial_name": "test",
        "use_decoupled_loss": True,
        "recompute_logprob": True,
        "ppo_n_minibatches": 1,
    }
    return PPOActor(PPOActorConfig(**(settings | config)), engine)  # type: ignore[arg-type]


def rollout_batch(seed: int, model: TinyModel, *, n: int = 4, drift: float = 0.4) -> dict:
    """A padded rollout: `PROMPT` prompt tokens and 2–5 response tokens per sequence, μ from an
    engine whose logit table is `model`'s plus `drift`·N(0, 1), π_old (`prox_logp`) from
    `model`, aligned as `PPOActor.compute_logp` returns it (position t: token t + 1)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [PROMPT + int(r) for r in torch.randint(2, 6, (n,), generator=g)]
    width = max(lengths) + 1
    ids = torch.randint(0, VOCAB, (n, width), generator=g)
    attn = torch.zeros(n, width, dtype=torch.bool)
    loss_mask = torch.zeros(n, width, dtype=torch.int32)
    for i, ln in enumerate(lengths):
        attn[i, :ln] = True
        loss_mask[i, PROMPT:ln] = 1
    ids = torch.where(attn, ids, torch.zeros_like(ids))
    engine_table = model.table.detach() + drift * torch.randn(VOCAB, VOCAB, generator=g)
    mu_next = _next_logp(engine_table, ids)  # position t: log μ(token t + 1)
    logprobs = torch.roll(mu_next, 1, dims=-1) * loss_mask  # the engine's: position t, token t
    prox = _next_logp(model.table.detach(), ids) * torch.roll(loss_mask, -1, dims=-1)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss_mask,
        "logprobs": logprobs.float(),
        "prox_logp": prox.float(),
        "rewards": torch.randn(n, generator=g),
        "versions": torch.zeros(n, width, dtype=torch.int32),
        "_engine_table": engine_table,
    }


def _next_logp(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(table[ids].float(), dim=-1)
    return logp.gather(-1, torch.roll(ids, -1, dims=-1)[..., None])[..., 0]


def trajectories(batch: dict) -> list[dict]:
    """The batch as AReaL's trainer holds it: one dict per trajectory."""
    keys = [k for k in batch if not k.startswith("_")]
    return [{k: batch[k][i : i + 1] for k in keys} for i in range(batch["input_ids"].shape[0])]


def expected_tokens(batch: dict, model: TinyModel) -> list[list[tuple[float, float, float]]]:
    """Per sequence, (μ, π_old, H) of each response token in float64, from the two logit tables
    directly (not from AReaL's arrays): token t follows token t − 1 in a bigram model."""
    table_mu = batch["_engine_table"].double()
    table_pi = model.table.detach().double()
    out = []
    for i in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][i]
        seq = []
        for t in range(PROMPT, int(batch["attention_mask"][i].sum())):
            prev, tok = int(ids[t - 1]), int(ids[t])
            lmu = torch.log_softmax(table_mu[prev], -1)
            lpi = torch.log_softmax(table_pi[prev], -1)
            seq.append((float(lmu[tok]), float(lpi[tok]), float(-(lpi.exp() * lpi).sum())))
        out.append(seq)
    return out


def packed_expected(tokens: list[list[tuple[float, float, float]]]) -> dict[str, np.ndarray]:
    """`expected_tokens` in the packed layout, response tokens only."""
    flat = [t for seq in tokens for t in seq]
    cu = np.cumsum([0] + [len(s) for s in tokens]).astype(np.int64)
    arr = np.array(flat, dtype=np.float64)
    return {
        "cu_seqlens": cu,
        "logp_rollout": arr[:, 0],
        "logp_train": arr[:, 1],
        "entropy": arr[:, 2],
        "loss_mask": np.ones(len(flat), dtype=np.int8),
    }


def reported_tokens(arrays: dict[str, Any]) -> list[list[tuple[float, float, float]]]:
    """A report's masked tokens, per sequence, as (μ, π_old, H)."""
    cu = [int(x) for x in np.asarray(arrays["cu_seqlens"])]
    cols = [np.asarray(arrays[k], dtype=np.float64) for k in ("logp_rollout", "logp_train")]
    h = np.asarray(arrays["entropy"], dtype=np.float64)
    m = np.asarray(arrays["loss_mask"]) != 0
    return [
        [(cols[0][j], cols[1][j], h[j]) for j in range(cu[s], cu[s + 1]) if m[j]]
        for s in range(len(cu) - 1)
    ]


def update(actor_: Any, batch: dict) -> None:
    """One AReaL training step's actor part, as `PPOTrainer.train` runs it."""
    adv = actor_.compute_advantages(trajectories(batch))
    actor_.ppo_update(adv)
