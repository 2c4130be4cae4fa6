"""Every Python and shell snippet of README.md and docs/integrations.md runs here, or says why not.

A fenced block is read with the HTML comment on the line right before it, if any:

- no marker: run as written (Python in a fresh interpreter, shell under ``bash -euo pipefail``)
  in a scratch folder that links the repository's ``examples/`` and ``alerts/``, with
  ``timwatch`` and ``python`` on ``PATH`` meaning this checkout;
- ``<!-- snippet: context NAME -->``: Python run after `CONTEXTS[NAME]` defined the names the
  snippet takes as given (tensors of the right shapes), in the same interpreter (marked
  ``framework`` where that runs a trainer package's code, `IN_A_TRAINER`);
- ``<!-- snippet: serve -->``: the ``timwatch serve`` command, started exactly as written plus
  ``--port`` (a free one); the document's ``service`` blocks then run against it, in order, with
  ``127.0.0.1:8000`` / ``localhost:8000`` pointed at that port and ``TIMWATCH_URL`` set, and
  `EXPECT` checks what they left in its history;
- ``<!-- snippet: setup -->``: the set-up commands, which must be exactly `SETUP` (the ones
  ``.ci/run`` and the demo's test exercise);
- ``<!-- snippet: needs-gpu (why) -->`` / ``needs-cluster (why)``: reported as a skip with the
  reason (``pytest -rs`` lists them).

A block in any other language but YAML (parsed) is not code; a block with no language, an
unknown marker or an unknown context fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers.procs import REPO, answers_200, free_port, server_env, stop_process

DOCS = ("README.md", "docs/integrations.md")
PYTHON = {"python", "py"}
SHELL = {"sh", "bash", "shell"}
MARKER = re.compile(r"^<!-- snippet: (?P<kind>[a-z-]+)(?: (?P<arg>.*?))? -->$")
SKIPS = {"needs-gpu", "needs-cluster"}

# The set-up commands: the demo's install-and-run line (tests/stack/test_demo.py runs
# `timwatch demo`; the `demo` extra must exist) and the test command `.ci/run` execs.
SETUP = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[demo]' && timwatch demo",
    "scripts/test.sh",
}

# Names a `context` snippet takes as given.
CONTEXTS = {
    "arrays": """
        import numpy as np
        rng = np.random.default_rng(0)
        mu = np.log(rng.uniform(0.05, 1.0, 100))
        pi = np.minimum(mu + rng.normal(0.0, 0.02, 100), 0)
        h = rng.gamma(1.0, 0.8, 100)
    """,
    "torch_loop": """
        import torch
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 6, 17, generator=g, dtype=torch.bfloat16).requires_grad_()
        labels = torch.randint(0, 17, (2, 6), generator=g)
        rollout_temperature = 1.0
        lp = torch.log_softmax(logits.detach().float(), -1)
        old_logp = lp.gather(-1, labels[..., None])[..., 0]
        engine_logp = (old_logp + 0.01 * torch.randn(2, 6, generator=g)).clamp(max=0)
        adv = torch.randn(2, 1, generator=g).expand(2, 6)
        response_mask = torch.ones(2, 6)
    """,
    "verl_micro_batch": """
        from tests.unit.test_integrations import actor_config as _cfg, verl_batch
        old_log_probs, log_prob, rollout_log_probs, entropy, advantages, response_mask = (
            verl_batch(0)
        )
        actor_config = _cfg()
    """,
}

# What the service blocks of a document leave in the server's history.
EXPECT = {
    # the tap's steps 0-2, the posted example batch's step 3; `timwatch finish` ran last
    "README.md": {"run": "my-run", "steps": [0, 1, 2, 3], "files": ["my-run.html"]},
}


@dataclass(frozen=True)
class Snippet:
    doc: str
    line: int
    lang: str
    body: str
    kind: str  # "" when unmarked
    arg: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def snippets(doc: str) -> list[Snippet]:
    lines = (REPO / doc).read_text().splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(1)
        i += 1
        while not lines[i].startswith("```"):
            i += 1
        marker = MARKER.match(lines[start - 1]) if start else None
        out.append(
            Snippet(
                doc,
                start + 1,
                lang,
                "\n".join(lines[start + 1 : i]) + "\n",
                marker.group("kind") if marker else "",
                (marker.group("arg") or "") if marker else "",
            )
        )
        i += 1
    return out


ALL = [s for doc in DOCS for s in snippets(doc)]
STANDALONE = [s for s in ALL if s.kind not in ("serve", "service")]
#: the contexts whose snippets run a real trainer package's code (verl's policy loss): marked
#: `framework`, like the tests inside those packages (verl's imports alone take ~9 s of CPU)
IN_A_TRAINER = {"verl_micro_batch"}


def scratch(tmp_path: Path) -> dict[str, str]:
    """A working folder with the repository's examples and alerts, and an environment whose
    ``timwatch`` and ``python`` are this checkout's."""
    for name in ("examples", "alerts"):
        (tmp_path / name).symlink_to(REPO / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, args in (("timwatch", "-m timwatch"), ("python", "")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {args} "$@"\n')
        shim.chmod(0o755)
    env = server_env(None)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def run_block(s: Snippet, cwd: Path, env: dict[str, str], prelude: str = "") -> None:
    if s.lang in PYTHON:
        cmd = [sys.executable, "-c", textwrap.dedent(prelude) + s.body]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", s.body]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (
        f"{s.id} ({s.lang}) exited {done.returncode}:\n{s.body}\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )


def test_every_block_is_known() -> None:
    """Each fence names its language; each marker and context is one this test knows."""
    assert ALL, "no snippets found"
    for s in ALL:
        assert s.lang, f"{s.id}: a fence without a language"
        assert s.kind in {"", "setup", "serve", "service", "context", *SKIPS}, (
            f"{s.id}: unknown marker {s.kind!r}"
        )
        if s.kind == "context":
            assert s.arg in CONTEXTS, f"{s.id}: unknown context {s.arg!r}"
        if s.kind in SKIPS:
            assert s.arg.startswith("(") and s.arg.endswith(")"), f"{s.id}: say why, in ()"


@pytest.mark.parametrize(
    "s",
    [
        pytest.param(s, marks=pytest.mark.framework)
        if s.kind == "context" and s.arg in IN_A_TRAINER
        else s
        for s in STANDALONE
    ],
    ids=[s.id for s in STANDALONE],
)
def test_snippet(s: Snippet, tmp_path: Path) -> None:
    if s.kind in SKIPS:
        pytest.skip(f"{s.kind} {s.arg}: {s.body.splitlines()[0]}")
    if s.kind == "setup":
        assert s.body.strip() in SETUP, f"{s.id}: not a tested set-up command: {s.body}"
        return
    if s.lang == "yaml":
        assert yaml.safe_load(s.body) is not None
        return
    if s.lang not in PYTHON | SHELL:
        return  # not code
    run_block(s, tmp_path, scratch(tmp_path), CONTEXTS.get(s.arg, "") if s.kind else "")


def test_setup_commands_are_the_tested_ones() -> None:
    """`.ci/run` execs `scripts/test.sh`; the demo line installs an extra that exists and runs
    the command tests/stack/test_demo.py runs."""
    assert "exec bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r"^demo = ", pyproject, re.M), "the [demo] extra is gone"
    assert '"timwatch", "demo"' in (REPO / "tests" / "stack" / "test_demo.py").read_text()
    marked = {s.body.strip() for s in ALL if s.kind == "setup"}
    assert marked == SETUP


@pytest.mark.parametrize(
    "doc", [d for d in DOCS if any(s.kind == "service" for s in ALL if s.doc == d)]
)
def test_service_snippets(doc: str, tmp_path: Path) -> None:
    """The document's `serve` command started as written, then its `service` blocks in order
    against it, then what they stored."""
    blocks = [s for s in ALL if s.doc == doc and s.kind in ("serve", "service")]
    serve = [s for s in blocks if s.kind == "serve"]
    assert len(serve) == 1, f"{doc}: one `serve` block for its service blocks"
    env = scratch(tmp_path)
    port = free_port()
    args = shlex.split(serve[0].body.strip())
    assert args[:2] == ["timwatch", "serve"], serve[0].body
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "timwatch", *args[1:], "--port", str(port)],
        cwd=tmp_path, env=env, stdout=log, stderr=log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # a readiness wait: a cold numba cache compiles first
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            if answers_200(f"{url}/healthz"):
                break
            assert time.monotonic() < deadline, "timwatch serve did not come up"
            time.sleep(0.2)
        env["TIMWATCH_URL"] = url
        for s in blocks:
            if s.kind == "service":
                body = s.body.replace("http://127.0.0.1:8000", url)
                body = body.replace("localhost:8000", f"127.0.0.1:{port}")
                run_block(Snippet(s.doc, s.line, s.lang, body, s.kind, s.arg), tmp_path, env)
        want = EXPECT[doc]
        got = httpx.get(
            f"{url}/v1/runs/{want['run']}/metrics", params={"names": "mismatch_kl"}
        ).json()
        assert got["steps"] == want["steps"], got
        assert all(v > 0 for v in got["series"]["mismatch_kl"]), got
        for name in want["files"]:
            assert (tmp_path / name).read_text().lstrip().lower().startswith("<!doctype html")
    finally:
        stop_process(proc)
