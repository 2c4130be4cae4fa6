"""The JSON Schema of a packed batch body, built from the core's field tables and bounds.

Invariant: the schema is never stricter than `Batch.from_json_bytes` — every body the schema
refuses, the server refuses too (schemathesis checks this against a live server). Constraints
JSON Schema cannot state (bounds that hold on kept tokens only, every per-token array as long
as ``logp_rollout``, ``cu_seqlens`` ending at that length, integers given as ``1.0``) are
checked by the server alone and named in the 422 it answers.
"""

from __future__ import annotations

from typing import Any

from ..core.batch import (
    ENTROPY_SOURCES,
    FLOAT_FIELDS,
    LOGP_FIELDS,
    LOGP_MAX,
    OPTIONAL_FIELDS,
    REQUIRED_FIELDS,
)
from ..core.batch_checks import ENTROPY_MAX, LOGP_MIN

__all__ = ["batch_schema"]

INT64_MAX = 2**63 - 1
_NO_CONTROL = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"  # no C0, DEL or C1 character

_DESCRIPTIONS = {
    "cu_seqlens": "sequence boundaries: 0, then each sequence's end offset, ending at N",
    "logp_rollout": "log-prob μ of each sampled token under the rollout engine (N numbers); "
    f"on kept tokens (loss_mask 1) every log-prob must be ≥ {LOGP_MIN:g}",
    "logp_train": "log-prob π of the same token recomputed by the trainer",
    "entropy": f"token entropy H in nats (≥ 0; ≤ {ENTROPY_MAX:g} on kept tokens)",
    "loss_mask": "1 where the token counts (0/1 or booleans)",
    "token_ids": "token ids the engine sampled",
    "token_ids_train": "token ids the trainer scored (compared with token_ids)",
    "versions": "policy version that sampled each token",
    "logp_old": "log-prob under the behaviour policy of the PPO ratio",
    "logp_teacher": "log-prob under a teacher / reference model",
}


def _array(name: str) -> dict[str, Any]:
    item: dict[str, Any]
    if name in LOGP_FIELDS:
        item = {"type": "number", "maximum": LOGP_MAX}
    elif name in FLOAT_FIELDS:
        item = {"type": "number", "minimum": 0}
    elif name == "loss_mask":
        item = {"enum": [0, 1, False, True]}
    elif name == "versions":
        item = {"type": "integer", "minimum": -(2**63), "maximum": INT64_MAX}
    else:
        item = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}
    schema: dict[str, Any] = {"type": "array", "items": item, "description": _DESCRIPTIONS[name]}
    if name == "cu_seqlens":
        schema["minItems"] = 2
    elif name == "logp_rollout":
        schema["minItems"] = 1
    if name in OPTIONAL_FIELDS:
        return {"anyOf": [schema, {"type": "null"}], "description": _DESCRIPTIONS[name]}
    return schema


def batch_schema() -> dict[str, Any]:
    """The body of ``POST /v1/runs/{run}/batches`` and ``POST /v1/masks`` as JSON."""
    properties: dict[str, Any] = {
        "step": {
            "anyOf": [{"type": "integer", "minimum": 0, "maximum": INT64_MAX}, {"type": "null"}],
            "description": "training step (default 0)",
        },
        "batch_id": {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": 256, "pattern": _NO_CONTROL},
                {"type": "null"},
            ],
            "description": "idempotency key: a replay with the same content is answered from "
            "the store; the same id with other content is a 409",
        },
        "policy_version": {
            "anyOf": [{"type": "integer", "minimum": 0, "maximum": INT64_MAX}, {"type": "null"}],
            "description": "policy version of the trainer for this batch",
        },
        "entropy_source": {
            "anyOf": [{"enum": list(ENTROPY_SOURCES)}, {"type": "null"}],
            "description": "where `entropy` comes from (default trainer)",
        },
    }
    for name in REQUIRED_FIELDS + OPTIONAL_FIELDS:
        properties[name] = _array(name)
    return {
        "type": "object",
        "description": "a packed batch (docs/reference/batch.md)",
        "required": list(REQUIRED_FIELDS),
        "properties": properties,
        "additionalProperties": False,
    }
