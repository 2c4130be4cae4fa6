"""The synthetic long-tailed corpus lab v2's policy is pretrained on.

A first-order Markov chain over ``vocab`` ids: each id has ``fanout`` successors drawn (without
replacement) from a Zipf unigram, weighted by a Zipf law over their draw order; with probability
``backoff`` the next id is drawn from the unigram instead, so every id has non-zero probability
after every id (the tail is real, as in text). Invariants: `Corpus.transition` rows sum to 1;
`Corpus.entropy_rate` is the chain's exact conditional entropy under its stationary law; sampling
is deterministic given the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Corpus", "CorpusConfig"]


@dataclass(frozen=True)
class CorpusConfig:
    vocab: int = 2048
    zipf: float = 1.1
    fanout: int = 48
    fanout_zipf: float = 1.0
    backoff: float = 0.05
    seed: int = 1234


class Corpus:
    """The chain's unigram, dense transition matrix and a sampler of sequences."""

    def __init__(self, cfg: CorpusConfig) -> None:
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        v = cfg.vocab
        ranks = rng.permutation(v)  # id -> rank, so frequent ids are not simply the small ones
        self.unigram = 1.0 / (ranks + 1.0) ** cfg.zipf
        self.unigram /= self.unigram.sum()
        w = 1.0 / np.arange(1, cfg.fanout + 1) ** cfg.fanout_zipf
        w /= w.sum()
        trans = np.tile(cfg.backoff * self.unigram, (v, 1))
        for i in range(v):
            succ = rng.choice(v, size=cfg.fanout, replace=False, p=self.unigram)
            trans[i, succ] += (1.0 - cfg.backoff) * w
        self.transition = trans / trans.sum(1, keepdims=True)
        self._cum = np.cumsum(self.transition, 1)

    def stationary(self, iters: int = 200) -> np.ndarray:
        pi = self.unigram.copy()
        for _ in range(iters):
            pi = pi @ self.transition
        return pi / pi.sum()

    def entropy_rate(self) -> float:
        """H(X_{t+1} | X_t) in nats under the stationary law."""
        t = self.transition
        row_h = -(t * np.log(t)).sum(1)
        return float(self.stationary() @ row_h)

    def sample(self, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` sequences of ``length`` ids, the first from the unigram."""
        out = np.empty((n, length), dtype=np.int64)
        out[:, 0] = rng.choice(self.cfg.vocab, size=n, p=self.unigram)
        for t in range(1, length):
            u = rng.random(n)
            cum = self._cum[out[:, t - 1]]
            out[:, t] = np.minimum((cum < u[:, None]).sum(1), self.cfg.vocab - 1)
        return out
