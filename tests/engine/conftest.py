"""The real-engine tier: a real vLLM (CPU build) serving a tiny Llama built here.

Every test under ``tests/engine`` is marked ``vllm`` (and ``slow``); ``scripts/test.sh`` runs
them after the rest of the suite, on one worker, once ``.ci/vllm-venv.sh`` has installed (or
found) the vLLM venv. Fixtures: `vllm_python` (the venv's interpreter; skips without it, fails
under ``CI``/``TIMWATCH_REQUIRE_VLLM``) and `tiny_model` (the model directory, built once per
session). Servers come from `tests.helpers.vllm.vllm_server`, one at a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.vllm import build_tiny_model, require_vllm_python

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)


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
