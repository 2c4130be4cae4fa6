"""A SkyRL 0.3.0 policy update on CPU with a tiny model, run through SkyRL's own code.

Real SkyRL: `RayPPOTrainer.train_critic_and_policy` (sets `metadata["global_step"]`),
`_execute_training_step` (epochs × mini-batches, forward_backward + optim_step, metric
reduction), `_normalize_advantages`, `TrainingInputBatch` and its slicing, the worker's
`PolicyWorkerBase.forward_backward` / `_forward_backward_micro` (micro-batch iterator, `Experience`,
the entropy slice, the loss from `PolicyLossRegistry`, metric reduction), the config dataclasses
and `MeshRank`. Written here, because SkyRL's FSDP worker needs CUDA, Ray actors and a Hugging
Face model: `TinyPolicy` (a `[vocab, vocab]` logit table with SkyRL's `HFModelWrapper` call and
output layout: right-aligned action log-probs, `output["entropy"]` over the whole sequence),
`LocalStrategy` (backward, an SGD step, all-reduce over one process), `LocalDispatch` (SkyRL's
`WorkerDispatch` without Ray: the mini-batch slices `stage_data` would put in the object store,
handed to the one worker), and `torch.cuda.current_device`, pointed at the CPU by
`cpu_device_patches`.

skyrl 0.3.0 does not import on Python 3.11 (its `skyrl/tinker/types.py` puts a
`typing.TypedDict` into a pydantic model, which pydantic refuses before 3.12); `import_skyrl`
lends it `typing_extensions.TypedDict` for that one import. SkyRL itself runs on ≥ 3.12.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
import torch

VOCAB = 11


def import_skyrl() -> None:
    """Import SkyRL's modules used here (see the module doc for the TypedDict stand-in)."""
    import typing

    import typing_extensions

    original = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
    try:
        import skyrl.tinker.types  # noqa: F401
    finally:
        typing.TypedDict = original  # type: ignore[misc]
    import skyrl.backends.skyrl_train.workers.worker  # noqa: F401
    import skyrl.train.trainer  # noqa: F401


def cpu_device_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


class TinyPolicy(torch.nn.Module):
    """SkyRL's policy-model call: `(sequences, num_actions, attention_mask=…, temperature=…,
    return_output=True, compute_entropy=True, …)` → `(action_log_probs [B, num_actions],
    {"entropy": [B, T]})`, the log-prob of token t+1 and the entropy at position t."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g) * 1.5)

    def logp_entropy(
        self, sequences: torch.Tensor, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(self.table[sequences].float() / temperature, dim=-1)
        chosen = logp[:, :-1].gather(-1, sequences[:, 1:, None])[..., 0]  # [B, T-1]
        entropy = -(logp.exp() * logp).sum(-1)  # [B, T]
        return chosen, entropy

    def forward(
        self,
        sequences: torch.Tensor,
        num_actions: int,
        attention_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        return_output: bool = False,
        compute_entropy: bool = False,
        **kwargs: Any,
    ) -> Any:
        del attention_mask, kwargs
        chosen, entropy = self.logp_entropy(sequences, temperature)
        action = chosen[:, -num_actions:]
        if not return_output:
            return action
        return action, {"entropy": entropy if compute_entropy else None}


class LocalStrategy:
    """The parts of SkyRL's `DistributedStrategy` the policy worker calls, for one process."""

    def backward(self, loss: torch.Tensor, model: Any, optimizer: Any) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: Any, model: Any, scheduler: Any, name: str = "") -> Any:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        optimizer.step()
        optimizer.zero_grad()
        return norm

    def all_reduce(self, data: Any, op: str = "mean", group: Any = None) -> Any:
        return data


def trainer_config(loss: str = "estr", **algorithm: Any) -> Any:
    from skyrl.train.config.config import TrainerConfig

    cfg = TrainerConfig()
    cfg.algorithm.policy_loss_type = loss
    cfg.algorithm.temperature = 1.0
    cfg.algorithm.max_seq_len = 32
    cfg.algorithm.use_kl_loss = False  # no reference model here
    cfg.micro_train_batch_size_per_gpu = 2
    for k, v in algorithm.items():
        setattr(cfg.algorithm, k, v)
    return cfg


def make_worker(model: TinyPolicy, cfg: Any, *, dp: int = 0, sp: int = 0) -> Any:
    """SkyRL's `PolicyWorkerBase` (what its FSDP worker inherits `forward_backward`,
    `_forward_backward_micro` and `optim_step` from; `fsdp_worker` itself imports flash-attn)
    with the model, optimizer, strategy and mesh set here."""
    from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase

    worker_cls = type("TinyPolicyWorker", (PolicyWorkerBase,), {})
    worker_cls.__abstractmethods__ = frozenset()
    worker = object.__new__(worker_cls)
    worker.cfg = cfg
    worker.model = model
    worker.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda _: 1.0)
    worker.strategy = LocalStrategy()
    worker.mesh_rank = MeshRank(dp=dp, sp=sp, tp=0, pp=0, world_size=1, dp_size=1, pp_size=1)
    worker.device_mesh = types.SimpleNamespace(get_group=lambda name: None)
    worker.policy_loss_fn = PolicyLossRegistry.get(cfg.algorithm.policy_loss_type)
    return worker


