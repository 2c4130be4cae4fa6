"""The guard's page board: which runs are paged, fed by Alertmanager's webhook.

`PageBoard.apply` takes one Alertmanager webhook payload (JSON, ``"version": "4"``): every alert
that has a ``run`` label and the board's ``severity`` label value is recorded as firing or,
``"status": "resolved"``, cleared; alerts without a ``run`` label or of another severity are
counted as ignored. An alert is keyed by its ``fingerprint`` (by its sorted labels when it has
none), so one alert name firing for two label sets (two policies) needs both resolved.

Invariants: `page` of a run is None exactly when no recorded alert of it fires; its ``alerts``
are the sorted, unique alert names and ``since`` the earliest ``startsAt``. A payload that fails
validation (`InputError` naming the field and index, e.g. ``alerts[2].labels``) changes nothing:
it is checked whole before anything is applied. The board is in memory, per process: a replica
knows the pages sent to it (docs/service.md, Guard).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from ..core.errors import InputError
from ..core.page import Page

__all__ = ["PageBoard", "parse_time"]

_TIME = re.compile(
    r"^(\d{4}-\d{2}-\d{2})T(\d{2}:\d{2}:\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:\d{2})$", re.I
)
_MAX_ALERTS = 10_000


def parse_time(text: str) -> float:
    """Unix seconds of an RFC 3339 time as Alertmanager writes it (nanoseconds, ``Z``); a time
    without its zone is refused."""
    m = _TIME.match(text)
    if not m:
        raise ValueError(f"not an RFC 3339 time: {text[:60]!r}")
    date, clock, frac, zone = m.groups()
    zone = "+00:00" if zone.upper() == "Z" else zone
    stamp = datetime.fromisoformat(f"{date}T{clock}{zone}").astimezone(timezone.utc)
    return stamp.timestamp() + (float(f"0.{frac}") if frac else 0.0)


def _alerts(payload: object) -> list[tuple[str, str, str, str, float | None, str]]:
    """(status, run, name, key, startsAt, severity) of every alert; raises `InputError`."""
    if not isinstance(payload, Mapping):
        raise InputError("body", "the body must be a JSON object (Alertmanager webhook)")
    version = payload.get("version")
    if version != "4":
        raise InputError("version", f'version must be "4" (Alertmanager webhook), got {version!r}')
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise InputError("alerts", "alerts must be a list")
    if len(alerts) > _MAX_ALERTS:
        raise InputError("alerts", f"at most {_MAX_ALERTS} alerts per payload, got {len(alerts)}")
    out = []
    for i, alert in enumerate(alerts):
        where = f"alerts[{i}]"
        if not isinstance(alert, Mapping):
            raise InputError(where, f"{where} must be an object")
        status = alert.get("status")
        if status not in ("firing", "resolved"):
            raise InputError(f"{where}.status", f'{where}.status must be "firing" or "resolved"')
        labels = alert.get("labels")
        if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise InputError(f"{where}.labels", f"{where}.labels must map strings to strings")
        starts: float | None = None
        if "startsAt" in alert:
            try:
                if not isinstance(alert["startsAt"], str):
                    raise ValueError("must be a string")
                starts = parse_time(alert["startsAt"])
            except ValueError as exc:
                raise InputError(f"{where}.startsAt", f"{where}.startsAt: {exc}") from None
        fingerprint = alert.get("fingerprint")
        if "fingerprint" in alert and not isinstance(fingerprint, str):
            raise InputError(f"{where}.fingerprint", f"{where}.fingerprint must be a string")
        key = str(fingerprint) if fingerprint else repr(sorted(labels.items()))
        out.append(
            (
                status,
                labels.get("run", ""),
                labels.get("alertname", ""),
                key,
                starts,
                labels.get("severity", ""),
            )
        )
    return out


class PageBoard:
    """Firing page alerts per run (see the module doc). Thread-safe."""

    def __init__(self, severity: str = "page") -> None:
        self.severity = severity
        self._lock = threading.Lock()
        self._firing: dict[str, dict[str, tuple[str, float | None]]] = {}

    def apply(self, payload: object) -> dict[str, Any]:
        """Record one webhook payload; the counts of what it did and the runs paged now."""
        alerts = _alerts(payload)
        counts = {"firing": 0, "resolved": 0, "ignored": 0}
        touched: set[str] = set()
        with self._lock:
            for status, run, name, key, starts, severity in alerts:
                if not run or severity != self.severity:
                    counts["ignored"] += 1
                    continue
                touched.add(run)
                counts[status] += 1
                if status == "firing":
                    self._firing.setdefault(run, {})[key] = (name, starts)
                else:
                    self._firing.get(run, {}).pop(key, None)
                    if not self._firing.get(run):
                        self._firing.pop(run, None)
            paged = sorted(r for r in touched if r in self._firing)
        return {**counts, "paged": paged}

    def page(self, run: str) -> Page | None:
        """The run's firing page alerts, or None."""
        with self._lock:
            firing = list(self._firing.get(run, {}).values())
        if not firing:
            return None
        starts = [s for _, s in firing if s is not None]
        return Page(tuple(sorted({n for n, _ in firing})), min(starts) if starts else None)
