"""Markers of policies.md: POLICIES and `dataclasses.fields(PolicyParams)` (metadata "policy" and
"help", defaults) merged with tables.POLICY_RULES, checked against the CLI and the API."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path
from typing import Any

import typer

from timwatch.cli import app
from timwatch.monitor.core import masks, rs_modes
from timwatch.monitor.core.masks import POLICIES, SEQUENCE_POLICIES, PolicyParams

from .common import code, merge_check, num, table
from .tables import POLICY_RULES

__all__ = ["markers"]


def _defaults(policy: str) -> str:
    params = [f for f in fields(PolicyParams) if f.metadata["policy"] == policy]
    return ", ".join(f"`{f.name}` = {num(f.default)}" for f in params)


def _rules() -> str:
    merge_check("policy", POLICIES, POLICY_RULES, "tables.POLICY_RULES")
    rows = []
    for policy in POLICIES:
        rule, source, function = POLICY_RULES[policy]
        if not callable(getattr(masks, function, None) or getattr(rs_modes, function, None)):
            raise ValueError(f"tables.POLICY_RULES[{policy!r}] names no function {function!r}")
        kind = "sequence" if policy in SEQUENCE_POLICIES else "token"
        rows.append([code(policy), kind, rule, _defaults(policy), code(function), source])
    return table(["policy", "kind", "keeps iff", "defaults", "function", "source"], rows)


def _options(command: str) -> dict[str, Any]:
    """The options of ``timwatch <command>`` as typer builds them (click objects), by name."""
    group: Any = typer.main.get_command(app)
    return {p.name: p for p in group.commands[command].params if p.name}


def _option(command: str, options: dict[str, Any], name: str, default: object) -> str:
    option = options.get(name)
    if option is None:
        return "—"
    if option.default != default:
        raise ValueError(
            f"timwatch {command} {option.opts[0]} defaults to {option.default}, "
            f"PolicyParams.{name} to {default}"
        )
    return code(option.opts[0])


def _params(masks_query: set[str]) -> str:
    commands = ("analyze", "serve")
    options = {c: _options(c) for c in commands}
    rows = []
    for f in fields(PolicyParams):
        policy = f.metadata["policy"]
        if policy not in POLICIES:
            raise ValueError(f"PolicyParams.{f.name} belongs to unknown policy {policy!r}")
        flags = [_option(c, options[c], f.name, f.default) for c in commands]
        query = code(f.name) if f.name in masks_query else "—"
        rows.append([code(f.name), code(policy), num(f.default), f.metadata["help"], *flags, query])
    header = ["parameter", "policy", "default", "meaning"]
    header += [f"`timwatch {c}`" for c in commands] + ["`/v1/masks`"]
    return table(header, rows)


def _loss_defaults(root: Path) -> str:
    """The keyword defaults of `estr_ppo_loss`, read from its source (importing it needs torch)."""
    path = root / "monitor" / "trainer" / "losses.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "estr_ppo_loss":
            pairs = zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True)
            found: dict[str, Any] = {
                a.arg: ast.literal_eval(d) for a, d in pairs if isinstance(d, ast.Constant)
            }
            break
    else:
        raise ValueError(f"no estr_ppo_loss in {path}")
    for name in ("tau", "eps"):
        if found.get(name) != getattr(PolicyParams(), name):
            raise ValueError(f"estr_ppo_loss {name}={found.get(name)} differs from PolicyParams")
    shown = ("tau", "eps", "clip_low", "clip_high")
    return ", ".join(f"`{k}` = {num(found[k])}" for k in shown)


def markers(root: Path, masks_query: set[str]) -> dict[str, str]:
    return {
        "clamp": num(masks.CLAMP),
        "p_min": num(masks.P_MIN),
        "rules": _rules(),
        "params": _params(masks_query),
        "loss_defaults": _loss_defaults(root),
    }
