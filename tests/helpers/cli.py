"""The ``timwatch`` program as the tests run it, answering like ``subprocess.run(...,
capture_output=True, text=True)``.

`timwatch` runs the program in this process: the entry point ``timwatch.cli.main`` (what the
installed ``timwatch`` command and ``python -m timwatch`` call) on the arguments, in working
directory ``cwd``, with exactly the environment ``env`` (default: this process's, less every
``TIMWATCH_*`` variable), its own stdout and stderr, and the exit code it passes to
``sys.exit``. Working directory, environment and streams are restored afterwards. A command
started this way costs the test what the command does, not a new interpreter importing
numpy, numba and its kernels again (about 0.5 s of CPU per call here, 1.4 s for ``gate``).

`timwatch_process` runs a real ``python -m timwatch`` subprocess. Commands that run until
stopped (`SERVING`: they bind ports and install signal handlers) always run that way, as do the
tests that check what only a process shows: hostile input that could crash an interpreter, what
the process prints when the program is missing a module, and that both ways print the same
(tests/service/test_cli_errors.py).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.helpers.procs import REPO

__all__ = ["SERVING", "clean_env", "timwatch", "timwatch_process"]

#: the commands that serve until stopped: never run inside the test's process
SERVING = frozenset({"serve", "sidecar", "demo"})


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``TIMWATCH_*`` variables (a developer's shell or the
    test script may set them), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMWATCH_")}
    env.update(extra)
    return env


def timwatch_process(
    *args: str, cwd: Path = REPO, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m timwatch ARGS`` as a subprocess (this checkout importable)."""
    env = dict(clean_env() if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "timwatch", *args], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def timwatch(
    *args: str, cwd: Path = REPO, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``timwatch ARGS`` run by ``timwatch.cli.main`` in this process; a `SERVING` command as a
    subprocess (`timwatch_process`). ``timeout`` applies to the subprocess only: in this
    process a hung command is stopped by pytest-timeout."""
    word = next((a for a in args if not a.startswith("-")), None)
    if word in SERVING:
        return timwatch_process(*args, cwd=cwd, env=env, timeout=timeout)
    from timwatch.cli import main

    out, err = io.BytesIO(), io.BytesIO()
    streams = sys.stdin, sys.stdout, sys.stderr
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    text = [io.TextIOWrapper(b, encoding="utf-8", newline="\n") for b in (io.BytesIO(), out, err)]
    sys.stdin, sys.stdout, sys.stderr = text
    os.environ.clear()
    os.environ.update(clean_env() if env is None else env)
    os.chdir(cwd)
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:  # as the interpreter ends: a message is printed, exit 1
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    finally:
        for wrapper in text:  # flushed, then let go of without closing the buffer under it
            wrapper.flush()
            wrapper.detach()
        sys.stdin, sys.stdout, sys.stderr = streams
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
    return subprocess.CompletedProcess(
        ["timwatch", *args], code, out.getvalue().decode(), err.getvalue().decode()
    )
