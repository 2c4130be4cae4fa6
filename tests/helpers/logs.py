"""The logging set-up of the test process, kept from frameworks that replace it.

AReaL's ``areal.utils.logging.getLogger`` (called at import by its modules, and at run time)
swaps in a new root logger and manager (``logging.Logger.root``/``.manager``) and runs
``dictConfig`` with ``disable_existing_loggers=True``. In a test process that leaves loggers
made afterwards under a root that pytest's ``caplog`` never hears from, and silences those made
before. `restore` puts back the manager this module found (imported by tests/conftest.py before
any test module) and switches its loggers on again; tests/conftest.py runs it before every
test, and the AReaL test modules right after importing AReaL.
"""

from __future__ import annotations

import logging

__all__ = ["restore"]

_ROOT, _MANAGER = logging.Logger.root, logging.Logger.manager


def restore() -> None:
    logging.Logger.root, logging.Logger.manager = _ROOT, _MANAGER
    for logger in list(_MANAGER.loggerDict.values()):
        if isinstance(logger, logging.Logger) and logger.disabled:
            logger.disabled = False
