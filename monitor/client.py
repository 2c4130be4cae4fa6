"""A small synchronous client of the timwatch HTTP API (used by the CLI and the benchmark)."""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .core.errors import TimwatchHTTPError
from .core.jsoncodec import dumps, loads

if TYPE_CHECKING:
    import httpx

__all__ = ["DEFAULT_URL", "TimwatchClient", "TimwatchHTTPError", "decode_masks"]

DEFAULT_URL = "http://127.0.0.1:8000"


def decode_masks(masks: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Undo the API's bit packing: ``{"n", "encoding", "data"}`` → bool arrays of length n."""
    if masks.get("encoding") != "packbits-little-base64":
        raise ValueError(f"unknown mask encoding {masks.get('encoding')!r}")
    n = int(masks["n"])
    return {
        name: np.unpackbits(
            np.frombuffer(base64.b64decode(b64), np.uint8), count=n, bitorder="little"
        ).astype(bool)
        for name, b64 in masks["data"].items()
    }


class TimwatchClient:
    """Thin wrapper over httpx; tokens default to TIMWATCH_TOKEN / TIMWATCH_READ_TOKEN."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = (url or os.environ.get("TIMWATCH_URL") or DEFAULT_URL).rstrip("/")
        tok = token or os.environ.get("TIMWATCH_TOKEN") or os.environ.get("TIMWATCH_READ_TOKEN")
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        import httpx  # on first use: the CLI starts without it

        self.http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> TimwatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, r: httpx.Response) -> httpx.Response:
        if r.status_code >= 400:
            try:
                detail = str(r.json().get("detail", r.text))
            except ValueError:
                detail = r.text
            raise TimwatchHTTPError(r.status_code, detail)
        return r

    @staticmethod
    def _body(batch: Any, fmt: str) -> tuple[bytes, str]:
        if isinstance(batch, (bytes, bytearray)):
            ctype = "application/x-safetensors" if fmt == "safetensors" else "application/json"
            return bytes(batch), ctype
        if isinstance(batch, Mapping):
            return dumps(batch), "application/json"
        if fmt == "safetensors":
            return batch.to_safetensors(), "application/x-safetensors"
        return dumps(batch.to_json()), "application/json"

    def ingest(
        self,
        run: str,
        batch: Any,
        *,
        fmt: str = "safetensors",
        masks: Sequence[str] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """POST a Batch (or encoded bytes, or a JSON mapping) to ``/v1/runs/{run}/batches``."""
        body, ctype = self._body(batch, fmt)
        params: list[tuple[str, str | int | float | bool | None]] = []
        if masks:
            params.append(("masks", ",".join(masks)))
        params += [("tag", f"{k}={v}") for k, v in (tags or {}).items()]
        r = self.http.post(
            f"/v1/runs/{run}/batches", content=body, params=params,
            headers={"Content-Type": ctype},
        )  # fmt: skip
        return loads(self._check(r).content)

    def masks(
        self, batch: Any, policies: Sequence[str] = ("estr",), *, fmt: str = "safetensors",
        **params: float,
    ) -> dict[str, np.ndarray]:  # fmt: skip
        body, ctype = self._body(batch, fmt)
        q = {"policies": ",".join(policies), **{k: str(v) for k, v in params.items()}}
        r = self.http.post("/v1/masks", content=body, params=q, headers={"Content-Type": ctype})
        return decode_masks(loads(self._check(r).content))

    def finish(self, run: str) -> dict[str, Any]:
        """POST ``/v1/runs/{run}/finish``: ``{"run", "finished_at", "already_finished"}``."""
        return loads(self._check(self.http.post(f"/v1/runs/{run}/finish")).content)

    def runs(self) -> list[dict[str, Any]]:
        return loads(self._check(self.http.get("/v1/runs")).content)["runs"]

    def metrics(
        self,
        run: str,
        names: Sequence[str],
        *,
        from_step: int | None = None,
        to_step: int | None = None,
        last: int | None = None,
        csv: bool = False,
    ) -> Any:
        """``{"steps": [...], "series": {...}}``, or the CSV text with ``csv=True``."""
        params: dict[str, Any] = {"names": ",".join(names)}
        for k, v in (("from_step", from_step), ("to_step", to_step), ("last", last)):
            if v is not None:
                params[k] = v
        if csv:
            params["format"] = "csv"
        r = self._check(self.http.get(f"/v1/runs/{run}/metrics", params=params))
        return r.text if csv else loads(r.content)

    def scalars(
        self,
        run: str,
        names: Sequence[str] | None = None,
        *,
        from_step: int | None = None,
        to_step: int | None = None,
        last: int | None = None,
    ) -> dict[str, Any]:
        """The run's trainer scalars: ``{"steps": [...], "scalars": {name: [...]},
        "sources": {name: source}}`` (``GET /v1/runs/{run}/scalars/series``)."""
        params: dict[str, Any] = {"names": ",".join(names)} if names else {}
        for k, v in (("from_step", from_step), ("to_step", to_step), ("last", last)):
            if v is not None:
                params[k] = v
        return loads(
            self._check(self.http.get(f"/v1/runs/{run}/scalars/series", params=params)).content
        )

    def post_scalars(
        self,
        run: str,
        step: int,
        scalars: dict[str, float],
        *,
        source: str | None = None,
        nonfinite: Sequence[str] = (),
    ) -> dict[str, Any]:
        """POST one step's trainer scalars (``POST /v1/runs/{run}/scalars``); the answer."""
        body: dict[str, Any] = {"step": step, "scalars": scalars}
        if source is not None:
            body["source"] = source
        if nonfinite:
            body["nonfinite"] = list(nonfinite)
        r = self.http.post(
            f"/v1/runs/{run}/scalars",
            content=dumps(body),
            headers={"Content-Type": "application/json"},
        )
        return loads(self._check(r).content)

    def report_html(
        self, run: str, *, from_step: int | None = None, to_step: int | None = None,
        against: str | None = None,
    ) -> str:  # fmt: skip
        """The report page of ``run`` (``GET /v1/runs/{run}/report.html``), inclusive range;
        ``against``: with the comparison against that run."""
        params = {
            k: v
            for k, v in (("from_step", from_step), ("to_step", to_step), ("against", against))
            if v is not None
        }
        return self._check(self.http.get(f"/v1/runs/{run}/report.html", params=params)).text

    def diagnosis(
        self, run: str, *, from_step: int | None = None, to_step: int | None = None
    ) -> dict[str, Any]:
        """``GET /v1/runs/{run}/diagnosis``: ranked causes with evidence (docs/diagnosis.md)."""
        params = {
            k: v for k, v in (("from_step", from_step), ("to_step", to_step)) if v is not None
        }
        r = self._check(self.http.get(f"/v1/runs/{run}/diagnosis", params=params))
        return loads(r.content)

    def compare(
        self, a: str, b: str, *, from_step: int | None = None, to_step: int | None = None,
        seed: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        """``GET /v1/compare?a=&b=``: B against A, ratios with bootstrap intervals, verdict."""
        params: dict[str, Any] = {"a": a, "b": b, "seed": seed}
        params.update(
            {k: v for k, v in (("from_step", from_step), ("to_step", to_step)) if v is not None}
        )
        return loads(self._check(self.http.get("/v1/compare", params=params)).content)

    def step(self, run: str, step: int) -> dict[str, Any]:
        return loads(self._check(self.http.get(f"/v1/runs/{run}/steps/{step}")).content)

    def health(self) -> dict[str, Any]:
        return loads(self._check(self.http.get("/healthz")).content)

    def exposition(self) -> str:
        return self._check(self.http.get("/metrics")).text
