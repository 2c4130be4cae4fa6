"""The one exception tree of timwatch: every error the project raises derives from
`TimwatchError`, so ``except TimwatchError`` catches all of them and nothing else.

Each subclass also keeps the builtin base callers already catch (`ValueError` for bad input,
`RuntimeError` for a failing dependency), so handlers written against those keep working.

    TimwatchError
    ├── InputError (ValueError)            bad data from a user or a client
    │   ├── BatchError                     a batch that fails validation (field, index)
    │   ├── BatchConflict                  a known batch_id posted again with other content
    │   ├── JoinError                      a malformed trainer report (field)
    │   └── WireError                      an engine answer of the wrong shape
    ├── ConfigError (ValueError)           a setting that cannot work (URL, path, port, driver)
    ├── NotFast                            the proxy's byte path declines; it parses instead
    ├── UpstreamError (ConnectionError)    the proxy's engine is unreachable or broke off
    ├── StoreUnavailable (RuntimeError)    the history store is down, locked or full
    ├── SeriesMismatch (RuntimeError)      stored series chunks disagree with each other
    ├── InsecureBindError (RuntimeError)   a public bind without a write token
    ├── PluginContextError (RuntimeError)  a trainer plug-in's per-micro-batch inputs are missing
    │                                      or belong to another micro-batch
    ├── RunPaged (RuntimeError)            the guard stops a training loop: its run is paged
    ├── ApiError                           an HTTP answer the service gives (status, detail)
    └── TimwatchHTTPError (RuntimeError)   a non-2xx answer seen by the client (status, detail)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ApiError",
    "BatchConflict",
    "BatchError",
    "ConfigError",
    "InputError",
    "InsecureBindError",
    "JoinError",
    "NotFast",
    "PluginContextError",
    "RunPaged",
    "SeriesMismatch",
    "StoreUnavailable",
    "TimwatchError",
    "TimwatchHTTPError",
    "UpstreamError",
    "WireError",
]


class TimwatchError(Exception):
    """Base of every exception timwatch raises."""


class InputError(TimwatchError, ValueError):
    """Input that timwatch refuses; `field` names where it went wrong when known."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    @property
    def message(self) -> str:
        return str(self.args[0])


class BatchError(InputError):
    """A batch that fails validation. `field` and `index` locate the first problem."""

    def __init__(self, field: str, message: str, index: int | None = None) -> None:
        super().__init__(field, message)
        self.index = index


class BatchConflict(InputError):
    """A ``batch_id`` the run already has, posted again with different content (another content
    digest). ``step`` is the step stored under that id; nothing of the new batch was stored."""

    def __init__(self, run: str, batch_id: str, step: int) -> None:
        super().__init__(
            "batch_id",
            f"batch_id {batch_id!r} of run {run!r} was already ingested (step {step}) with "
            "different content; nothing was stored: send new content under a new batch_id",
        )
        self.run, self.batch_id, self.step = run, batch_id, step


class JoinError(InputError):
    """A malformed trainer report; ``field`` names the offending place (``samples[3].entropy``)."""


class WireError(TimwatchError, ValueError):
    """An engine answer that does not have the expected shape; names the field and index."""


class ConfigError(TimwatchError, ValueError):
    """A setting the user gave that cannot work (a database URL, a path, a port, a missing
    driver); the message is one line that says how to fix it."""


class NotFast(TimwatchError):
    """Bytes the SGLang proxy's byte path does not read exactly; it takes the object path."""


class UpstreamError(TimwatchError, ConnectionError):
    """The proxy's engine could not be reached or broke off; ``timeout`` if it was too slow."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class StoreUnavailable(TimwatchError, RuntimeError):
    """The database is down, locked past its timeout, or refused the connection."""


class SeriesMismatch(TimwatchError, RuntimeError):
    """The stored series chunks disagree with each other (e.g. a metric added without backfill)."""


class InsecureBindError(TimwatchError, RuntimeError):
    """A non-loopback bind without a write token and without ``--insecure``."""


class PluginContextError(TimwatchError, RuntimeError):
    """A trainer plug-in's loss found no μ/H context for its micro-batch, or one set for another."""


class RunPaged(TimwatchError, RuntimeError):
    """Raised by `Tap.report` (``on_page="raise"``) at the first step boundary after the
    service said the run is paged; `alerts` names the firing alerts, `since` when (Unix s)."""

    def __init__(self, run: str, alerts: tuple[str, ...], since: float | None) -> None:
        names = ", ".join(alerts) or "page"
        super().__init__(f"run {run} is paged ({names}); stopped by the timwatch guard")
        self.run, self.alerts, self.since = run, alerts, since

    def __reduce__(self) -> tuple[type[RunPaged], tuple[str, tuple[str, ...], float | None]]:
        """Pickled with its three fields (the default pickles only the message, and unpickling
        then fails): a Ray worker's RunPaged reaches the driver as one (verl, OpenRLHF, SkyRL)."""
        return RunPaged, (self.run, self.alerts, self.since)


class ApiError(TimwatchError):
    """An error the service answers as ``{"detail": ...}`` with a status (and a rejection reason
    counted in ``timwatch_rejected_batches_total{reason}`` when one is given)."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        reason: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.status, self.detail, self.reason = status, detail, reason
        self.headers, self.extra = headers or {}, extra


class TimwatchHTTPError(TimwatchError, RuntimeError):
    """A non-2xx answer from a timwatch server; ``status`` and the server's ``detail``."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail
