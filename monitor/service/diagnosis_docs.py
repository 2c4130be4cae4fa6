"""OpenAPI description and documented answers of ``GET /v1/runs/{run}/diagnosis`` (apart from
``openapi_examples.py``, which is near its size bound)."""

from __future__ import annotations

from typing import Any

from .openapi_examples import error, read_errors

__all__ = ["DIAGNOSIS_DESCRIPTION", "DIAGNOSIS_RESPONSES"]

DIAGNOSIS_DESCRIPTION = """
Why the mismatch of run `{run}` is what it is: every cause timwatch can check (precision,
staleness, decode vs prefill kernels, length, token-id round trip, entropy collapse, distillation
teacher collapse), scored in [0, 1] and ranked best first, each with a verdict that names its
numbers, the setting to change, and the evidence (metric, steps, value, late/early trend).
Causes whose input was not sent are listed in `not_checked` with the reason. `from_step` /
`to_step` bound the window (inclusive). Rules and thresholds: docs/diagnosis.md.
"""

_EXAMPLE = {
    "run": "grpo-7b",
    "from_step": 0,
    "to_step": 23,
    "steps": 24,
    "causes": [
        {
            "cause": "precision",
            "score": 0.81,
            "verdict": "engine precision/kernels: engine-only KL 0.00214 (discrepancy_kl), "
            "Pearson(δ², H) 0.31, σ̂² 0.0011 (nearest bf16's 0.001)",
            "action": "Run the engine in FP16 or match the kernels: verl "
            "`actor_rollout_ref.rollout.dtype=float16` …",
            "evidence": [
                {
                    "metric": "discrepancy_kl",
                    "steps": [0, 23],
                    "value": 0.00214,
                    "trend": 1.4,
                    "detail": "engine-only KL: mean k3 of logp_old − μ",
                }
            ],
        }
    ],
    "not_checked": [{"cause": "teacher_collapse", "reason": "no logp_teacher"}],
}

DIAGNOSIS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Ranked causes with evidence, and the causes not checked.",
        "content": {"application/json": {"example": _EXAMPLE}},
    },
    404: error("Unknown run.", "run 'x' not found"),
    422: error("A parameter out of range, or from_step after to_step.",
               "from_step 9 is after to_step 3"),
    **read_errors(),
}  # fmt: skip
