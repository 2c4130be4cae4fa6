"""Service settings: one frozen object built by the CLI (or tests) and handed to ``create_app``.

Secrets come from the environment (``TIMWATCH_TOKEN``, ``TIMWATCH_READ_TOKEN``) so they stay out
of process listings; command-line flags override them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ..core.masks import PolicyParams

__all__ = [
    "DEFAULT_DB_URL",
    "DEFAULT_FINISH_GRACE",
    "DEFAULT_MAX_BODY",
    "DEFAULT_RUN_TTL",
    "INFLIGHT_BODIES",
    "Settings",
    "is_loopback",
]

DEFAULT_DB_URL = "sqlite:///./timwatch.db"
DEFAULT_MAX_BODY = 256 * 1024 * 1024
#: seconds an idle, unfinished run stays in /metrics (a day: a stuck run keeps alerting)
DEFAULT_RUN_TTL = 86400.0
#: seconds a finished run (``POST /v1/runs/{run}/finish``) stays in /metrics
DEFAULT_FINISH_GRACE = 300.0
#: the in-flight budget is this many largest bodies unless --max-inflight says otherwise: four
#: producers may upload full-size batches at once (1 GiB with the default --max-body), which
#: bounds the memory bodies can pin while leaving headroom for the parse copies of each
INFLIGHT_BODIES = 4


def _default_params() -> PolicyParams:
    from ..core.masks import PolicyParams

    return PolicyParams()


@dataclass(frozen=True)
class Settings:
    """Everything ``create_app`` needs; defaults match ``timwatch serve`` without flags."""

    host: str = "127.0.0.1"
    port: int = 8000
    db_url: str = DEFAULT_DB_URL
    token: str | None = None
    read_token: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    max_inflight: int | None = None  # bytes; None: INFLIGHT_BODIES × max_body
    run_ttl: float = DEFAULT_RUN_TTL
    finish_grace: float = DEFAULT_FINISH_GRACE
    nonfinite: Literal["refuse", "drop"] = "refuse"
    params: PolicyParams = field(default_factory=_default_params)
    insecure: bool = False
    #: a Hugging Face tokenizer.json: the report shows the worst tokens' text (None: ids only)
    tokenizer: str | None = None
    #: ``--replica-id``: counters are kept in the store under this id and continue across
    #: restarts (None: they restart at 0 with the process)
    replica_id: str | None = None
    #: ``--page-severity``: the ``severity`` label of the Alertmanager alerts that page a run for
    #: the guard (``POST /v1/alertmanager``); alerts of other severities are ignored
    page_severity: str = "page"

    @property
    def inflight_budget(self) -> int:
        """Request-body bytes the server reads or processes at once (``--max-inflight``)."""
        return (
            self.max_inflight if self.max_inflight is not None else INFLIGHT_BODIES * self.max_body
        )

    @property
    def writes_protected(self) -> bool:
        return bool(self.token)

    @property
    def reads_protected(self) -> bool:
        return bool(self.read_token)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, ``localhost``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
