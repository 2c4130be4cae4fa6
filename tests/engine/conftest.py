"""The real-engine tier: a real vLLM (CPU build) serving a tiny Llama built here.

Every test under ``tests/engine`` is marked ``vllm`` (and ``slow``); ``scripts/test.sh`` runs
them after the rest of the suite, on one worker, once ``.ci/vllm-venv.sh`` has installed (or
found) the vLLM venv. Fixtures: `vllm_python` (the venv's interpreter; skips without it, fails
under ``CI``/``TIMWATCH_REQUIRE_VLLM``) and `tiny_model` (the model directory, built once per
session), and `engines`, through which every server of the tier is started: it keeps the last
one running for the next test that asks for the same settings (a start costs about a minute
here) and stops it before starting another (a server holds the machine-wide vLLM lock).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.vllm import Engines, build_tiny_model, require_vllm_python

HERE = Path(__file__).resolve().parent


# The tier's modules in the order that starts the fewest servers: the engine tests' bf16 server
# (stopped after its reloads), then one fp32 server for the engine's history test, the proxy
# tests and TRL's fp32 run (which plans fp32 first), then one bf16 server for TRL's bf16 and
# ESTR runs; the demo last: its CLI run starts its own, then one fp32 server for the gate's
# two runs. Alphabetical order needs one start more.
ORDER = ("test_vllm_engine.py", "test_vllm_proxy.py", "test_trl_vllm.py", "test_vllm_demo.py")


def _rank(item: pytest.Item) -> int:
    name = Path(str(item.fspath)).name
    return ORDER.index(name) if name in ORDER else len(ORDER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    slots = [i for i, item in enumerate(items) if HERE in Path(str(item.fspath)).resolve().parents]
    for i in slots:
        items[i].add_marker(pytest.mark.vllm)
        items[i].add_marker(pytest.mark.slow)
    # reordered among their own positions (stable: a module's tests keep their order)
    for i, item in zip(slots, sorted((items[i] for i in slots), key=_rank), strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM venv's python."""
    return require_vllm_python()


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh tiny Llama + byte-level BPE tokenizer directory (seed 0), built once."""
    out = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(vllm_python, out, seed=0)
    return out


@pytest.fixture(scope="session")
def engines(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    """The tier's one vLLM server at a time (`Engines`), stopped at the end of the session."""
    e = Engines(vllm_python, tiny_model, tmp_path_factory)
    try:
        yield e
    finally:
        e.stop()
