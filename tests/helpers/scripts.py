"""Load a repository script that is no package module (a generator, a hook, a rules tool) by
its path, as the module named ``name`` (registered in ``sys.modules``, so dataclasses and
pickling inside it resolve their module)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