class LocalDispatch:
    """SkyRL's `WorkerDispatch` for the policy without Ray: every worker gets each mini-batch
    (they stand for the sp ranks of one dp group)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    def stage_data(self, model: str, data: Any, boundaries: list[tuple[int, int]]) -> list[Any]:
        return [data[start:end] for start, end in boundaries]

    def forward_backward_from_staged(self, model: str, chunk: Any, **kw: Any) -> Any:
        outs = [w.forward_backward(chunk, **kw) for w in self.workers]
        return outs[0]

    def optim_step(self, model: str) -> Any:
        norms = [w.optim_step() for w in self.workers]
        return norms[0]

    def empty_cache(self) -> None:
        pass


def stub_trainer(cfg: Any, dispatch: LocalDispatch, global_step: int) -> Any:
    """SkyRL's `RayPPOTrainer` with only what `train_critic_and_policy` reads."""
    from skyrl.train.trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.cfg = types.SimpleNamespace(trainer=cfg)
    trainer.global_step = global_step
    trainer.all_timings = {}
    trainer.all_metrics = {}
    trainer.dispatch = dispatch
    return trainer


def rollout_batch(
    seed: int,
    model: TinyPolicy,
    bs: int = 4,
    prompt: int = 3,
    response: int = 6,
    noise: float = 0.8,
) -> Any:
    """A `TrainingInputBatch` laid out as SkyRL's `convert_prompts_responses_to_batch_tensors`
    lays it out (one left-padded block per row, response tensors right-aligned), with π_old from
    `model`, μ = π_old + Gaussian noise (kept below 0), a loss-mask hole, and mini-batches of 2
    rows."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    g = torch.Generator().manual_seed(seed)
    resp_len = torch.randint(2, response + 1, (bs,), generator=g)
    resp_len[0] = response
    width = prompt + response
    sequences = torch.zeros(bs, width, dtype=torch.long)
    attention = torch.zeros(bs, width, dtype=torch.long)
    response_mask = torch.zeros(bs, response, dtype=torch.long)
    for i in range(bs):
        n = prompt + int(resp_len[i])
        sequences[i, width - n :] = torch.randint(1, VOCAB, (n,), generator=g)
        attention[i, width - n :] = 1
        response_mask[i, response - int(resp_len[i]) :] = 1
    loss_mask = response_mask.clone().float()
    loss_mask[1, -1] = 0.0  # a masked token inside a sequence
    with torch.no_grad():
        chosen, _ = model.logp_entropy(sequences)
    old = chosen[:, -response:] * response_mask
    mu = (old + noise * torch.randn(old.shape, generator=g)).clamp(max=-1e-3) * response_mask
    advantages = torch.randn(bs, 1, generator=g).expand(bs, response) * response_mask
    batch = TrainingInputBatch(
        {
            "sequences": sequences,
            "attention_mask": attention,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
            "rollout_logprobs": mu.float(),
            "action_log_probs": old.float(),
            "advantages": advantages.float().contiguous(),
        }
    )
    batch.metadata = {
        "response_length": response,
        "policy_mini_batch_boundaries": [(i, min(i + 2, bs)) for i in range(0, bs, 2)],
        "uids": [str(i) for i in range(bs)],
    }
    return batch


def packed_reference(batch: Any, model: TinyPolicy | None = None) -> dict[str, np.ndarray]:
    """The packed arrays a report of `batch` holds, row by row from its masks (float64);
    entropy from `model` (the weights before the update) when given."""
    b = batch
    cu, mu, pi, h, lm = [0], [], [], [], []
    n = b["response_mask"].shape[1]
    ent = None
    if model is not None:
        with torch.no_grad():
            _, full = model.logp_entropy(b["sequences"])
        ent = full[:, -n - 1 : -1]
    for i in range(b["sequences"].shape[0]):
        r = int(b["response_mask"][i].sum())
        sl = slice(n - r, n)
        mu.append(b["rollout_logprobs"][i, sl].double().numpy())
        pi.append(b["action_log_probs"][i, sl].double().numpy())
        lm.append((b["loss_mask"][i, sl] != 0).numpy().astype(np.int8))
        h.append(np.zeros(r) if ent is None else ent[i, sl].double().numpy())
        cu.append(cu[-1] + r)
    return {
        "cu_seqlens": np.asarray(cu, dtype=np.int64),
        "logp_rollout": np.concatenate(mu),
        "logp_train": np.concatenate(pi),
        "entropy": np.concatenate(h),
        "loss_mask": np.concatenate(lm),
    }
