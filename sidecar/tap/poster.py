"""The tap's HTTP client: one keep-alive connection from the shipper thread, on the standard
library only, so that importing the tap costs a trainer almost nothing (httpx alone takes
~0.15 s and pulls in its own CLI's dependencies when they are installed)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["Answer", "Poster", "post_finish"]


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    text: str

    @property
    def replayed(self) -> bool:
        """Whether an ingest answer says ``"replayed": true`` (the monitor counted nothing)."""
        try:
            answer = json.loads(self.text)
        except ValueError:
            return False
        return isinstance(answer, dict) and answer.get("replayed") is True

    @property
    def retry_after(self) -> float | None:
        """``Retry-After`` in seconds, if the answer has a numeric one."""
        try:
            return max(0.0, float(self.headers.get("retry-after", "")))
        except ValueError:
            return None


class Poster:
    """POSTs to one server over a persistent connection, reopened after any error. Not
    thread-safe: one shipper thread owns it. Network errors raise `OSError` (``http.client``'s
    errors derive from it or are converted)."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://host[:port], got {base_url!r}")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self._headers = headers
        self._timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self._timeout)
        return self._conn

    def post(
        self, path: str, body: bytes | Sequence[Any], headers: dict[str, str] | None = None
    ) -> Answer:
        """POST `body` (bytes, or buffers sent one after the other without joining them) with
        the constructor's headers updated by `headers`."""
        if isinstance(body, (bytes, bytearray, memoryview)):
            parts: Sequence[Any] = [body]
        else:
            parts = body
        length = sum(memoryview(p).nbytes for p in parts)
        sent = {**self._headers, **(headers or {}), "Content-Length": str(length)}
        conn = self._connection()
        try:
            conn.request("POST", self._prefix + path, body=iter(parts), headers=sent)
            resp = conn.getresponse()
            text = resp.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            if isinstance(exc, OSError):
                raise
            raise OSError(f"{type(exc).__name__}: {exc}") from exc
        if resp.will_close:
            self.close()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, text)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def post_finish(base_url: str, headers: dict[str, str], run: str, timeout: float) -> str | None:
    """POST ``/v1/runs/{run}/finish`` on a connection of its own; None if the monitor accepted
    it, else what went wrong (an HTTP status or a network error). Never raises `OSError`."""
    poster = Poster(base_url, headers, timeout)
    try:
        resp = poster.post(f"/v1/runs/{run}/finish", b"")
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        poster.close()
    return None if resp.status < 300 else f"HTTP {resp.status}: {resp.text[:300]}"
