"""Run ids: part of a URL path, a SQL key and a Prometheus label value.

Rather than guess how to sanitise arbitrary text (two different ids must not collide after
sanitising), ids outside a small safe alphabet are refused; the exposition therefore never sees
a quote, backslash or newline, and prometheus_client escapes label values anyway.
"""

from __future__ import annotations

import re

__all__ = ["MAX_RUN_ID", "check_run_id"]

MAX_RUN_ID = 128
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]*")


def check_run_id(run: str) -> str | None:
    """None if ``run`` is acceptable, else the reason it is refused."""
    if not run:
        return "run id is empty"
    if len(run) > MAX_RUN_ID:
        return f"run id is {len(run)} characters long; at most {MAX_RUN_ID} are allowed"
    if not _RUN_RE.fullmatch(run):
        return (
            "run id may contain only letters, digits and . _ : - and must start with a letter "
            "or digit"
        )
    return None
