"""Command-line options made from `PolicyParams`: one ``--name`` per dataclass field, with the
field's default and its ``metadata["help"]``, so the API, the CLI and the docs share one
definition of every policy parameter."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import Field, fields
from typing import Annotated, Any, Literal, TypeVar

import typer

from ..core.errors import ConfigError
from ..core.masks import PolicyParams

__all__ = [
    "NONFINITE",
    "POLICY_PANEL",
    "check_nonfinite",
    "flag",
    "policy_fields",
    "policy_params",
    "with_policy_options",
]

R = TypeVar("R")

#: the help panel the policy options are listed under
POLICY_PANEL = "Policy parameters"
#: what ``--nonfinite`` accepts
NONFINITE = ("refuse", "drop")


def policy_fields() -> tuple[Field[Any], ...]:
    return fields(PolicyParams)


def flag(name: str) -> str:
    """The option a `PolicyParams` field is set with (``delta_abs_c`` → ``--delta-abs-c``)."""
    return "--" + name.replace("_", "-")


def check_nonfinite(value: str) -> Literal["refuse", "drop"]:
    if value not in NONFINITE:
        raise ConfigError(f"--nonfinite must be 'refuse' or 'drop', got {value!r}")
    return value  # type: ignore[return-value]


def policy_params(values: dict[str, float]) -> PolicyParams:
    """`PolicyParams(**values)`; a refusal becomes a `ConfigError` that names the options."""
    try:
        return PolicyParams(**values)
    except ValueError as exc:
        names = "|".join(sorted((f.name for f in policy_fields()), key=len, reverse=True))
        message = re.sub(rf"\b({names})\b", lambda m: flag(m.group(1)), str(exc))
        raise ConfigError(message.replace("policy parameter ", "")) from None


def with_policy_options(
    command: Callable[..., R], only: tuple[str, ...] | None = None
) -> Callable[..., R]:
    """A typer command equal to ``command`` with its ``params: PolicyParams`` argument
    replaced by one float option per field (all fields, or those named in ``only``); the
    options are gathered into a `PolicyParams`, validated, and passed as ``params``."""
    sig = inspect.signature(command, eval_str=True)
    chosen = [f for f in policy_fields() if only is None or f.name in only]
    if "params" not in sig.parameters or (only and len(chosen) != len(only)):
        raise TypeError(f"{command.__name__} needs a params argument and known field names")
    own = [p for p in sig.parameters.values() if p.name != "params"]
    extra = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=f.default,
            annotation=Annotated[
                float,
                typer.Option(flag(f.name), help=f.metadata["help"], rich_help_panel=POLICY_PANEL),
            ],
        )
        for f in chosen
    ]
    names = [f.name for f in chosen]

    def wrapper(**kwargs: Any) -> R:
        params = policy_params({n: kwargs.pop(n) for n in names})
        return command(**kwargs, params=params)

    wrapper.__name__ = command.__name__
    wrapper.__qualname__ = command.__qualname__
    wrapper.__doc__ = command.__doc__
    wrapper.__module__ = command.__module__
    wrapper.__signature__ = sig.replace(parameters=[*own, *extra])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in [*own, *extra]}
    return wrapper
