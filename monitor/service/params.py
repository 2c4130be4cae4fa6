"""Policy parameters and policy names as the API takes them, generated from `PolicyParams`.

The query model has one optional float per `PolicyParams` field, described by the field's
``metadata["help"]``: adding a field to the dataclass adds the query parameter, its OpenAPI
entry and its line in `policy_parameters` (the docs' table) with no edit here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, create_model

from ..core.errors import ApiError
from ..core.masks import POLICIES, PolicyParams
from .responses import split_list

__all__ = [
    "ParamDoc",
    "PolicyQuery",
    "apply_query",
    "policy_names",
    "policy_parameters",
    "policy_query_model",
]


@dataclass(frozen=True)
class ParamDoc:
    """One policy parameter: query name, default, the policy it tunes, one-line help."""

    name: str
    default: float
    policy: str
    help: str


def policy_parameters() -> list[ParamDoc]:
    """Every `PolicyParams` field in declaration order, as the reference docs list them."""
    defaults = PolicyParams()
    return [
        ParamDoc(f.name, getattr(defaults, f.name), f.metadata["policy"], f.metadata["help"])
        for f in fields(PolicyParams)
    ]


def policy_query_model() -> type[BaseModel]:
    """A pydantic model with one ``float | None = None`` field per `PolicyParams` field; None
    means "the server's value", so only the parameters a request names override it."""
    spec: dict[str, Any] = {
        p.name: (float | None, Field(None, description=p.help)) for p in policy_parameters()
    }
    return create_model("PolicyQuery", **spec)


if TYPE_CHECKING:
    PolicyQuery = BaseModel
else:
    PolicyQuery = policy_query_model()


def apply_query(base: PolicyParams, query: BaseModel) -> PolicyParams:
    """`base` with the parameters `query` gives; an invalid combination is a 422 naming the
    parameter (`PolicyParams` validates), never a 500."""
    given = {k: v for k, v in query.model_dump().items() if v is not None}
    try:
        return replace(base, **given)
    except ValueError as e:
        raise ApiError(422, str(e)) from None


def policy_names(value: str | None) -> list[str]:
    """``"all"`` → every policy; else the comma-separated names, each checked (422 if unknown)."""
    names = list(POLICIES) if value == "all" else split_list(value)
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise ApiError(422, f"unknown policy {bad[0]!r}; known: {', '.join(POLICIES)}")
    return names
