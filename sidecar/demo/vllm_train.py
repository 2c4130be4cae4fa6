"""`timwatch demo --engine vllm`: the demo's RL loop with a real vLLM (CPU build) as the rollout
engine, asynchronous, so staleness and per-token weight versions come from the engine.

* The model is the tiny Llama of `timwatch.sidecar.demo.hf_model`, built in a work directory by
  the vLLM venv's python; vLLM serves it in ``--precision`` (bf16 or fp32) with
  ``--enable-scale-out`` and dev mode (`timwatch.sidecar.demo.vllm_engine`).
* ``batch`` rollout threads stream ``/inference/v1/generate`` requests (random 4-token prompts,
  ``max_new_tokens/4``…``max_new_tokens`` new tokens, μ of each sampled token, its weight
  version from the engine's ``weight_versions`` spans) and queue the results. A request may
  start only while fewer than (trainer version + 2) × ``batch`` have started, so rollouts are
  at most about two versions behind (staleness bounded as in asynchronous RL systems).
* Each `VllmDemoTrainer.step` takes ``batch`` finished rollouts, recomputes in fp32 torch
  (`timwatch.sidecar.demo.llama`) ``logp_old`` and H under the weights of each token's own
  version and π under the current ones, takes ``updates`` Adam steps with the ESTR PPO loss on
  the demo's toy reward (share of token ids divisible by 8), saves the weights and has vLLM
  reload them (pause with requests kept, ``reload_weights``, ``update_weight_version``,
  resume) once the next step's rollouts have started and one has received tokens: the reload
  lands inside requests in flight, whose later tokens carry the new version.
* The step's μ, π, H, per-token versions and ``logp_old`` go to the tap with
  ``policy_version`` = the trainer's version, as in the embedded demo.

Imports torch: demo-only code.
"""

from __future__ import annotations

import queue
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import torch

from ...monitor.trainer.logprobs import logprobs_and_entropy_from_logits
from ...monitor.trainer.losses import estr_ppo_loss
from . import llama
from .vllm_engine import EngineClient, Generation, VllmProcess, build_model

__all__ = ["DTYPES", "PROMPT_LEN", "VllmDemoTrainer"]

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PROMPT_LEN = 4
KEEP_VERSIONS = 8  # weight versions kept for logp_old (rollouts lag by about two)


