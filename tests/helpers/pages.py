"""Alertmanager's webhook notification as `timwatch serve` receives it at ``POST
/v1/alertmanager`` (payload version 4, as Alertmanager sends it), for the guard's tests:
`webhook` builds one, `page` posts it (a real Alertmanager sending it:
tests/stack/test_guard_alertmanager.py)."""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["page", "webhook"]


def webhook(run: str, status: str = "firing", name: str = "TimwatchMismatchKLRising") -> Any:
    """One page-severity alert `name` of `run`, firing or resolved."""
    return {
        "version": "4", "status": status, "receiver": "timwatch-guard",
        "groupLabels": {"alertname": name}, "commonLabels": {}, "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093", "groupKey": "{}:{alertname=\"x\"}",
        "alerts": [{
            "status": status,
            "labels": {"alertname": name, "run": run, "severity": "page"},
            "annotations": {}, "startsAt": "2026-12-05T21:00:00.5Z",
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "", "fingerprint": "0f1e2d",
        }],
    }  # fmt: skip


def page(url: str, run: str, token: str, status: str = "firing") -> list[str]:
    """Post `webhook(run, status)` to the service at `url` with the write `token`; the runs it
    says are paged now."""
    headers = {"Authorization": f"Bearer {token}"}
    answer = httpx.post(
        f"{url}/v1/alertmanager", json=webhook(run, status), headers=headers, timeout=10
    )
    answer.raise_for_status()
    paged: list[str] = answer.json()["paged"]
    return paged
