"""The proxies import no numba: their compiled code is the C reader (`proxy.native`), their
fallback orjson. In a fresh interpreter, so nothing else imported it first."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.procs import REPO

_CODE = """
import builtins, json, os, sys, traceback
real, importers = builtins.__import__, set()

def spy(name, *args, **kwargs):
    if name == "numba" or name.startswith("numba."):
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = os.path.realpath(frame.filename)
            if path.startswith(os.getcwd() + os.sep) and path.endswith(".py"):
                importers.add(os.path.relpath(path))  # the innermost file of this repo
                break
    return real(name, *args, **kwargs)

builtins.__import__ = spy
import timwatch.sidecar.proxy.sglang.app
import timwatch.sidecar.proxy.vllm.app
import timwatch.sidecar.cli
print(json.dumps(sorted(importers)))
"""


def test_the_proxy_apps_import_no_numba() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CODE], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    importers = set(json.loads(out.stdout.splitlines()[-1]))
    assert importers == set()
