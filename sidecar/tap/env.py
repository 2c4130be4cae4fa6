"""A plug-in's tap from the environment: the one reading of ``TIMWATCH_URL``, ``TIMWATCH_RUN``,
``TIMWATCH_TOKEN`` and ``TIMWATCH_ON_PAGE`` for the trainer plug-ins that build their `Tap` in
the framework's own processes (verl's workers, AReaL, OpenRLHF, SkyRL), so that each of them
honours the same variables the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .guard import on_page_from_env
from .shipper import Tap

__all__ = ["tap_from_env"]


def tap_from_env(default_run: str, environ: Mapping[str, str] | None = None) -> Tap | None:
    """A `Tap` to ``TIMWATCH_URL`` for run ``TIMWATCH_RUN`` (`default_run` when unset or
    empty) with ``TIMWATCH_TOKEN``, its guard action from ``TIMWATCH_ON_PAGE`` (``raise`` or
    ``marker:PATH``: `on_page_from_env`); None when ``TIMWATCH_URL`` is unset or empty.
    `environ` defaults to ``os.environ``.

    A bad ``TIMWATCH_ON_PAGE`` raises `ConfigError` naming it, and no tap is made: the
    plug-ins call this when the first training step needs the tap, so a misspelt guard stops
    the run there instead of leaving it unguarded."""
    env = os.environ if environ is None else environ
    url = env.get("TIMWATCH_URL")
    if not url:
        return None
    on_page = on_page_from_env(env.get("TIMWATCH_ON_PAGE"))
    return Tap(
        url, env.get("TIMWATCH_RUN") or default_run, env.get("TIMWATCH_TOKEN"), on_page=on_page
    )
