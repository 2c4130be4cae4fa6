"""A verl 0.9 actor update on CPU with a tiny model, run through verl's own code.

Real verl: `RayPPOTrainer._update_actor` (driver), `DataProto.to_tensordict`,
`left_right_2_no_padding`, `TrainingWorker.train_mini_batch` / `train_batch` /
`_postprocess_output`, `BaseEngine.train_batch`, `FSDPEngine.forward_backward_batch` (micro-batch
split, token counts, output gathering), `ppo_loss`, the policy-loss registry, `agg_loss`,
`Metric`, `tensordict_utils`. Written here, because verl's FSDP engine needs a CUDA device and a
Hugging Face model: `TinyEngine.forward_step`'s model (a `[vocab, vocab]` logit table, log-probs
and entropy laid out as verl's FSDP engine lays them out, nested per sequence and shifted by one),
its optimizer step, and the parallel layout it claims (data-parallel rank, whether it is the
rank verl collects from). The one CPU-forced patch: verl's device helpers (`get_device_id`,
`get_torch_device`) assume CUDA, so `cpu_device_patches` points them at the CPU.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

VOCAB = 11


def cpu_device_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.workers import engine_workers
    from verl.workers.engine.fsdp import transformer_impl

    cpu = types.SimpleNamespace(max_memory_allocated=lambda: 0, max_memory_reserved=lambda: 0)
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(engine_workers, "get_torch_device", lambda: cpu)


@contextlib.contextmanager
def gloo_world() -> Iterator[None]:
    """A one-process gloo group: verl's worker all-gathers token counts through it."""
    import torch.distributed as dist

    from tests.helpers.procs import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


class TinyModel(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=g) * 1.5)

    def token_logp_entropy(
        self, tokens: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For a flat token stream: log p(next token) and H at each position (next = roll -1)."""
        logits = self.table[tokens].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        labels = torch.roll(tokens, shifts=-1)
        chosen = logp.gather(-1, labels[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        return chosen, entropy


def tiny_engine(model: TinyModel, *, dp_rank: int = 0, collect: bool = True) -> Any:
    """verl's FSDP engine (`FSDPEngineWithLMHead`) with only the model, optimizer and layout
    replaced (the class is built here so that verl is imported inside the test only)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine_cls = type("TinyFSDPEngine", (_TinyMixin, FSDPEngineWithLMHead), {})
    engine = object.__new__(engine_cls)
    engine._setup(model, dp_rank=dp_rank, collect=collect)
    return engine


class _TinyMixin:
    def _setup(self, model: TinyModel, *, dp_rank: int = 0, collect: bool = True) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        self.dp_rank, self.collect = dp_rank, collect
        self.ulysses_sequence_parallel_size = 1
        self.forward_calls: list[bool] = []  # calculate_entropy per micro-batch

    # the layout this rank claims
    def get_data_parallel_group(self) -> None:
        return None

    def get_data_parallel_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def is_mp_src_rank_with_outputs(self) -> bool:
        return self.collect

    def _gradient_sync_context(self, is_last_micro_batch: bool) -> Any:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def train_mode(self, **kwargs: Any) -> Iterator[None]:
        yield

    def optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9)
        self.optimizer.step()
        return float(norm)

    def lr_scheduler_step(self) -> float:
        return 0.5

    def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        from verl.utils import tensordict_utils as tu

        calc_entropy = bool(tu.get_non_tensor_data(micro_batch, "calculate_entropy", False))
        temperature = float(tu.get_non_tensor_data(micro_batch, "temperature", 1.0))
        self.forward_calls.append(calc_entropy)
        ids = micro_batch["input_ids"]
        logp, entropy = self.model.token_logp_entropy(ids.values(), temperature)
        offsets = ids.offsets()
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(logp, offsets)}
        if calc_entropy:
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, offsets)
        loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=None)
        return loss, {"loss": loss.detach().item(), "metrics": metrics}


