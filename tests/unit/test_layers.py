"""The layers of the code, by folder, and the one direction imports may point.

The map is `tests.helpers.layers.ALLOWED` (CONTRIBUTING's layer table is generated from the
same definition). Every ``import``/``from … import`` of a ``timwatch`` module anywhere in the
package, absolute or relative (at module level, inside functions, and under ``TYPE_CHECKING``
alike), is an edge from the importing module's layer to the imported one's. An edge to a layer
not listed as allowed, or a cycle among modules, fails the test. The self-tests below prove the
check bites: an added upward import in ``monitor/core/batch.py``, written either way::

    from timwatch.monitor.service.app import create_app
    from ..service.app import create_app

makes `find_violations` report ``timwatch.monitor.core.batch -> timwatch.monitor.service.app``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.helpers import layers
from tests.helpers.layers import ALLOWED

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "monitor": "timwatch.monitor",
    "sidecar": "timwatch.sidecar",
    "dashboards": "timwatch.dashboards",
}


def module_files() -> dict[str, Path]:
    """Dotted installed name → source file, for every module of the package."""
    out: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    for path in sorted((ROOT / "timwatch").glob("*.py")):
        out["timwatch" if path.stem == "__init__" else f"timwatch.{path.stem}"] = path
    return out


def layer_of(module: str) -> str:
    """The longest layer name that is `module` or a package above it."""
    best = ""
    for layer in ALLOWED:
        if (module == layer or module.startswith(layer + ".")) and len(layer) > len(best):
            best = layer
    return best


def imports_of(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """The timwatch modules `module` imports (``from pkg import mod`` resolves to the module)."""
    known = set(known)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "timwatch")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "timwatch":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return out


def _allowed(src_layer: str, dst: str) -> bool:
    dst_layer = layer_of(dst)
    if dst_layer == src_layer:
        return True
    for rule in ALLOWED[src_layer]:
        if rule.endswith(".*"):
            if dst.startswith(rule[:-1]):
                return True
        elif dst_layer == rule or dst.startswith(rule + "."):
            return True
    return False


def find_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        layer = layer_of(src)
        assert layer, f"{src} belongs to no layer: add its folder to ALLOWED"
        bad += [f"{src} -> {dst}" for dst in sorted(targets) if not _allowed(layer, dst)]
    return bad


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles among modules (a package importing its own submodules is not one)."""
    edges = {
        s: {d for d in ds if d in graph and d != s and not d.startswith(s + ".")}
        for s, ds in graph.items()
    }
    edges = {s: {d for d in ds if not s.startswith(d + ".")} for s, ds in edges.items()}
    cycles, state, stack = [], {}, []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m) :] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    return cycles


def build_graph() -> dict[str, set[str]]:
    files = module_files()
    return {m: imports_of(m, p, files) for m, p in files.items()}


def test_every_import_points_down() -> None:
    assert find_violations(build_graph()) == []


def test_no_import_cycles() -> None:
    assert find_cycles(build_graph()) == []


def test_the_check_bites() -> None:
    graph = build_graph()
    graph["timwatch.monitor.core.batch"] = graph["timwatch.monitor.core.batch"] | {
        "timwatch.monitor.service.app"
    }
    assert find_violations(graph) == ["timwatch.monitor.core.batch -> timwatch.monitor.service.app"]
    graph["timwatch.sidecar.tap.shipper"] |= {"timwatch.sidecar.demo.run"}
    assert "timwatch.sidecar.tap.shipper -> timwatch.sidecar.demo.run" in find_violations(graph)
    loop = {"a.x": {"a.y"}, "a.y": {"a.x"}}
    assert find_cycles(loop) == [["a.x", "a.y", "a.x"]]


def test_the_vllm_proxy_imports_nothing_of_the_sglang_proxy() -> None:
    """What both proxies share lives in ``proxy.http``, ``proxy.capture`` and ``proxy.records``;
    neither engine's package reaches into the other's."""
    vllm, sglang = "timwatch.sidecar.proxy.vllm", "timwatch.sidecar.proxy.sglang"
    graph = build_graph()
    assert any(src.startswith(vllm + ".") for src in graph)
    crossing = [
        f"{src} -> {dst}"
        for src, targets in sorted(graph.items())
        for dst in sorted(targets)
        if (src.startswith(vllm) and dst.startswith(sglang))
        or (src.startswith(sglang) and dst.startswith(vllm))
    ]
    assert crossing == []


def test_relative_imports_are_edges(tmp_path: Path) -> None:
    """A relative import is resolved against the importing module (a package's ``__init__``
    counts as the package itself) and one pointing up the layers fails the check."""
    files = module_files()
    graph = build_graph()
    # written relatively in the package: ``from ..core.masks import TOKEN_POLICIES``
    assert "timwatch.monitor.core.masks" in graph["timwatch.monitor.report.html"]
    upward = tmp_path / "batch.py"
    upward.write_text("def f():\n    from ..service.app import create_app\n")
    edges = imports_of("timwatch.monitor.core.batch", upward, files)
    assert edges == {"timwatch.monitor.service.app"}
    graph["timwatch.monitor.core.batch"] = edges
    assert find_violations(graph) == ["timwatch.monitor.core.batch -> timwatch.monitor.service.app"]
    package = tmp_path / "__init__.py"
    package.write_text("from . import shipper\nfrom ...monitor import service\n")
    assert imports_of("timwatch.sidecar.tap", package, files) == {
        "timwatch.sidecar.tap.shipper",
        "timwatch.monitor.service",
    }


def test_layer_table_is_current() -> None:
    """CONTRIBUTING's table, as CI and contributors check it: exit 0 on the committed tree."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.helpers.layers", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def test_layer_table_check_names_the_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "CONTRIBUTING.md"
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if "`timwatch.monitor.report`" in line)
    doc.write_text(text.replace(row + "\n", ""), encoding="utf-8")
    assert layers.main(["--check", "--file", str(doc)]) == 1
    assert capsys.readouterr().err.startswith("stale: CONTRIBUTING.md")
    assert layers.main(["--file", str(doc)]) == 0
    assert doc.read_text(encoding="utf-8") == text
    assert layers.main(["--check", "--file", str(doc)]) == 0
    doc.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="expected one"):
        layers.main(["--check", "--file", str(doc)])


def test_no_module_outside_the_installed_name() -> None:
    """No file of the package imports the folders by their bare names (``import monitor``)."""
    offenders = []
    for module, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [f"{module}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert offenders == []


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("timwatch.sidecar.tap", ("numba", "fastapi", "torch", "sqlalchemy")),
        ("timwatch.monitor.core.batch", ("numba", "fastapi", "torch", "httpx")),
        ("timwatch.monitor.store", ("numba", "fastapi", "torch")),
        ("timwatch", ("numba", "fastapi", "torch", "numpy")),
        ("timwatch.monitor", ("numba", "fastapi", "torch")),
        ("timwatch.cli", ("numba", "fastapi", "torch", "sqlalchemy", "httpx")),
    ],
)
def test_light_imports(module: str, forbidden: tuple[str, ...]) -> None:
    """What a trainer (or `timwatch --help`) pays for an import, in a fresh interpreter."""
    code = f"import sys, {module}\nprint(','.join(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.strip()
    assert out == "", f"import {module} loaded {out}"
