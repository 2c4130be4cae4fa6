"""A real vLLM (the CPU build from PyPI, in its own venv) for the real-engine tier: where its
python is, the tiny model it serves, and `vllm_server`, which starts one server, waits until it
answers and stops it (with its engine subprocess) on exit. The process handling is the demo's
(`timwatch.sidecar.demo.vllm_engine`); this module adds the tier's skip rule and a tokenizer
call in the vLLM venv.

The venv comes from ``.ci/vllm-venv.sh`` (``scripts/test.sh`` runs it and exports
``TIMWATCH_VLLM_PYTHON``). Without it the tier skips, except under ``CI`` or
``TIMWATCH_REQUIRE_VLLM``, where it fails. One vLLM server at a time on this machine (each holds
~3.3 GiB and both cores while it starts): a server holds an exclusive file lock for its whole
life, so servers of other test processes (xdist workers, other checkouts) wait their turn.
Within the tier's session, `Engines` keeps the last server running for the next test that asks
for the same settings, and stops it before starting another.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from timwatch.sidecar.demo.vllm_engine import (
    BUILDER,
    VLLM_ENV,
    VllmProcess,
    build_model,
    find_python,
)

if TYPE_CHECKING:
    import pytest

__all__ = [
    "BUILDER",
    "FP32_EXTRA",
    "Engines",
    "VLLM_ENV",
    "VllmServer",
    "build_tiny_model",
    "require_vllm_python",
    "tokenizer_roundtrip",
    "vllm_python",
    "vllm_server",
]

VllmServer = VllmProcess  # .url, .model, .dtype, .log, .proc, .started_s, .output()
vllm_python = find_python
build_tiny_model = build_model


def require_vllm_python() -> str:
    """The vLLM venv's python; skips the test without one (fails under CI or
    ``TIMWATCH_REQUIRE_VLLM``)."""
    import pytest

    py = vllm_python()
    if py is None:
        msg = "no vLLM venv: run `bash .ci/vllm-venv.sh` (or set TIMWATCH_VLLM_PYTHON)"
        if os.environ.get("CI") or os.environ.get("TIMWATCH_REQUIRE_VLLM"):
            pytest.fail(msg)
        pytest.skip(msg)
    return py


@contextmanager
def vllm_server(
    python: str, model_dir: Path, log: Path, *, dtype: str = "bfloat16",
    extra: tuple[str, ...] = (), timeout: float = 600.0, env: dict[str, str] | None = None,
) -> Iterator[VllmProcess]:  # fmt: skip
    """``python -m vllm.entrypoints.openai.api_server`` on a 127.0.0.1 port `VllmProcess`
    chooses (``port`` 0, as the demo starts it) serving ``model_dir`` in ``dtype``
    (``--enforce-eager``, ``--max-model-len 512``, ``EXTRA``), up once ``/health`` answers 200
    and ``/v1/models`` lists it; stopped with its whole process group on exit. Holds the
    machine-wide vLLM lock from before the start until after the stop."""
    server = VllmProcess(python, model_dir, log, dtype=dtype, extra=extra, env=dict(env or {}))
    server.start(timeout)
    try:
        yield server
    finally:
        server.stop()


class Engines:
    """At most one vLLM server of the tier at a time: `get` answers the running one when its
    settings are the ones asked for, else stops it and starts those; `stop` stops it (before a
    test that starts its own, as the demo does)."""

    def __init__(self, python: str, model: Path, tmp: pytest.TempPathFactory) -> None:
        self.python, self.model, self.tmp = python, model, tmp
        self.key: tuple[str, tuple[str, ...]] | None = None
        self.server: VllmServer | None = None
        self._stack = ExitStack()

    def get(self, dtype: str, extra: tuple[str, ...] = ()) -> VllmServer:
        if self.server is not None and self.key == (dtype, extra):
            return self.server
        self.stop()
        log = self.tmp.mktemp(f"vllm-{dtype}") / "vllm.log"
        self.server = self._stack.enter_context(
            vllm_server(self.python, self.model, log, dtype=dtype, extra=extra)
        )
        self.key = (dtype, extra)
        return self.server

    def stop(self) -> None:
        self._stack.close()
        self._stack, self.server, self.key = ExitStack(), None, None


# the fp32 engine of the history test and of the proxy's tests: one start for both
FP32_EXTRA = ("--enable-scale-out", "--trust-request-chat-template")


_TOKENIZE = """
import json, sys
from transformers import PreTrainedTokenizerFast
tok = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])
req = json.load(sys.stdin)
json.dump({
    "encoded": [tok.encode(t, add_special_tokens=False) for t in req["texts"]],
    "decoded": [tok.decode(ids) for ids in req["ids"]],
}, sys.stdout)
"""


def tokenizer_roundtrip(
    python: str, model_dir: Path, texts: list[str], ids: list[list[int]]
) -> dict[str, Any]:
    """The model's own tokenizer (transformers, in the vLLM venv): ``encoded`` ids of each text
    and ``decoded`` text of each id list."""
    res = subprocess.run(
        [python, "-c", _TOKENIZE, str(model_dir)], input=json.dumps({"texts": texts, "ids": ids}),
        capture_output=True, text=True, timeout=300, env=dict(os.environ, **VLLM_ENV),
    )  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"tokenizer call failed:\n{res.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(res.stdout)
    return out
