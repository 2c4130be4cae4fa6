"""A real TRL `GRPOTrainer` run on the CPU for the TRL plug-in's tests: the tiny Llama and
tokenizer of `timwatch.sidecar.demo.hf_model` (built in code, nothing from a hub), a few prompts,
a length reward, and `TimwatchGRPOTrainer` reporting to a real `Tap` that also keeps a copy of
what it reported (`RecordingTap.sent`) and TRL's logs (`LogCapture.logs`).

The engine mode (`use_vllm_http`): `GRPOTrainer`'s ``rollout_func`` samples on a real vLLM
server over HTTP (token in, token out, μ of each token), and a stand-in for TRL's
`VLLMGeneration` pushes the trainer's weights before each step by save + vLLM's
``reload_weights`` (`HttpWeightSync`). TRL's own server mode cannot run here: its weight sync
is vLLM's NCCL weight-transfer engine (CUDA only) and its client imports vllm in the trainer's
process (vllm lives in another venv). With the stand-in in place, `use_vllm` is set so TRL runs
its real vLLM code path after generation: old log-probs, the importance-sampling correction in
the loss, and the ``sampling/*`` metrics it logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers import TrainerCallback

from timwatch.sidecar.demo.vllm_engine import EngineClient
from timwatch.sidecar.tap import Tap

PROMPTS = [
    "def hello(x):",
    "Return the number of items in a container.",
    "import json",
    "The list of",
]
GENERATIONS = 4  # completions per prompt; one step trains PER_STEP completions
PER_STEP = 8
NEW = 8  # completion tokens (the engine mode samples exactly NEW, ignoring EOS)


def build_model(out: Path) -> Path:
    """The tiny Llama + BPE tokenizer (seed 0) in ``out``, built in this venv."""
    from timwatch.sidecar.demo.hf_model import build

    if not (out / "config.json").exists():
        build(out, seed=0)
    return out


class RecordingTap(Tap):
    """A real `Tap` that keeps a float64/int64 numpy copy of each step's report."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: dict[int, dict[str, np.ndarray]] = {}

    def report(self, step: int, **arrays: Any) -> bool:
        kept = {k: v for k, v in arrays.items() if hasattr(v, "numpy")}
        self.sent[step] = {k: v.numpy().astype(np.float64 if v.is_floating_point() else np.int64)
                           for k, v in kept.items()}  # fmt: skip
        return super().report(step, **arrays)


class LogCapture(TrainerCallback):  # type: ignore[misc]
    """TRL's logs per global step (the per-step ones: those with ``loss``)."""

    def __init__(self) -> None:
        self.logs: dict[int, dict[str, float]] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.logs[int(state.global_step)] = dict(logs)


@dataclass
class HttpWeightSync:
    """Stand-in for TRL's `VLLMGeneration` in server mode, of which the rollout path calls only
    `sync_weights`: save the trainer's weights (fp32 safetensors and config) and have the vLLM
    server reload them, labelled with TRL's global step."""

    trainer: Any
    engine: EngineClient
    workdir: Path
    pushed: list[int] = field(default_factory=list)

    def sync_weights(self) -> None:
        step = int(self.trainer.state.global_step)
        out = self.workdir / f"v{step}"
        self.trainer.model.save_pretrained(out, safe_serialization=True)
        self.engine.reload(out, str(step))
        self.pushed.append(step)


@dataclass
class VllmRollout:
    """`GRPOTrainer`'s ``rollout_func``: each prompt (TRL repeats each one per generation)
    sampled on the vLLM server; keeps vLLM's answers per call (`answers`)."""

    engine: EngineClient
    answers: list[list[list[float]]] = field(default_factory=list)

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        tok = trainer.processing_class
        prompt_ids, completion_ids, logprobs = [], [], []
        for i, text in enumerate(prompts):
            ids = tok.encode(text, add_special_tokens=False)
            g = self.engine.generate(ids, NEW, seed=1000 * len(self.answers) + i)
            prompt_ids.append(ids)
            completion_ids.append(g.token_ids)
            logprobs.append(g.logprobs)
        self.answers.append(logprobs)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def train(
    model_dir: Path, tap: Any, out: Path, *, steps: int, engine: EngineClient | None = None,
    estr_tau: float | None = None, callbacks: tuple[Any, ...] = (), report: bool = True,
) -> tuple[Any, LogCapture]:  # fmt: skip
    """`steps` optimizer steps of `TimwatchGRPOTrainer` (one generation batch of `PER_STEP`
    completions per step, fp32 on the CPU); with ``engine``, generation on vLLM (module doc);
    ``estr_tau``: ESTR in TRL's loss; ``callbacks`` join TRL's (after the log capture, before
    `TimwatchCallback`); ``report=False``: the trainer reports no batches, only TRL's logs
    reach `tap` (through `TimwatchCallback`). Returns the trainer (its ``loss_rows``: per step,
    the (completion ids, loss mask) rows that TRL's `_compute_loss` received) and TRL's logs."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig

    from timwatch.sidecar.integrations.trl import TimwatchCallback, TimwatchGRPOTrainer

    class Trainer(TimwatchGRPOTrainer):
        loss_rows: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:  # what TRL's loss multiplies in (grpo_trainer.py)
                mask = mask * inputs["tool_mask"]
            rows = self.loss_rows.setdefault(int(self.state.global_step) + 1, [])
            for ids, m in zip(inputs["completion_ids"].tolist(), mask.tolist(), strict=True):
                rows.append((tuple(ids), tuple(int(x) for x in m)))
            return super()._compute_loss(model, inputs)

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(0)
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", seed=0,
        per_device_train_batch_size=PER_STEP, num_generations=GENERATIONS,
        max_completion_length=NEW, max_steps=steps, logging_steps=1, save_strategy="no",
        disable_tqdm=True, learning_rate=1e-3,
        # the per-token ratio, truncated far above anything it reaches: TRL's logged IS ratio
        # is then exp(π_old − μ) of every token, as timwatch's is_ratio_*
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1e6,
    )  # fmt: skip
    data = Dataset.from_dict({"prompt": PROMPTS * (steps * PER_STEP // len(PROMPTS) + 1)})
    capture = LogCapture()
    rollout = VllmRollout(engine) if engine is not None else None
    trainer = Trainer(
        model=model, processing_class=tok, args=config, train_dataset=data,
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        rollout_func=rollout, estr_tau=estr_tau,
        callbacks=[capture, *callbacks, *([] if report else [TimwatchCallback(tap)])],
        tap=tap if report else None,
    )  # fmt: skip
    trainer.loss_rows = {}
    if engine is not None:
        trainer.use_vllm = True  # TRL's vLLM path after generation (module doc)
        trainer.vllm_generation = HttpWeightSync(trainer, engine, out / "weights")
        trainer._last_loaded_step = -1
        trainer.timwatch_rollout = rollout
    trainer.train()
    return trainer, capture
