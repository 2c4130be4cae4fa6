"""Examples and descriptions for the OpenAPI document (kept apart so the routes stay readable)."""

from __future__ import annotations

from typing import Any

from .batch_schema import batch_schema

__all__ = [
    "ALERTMANAGER_DESCRIPTION",
    "ALERTMANAGER_BODY",
    "ALERTMANAGER_RESPONSES",
    "BATCH_BODY",
    "ERROR_SCHEMA",
    "EVENTS_RESPONSES",
    "SCALARS_GET_RESPONSES",
    "SCALARS_POST_RESPONSES",
    "FINISH_DESCRIPTION",
    "FINISH_RESPONSES",
    "HEALTHZ_DESCRIPTION",
    "HEALTHZ_RESPONSES",
    "INGEST_DESCRIPTION",
    "INGEST_RESPONSES",
    "MASKS_DESCRIPTION",
    "MASKS_RESPONSES",
    "PAGE_DESCRIPTION",
    "PAGE_RESPONSES",
    "METRICS_RESPONSES",
    "REPORT_DESCRIPTION",
    "REPORT_RESPONSES",
    "RUNS_RESPONSES",
    "STEP_RESPONSES",
    "error",
    "read_errors",
]

_BATCH = {
    "step": 12,
    "batch_id": "run7-step12-rank0",
    "policy_version": 12,
    "entropy_source": "trainer",
    "cu_seqlens": [0, 3, 5],
    "logp_rollout": [-0.11, -2.3, -0.02, -0.7, -1.2],
    "logp_train": [-0.12, -2.1, -0.02, -0.69, -1.25],
    "entropy": [0.4, 1.9, 0.05, 0.8, 1.1],
    "loss_mask": [0, 1, 1, 1, 1],
    "versions": [12, 12, 12, 11, 12],
}

BATCH_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {
            "schema": batch_schema(),
            "example": _BATCH,
        },
        "application/x-safetensors": {
            "schema": {"type": "string", "format": "binary"},
            "description": (
                "Named tensors (field names of docs/reference/batch.md); step, batch_id, "
                "policy_version and entropy_source as strings in the safetensors metadata."
            ),
        },
    },
}

_ROW = {
    "step": 12,
    "tokens": 4,
    "sequences": 2,
    "batches": 1,
    "mismatch_kl": 0.0023,
    "is_ratio_std": 0.09,
    "mask_ratio": {"estr": 0.0, "icepop": 0.0, "tis": 0.0},
    "policy_version": 12,
    "entropy_source": "trainer",
}

_MASKS = {
    "n": 5,
    "encoding": "packbits-little-base64",
    "data": {"estr": "Hw==", "icepop": "Hw=="},
}


#: every error answer: ``detail`` is a message (a list of FastAPI's validation errors, each with
#: the ``loc`` of the bad parameter, for malformed path or query parameters); ``field`` and
#: ``index`` name what a refused batch got wrong
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["detail"],
    "properties": {
        "detail": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "field": {"type": ["string", "null"]},
        "index": {"type": ["integer", "null"]},
    },
}


