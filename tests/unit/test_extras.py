"""Extras that match who installs what (pyproject.toml, `timwatch.monitor.core.extras`).

- The plain install is numpy: the trainer's paths (the tap, the batch model, the numpy masks)
  load nothing outside the standard library and numpy, run end to end.
- The extras table the program consults is pyproject's, and every third-party import of the
  code lies in the extra of the part it belongs to; the proxy and ``dashboards push`` run with
  every module outside their extra missing.
- A command whose extra is missing prints one line naming it and exits 2, for every command:
  the real ``timwatch.cli.main`` in a fresh interpreter, with the modules made missing the way
  the import system itself marks them (``sys.modules[name] = None``: ``import name`` raises
  ModuleNotFoundError, ``importlib.util.find_spec(name)`` answers None).

tests/stack/test_extras_install.py installs the wheel and each extra into real virtualenvs.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from timwatch.monitor.core.extras import COMMANDS, EXTRAS, extra_for
from timwatch.monitor.core.version import __version__

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL: dict[str, list[str]] = PROJECT["optional-dependencies"]
#: distributions an extra installs that no timwatch code imports (so no command needs them)
NOT_IMPORTED = {"sniffio"}  # httpcore looks it up on every lock; timwatch never imports it
#: names never made missing with the others outside an extra: a distribution it lists requires
#: them (typer requires pydantic, numba llvmlite)
PULLED = {"pydantic", "llvmlite"}
#: the user's own frameworks, imported by the plug-ins for them; never installed by timwatch
FRAMEWORKS = {
    "verl",
    "slime",
    "megatron",
    "transformers",
    "tokenizers",
    "trl",
    "areal",
    "openrlhf",
    "skyrl",
}
#: where the code lives → the extras that supply its imports (first matching prefix wins)
AREAS: list[tuple[str, tuple[str, ...]]] = [
    ("monitor/core/", ("server", "torch")),  # the engine (numba) and the torch masks
    ("monitor/trainer/", ("torch",)),
    ("monitor/store/", ("server",)),
    ("monitor/service/", ("server",)),
    ("monitor/client.py", ("server",)),
    ("monitor/diagnosis/", ("server",)),
    ("monitor/compare/", ("server",)),
    ("monitor/report/", ("report", "server")),
    ("monitor/cli/dashboards.py", ("dashboards",)),
    ("monitor/cli/", ("server",)),
    ("monitor/__init__.py", ()),  # lazy re-exports
    ("dashboards/", ("dashboards",)),
    ("sidecar/__init__.py", ()),
    ("sidecar/tap/", ("torch",)),  # torch only for tensors a trainer hands it
    ("sidecar/proxy/", ("proxy",)),
    ("sidecar/cli.py", ("proxy",)),
    ("sidecar/integrations/", ("torch",)),
    ("sidecar/demo/", ("demo",)),
    ("timwatch/", ("cli",)),
]
#: one module only that extra (and the extras including it) supplies, per command's extra
ONLY_IN = {
    "server": "fastapi",
    "proxy": "httptools",
    "dashboards": "grafana_client",
    "demo": "torch",
}


def _name(requirement: str) -> str:
    """``prometheus-client>=0.20`` → ``prometheus_client`` (how its import name is spelled)."""
    match = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert match is not None, requirement
    return match.group(0).lower().replace("-", "_")


def _installs(extra: str) -> set[str]:
    """Import-style names of the distributions ``extra`` lists, its ``timwatch[...]`` included."""
    out: set[str] = set()
    for requirement in OPTIONAL[extra]:
        included = re.fullmatch(r"timwatch\[([a-z,]+)\]", requirement)
        if included:
            for sub in included.group(1).split(","):
                out |= _installs(sub)
        else:
            out.add(_name(requirement))
    return out


def _blocked(modules: list[str] | set[str]) -> str:
    """Python source that makes ``modules`` missing for the rest of the interpreter's life."""
    return f"import sys\nfor _n in {sorted(modules)!r}:\n    sys.modules[_n] = None\n"


def _cli(argv: list[str], missing: list[str] | set[str]) -> subprocess.CompletedProcess[str]:
    code = _blocked(missing) + "from timwatch.cli import main\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


# ---- the plain install ---------------------------------------------------------------------


def test_plain_install_is_numpy_alone() -> None:
    assert [_name(r) for r in PROJECT["dependencies"]] == ["numpy"]


def test_trainer_paths_load_nothing_but_the_standard_library_and_numpy() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "helpers" / "trainer_paths.py")],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=True,
    ).stdout  # fmt: skip
    got = json.loads(out)
    assert got["foreign"] == []
    assert got["posts"] == [
        ["/v1/runs/trainer-paths/batches", "application/x-safetensors"],
        ["/v1/runs/trainer-paths/finish", None],
    ]
    assert got["kept"]["tis_weights_finite"] == 12
    assert all(0 <= n <= 12 for n in got["kept"].values()) and len(got["kept"]) > 8


# ---- the table -----------------------------------------------------------------------------


