"""Which extra of the ``timwatch`` distribution supplies what: `extra_for` answers the extra that
provides a missing module (``ModuleNotFoundError.name``), `missing_for` the first module a
command's extra lacks, `hint` the one line that says what to install. Standard library only: the
``timwatch`` program asks before it imports typer, which itself comes with an extra.

Invariants (tests/unit/test_extras.py holds them against pyproject.toml and the code):
`EXTRAS[extra]` is the set of top-level import names of the distributions that extra installs,
itself or through the extras it includes, less the ones no timwatch code imports; every command
of the program needs exactly one extra (`COMMANDS`); the plain install (numpy) imports none of
these names on the trainer's paths (the tap, the batch model, the numpy masks).
"""

from __future__ import annotations

import importlib.util

__all__ = ["COMMANDS", "EXTRAS", "extra_for", "hint", "missing_for", "with_hint"]

_CLI = frozenset({"typer", "rich", "orjson"})
_PROXY = _CLI | {"starlette", "uvicorn", "httptools", "safetensors"}
_SERVER = _CLI | {
    "fastapi", "starlette", "pydantic", "uvicorn", "prometheus_client", "sqlalchemy",
    "alembic", "numba", "llvmlite", "safetensors", "httpx",
}  # fmt: skip
_TORCH = frozenset({"torch"})
_REPORT = frozenset({"matplotlib"})

#: extra → the top-level import names it makes importable (that timwatch's code imports)
EXTRAS: dict[str, frozenset[str]] = {
    "cli": _CLI,
    "torch": _TORCH,
    "report": _REPORT,
    "postgres": _SERVER | {"psycopg"},
    "dashboards": _CLI | {"grafana_client", "niquests", "grafana_foundation_sdk"},
    "proxy": _PROXY,
    "server": _SERVER,
    "demo": _SERVER | _TORCH | _REPORT,
}

#: command of the ``timwatch`` program (its first word) → the extra it needs
COMMANDS: dict[str, str] = {
    **dict.fromkeys(
        (
            "serve",
            "analyze",
            "finish",
            "runs",
            "query",
            "show",
            "report",
            "diagnose",
            "compare",
            "gate",
        ),
        "server",
    ),
    "sidecar": "proxy",
    "dashboards": "dashboards",
    "demo": "demo",
}


def extra_for(module: str, command: str | None = None) -> str | None:
    """The extra that supplies ``module`` (a dotted name; its top level decides): ``command``'s
    own extra when it does, else the smallest extra that does; None when no extra does."""
    top = module.partition(".")[0]
    own = COMMANDS.get(command or "")
    if own is not None and top in EXTRAS[own]:
        return own
    supplying = [name for name, provides in EXTRAS.items() if top in provides]
    return min(supplying, key=lambda name: len(EXTRAS[name]), default=None)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken or half-removed installation counts as absent
        return False


def missing_for(command: str | None) -> str | None:
    """The first (alphabetically) import name that ``command``'s extra supplies and this
    environment cannot import; None when all are there or ``command`` is no known command (the
    program itself then needs the ``cli`` names). Finds specs only: imports nothing."""
    needed = EXTRAS[COMMANDS.get(command or "", "cli")]
    return next((name for name in sorted(needed) if not _importable(name)), None)


def hint(what: str, extra: str) -> str:
    """``timwatch serve needs the [server] extra: pip install 'timwatch[server]'``."""
    return f"{what} needs the [{extra}] extra: pip install 'timwatch[{extra}]'"


def with_hint(exc: ModuleNotFoundError, what: str, extra: str | None = None) -> ModuleNotFoundError:
    """``exc`` with `hint` for ``what`` appended to its message and the same ``name``: the
    ``extra`` named, else the smallest that supplies the module; ``exc`` itself when none does."""
    extra = extra or extra_for(exc.name or "")
    if extra is None:
        return exc
    return ModuleNotFoundError(f"{exc} ({hint(what, extra)})", name=exc.name)