def error(description: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {
        "description": description,
        "content": {
            "application/json": {"schema": ERROR_SCHEMA, "example": {"detail": detail, **extra}}
        },
    }


def read_errors() -> dict[int | str, dict[str, Any]]:
    """What any read of the store can answer besides its own statuses."""
    return {
        401: error("Reads need TIMWATCH_READ_TOKEN (or the write token) when one is set.",
                   "unauthorized"),
        503: error("Store down or unreachable; retry after the Retry-After seconds.",
                   "store unavailable: connection refused"),
    }  # fmt: skip


INGEST_DESCRIPTION = """
Ingest one packed batch for run `{run}` and answer its metric row.

* Body: JSON (`Content-Type: application/json`) or safetensors
  (`Content-Type: application/x-safetensors`, several times cheaper to send and parse).
* Idempotent on `batch_id`: a replay (same `batch_id`, same content) answers the stored answer
  with `"replayed": true` and changes nothing (history, counters). The content is compared by
  digest, whatever the wire format (JSON or safetensors of the same numbers is the same batch).
  The same `batch_id` with different content answers `409` naming the batch id and its stored
  step, stores nothing and counts as `conflict`. Without a `batch_id` every post counts.
* Several batches of one step (ranks, micro-batches) merge exactly into one step row:
  `row` is this batch's row, `step_row` the step's row so far.
* `?masks=estr,icepop` adds keep masks: for N positions, `np.packbits(mask, bitorder="little")`
  encoded base64 (`"encoding": "packbits-little-base64"`); decode with
  `np.unpackbits(np.frombuffer(base64.b64decode(s), np.uint8), count=n, bitorder="little")`.
* `?tag=key=value` (repeatable) merges tags into the run, within the bounds the parameter
  states; beyond them `422` names the tag and nothing is stored.
* Header `Timwatch-Tap-Dropped: N` (sent by the tap): batches it dropped since its last accepted
  post, added to `timwatch_tap_dropped_batches_total{run}` when this batch is new.
* A batch for a finished run re-opens it.
"""

INGEST_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The batch's row, the step's merged row, and masks when asked.",
        "content": {
            "application/json": {
                "example": {
                    "run": "grpo-7b",
                    "step": 12,
                    "batch_id": "run7-step12-rank0",
                    "replayed": False,
                    "row": _ROW,
                    "step_row": _ROW,
                    "masks": _MASKS,
                }
            }
        },
    },
    401: error("Missing or wrong bearer token (writes need TIMWATCH_TOKEN).", "unauthorized"),
    409: error(
        "The batch_id is known with different content; nothing stored.",
        "batch_id 'run7-step12-rank0' of run 'grpo-7b' was already ingested (step 12) with "
        "different content; nothing was stored: send new content under a new batch_id",
        field="batch_id",
        batch_id="run7-step12-rank0",
        step=12,
    ),
    413: error("Body over --max-body.", "body exceeds 268435456 bytes"),
    415: error("Unsupported Content-Type.", "unsupported content type 'text/plain'"),
    422: error(
        "Validation failed; nothing stored.",
        "logp_rollout[3] is NaN",
        field="logp_rollout",
        index=3,
    ),
    503: error(
        "Store down, locked (writers wait at most 1 s), or the server is overloaded (in-flight "
        "body budget --max-inflight spent, or every ingest slot waiting for the store); nothing "
        "stored: retry after the Retry-After seconds.",
        "store unavailable: database is locked",
    ),
}

FINISH_DESCRIPTION = """
Mark run `{run}` finished (the trainer is done): stored as the run's `finished_at` with an event
`run_finished`; the run's series leave `/metrics` after `--finish-grace` seconds (default 300)
and meanwhile `timwatch_run_finished{run}` is 1, so the stall alert stays quiet. Idempotent: a
second call answers the first `finished_at` with `already_finished: true`. A later batch
re-opens the run.
"""

FINISH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The run and when it was finished.",
        "content": {
            "application/json": {
                "example": {
                    "run": "grpo-7b",
                    "finished_at": 1764403600.0,
                    "already_finished": False,
                }
            }
        },
    },
    401: error("Missing or wrong bearer token (writes need TIMWATCH_TOKEN).", "unauthorized"),
    404: error("Unknown run.", "run 'x' not found"),
    422: error(
        "A malformed Timwatch-Tap-Dropped header.",
        "header Timwatch-Tap-Dropped must be an integer from 0 to 2147483648, got 'x'",
        field="Timwatch-Tap-Dropped",
    ),
    503: read_errors()[503],
}

ALERTMANAGER_DESCRIPTION = """
The guard's receiver: point an Alertmanager `webhook_configs` entry at it (with
`send_resolved: true` and the write token as `http_config.authorization.credentials`). Each alert
with a `run` label and the server's `--page-severity` (default `page`) pages its run while it
fires and is cleared when resolved; other alerts are counted as `ignored`. A paged run's batch
POSTs, and `GET /v1/runs/{run}/page`, answer with the header
`Timwatch-Page: firing; alerts=NAME[,NAME]; since=UNIX_S`, which a `Tap(on_page=...)` acts on.
The page state is kept in this process's memory.
"""