def test_extras_table_is_pyprojects() -> None:
    assert set(EXTRAS) == set(OPTIONAL) - {"all", "test"}
    for extra, provides in EXTRAS.items():
        assert provides == _installs(extra) - NOT_IMPORTED, extra


def test_all_holds_every_extra_and_test_holds_all() -> None:
    everything = set().union(*(_installs(e) for e in EXTRAS))
    assert _installs("all") == everything
    assert _installs("test") >= everything


def test_every_command_needs_one_extra() -> None:
    import typer.main

    from timwatch.commands import app

    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    assert set(group.commands) == set(COMMANDS)


def _third_party_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.partition(".")[0])
    return out - set(sys.stdlib_module_names) - {"__future__", "timwatch"}


def test_every_import_of_the_code_lies_in_its_extra() -> None:
    """Each file's third-party imports (module level or in functions) are numpy or names the
    extra of its area supplies; the plug-ins may import the framework they plug into."""
    stray = []
    files = [
        p
        for d in ("monitor", "sidecar", "dashboards", "timwatch")
        for p in (ROOT / d).rglob("*.py")
    ]
    for path in sorted(files):
        rel = path.relative_to(ROOT).as_posix()
        extras = next(e for prefix, e in AREAS if rel.startswith(prefix))
        allowed = {"numpy", *FRAMEWORKS}.union(*(EXTRAS[e] for e in extras))
        stray += [f"{rel}: {m} (not in {extras})" for m in _third_party_imports(path) - allowed]
    assert stray == []


def test_extra_for_prefers_the_commands_own_extra() -> None:
    assert extra_for("typer.main", "sidecar") == "proxy"
    assert extra_for("typer", "serve") == "server"
    assert extra_for("typer") == "cli"
    assert extra_for("matplotlib.figure", "serve") == "report"
    assert extra_for("psycopg", "serve") == "postgres"
    assert extra_for("grafana_client", "dashboards") == "dashboards"
    assert extra_for("verl", "serve") is None


# ---- parts running on their extra alone ------------------------------------------------------


def _outside(extra: str) -> set[str]:
    """Every name an extra supplies that ``extra`` does not (less `PULLED`)."""
    return set().union(*EXTRAS.values()) - EXTRAS[extra] - PULLED