def make_worker(engine: Any, actor_config: Any, micro_batch_size: int = 2) -> Any:
    """verl's `TrainingWorker` around `engine`, with the loss its actor worker binds."""
    from verl.workers import engine_workers

    worker = object.__new__(engine_workers.TrainingWorker)
    worker.engine = engine
    worker.loss_fn = partial(engine_workers.ppo_loss, config=actor_config)
    worker.engine_config = types.SimpleNamespace(
        forward_only=False,
        use_dynamic_bsz=False,
        max_token_len_per_gpu=None,
        micro_batch_size_per_gpu=micro_batch_size,
        use_fused_kernels=False,
    )
    worker.model_config = {}
    worker.profiler = types.SimpleNamespace(step=lambda: None, check_enable=lambda: False, rank=0)
    # MFU needs a GPU's peak FLOPs: report 0 of 1
    worker.flops_counter = types.SimpleNamespace(estimate_flops=lambda *a, **k: (0.0, 1.0))
    worker.device_name = "cpu"
    return worker


def actor_config(loss_mode: str = "estr", **over: Any) -> Any:
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    kw: dict[str, Any] = dict(
        strategy="fsdp",
        ppo_mini_batch_size=4,
        ppo_micro_batch_size_per_gpu=2,
        rollout_n=1,
        clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )
    kw.update(over)
    return FSDPActorConfig(**kw)


def trainer_config(**actor: Any) -> Any:
    from omegaconf import OmegaConf

    a = {
        "calculate_entropy": False,
        "entropy_coeff": 0.0,
        "ppo_mini_batch_size": 4,
        "ppo_epochs": 1,
        "data_loader_seed": 0,
        "shuffle": False,
    }
    a.update(actor)
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "actor": a,
                "rollout": {"multi_turn": {"enable": False}, "temperature": 1.0, "n": 1},
            }
        }
    )


def rollout_batch(seed: int, model: TinyModel, bs: int = 4, prompt: int = 3, response: int = 6):
    """A `DataProto` as verl's trainer holds it before `_update_actor`: left-padded prompts,
    right-padded responses, π_old from `model`, μ = π_old + engine noise, GRPO advantages."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, prompt + 1, (bs,), generator=g)
    r_len = torch.randint(1, response + 1, (bs,), generator=g)
    prompts = torch.zeros(bs, prompt, dtype=torch.long)
    responses = torch.zeros(bs, response, dtype=torch.long)
    attn = torch.zeros(bs, prompt + response, dtype=torch.long)
    old = torch.zeros(bs, response)
    for i in range(bs):
        p = torch.randint(1, VOCAB, (int(p_len[i]),), generator=g)
        r = torch.randint(1, VOCAB, (int(r_len[i]),), generator=g)
        prompts[i, prompt - len(p) :], responses[i, : len(r)] = p, r
        attn[i, prompt - len(p) : prompt + len(r)] = 1
        with torch.no_grad():
            lp, _ = model.token_logp_entropy(torch.cat([p, r]), 1.0)
        old[i, : len(r)] = lp[len(p) - 1 : len(p) + len(r) - 1]
    response_mask = attn[:, prompt:].clone()
    rollout = torch.where(response_mask.bool(), old + torch.randn(bs, response, generator=g), 0.0)
    adv = torch.randn(bs, 1, generator=g).expand(bs, response) * response_mask
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attn,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "old_log_probs": old,
            "rollout_log_probs": rollout.clamp(max=0.0),
            "advantages": adv.contiguous(),
        }
    )


class LocalActorGroup:
    """The driver's `actor_rollout_wg` for an in-process set of workers that all get the whole
    batch (one data-parallel rank; several workers = one sequence-parallel group); verl's answer
    comes from the rank it collects from."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.calls: list[Any] = []

    def update_actor(self, batch_td: Any) -> Any:
        self.calls.append(batch_td)
        outs = [w.train_mini_batch(data=batch_td.clone()) for w in self.workers]
        return next(o for o in outs if o is not None)


def stub_trainer(config: Any, group: LocalActorGroup, global_steps: int) -> Any:
    """What `RayPPOTrainer._update_actor` reads from `self`."""
    return types.SimpleNamespace(config=config, actor_rollout_wg=group, global_steps=global_steps)


def packed_reference(batch: Any) -> dict[str, np.ndarray]:
    """What the hooks should report for `batch`: its response tokens packed in order."""
    from timwatch.sidecar.integrations.verl import pack_padded

    b = batch.batch
    cu, arrays = pack_padded(
        b["response_mask"],
        logp_rollout=b["rollout_log_probs"],
        logp_train=b["old_log_probs"],
    )
    out = {k: v.numpy() for k, v in arrays.items()}
    out["cu_seqlens"] = cu.numpy()
    return out