class VllmDemoTrainer:
    """The fp32 trainer, the vLLM server and its rollout threads; `step` runs one RL step and
    returns its mean reward; `close` stops the threads and the server."""

    def __init__(
        self, *, python: str, workdir: Path, precision: str, batch: int,
        max_new_tokens: int, updates: int, lr: float, seed: int, threads: int,
        server: VllmProcess | None = None,
    ) -> None:  # fmt: skip
        """``server``: a running vLLM to train on instead of starting one. It must serve a
        model of this architecture (`llama`'s, from `build_model`, any seed) in ``precision``,
        in dev mode with ``--enable-scale-out``; `start` loads this trainer's initial weights
        into it as version 0, and `close` leaves it running."""
        if precision not in DTYPES:
            raise ValueError(f"the vLLM engine runs bf16 or fp32, not {precision}")
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.workdir, self.batch, self.updates = workdir, batch, updates
        self.max_new_tokens = max_new_tokens
        self.model_dir = workdir / "model"
        build_model(python, self.model_dir, seed)
        self.model = llama.load(self.model_dir)
        self.old = llama.load(self.model_dir).eval()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.history = {0: _copy_state(self.model)}
        if server is not None and server.dtype != DTYPES[precision]:
            raise ValueError(f"the server runs {server.dtype}, not {DTYPES[precision]}")
        self.owns_server = server is None
        self.server = server or VllmProcess(
            python, self.model_dir, workdir / "vllm.log", dtype=DTYPES[precision],
            extra=("--enable-scale-out",),
        )  # fmt: skip
        self.engine: EngineClient | None = None
        self.done: queue.Queue[Generation | BaseException] = queue.Queue()
        self.cond = threading.Condition()
        self.allowed = 2 * batch  # rollouts that may start: this step's and the next one's
        self.started = 0
        self.progress: dict[int, int] = {}  # worker → tokens received of its request in flight
        self.stopping = threading.Event()
        self.workers: list[threading.Thread] = []
        self.seed = seed

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def vocab(self) -> int:
        return self.model.vocab

    def start(self) -> float:
        """Starts vLLM (returns its start time in seconds; 0 for a server given) and the
        rollout threads."""
        if self.owns_server:
            self.server.start()
        self.engine = EngineClient(self.server.url, self.server.model)
        if self.owns_server:
            self.engine.set_version("0")
        else:
            self.engine.reload(self.model_dir, "0")  # this run's initial weights
        for i in range(self.batch):
            t = threading.Thread(target=self._rollouts, args=(i,), daemon=True)
            t.start()
            self.workers.append(t)
        return float(self.server.started_s or 0.0) if self.owns_server else 0.0

    def _rollouts(self, worker: int) -> None:
        """One rollout thread: start a request when the staleness bound allows it, stream it
        (its progress is what `_publish` waits on), queue the result."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + worker + 1)
        assert self.engine is not None
        k = 0
        while True:
            with self.cond:
                self.cond.wait_for(
                    lambda: self.stopping.is_set() or self.started < self.allowed, timeout=None
                )
                if self.stopping.is_set():
                    return
                self.started += 1
                self.progress[worker] = 0
            prompt = torch.randint(0, self.vocab, (PROMPT_LEN,), generator=gen).tolist()
            lo = max(1, self.max_new_tokens // 4)
            new = int(torch.randint(lo, self.max_new_tokens + 1, (1,), generator=gen))
            item: Generation | BaseException
            try:
                item = self.engine.generate(
                    prompt, new, seed=self.seed * 100000 + worker * 997 + k,
                    on_tokens=lambda n: self._progress(worker, n),
                )  # fmt: skip
            except BaseException as e:  # handed to the trainer, which raises it
                item = e
            finally:
                with self.cond:
                    self.progress.pop(worker, None)
                    self.cond.notify_all()
            k += 1
            if self.stopping.is_set():
                return
            self.done.put(item)
            if isinstance(item, BaseException):
                return

    def _progress(self, worker: int, tokens: int) -> None:
        with self.cond:
            self.progress[worker] = tokens
            self.cond.notify_all()

    def _take(self) -> list[Generation]:
        out: list[Generation] = []
        while len(out) < self.batch:
            item = self.done.get(timeout=600)
            if isinstance(item, BaseException):
                raise RuntimeError(f"a vLLM rollout failed: {item}") from item
            out.append(item)
        return out

    def _behaviour(self, gens: list[Generation], versions: torch.Tensor) -> Any:
        """logp_old and H: each token recomputed in fp32 under its own version's weights."""
        b, t = versions.shape
        logp_old, h_old = torch.zeros(b, t), torch.zeros(b, t)
        for v in sorted({int(x) for x in versions.unique() if x >= 0}):
            if v not in self.history:
                raise RuntimeError(f"weights of version {v} are no longer kept (rollout too old)")
            self.old.load_state_dict(self.history[v])
            for i, g in enumerate(gens):
                sel = versions[i, : len(g.token_ids)] == v
                if bool(sel.any()):
                    with torch.no_grad():
                        lp, h = llama.response_logprobs(self.old, g.prompt, g.token_ids)
                    logp_old[i, : len(g.token_ids)][sel] = lp[sel]
                    h_old[i, : len(g.token_ids)][sel] = h[sel]
        return logp_old, h_old

    def step(self, step: int, tap: Any) -> float:
        gens = self._take()
        b, new = self.batch, max(len(g.token_ids) for g in gens)
        lengths = torch.tensor([len(g.token_ids) for g in gens])
        mask = torch.arange(new)[None, :] < lengths[:, None]
        tokens = torch.zeros(b, new, dtype=torch.int64)
        mu, versions = torch.zeros(b, new), torch.full((b, new), -1, dtype=torch.int64)
        for i, g in enumerate(gens):
            n = len(g.token_ids)
            if None in g.versions:
                raise RuntimeError("vLLM returned tokens without a weight version")
            tokens[i, :n] = torch.tensor(g.token_ids)
            mu[i, :n] = torch.tensor(g.logprobs)
            versions[i, :n] = torch.tensor([int(v) for v in g.versions])  # type: ignore[arg-type]
        full = torch.cat([torch.tensor([g.prompt for g in gens]), tokens], dim=1)
        logp_old, h_old = self._behaviour(gens, versions)
        target = (tokens % 8 == 0).float()
        reward = (target * mask).sum(1) / lengths
        adv = ((reward - reward.mean()) / (reward.std() + 1e-6))[:, None].expand_as(mu)
        pi0 = h0 = None
        for _ in range(self.updates):
            logits = self.model(full)[:, PROMPT_LEN - 1 : -1]
            pi, h = logprobs_and_entropy_from_logits(logits, tokens)
            if pi0 is None:
                pi0, h0 = pi.detach(), h.detach()
            loss, _ = estr_ppo_loss(pi, logp_old, adv, mask.float(), mu, h_old)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        assert pi0 is not None and h0 is not None
        self._publish(step + 1)
        cu = torch.zeros(b + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=cu[1:])
        n = int(cu[-1])
        tap.report(
            step, cu_seqlens=cu, logp_rollout=mu[mask], logp_train=pi0[mask], entropy=h0[mask],
            loss_mask=torch.ones(n, dtype=torch.int8), token_ids=tokens[mask],
            token_ids_train=full[:, PROMPT_LEN:][mask], versions=versions[mask],
            logp_old=logp_old[mask], policy_version=step,
        )  # fmt: skip
        return float(reward.mean())

    def _publish(self, version: int) -> None:
        """Saves the new weights in their own directory and has vLLM reload them as
        ``version`` while rollouts are in flight; keeps the last `KEEP_VERSIONS` versions."""
        assert self.engine is not None
        out = self.workdir / "weights" / f"v{version}"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.model_dir / "config.json", out / "config.json")
        llama.save(self.model, out)
        with self.cond:
            self.allowed += self.batch  # the next step's rollouts may start (old weights)
            self.cond.notify_all()
            # land the reload inside a request: wait until one has tokens of the old weights
            self.cond.wait_for(lambda: any(n >= 1 for n in self.progress.values()), timeout=30)
        try:
            self.engine.reload(out, str(version))
        except httpx.TransportError:
            self.server.check_alive()  # a server that died says why, with its log
            raise
        self.history[version] = _copy_state(self.model)
        for old in [v for v in self.history if v <= version - KEEP_VERSIONS]:
            del self.history[old]
            shutil.rmtree(self.workdir / "weights" / f"v{old}", ignore_errors=True)

    def close(self) -> None:
        """Stops the rollout threads (their requests in flight end with the server) and vLLM
        (a server given runs on: the requests in flight end within ``max_new_tokens``)."""
        self.stopping.set()
        with self.cond:
            self.cond.notify_all()
        if self.owns_server:
            self.server.stop()
        for t in self.workers:
            t.join(timeout=10)
        if self.engine is not None:
            self.engine.close()


def _copy_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
