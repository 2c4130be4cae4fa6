"""The timwatch HTTP API (docs/reference/api.md): ingest, stateless masks, history queries,
/metrics.

The event loop only moves bytes: parsing, validation, the metric kernel and the database
transaction of a batch all run in the threadpool, so one big batch never stalls scrapes or
other clients.
"""

from __future__ import annotations

import base64
import csv
import hmac
import io
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, replace
from typing import Annotated, Any

import numpy as np
from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from timwatch.monitor.core.batch import Batch, BatchError
from timwatch.monitor.core.errors import ApiError
from timwatch.monitor.core.jsoncodec import dumps, loads
from timwatch.monitor.core.row import derive_row
from timwatch.monitor.core.runid import check_run_id
from timwatch.monitor.service import openapi_examples as ex
from timwatch.monitor.service.exporter import CONTENT_TYPE, make_registry, render
from timwatch.monitor.service.runs import RunRegistry
from timwatch.monitor.service.settings import Settings
from timwatch.monitor.store import METRIC_COLUMNS, Store, StoreUnavailable

__all__ = ["ApiError", "create_app", "encode_masks", "metric_column"]

log = logging.getLogger("timwatch.api")

SAFETENSORS = "application/x-safetensors"
RETRY_AFTER_S = "1"
_METRICS_EXAMPLE = 'timwatch_tokens_total{run="grpo-7b"} 1.048576e+06\n'


def metric_column(name: str) -> str:
    """``mask_ratio.estr`` / ``mask_ratio[estr]`` / ``mask_ratio_estr`` → ``mask_ratio_estr``."""
    n = name.strip()
    for prefix in ("mask_ratio", "seq_reject_ratio"):
        for open_, close in ((".", ""), ("[", "]"), ("{", "}")):
            if n.startswith(prefix + open_) and n.endswith(close):
                return f"{prefix}_{n[len(prefix) + 1 : len(n) - len(close)]}"
    return n


def encode_masks(masks: dict[str, np.ndarray], n: int) -> dict[str, Any]:
    """Bit-pack keep masks: ``np.packbits(mask, bitorder="little")`` in base64."""
    return {
        "n": n,
        "encoding": "packbits-little-base64",
        "data": {
            name: base64.b64encode(
                np.packbits(np.asarray(m, bool), bitorder="little").tobytes()
            ).decode()
            for name, m in masks.items()
        },
    }


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _bearer(request: Request) -> str | None:
    h = request.headers.get("authorization", "")
    return h[7:].strip() if h[:7].lower() == "bearer " else None


def _matches(given: str | None, *expected: str | None) -> bool:
    return given is not None and any(
        e is not None and hmac.compare_digest(given.encode(), e.encode()) for e in expected
    )


def _decode_json(body: bytes) -> Any:
    """Strict JSON fast path; Python's json as fallback so NaN/Infinity literals (which
    ``json.dumps`` writes) reach validation and get a message naming field and index."""
    try:
        return loads(body)
    except ValueError:
        try:
            return json.loads(body)
        except ValueError as e:
            raise BatchError("body", f"body is not valid JSON: {e}") from None


