"""One finished rollout sample as the sidecar captured it, plus the top-k entropy bounds.

A `RolloutRecord` is engine-agnostic: the SGLang proxy and the vLLM adapter both produce it,
and the join with trainer reports consumes it. Per-token arrays are tuples so a record can be
shared between threads (the proxy's event loop and the joiner) without copying.

Entropy from top-k (``entropy_source = "topk"`` in docs/reference/batch.md). The engine returns the
log-probs of a set S of tokens that contains the true top-k of the next-token distribution p. Let
``m = 1 - Σ_{i∈S} p_i`` be the mass outside S and ``t`` the k-th largest probability in S. Then

* every token outside S has probability ≤ t (it is not in the top-k), so its term
  ``-q log q ≥ -q log t``; summed: ``H ≥ H_S + m·(-log t)`` where ``H_S = -Σ_{i∈S} p_i log p_i``.
  That is ``entropy_lower``; it is never above the true entropy and is tighter than ``H_S``.
* the tail's entropy is largest when its mass is spread evenly over the ``V - |S|`` remaining
  tokens: ``H_tail ≤ m·log((V - |S|)/m)``. That is ``entropy_tail``; the true entropy lies in
  ``[entropy_lower, entropy_lower - m·(-log t) + entropy_tail]`` and in particular
  ``H ≤ H_S + entropy_tail``. It needs the vocabulary size V; without it the tail is unbounded
  and ``entropy_tail`` is ``None``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RolloutRecord", "topk_entropy_bounds", "EntropyBounds", "version_as_int"]


@dataclass(frozen=True)
class EntropyBounds:
    """Bounds (nats) on one position's entropy computed from a top-k slice."""

    lower: float  # H_S + m·(-log t): a sound lower bound on H
    head: float  # H_S = -Σ_{i∈S} p_i log p_i
    tail_mass: float  # m = 1 - Σ_{i∈S} p_i, clamped to [0, 1]
    tail: float | None  # m·log((V-|S|)/m): upper bound on the tail's entropy; None without V

    @property
    def upper(self) -> float | None:
        """A sound upper bound on H: ``H_S + tail``."""
        return None if self.tail is None else self.head + self.tail


def topk_entropy_bounds(
    logprobs: Sequence[float | None],
    *,
    k: int | None = None,
    vocab_size: int | None = None,
) -> EntropyBounds:
    """Entropy bounds from the log-probs of a token set S that contains the true top-k.

    ``k`` is how many of S are guaranteed to be the true top-k (default: all of S, which is
    what SGLang's ``output_top_logprobs`` is). vLLM's lists may carry the sampled token in one
    slot, so its adapter passes ``k = len(S) - 1``. ``None`` entries (``-inf`` serialised by the
    engine) count as probability 0.
    """
    probs = sorted(
        (math.exp(lp) for lp in logprobs if lp is not None and lp != -math.inf),
        reverse=True,
    )
    head = 0.0
    for p in probs:
        if p > 0.0:
            head -= p * math.log(p)
    mass = min(max(1.0 - math.fsum(probs), 0.0), 1.0)
    kk = len(probs) if k is None else min(k, len(probs))
    lower = head
    if mass > 0.0 and kk > 0:
        threshold = probs[kk - 1]
        if threshold > 0.0:
            lower += mass * -math.log(min(threshold, 1.0))
    tail: float | None = None
    if vocab_size is not None:
        rest = vocab_size - len(logprobs)
        if rest <= 0 or mass <= 0.0:
            tail = 0.0
        else:
            tail = max(mass * math.log(rest / mass), 0.0)
    return EntropyBounds(lower=lower, head=head, tail_mass=mass, tail=tail)


def version_as_int(label: str | None) -> int | None:
    """An engine's weight-version label as an int (``"7"``, ``"step-7"``, ``"v_7"``), else None."""
    if label is None:
        return None
    digits = label.rsplit("-", 1)[-1].rsplit("_", 1)[-1]
    try:
        return int(digits)
    except ValueError:
        return None


def _ints(values: Sequence[Any] | None) -> tuple[int, ...] | None:
    return None if values is None else tuple(int(v) for v in values)


def _floats(values: Sequence[Any] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(float(v) for v in values)


@dataclass(frozen=True)
class RolloutRecord:
    """A finished sample: what the engine sampled and with which log-prob (μ) and version.

    ``versions`` holds the engine's weight-version label per output token (SGLang reports
    strings, e.g. ``"default"`` or ``"step-12"``); `versions_as_int` converts them for the
    packed batch. ``finish_reason`` is the engine's type (``stop``, ``length``, ``abort``).
    """

    rid: str
    input_ids: tuple[int, ...] | None
    output_ids: tuple[int, ...]
    logp: tuple[float, ...]
    versions: tuple[str | None, ...]
    finish_reason: str | None
    weight_version: str | None
    entropy_lower: tuple[float, ...] | None = None
    entropy_tail: tuple[float, ...] | None = None
    entropy_source: str | None = None
    created: float = field(default_factory=time.time)
    engine: str = "sglang"

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        for name in ("logp", "versions", "entropy_lower", "entropy_tail"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(
                    f"RolloutRecord {self.rid!r}: {name} has {len(value)} entries, "
                    f"output_ids has {n}"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)

    def versions_as_int(self) -> list[int] | None:
        """Per-token versions as ints when every label is an integer (``"7"``, ``"step-7"``)."""
        out: list[int] = []
        for label in self.versions:
            value = version_as_int(label)
            if value is None:
                return None
            out.append(value)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key, value in d.items():
            if isinstance(value, tuple):
                d[key] = list(value)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutRecord:
        return cls(
            rid=str(d["rid"]),
            input_ids=_ints(d.get("input_ids")),
            output_ids=_ints(d["output_ids"]) or (),
            logp=_floats(d["logp"]) or (),
            versions=tuple(d["versions"]),
            finish_reason=d.get("finish_reason"),
            weight_version=d.get("weight_version"),
            entropy_lower=_floats(d.get("entropy_lower")),
            entropy_tail=_floats(d.get("entropy_tail")),
            entropy_source=d.get("entropy_source"),
            created=float(d.get("created", time.time())),
            engine=str(d.get("engine", "sglang")),
        )
