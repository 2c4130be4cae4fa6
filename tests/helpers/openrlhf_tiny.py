"""An OpenRLHF 0.11.2 actor update on CPU with a tiny Llama, run through OpenRLHF's own code.

Real OpenRLHF: `ActorPPOTrainer.ppo_train` / `training_step`, `NaiveReplayBuffer` (its split
into samples and collation into micro-batches), `iter_grad_accum_global_norm`, `Experience`,
`Actor` and its `forward` (log-probs and entropy from the logits), `PolicyLoss`,
`aggregate_loss`, on a real Transformers `LlamaForCausalLM` built from a config in code.

Written here instead of OpenRLHF's:
- two import-only stand-ins, because the real packages cannot run here: `flash_attn` (CUDA-only;
  `openrlhf/models/ring_attn_utils.py` imports five names from it at module level, used only for
  ring attention and sample packing, which this path does not take) and `vllm` (never a
  timwatch dependency; `openrlhf/trainer/ray/__init__.py` imports its engine wrapper, which the
  actor update does not call). Each stand-in raises if anything is called.
- the DeepSpeed strategy (`DeepspeedStrategy` wraps a DeepSpeed engine, which needs a GPU
  launcher): backward, an SGD step per micro-batch, no gradient norm, the one-process layout;
- the trainer object's construction (`ActorPPOTrainer.__init__` opens the vLLM weight-sync
  group): its attributes are set as `__init__` sets them.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

VOCAB, PROMPT, ACTIONS = 16, 3, 5


def _refuse(*_a: Any, **_k: Any) -> Any:
    raise RuntimeError("import-only stand-in called (see tests/helpers/openrlhf_tiny.py)")


@contextlib.contextmanager
def import_stand_ins() -> Iterator[None]:
    """`install_import_stand_ins` for the duration of the block, then removed from
    ``sys.modules`` again: the rest of the test process (verl's tests share the worker) must see
    no flash_attn or vllm. OpenRLHF modules imported inside keep what they took from them."""
    before = set(sys.modules)
    install_import_stand_ins()
    try:
        yield
    finally:
        for name in sorted(set(sys.modules) - before, reverse=True):
            if getattr(sys.modules[name], "_timwatch_stand_in", False):
                del sys.modules[name]


def install_import_stand_ins() -> None:
    """`flash_attn` and `vllm` as import-only modules, unless the real ones are importable."""
    for name, attrs in {
        "flash_attn": {},
        "flash_attn.bert_padding": dict.fromkeys(
            ("index_first_axis", "pad_input", "rearrange", "unpad_input"), _refuse
        ),
        "flash_attn.utils": {},
        "flash_attn.utils.distributed": {"all_gather": _refuse},
        "vllm": {"SamplingParams": _refuse},
        "vllm.inputs": {"TokensPrompt": _refuse},
        "vllm.utils": {"random_uuid": _refuse},
    }.items():
        top = name.split(".")[0]
        if top in sys.modules and not getattr(sys.modules[top], "_timwatch_stand_in", False):
            continue
        try:
            if name == top and name not in sys.modules:
                __import__(top)
                continue  # the real package
        except ImportError:
            pass
        mod = types.ModuleType(name)
        mod.__path__ = []  # type: ignore[attr-defined]
        # a spec, so that find_spec() works; no distribution metadata, so that Transformers
        # still finds no flash-attn installed
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod._timwatch_stand_in = True  # type: ignore[attr-defined]
        for k, v in attrs.items():
            setattr(mod, k, v)
        sys.modules[name] = mod
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, mod)


def tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).float()


class TinyStrategy:
    """The parts of `DeepspeedStrategy` that `ActorPPOTrainer` calls, for one process."""

    ring_attn_group = None
    accumulated_gradient = 1

    def __init__(self, args: Any) -> None:
        self.args = args

    def backward(self, loss: torch.Tensor, model: Any, optimizer: Any) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: Any, model: Any, scheduler: Any, name: str) -> None:
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    def get_grad_norm(self, model: Any) -> float:
        return 0.0

    def all_reduce(self, data: Any, op: str = "mean") -> Any:
        return data

    def is_rank_0(self) -> bool:
        return True


def args(*, max_epochs: int = 1, freezing_steps: int = -1, ckpt_path: str = "") -> Any:
    """OpenRLHF's parsed arguments, as far as the actor update reads them (its defaults)."""
    ns = SimpleNamespace
    return ns(
        actor=ns(
            eps_clip_low_high=(0.2, 0.2),
            dual_clip=None,
            loss_agg_mode="token-mean",
            policy_loss_type="ppo",
            entropy_coef=None,
            aux_loss_coef=0.0,
        ),
        algo=ns(
            advantage=ns(
                is_correction_level="off",
                is_correction_mode="mask",
                is_correction_gating="ratio",
                is_correction_threshold=(0.5, 5.0),
            ),
            kl=ns(use_loss=False, init_coef=0.0),
        ),
        train=ns(max_epochs=max_epochs, dynamic_batch_enable=False, colocate_all=False),
        ds=ns(packing_samples=False, tensor_parallel_size=1),
        critic=ns(freezing_steps=freezing_steps),
        ckpt=ns(load_enable=bool(ckpt_path), path=ckpt_path),
        vllm=ns(sync_backend="gloo"),
    )


def trainer(model: Any, arguments: Any, *, micro_batch: int = 2) -> Any:
    """`ActorPPOTrainer` with OpenRLHF's `Actor` around `model`, attributes as its `__init__`
    sets them (see the module docstring)."""
    from openrlhf.models import Actor, PolicyLoss
    from openrlhf.trainer.ppo_utils import NaiveReplayBuffer
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    t = object.__new__(ActorPPOTrainer)
    t.strategy = TinyStrategy(arguments)
    t.args = arguments
    t.actor = Actor(model)  # OpenRLHF loads a path; given a model, it leaves this unset:
    t.actor.packing_samples = False
    t.ema_model = None
    t.actor_optim = torch.optim.SGD(model.parameters(), lr=0.5)
    t.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(t.actor_optim, lambda _s: 1.0)
    t.micro_train_batch_size = micro_batch
    t.max_epochs = arguments.train.max_epochs
    t.dataloader_pin_memory = False
    t.aux_loss = False
    t.vllm_engines = None
    a = arguments
    t.actor_loss_fn = PolicyLoss(
        clip_eps_low=a.actor.eps_clip_low_high[0],
        clip_eps_high=a.actor.eps_clip_low_high[1],
        dual_clip=a.actor.dual_clip,
        token_level_loss=a.actor.loss_agg_mode == "token-mean",
        policy_loss_type=a.actor.policy_loss_type,
        is_correction_level=a.algo.advantage.is_correction_level,
        is_correction_mode=a.algo.advantage.is_correction_mode,
        is_correction_gating=a.algo.advantage.is_correction_gating,
        is_correction_threshold=a.algo.advantage.is_correction_threshold,
    )
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]  # the buffer names cuda:N
    try:
        t.replay_buffer = NaiveReplayBuffer(micro_batch, 0, True, False, False)
    finally:
        torch.cuda.current_device = current  # type: ignore[assignment]
    t.replay_buffer.target_device = torch.device("cpu")
    return t