#: what `PageBoard.apply` accepts, no stricter (fields it does not read are free)
ALERTMANAGER_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["version", "alerts"],
                "properties": {
                    "version": {"type": "string", "enum": ["4"]},
                    "alerts": {
                        "type": "array",
                        "maxItems": 10_000,
                        "items": {
                            "type": "object",
                            "required": ["status", "labels"],
                            "properties": {
                                "status": {"type": "string", "enum": ["firing", "resolved"]},
                                "labels": {
                                    "type": "object",
                                    "additionalProperties": {"type": "string"},
                                },
                                "startsAt": {"type": "string", "format": "date-time"},
                                "fingerprint": {"type": "string"},
                            },
                        },
                    },
                },
            },
            "example": {
                "version": "4",
                "status": "firing",
                "alerts": [
                    {
                        "status": "firing",
                        "labels": {
                            "alertname": "TimwatchMismatchKLRising",
                            "run": "grpo-7b",
                            "severity": "page",
                        },
                        "startsAt": "2026-12-05T21:00:00Z",
                        "fingerprint": "0f1e2d3c4b5a6978",
                    }
                ],
            },
        }
    },
}

ALERTMANAGER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "What the payload did, and which of the runs it named are paged now.",
        "content": {
            "application/json": {
                "example": {"firing": 1, "resolved": 0, "ignored": 2, "paged": ["grpo-7b"]}
            }
        },
    },
    401: error("Missing or wrong bearer token (writes need TIMWATCH_TOKEN).", "unauthorized"),
    413: error("Body larger than the limit.", "body exceeds 16777216 bytes"),
    422: error(
        "Not an Alertmanager webhook payload (version 4); nothing was applied.",
        'alerts[0].status must be "firing" or "resolved"',
        field="alerts[0].status",
    ),
}

PAGE_DESCRIPTION = """
Whether the guard pages the run (fed by `POST /v1/alertmanager`), with the
`Timwatch-Page` header while it does.
"""

PAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The run's page state.",
        "content": {
            "application/json": {
                "example": {
                    "run": "grpo-7b",
                    "paged": True,
                    "alerts": ["TimwatchMismatchKLRising"],
                    "since": 1764403600.0,
                }
            }
        },
    },
    401: read_errors()[401],
    422: error("A malformed run id.", "run id is empty"),
}

MASKS_DESCRIPTION = """
Stateless mask computation: same body as ingest, policy parameters as query parameters
(defaults: the server's). Answers bit-packed keep masks (see ingest) and stores nothing.
"""

MASKS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Keep masks, one per requested policy.",
        "content": {"application/json": {"example": {**_MASKS, "params": {"tau": 1.6}}}},
    },
    401: INGEST_RESPONSES[401],
    413: INGEST_RESPONSES[413],
    415: INGEST_RESPONSES[415],
    422: INGEST_RESPONSES[422],
    503: error(
        "The in-flight body budget (--max-inflight) is spent; retry after Retry-After.",
        "server busy: 1073741824 of 1073741824 in-flight body bytes in use, …",
    ),
}

RUNS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Known runs, most recently active first.",
        "content": {
            "application/json": {
                "example": {
                    "runs": [
                        {
                            "run": "grpo-7b",
                            "first_seen": 1764400000.0,
                            "last_seen": 1764403600.0,
                            "last_step": 812,
                            "steps": 813,
                            "scalar_steps": 813,
                            "tags": {"model": "qwen3-8b"},
                            "finished_at": None,
                        }
                    ]
                }
            }
        },
    },
    **read_errors(),
}

METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Series by step (`format=csv`: text/csv with a `step` column first).",
        "content": {
            "application/json": {
                "example": {
                    "run": "grpo-7b",
                    "steps": [10, 11, 12],
                    "series": {"mismatch_kl": [0.0021, 0.0022, 0.0023]},
                }
            },
            "text/csv": {"example": "step,mismatch_kl\n10,0.0021\n11,0.0022\n12,0.0023\n"},
        },
    },
    404: error("Unknown run.", "run 'x' not found"),
    422: error("Unknown metric name or a parameter out of range.", "unknown metric 'foo'"),
    **read_errors(),
}

STEP_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The step's merged row with its details (buckets, heatmap, worst tokens).",
        "content": {
            "application/json": {
                "example": {
                    "run": "grpo-7b",
                    "step": 12,
                    "batches": 8,
                    "updated_at": 1764403600.0,
                    "row": _ROW,
                }
            }
        },
    },
    404: error("Unknown run or step.", "step 12 of run 'x' not found"),
    **read_errors(),
}

EVENTS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The run's most recent events, newest first.",
        "content": {
            "application/json": {
                "example": {
                    "run": "grpo-7b",
                    "events": [
                        {
                            "ts": 1764403600.0,
                            "kind": "token_id_drift",
                            "step": 12,
                            "message": "3 of 4096 token ids differ",
                            "data": {"mismatched": 3, "tokens": 4096},
                        }
                    ],
                }
            }
        },
    },
    404: error("Unknown run.", "run 'x' not found"),
    **read_errors(),
}

