"""The guard in a lab run: the run is stopped at the first step boundary after its page.

Prometheus and Alertmanager are not in the lab's loop, so `LabGuard` stands in for both: after
each step it replays the run's series so far through the shipped rules with promtool
(Prometheus's own rule engine, `benchmarks.collapse_lab.replay`), and when a page-severity alert
first fires it POSTs the notification Alertmanager would send (webhook payload version 4, a
``run`` and ``severity`` label) to the lab's `timwatch serve` at ``/v1/alertmanager``. From there
on everything is the product: the service answers the run's next batch with the
``Timwatch-Page`` header, and the lab's ``Tap(on_page="raise")`` raises `RunPaged` at the step
boundary. A real Alertmanager delivering that webhook: tests/stack/test_guard_alertmanager.py.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.collapse_lab.replay import RULES, first_firings

__all__ = ["LabGuard", "webhook_payload"]


def webhook_payload(run: str, alerts: list[str], starts_at: float) -> dict[str, Any]:
    """What Alertmanager posts to a webhook receiver for firing page alerts of `run`."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(starts_at))
    return {
        "version": "4", "status": "firing", "receiver": "timwatch-guard",
        "groupLabels": {"run": run}, "commonLabels": {"run": run, "severity": "page"},
        "commonAnnotations": {}, "externalURL": "", "groupKey": f'{{}}:{{run="{run}"}}',
        "alerts": [
            {"status": "firing", "labels": {"alertname": a, "run": run, "severity": "page"},
             "annotations": {}, "startsAt": stamp, "endsAt": "0001-01-01T00:00:00Z",
             "generatorURL": "", "fingerprint": f"{run}/{a}"}
            for a in alerts
        ],
    }  # fmt: skip


class LabGuard:
    """Evaluates the shipped page rules after each step and notifies the service once."""

    def __init__(self, url: str, run: str, rules: Path = RULES) -> None:
        self.url, self.run, self.rules = url.rstrip("/"), run, rules
        self.paged_step: int | None = None
        self.alerts: list[str] = []

    def after_step(self, step: int, series: list[dict[str, float]]) -> None:
        if self.paged_step is not None or len(series) < 2:  # the replay needs two samples
            return
        pages = [f for f in first_firings(series, rules=self.rules) if f["severity"] == "page"]
        if not pages:
            return
        self.paged_step = step
        self.alerts = sorted({f["alert"] for f in pages})
        body = json.dumps(webhook_payload(self.run, self.alerts, time.time())).encode()
        req = urllib.request.Request(
            f"{self.url}/v1/alertmanager", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            if r.status != 200:
                raise RuntimeError(f"{self.run}: the service refused the page: HTTP {r.status}")