def cpu_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ppo_train` and the replay buffer ask for the current CUDA device: the CPU here."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def _action_logp_entropy(model: Any, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log p and H at each action position, from the model's logits (not OpenRLHF's)."""
    with torch.no_grad():
        logits = model(seq[None]).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    nxt = logp[:-1].gather(-1, seq[1:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)[:-1]
    return nxt[-ACTIONS:], ent[-ACTIONS:]


def experience(seed: int, model: Any, *, n: int = 4, drift: float = 0.4) -> tuple[Any, list]:
    """One `Experience` (as OpenRLHF's experience maker hands it to the actor) and, per sample,
    the float64 (μ, π_old, H) of its action tokens. π_old and H are `model`'s; μ is π_old plus
    `drift`·N(0, 1), kept below 0 (a vLLM that disagrees)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, VOCAB, (n, PROMPT + ACTIONS), generator=g)
    lengths = torch.randint(2, ACTIONS + 1, (n,), generator=g)
    action_mask = torch.arange(ACTIONS)[None, :] < lengths[:, None]
    attention = torch.cat([torch.ones(n, PROMPT, dtype=torch.long), action_mask.long()], 1)
    pi = torch.zeros(n, ACTIONS, dtype=torch.float64)
    mu = torch.zeros_like(pi)
    ent = torch.zeros_like(pi)
    expected = []
    for i in range(n):
        lp, h = _action_logp_entropy(model, seqs[i])
        noise = drift * torch.randn(ACTIONS, generator=g, dtype=torch.float64)
        m = (lp + noise).clamp(max=-1e-4)
        pi[i], mu[i], ent[i] = lp, m, h
        r = int(lengths[i])
        expected.append([(float(mu[i, j]), float(pi[i, j]), float(ent[i, j])) for j in range(r)])
    mask_f = action_mask.float()
    exp = Experience(
        sequences=seqs,
        attention_mask=attention,
        action_mask=action_mask,
        action_log_probs=(pi * mask_f).float(),
        rollout_log_probs=(mu * mask_f).float(),
        advantages=torch.randn(n, ACTIONS, generator=g) * mask_f,
        returns=torch.zeros(n, ACTIONS),
        response_length=lengths.float(),
        total_length=(lengths + PROMPT).float(),
        info={"reward": torch.randn(n, generator=g)},
    )
    return exp, expected


def update(t: Any, exp: Any) -> dict:
    """One actor update, as `PolicyModelActor.fit` runs it: append, train, clear."""
    t.replay_buffer.append(exp)
    status = t.ppo_train(0.0)
    t.replay_buffer.clear()
    return status  # type: ignore[no-any-return]