def test_the_proxies_build_with_the_proxy_extra_alone() -> None:
    code = _blocked(_outside("proxy")) + (
        "import uvicorn\n"
        "import timwatch.commands\n"
        "from timwatch.sidecar.proxy.join.http import install_join\n"
        "from timwatch.sidecar.proxy.sglang.app import create_app\n"
        "from timwatch.sidecar.proxy.sglang.probe_forward import install_probe_forward\n"
        "from timwatch.sidecar.proxy.vllm.app import create_app as create_vllm\n"
        "m = 'http://127.0.0.1:9'\n"
        "a = create_app('http://127.0.0.1:8', probe_rate=0.5)\n"
        "install_join(a, monitor=m, run='r', token=None, report_ttl_s=1.0,\n"
        "             peers=['http://127.0.0.1:7'], peer_timeout_s=1.0, self_url='http://x:1')\n"
        "install_probe_forward(a, monitor=m, run='r', token=None, batch_size=1, flush_s=1.0)\n"
        "b = create_vllm('http://127.0.0.1:8', logprobs_mode='raw_logprobs',\n"
        "                timeout_s=None, ttl_s=1.0, max_held_bytes=10)\n"
        "install_join(b, monitor=m, run='r', token=None, report_ttl_s=1.0)\n"
        "for app in (a, b):\n"
        "    uvicorn.Config(app, http='httptools', log_level='warning').load()\n"
        "print('built')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.stdout.strip() == "built", proc.stderr[-3000:]


def test_torch_masks_and_losses_run_with_the_torch_extra_alone() -> None:
    """The trainer's torch side (masks on tensors, the loss, chunked log-probs) with every module
    outside [torch] missing."""
    code = _blocked(_outside("torch")) + (
        "import torch\n"
        "from timwatch.monitor.core.masks import estr_keep_mask, tis_weights\n"
        "from timwatch.monitor.trainer.logprobs import logprobs_and_entropy_from_logits\n"
        "from timwatch.monitor.trainer.losses import estr_ppo_loss\n"
        "g = torch.Generator().manual_seed(0)\n"
        "logits = torch.randn(6, 11, generator=g, requires_grad=True)\n"
        "labels = torch.randint(0, 11, (6,), generator=g)\n"
        "logp, ent = logprobs_and_entropy_from_logits(logits, labels)\n"
        "mu = logp.detach() - 0.05\n"
        "keep = estr_keep_mask(logp.detach(), mu, ent.detach())\n"
        "w = tis_weights(logp.detach(), mu)\n"
        "loss, _ = estr_ppo_loss(log_prob=logp, old_log_prob=logp.detach(),\n"
        "    advantages=torch.ones(6), loss_mask=torch.ones(6), rollout_log_prob=mu,\n"
        "    entropy=ent.detach())\n"
        "loss.backward()\n"
        "assert isinstance(keep, torch.Tensor) and isinstance(w, torch.Tensor)\n"
        "print(bool(torch.isfinite(logits.grad).all()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.stdout.strip() == "True", proc.stderr[-3000:]


def test_dashboards_push_runs_with_the_dashboards_extra_alone() -> None:
    """With everything outside [dashboards] missing, the command gets as far as Grafana (none
    listens on port 9) and says so: no extra is named, no module is missing."""
    url = "http://127.0.0.1:9"
    proc = _cli(["dashboards", "push", "--grafana-url", url], _outside("dashboards"))
    assert proc.returncode != 0 and f"cannot reach Grafana at {url}" in proc.stderr, proc.stderr
    assert "extra" not in proc.stderr and "Module" not in proc.stderr


# ---- one line naming the missing extra -------------------------------------------------------


def _hint(what: str, extra: str) -> str:
    return f"{what} needs the [{extra}] extra: pip install 'timwatch[{extra}]'"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_names_its_missing_extra(command: str) -> None:
    extra = COMMANDS[command]
    proc = _cli([command, "--help"], [ONLY_IN[extra]])
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [_hint(f"timwatch {command}", extra)]


NO_PROGRAM = _hint("timwatch", "server") + " (or [proxy] for timwatch sidecar alone)"


@pytest.mark.parametrize(
    ("argv", "missing", "line"),
    [
        (["serve", "--port", "0"], ["numba"], _hint("timwatch serve", "server")),
        (["analyze", "batch.json"], ["sqlalchemy"], _hint("timwatch analyze", "server")),
        (["report", "r", "--html", "r.html"], ["httpx"], _hint("timwatch report", "server")),
        (["sidecar", "vllm", "--upstream", "h"], ["typer"], _hint("timwatch sidecar", "proxy")),
        (["sidecar", "sglang"], ["orjson", "numba"], _hint("timwatch sidecar", "proxy")),
        (["dashboards", "push"], ["niquests"], _hint("timwatch dashboards", "dashboards")),
        (["demo", "--steps", "3"], ["matplotlib"], _hint("timwatch demo", "demo")),
        ([], ["typer"], NO_PROGRAM),
        (["--help"], ["typer", "rich"], NO_PROGRAM),
    ],
)  # fmt: skip
def test_a_missing_module_names_the_extra(argv: list[str], missing: list[str], line: str) -> None:
    proc = _cli(argv, missing)
    assert (proc.returncode, proc.stdout, proc.stderr.splitlines()) == (2, "", [line])


def test_a_present_extra_runs_the_command() -> None:
    """The check passes a command whose extra is whole (here [server] with the report's
    matplotlib missing): typer answers its --help."""
    proc = _cli(["runs", "--help"], ["matplotlib", "grafana_client", "httptools"])
    assert proc.returncode == 0 and "Usage: timwatch runs" in proc.stdout, proc.stderr


def test_a_lazy_name_names_the_extra_of_its_module() -> None:
    code = _blocked(["fastapi"]) + (
        "import timwatch\n"
        "try:\n"
        "    timwatch.create_app\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc.name, '|', exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    name, _, message = proc.stdout.strip().partition(" | ")
    assert name == "fastapi", proc.stderr
    assert message.endswith(f"({_hint('timwatch.create_app', 'server')})")


@pytest.mark.parametrize(
    ("call", "missing", "extra"),
    [
        ("b.to_safetensors()", "safetensors", "server"),
        ("Batch.from_json_bytes(b'{}')", "orjson", "cli"),
    ],
)
def test_batch_methods_name_the_extra_they_need(call: str, missing: str, extra: str) -> None:
    code = _blocked([missing]) + (
        "from timwatch.monitor.core.batch import Batch\n"
        "b = Batch.from_json({'cu_seqlens': [0, 1], 'logp_rollout': [-1.0], 'logp_train': [-1.0],\n"
        "                     'entropy': [0.5], 'loss_mask': [1]})\n"
        "try:\n"
        f"    {call}\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc.name, '|', exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    name, _, message = proc.stdout.strip().partition(" | ")
    assert name.partition(".")[0] == missing, proc.stderr
    method = call.partition("(")[0].replace("b.", "Batch.")
    assert message.endswith(f"({_hint(method, extra)})")


def test_version_needs_no_extra() -> None:
    proc = _cli(["--version"], ["typer", "rich"])
    assert (proc.returncode, proc.stdout) == (0, f"timwatch {__version__}\n")


def test_a_module_missing_while_a_command_runs_names_its_extra() -> None:
    """A module the check did not look for (the command's extra is whole) that is missing when
    the command imports it: `program.run` names the extra that supplies it."""
    code = _blocked(["matplotlib"]) + (
        "import typer\n"
        "from timwatch.monitor.cli.program import run\n"
        "app = typer.Typer()\n"
        "@app.command()\n"
        "def draw() -> None:\n"
        "    from timwatch.monitor.report import plots\n"
        "@app.command()\n"
        "def other() -> None:\n"
        "    pass\n"
        "sys.exit(run(app, ['draw']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [_hint("timwatch draw", "report")])
