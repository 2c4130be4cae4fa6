"""The starting policy: `LM` pretrained on the corpus with Adam, cached on disk under a hash of
its configuration (model, corpus, schedule), so every run of every configuration starts from the
same weights. Invariants: a cached file is reused only for the exact configuration that wrote it;
the stored ``entropy_t1`` is the mean per-token entropy (nats, temperature 1) of the pretrained
policy along its own sampled continuations of corpus prompts, measured after training.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .corpus import Corpus, CorpusConfig
from .model import LM, ModelConfig

__all__ = ["PretrainConfig", "load_pretrained", "policy_entropy"]

CACHE = Path(os.environ.get("TIMWATCH_LAB2_CACHE", Path.home() / ".cache" / "timwatch" / "lab2"))


@dataclass(frozen=True)
class PretrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    steps: int = 400
    batch: int = 32
    seq_len: int = 80
    lr: float = 3e-3
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@torch.no_grad()
def policy_entropy(
    model: LM, corpus: Corpus, prompt_len: int, new: int, n: int, seed: int
) -> float:
    """Mean entropy (nats) of ``model``'s next-id distribution along its own samples."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.from_numpy(corpus.sample(n, prompt_len, rng))
    logits, cache = model.prefill(ids)
    total = 0.0
    for i in range(new):
        logp = F.log_softmax(logits.float(), -1)
        total += float(-(logp.exp() * logp).sum(-1).mean())
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
        if i + 1 < new:
            logits, cache = model.decode(nxt, prompt_len + i, cache)
    return total / new


def _train(cfg: PretrainConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    torch.manual_seed(cfg.seed)
    corpus = Corpus(cfg.corpus)
    model = LM(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.steps)
    rng = np.random.default_rng(cfg.seed)
    losses = []
    for _ in range(cfg.steps):
        ids = torch.from_numpy(corpus.sample(cfg.batch, cfg.seq_len, rng))
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.model.vocab), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    info = {
        "key": cfg.key(),
        "params": sum(p.numel() for p in model.parameters()),
        "final_loss_20": sum(losses[-20:]) / 20,
        "corpus_entropy_rate": corpus.entropy_rate(),
        "entropy_t1": policy_entropy(model, corpus, 16, 64, 64, seed=cfg.seed + 1),
        "config": asdict(cfg),
    }
    return model.state_dict(), info


def load_pretrained(
    cfg: PretrainConfig, cache: Path | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The pretrained weights and their record, trained and cached (in ``cache``, default
    ``~/.cache/timwatch/lab2`` or ``$TIMWATCH_LAB2_CACHE``) on first use."""
    cache = CACHE if cache is None else cache
    path = cache / f"lm-{cfg.key()}.pt"
    if path.exists():
        blob = torch.load(path, weights_only=True)
        return blob["state"], json.loads(blob["info"])
    state, info = _train(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"state": state, "info": json.dumps(info)}, tmp)
    tmp.replace(path)
    return state, info


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(load_pretrained(PretrainConfig())[1], indent=1))
