"""Markers of prometheus.md and api.md, read from a real app: the exposition it serves after one
ingested batch (parsed back with prometheus_client) and its OpenAPI document."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from timwatch.monitor.core.runid import MAX_RUN_ID, check_run_id
from timwatch.monitor.core.tags import MAX_TAG_KEY, MAX_TAG_VALUE, MAX_TAGS

from .common import code, table

__all__ = ["Served", "api_markers", "prometheus_markers", "serve_once"]

_SUFFIXES = {"counter": ("_total",), "summary": ("_sum", "_count")}
_SUFFIXES["histogram"] = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Served:
    """What the generator reads from the app: the exposition text and the OpenAPI document."""

    exposition: str
    openapi: dict[str, Any]


@contextmanager
def _client(root: Path) -> Iterator[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # starlette's notice about its httpx client
        from fastapi.testclient import TestClient

    from timwatch.monitor.service.app import create_app
    from timwatch.monitor.service.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(Settings(db_url=f"sqlite:///{tmp}/reference.db"))
        with TestClient(app) as client:
            yield client


def serve_once(root: Path) -> Served:
    """Ingest examples/batch.json and one step of every canonical trainer scalar as run
    `example` and read /metrics and /openapi.json back."""
    with _client(root) as client:
        body = (root / "examples" / "batch.json").read_bytes()
        answer = client.post(
            "/v1/runs/example/batches", content=body, headers={"content-type": "application/json"}
        )
        if answer.status_code != 200:
            raise ValueError(f"ingesting examples/batch.json answered {answer.status_code}")
        from timwatch.monitor.core.scalars import CANONICAL

        scalars = {"step": 1, "scalars": dict.fromkeys(CANONICAL, 0.5)}
        if client.post("/v1/runs/example/scalars", json=scalars).status_code != 200:
            raise ValueError("posting every canonical scalar failed")
        client.post("/v1/runs/example/scalars", json={"step": -1})  # one refused post
        exposition = client.get("/metrics").text
        openapi = client.get("/openapi.json").json()
    return Served(exposition, openapi)


def _labels(samples: list[Any]) -> str:
    values: dict[str, list[str]] = {}
    for s in samples:
        for key, value in s.labels.items():
            if key != "le" and value not in values.setdefault(key, []):
                values[key].append(value)
    parts = []
    for key, seen in values.items():
        parts.append(code(key) + ("" if key == "run" else f" ({', '.join(seen)})"))
    return ", ".join(parts)


def prometheus_markers(served: Served) -> dict[str, str]:
    rows, buckets = [], []
    for fam in text_string_to_metric_families(served.exposition):
        if not fam.samples:
            raise ValueError(f"{fam.name} has no samples: the example batch must fill every family")
        names = [fam.name + s for s in _SUFFIXES.get(fam.type, ("",))]
        seen = {s.name for s in fam.samples}
        if not seen <= set(names):
            raise ValueError(f"{fam.name} exposes unexpected samples {sorted(seen - set(names))}")
        samples = ", ".join(code(n) for n in names)
        rows.append([code(fam.name), fam.type, samples, _labels(fam.samples), fam.documentation])
        if fam.type == "histogram":
            edges: list[str] = []
            for s in fam.samples:
                if s.name.endswith("_bucket") and s.labels["le"] not in edges:
                    edges.append(s.labels["le"])
            buckets.append([code(fam.name + "_bucket"), ", ".join(edges)])
    return {
        "families": table(["family", "type", "series", "labels", "help"], rows),
        "buckets": table(["histogram", "`le` upper bounds"], buckets),
    }


def _schema_text(schema: dict[str, Any]) -> str:
    if "anyOf" in schema:
        kinds = [_schema_text(s) for s in schema["anyOf"] if s.get("type") != "null"]
        text = " or ".join(kinds)
    elif schema.get("type") == "array":
        text = f"list of {_schema_text(schema.get('items', {}))}"
    else:
        text = str(schema.get("type", "any"))
    bounds = [
        f"{sign} {schema[key]}"
        for key, sign in (("minimum", "≥"), ("maximum", "≤"))
        if key in schema
    ]
    if "pattern" in schema:
        bounds.append(f"matching `{schema['pattern']}`")
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def _operations(openapi: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in openapi["paths"].items():
        for method, op in methods.items():
            yield method.upper(), path, op


def _parameters(method: str, path: str, op: dict[str, Any]) -> str:
    rows = []
    for p in op.get("parameters", []):
        schema = p.get("schema", {})
        default = code(schema["default"]) if "default" in schema else "—"
        required = "yes" if p.get("required") else "no"
        description = p.get("description") or schema.get("description", "")
        rows.append(
            [code(p["name"]), p["in"], _schema_text(schema), default, required, description]
        )
    parts = [f"### {method} {path}"]
    body = op.get("requestBody", {}).get("content", {})
    if body:
        parts.append("Body: " + ", ".join(code(c) for c in body) + " ([batch.md](batch.md)).")
    if rows:
        parts.append(table(["name", "in", "type", "default", "required", "description"], rows))
    return "\n\n".join(parts)


def api_markers(served: Served) -> dict[str, str]:
    rows, params = [], []
    for method, path, op in _operations(served.openapi):
        responses = op["responses"].items()
        answers = "<br>".join(f"**{status}** {r.get('description', '')}" for status, r in responses)
        rows.append([method, code(path), op.get("summary", ""), answers])
        if op.get("parameters") or op.get("requestBody"):
            params.append(_parameters(method, path, op))
    rule = (check_run_id("-") or "").removeprefix("run id ")
    return {
        "endpoints": table(["method", "path", "summary", "answers"], rows),
        "parameters": "\n\n".join(params),
        "run_ids": f"A run id {rule}, and has at most {MAX_RUN_ID} characters.",
        "tag_bounds": (
            f"A run holds at most {MAX_TAGS} tags; a key has 1 to {MAX_TAG_KEY} characters of "
            f"`[A-Za-z0-9_.:-]`, a value at most {MAX_TAG_VALUE} characters and no control "
            "characters."
        ),
    }
