"""verl plug-in, the entry module: importing it inside verl's processes
(`VERL_USE_EXTERNAL_MODULES=timwatch.sidecar.integrations.verl`, which verl's own `__init__`
honours) registers the `estr` policy loss in verl's `POLICY_LOSS_REGISTRY` and installs the hooks
that feed it (`verl_hooks`). `TIMWATCH_VERL_AUTOREGISTER=0` turns that off; then call
`register_with_verl()`. The loss, its context and the collector live in `verl_loss`; see
docs/integrations.md for the recipe.
"""

from __future__ import annotations

import os

from .verl_loss import (
    ESTR_LOSS_NAME,
    EstrInputs,
    SupportsReport,
    TimwatchTracking,
    compute_policy_loss_estr,
    estr_inputs,
    pack_padded,
    set_estr_inputs,
)

__all__ = [
    "ESTR_LOSS_NAME",
    "EstrInputs",
    "SupportsReport",
    "TimwatchTracking",
    "compute_policy_loss_estr",
    "estr_inputs",
    "pack_padded",
    "register_with_verl",
    "set_estr_inputs",
]


def register_with_verl(*, hook_actor: bool = True) -> bool:
    """Register `estr` in verl's POLICY_LOSS_REGISTRY (and install the hooks); False without
    verl."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError:
        return False
    if ESTR_LOSS_NAME not in getattr(core_algos, "POLICY_LOSS_REGISTRY", {}):
        core_algos.register_policy_loss(ESTR_LOSS_NAME)(compute_policy_loss_estr)
    if hook_actor:
        from . import verl_hooks

        verl_hooks.install_all()
    return True


if os.environ.get("TIMWATCH_VERL_AUTOREGISTER", "1") != "0":
    register_with_verl()