def _split(value: str | None) -> list[str]:
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def create_app(settings: Settings, *, store: Store | None = None) -> FastAPI:
    """The ASGI app. Opens (and migrates) the store unless one is given."""
    from timwatch.monitor.core.engine import accumulate
    from timwatch.monitor.core.masks import POLICIES, keep_masks

    store = store if store is not None else Store(settings.db_url)
    runs = RunRegistry(ttl=settings.run_ttl)
    registry = make_registry(runs)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        store.close()

    app = FastAPI(
        title="timwatch",
        version="0.1.0",
        summary="Train–inference mismatch monitoring for LLM RL.",
        lifespan=lifespan,
    )
    app.state.settings, app.state.store, app.state.runs = settings, store, runs

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        if exc.reason is not None:
            runs.reject(exc.reason)
        return _json({"detail": exc.detail, **exc.extra}, exc.status, exc.headers)

    @app.exception_handler(StoreUnavailable)
    async def _store_down(request: Request, exc: StoreUnavailable) -> Response:
        if request.method == "POST" and request.url.path.endswith("/batches"):
            runs.reject("store_unavailable")
        log.warning("store unavailable: %s", exc)
        return _json({"detail": f"store unavailable: {exc}"}, 503, {"Retry-After": RETRY_AFTER_S})

    def require_write(request: Request) -> None:
        if settings.token and not _matches(_bearer(request), settings.token):
            reason = "unauthorized" if request.url.path.endswith("/batches") else None
            raise ApiError(
                401, "unauthorized", reason=reason, headers={"WWW-Authenticate": "Bearer"}
            )

    def require_read(request: Request) -> None:
        if settings.read_token and not _matches(
            _bearer(request), settings.read_token, settings.token
        ):
            raise ApiError(401, "unauthorized", headers={"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request, reason: str | None) -> bytes:
        limit = settings.max_body
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"body exceeds {limit} bytes", reason=reason and "too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"body exceeds {limit} bytes", reason=reason and "too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def parse(body: bytes, content_type: str, reason: str | None) -> Batch:
        ctype = content_type.split(";")[0].strip().lower()
        try:
            if ctype == SAFETENSORS:
                return Batch.from_safetensors(body, nonfinite=settings.nonfinite)
            if ctype in ("", "application/json"):
                obj = _decode_json(body)
                return Batch.from_json(obj, nonfinite=settings.nonfinite)
        except BatchError as e:
            raise ApiError(422, str(e), reason=reason, field=e.field, index=e.index) from None
        raise ApiError(
            415,
            f"unsupported content type {ctype!r}; use application/json or {SAFETENSORS}",
            reason=reason,
        )

    def policies_of(value: str | None) -> list[str]:
        names = list(POLICIES) if value == "all" else _split(value)
        bad = [n for n in names if n not in POLICIES]
        if bad:
            raise ApiError(422, f"unknown policy {bad[0]!r}; known: {', '.join(POLICIES)}")
        return names

    def ingest_sync(
        run: str, body: bytes, ctype: str, masks: list[str], tags: dict[str, str]
    ) -> dict[str, Any]:
        batch = parse(body, ctype, "validation")
        answer: dict[str, Any] | None = None
        if batch.batch_id is not None:
            answer = store.find_batch(run, batch.batch_id)
        if answer is None:
            acc = accumulate(batch, settings.params)
            batch_row = derive_row(acc).to_dict()

            def respond(step_row: dict[str, Any]) -> dict[str, Any]:
                return {
                    "run": run,
                    "step": batch.step,
                    "batch_id": batch.batch_id,
                    "replayed": False,
                    "row": batch_row,
                    "step_row": step_row,
                }

            answer, replayed, _merged = store.record_batch(
                run, step=batch.step, batch_id=batch.batch_id, acc=acc,
                tokens=batch.num_tokens, respond=respond, tags=tags,
            )  # fmt: skip
            if not replayed:
                runs.observe(run, acc, answer["step_row"], batch.step)
        else:
            replayed = True
        answer = {**answer, "replayed": replayed}
        if masks:
            answer["masks"] = encode_masks(
                keep_masks(batch, masks, settings.params), batch.num_tokens
            )
        return answer

    @app.post(
        "/v1/runs/{run}/batches",
        tags=["ingest"],
        summary="Ingest a batch",
        description=ex.INGEST_DESCRIPTION,
        responses=ex.INGEST_RESPONSES,
        openapi_extra={"requestBody": ex.BATCH_BODY},
        dependencies=[Depends(require_write)],
    )
    async def ingest(
        run: str,
        request: Request,
        masks: Annotated[
            str | None, Query(description="policies (comma-separated) or 'all'")
        ] = None,
        tag: Annotated[list[str] | None, Query(description="key=value tags for the run")] = None,
    ) -> Response:
        problem = check_run_id(run)
        if problem:
            raise ApiError(422, problem, reason="validation", field="run")
        wanted = policies_of(masks)
        tags = {k: v for k, _, v in (t.partition("=") for t in tag or [])}
        body = await read_body(request, "too_large")
        ctype = request.headers.get("content-type", "")
        answer = await run_in_threadpool(ingest_sync, run, body, ctype, wanted, tags)
        return _json(answer)

    def params_dep(
        tau: float | None = None, eps: float | None = None, delta_abs_c: float | None = None,
        icepop_low: float | None = None, icepop_high: float | None = None,
        kpop_phi: float | None = None, tis_c: float | None = None,
        seq_mis_low: float | None = None, seq_mis_high: float | None = None,
        geo_rs_low: float | None = None, geo_rs_high: float | None = None,
        k3_rs_kappa: float | None = None,
        token_k1_lower: float | None = None, token_k1_upper: float | None = None,
        token_k2_upper: float | None = None, token_k3_upper: float | None = None,
        seq_sum_k2_upper: float | None = None, seq_sum_k3_upper: float | None = None,
        seq_mean_k2_upper: float | None = None, seq_max_k2_upper: float | None = None,
        seq_max_k3_upper: float | None = None,
    ) -> Any:  # fmt: skip
        names = settings.params.__dataclass_fields__
        given = {k: v for k, v in locals().items() if k in names and v is not None}
        try:
            return replace(settings.params, **given)
        except ValueError as e:  # PolicyParams names the parameter; a 500 would not
            raise ApiError(422, str(e)) from None

    @app.post(
        "/v1/masks",
        tags=["masks"],
        summary="Compute keep masks (stateless)",
        description=ex.MASKS_DESCRIPTION,
        responses=ex.MASKS_RESPONSES,
        openapi_extra={"requestBody": ex.BATCH_BODY},
        dependencies=[Depends(require_write)],
    )
    async def masks_endpoint(
        request: Request,
        params: Any = Depends(params_dep),  # noqa: B008 (closure: Annotated can't resolve it)
        policies: Annotated[str, Query(description="comma-separated policies, or 'all'")] = "all",
    ) -> Response:
        wanted = policies_of(policies)
        body = await read_body(request, None)
        ctype = request.headers.get("content-type", "")

        def go() -> dict[str, Any]:
            batch = parse(body, ctype, None)
            out = encode_masks(keep_masks(batch, wanted, params), batch.num_tokens)
            return {**out, "params": asdict(params)}

        return _json(await run_in_threadpool(go))

    read = [Depends(require_read)]

    @app.get(
        "/v1/runs", tags=["history"], summary="List runs", responses=ex.RUNS_RESPONSES,
        dependencies=read,
    )  # fmt: skip
    def list_runs() -> Response:
        return _json({"runs": store.list_runs()})

    def known_run(run: str) -> None:
        if check_run_id(run) or not store.run_exists(run):
            raise ApiError(404, f"run {run[:200]!r} not found")

    @app.get(
        "/v1/runs/{run}/metrics",
        tags=["history"],
        summary="Metric series of a run",
        description=(
            "Columns by step. Names: "
            + ", ".join(METRIC_COLUMNS)
            + " (`mask_ratio.estr` and `mask_ratio[estr]` also work). `from_step`/`to_step` "
            "are inclusive; `last=N` keeps the last N steps."
        ),
        responses=ex.METRICS_RESPONSES,
        dependencies=read,
    )
    def metrics_query(
        run: str,
        names: Annotated[str, Query(description="comma-separated metric names")] = "mismatch_kl",
        from_step: Annotated[int | None, Query(ge=0)] = None,
        to_step: Annotated[int | None, Query(ge=0)] = None,
        last: Annotated[int | None, Query(ge=1)] = None,
        format: Annotated[str, Query(pattern="^(json|csv)$")] = "json",
    ) -> Response:
        requested = _split(names)
        if not requested:
            raise ApiError(422, "names must list at least one metric")
        cols = [metric_column(n) for n in requested]
        bad = [n for n, c in zip(requested, cols, strict=True) if c not in METRIC_COLUMNS]
        if bad:
            raise ApiError(422, f"unknown metric {bad[0]!r}; known: {', '.join(METRIC_COLUMNS)}")
        known_run(run)
        if format == "csv":
            steps, series = store.query_metrics(
                run, cols, from_step=from_step, to_step=to_step, last=last
            )
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            w.writerow(["step", *requested])
            columns = [series[c] for c in cols]
            for i, s in enumerate(steps):
                w.writerow([s, *("" if c[i] is None else repr(c[i]) for c in columns)])
            return Response(buf.getvalue(), media_type="text/csv")
        # columnar read path: numpy arrays straight into orjson, same JSON as the row path
        steps, series = store.query_series(
            run, cols, from_step=from_step, to_step=to_step, last=last
        )
        out = {n: series[c] for n, c in zip(requested, cols, strict=True)}
        return _json({"run": run, "steps": steps, "series": out})

    @app.get(
        "/v1/runs/{run}/steps/{step}",
        tags=["history"],
        summary="One step's row and details",
        responses=ex.STEP_RESPONSES,
        dependencies=read,
    )
    def get_step(run: str, step: int) -> Response:
        found = None if check_run_id(run) else store.get_step(run, step)
        if found is None:
            raise ApiError(404, f"step {step} of run {run[:200]!r} not found")
        return _json(found)

    @app.get(
        "/v1/runs/{run}/events", tags=["history"], summary="Recent events of a run",
        dependencies=read,
    )  # fmt: skip
    def get_events(run: str, limit: Annotated[int, Query(ge=1, le=10000)] = 100) -> Response:
        known_run(run)
        return _json({"run": run, "events": store.list_events(run, limit)})

    @app.get(
        "/metrics",
        tags=["monitoring"],
        summary="Prometheus exposition (docs/reference/prometheus.md)",
        responses={200: {"content": {CONTENT_TYPE: {"example": _METRICS_EXAMPLE}}}},
        dependencies=read,
    )  # fmt: skip
    def metrics() -> Response:
        return Response(render(registry), media_type=CONTENT_TYPE)

    @app.get(
        "/healthz",
        tags=["monitoring"],
        summary="Liveness and store check",
        responses={200: {"content": {"application/json": {"example": {"status": "ok"}}}}},
    )
    def healthz() -> Response:
        store.ping()
        return _json(
            {
                "status": "ok",
                "store": store.description,
                "writes_protected": settings.writes_protected,
                "reads_protected": settings.reads_protected,
                "live_runs": len(runs),
            }
        )

    return app