REPORT_DESCRIPTION = """
The incident report of run `{run}` as one self-contained HTML page (inline CSS, figures as PNG
data URIs, no script and no external resource: save it and open it offline): the diagnosis,
mismatch KL, IS-ratio std, mask ratios, entropy and version lag over steps with the alert
thresholds drawn, the entropy × |δ| heatmap and the length / lag buckets merged over the last
256 steps of the range, and the worst tokens (with their text when the service runs with
`--tokenizer tokenizer.json`). `from_step`/`to_step` are inclusive (default: the whole run);
long ranges are drawn as per-bucket min and max, so the page stays small.
"""

REPORT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The report page.",
        "content": {"text/html": {"example": "<!DOCTYPE html><html lang=\"en\">…</html>"}},
    },
    404: error("Unknown run.", "run 'x' not found"),
    422: error("A step parameter out of range, or from_step after to_step.",
               "from_step 9 is after to_step 3"),
    **read_errors(),
}  # fmt: skip

HEALTHZ_DESCRIPTION = """
Answered from memory, never by querying the store: the outcome of the most recent write
attempt and of a background store ping (every 5 s). 200 `"status": "ok"`; 503
`"status": "degraded"` while the last write attempt failed (disk full, read-only, locked,
unreachable) or the last ping failed or has been unanswered for over 5 s, with the error in
`write_error` / `ping_error`; 200 again after the next successful write (and ping).
"""

_HEALTH = {
    "status": "ok",
    "store": "sqlite:////var/lib/timwatch/timwatch.db (WAL)",
    "writes_protected": True,
    "reads_protected": False,
    "live_runs": 3,
    "write_error": None,
    "last_write_error": None,
    "last_write_error_at": None,
    "last_write_ok_at": 1764403600.0,
    "consecutive_write_failures": 0,
    "ping_error": None,
    "last_ping_ok_at": 1764403601.0,
    "consecutive_ping_failures": 0,
    "inflight_bytes": 0,
    "inflight_budget": 1073741824,
}

HEALTHZ_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Serving, and the last write and ping succeeded (or none happened yet).",
        "content": {"application/json": {"example": _HEALTH}},
    },
    503: {
        "description": "Degraded: the last write attempt or store ping failed.",
        "content": {
            "application/json": {
                "example": {
                    **_HEALTH,
                    "status": "degraded",
                    "write_error": "database or disk is full",
                    "last_write_error": "database or disk is full",
                    "last_write_error_at": 1764403700.0,
                    "consecutive_write_failures": 4,
                }
            }
        },
    },
}


SCALARS_POST_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "What was stored: canonical names, unmapped names kept, non-finite ones "
        "(stored as null), new and changed values; replayed when nothing changed.",
        "content": {
            "application/json": {
                "example": {
                    "run": "grpo-7b", "step": 3, "source": "verl",
                    "stored": ["grad_norm", "mismatch_kl"], "unmapped": ["timing_s/gen"],
                    "unmapped_dropped": 0, "nonfinite": [], "new": 3, "changed": 0,
                    "replayed": False,
                }
            }
        },
    },
    401: error("Missing or wrong bearer token (writes need TIMWATCH_TOKEN).", "unauthorized"),
    413: error("Body over 256 KiB.", "body exceeds 262144 bytes", field="body"),
    422: error(
        "A field is wrong (step, source, scalars, scalars.NAME, nonfinite[i]); nothing stored.",
        "scalars.loss must be a number, got str",
        field="scalars.loss",
    ),
    503: read_errors()[503],
}  # fmt: skip

SCALARS_GET_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Canonical scalars by step (null: not logged, or not finite) and the "
        "source each came from.",
        "content": {
            "application/json": {
                "example": {
                    "run": "grpo-7b", "steps": [3, 4],
                    "scalars": {"grad_norm": [0.41, None], "mismatch_kl": [2e-3, 2.4e-3]},
                    "sources": {"grad_norm": "verl", "mismatch_kl": "verl"},
                }
            }
        },
    },
    404: error("Unknown run.", "run 'x' not found"),
    422: error("A name that is not canonical, or a bad step range.",
               "unknown scalar 'vllm_kl'; known: ...", field="names"),
    **read_errors(),
}  # fmt: skip
