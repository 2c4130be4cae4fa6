"""`timwatch demo`: a real tiny RL loop with a real train–inference mismatch, watched live.

What runs, all on this machine, nothing downloaded:

1. the timwatch service, in-process (uvicorn on 127.0.0.1, SQLite history);
2. a tiny causal LM (`timwatch.sidecar.demo.tinylm`). The *rollout engine* is a copy of it cast to
   ``--precision`` (bf16 by default) that samples with a KV-cache decode loop and keeps μ; the
   *trainer* recomputes the same tokens with one fp32 full-sequence prefill and gets π and H from
   `timwatch.monitor.trainer.logprobs.logprobs_and_entropy_from_logits`;
3. asynchronous RL: the engine samples with the weights of ``--lag`` versions ago while the
   trainer is at the current version, then takes ``--updates`` Adam steps with the ESTR PPO loss
   on a toy reward (share of "target" tokens, ids divisible by 8), so the policy, its entropy and
   the staleness all move;
4. every step goes to the service through the non-blocking `Tap` with μ, π (current
   weights), H, per-token versions and logp_old (fp32 under the engine's weights), so the history
   separates engine mismatch (``discrepancy_kl``) from staleness (``staleness_kl``).

The mismatch is what the two numeric paths produce; nothing is injected. With ``--precision
fp32`` only kernel-order differences remain and the engine mismatch drops by orders of magnitude.
"""

from __future__ import annotations

import copy
import socket
import threading
import time
from typing import Annotated, Any

import httpx
import typer

from timwatch.sidecar.demo.live_view import COLUMNS, LiveView

__all__ = ["demo", "DemoService"]

PRECISIONS = ("bf16", "fp16", "fp32")
DEFAULT_DB = "sqlite:///./timwatch-demo.db"
PROMPT_LEN = 4


class DemoService:
    """The timwatch service in a background thread of this process, on a socket it owns."""

    def __init__(self, db_url: str, port: int = 0) -> None:
        import uvicorn

        from timwatch.monitor.service.app import create_app
        from timwatch.monitor.service.settings import Settings
        from timwatch.monitor.store import Store

        self.store = Store(db_url)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = int(self.sock.getsockname()[1])
        settings = Settings(host="127.0.0.1", port=self.port, db_url=db_url)
        app = create_app(settings, store=self.store)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the demo's timwatch service did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def _free_run_name(store: Any, run: str) -> str:
    """A run name not yet in the history (re-running the demo must not merge into old steps)."""
    if not store.run_exists(run):
        return run
    k = 2
    while store.run_exists(f"{run}-{k}"):
        k += 1
    return f"{run}-{k}"


def _fetch(client: httpx.Client, run: str, last: int | None) -> list[dict[str, Any]]:
    names = ",".join(c for c, _ in COLUMNS)
    params: dict[str, Any] = {"names": names}
    if last is not None:
        params["last"] = last
    r = client.get(f"/v1/runs/{run}/metrics", params=params)
    if r.status_code != 200:
        return []
    res = r.json()
    return [
        {"step": s, **{c: res["series"][c][i] for c, _ in COLUMNS}}
        for i, s in enumerate(res["steps"])
    ]


def _train(
    *, steps: int, precision: str, lag: int, batch: int, max_new_tokens: int, updates: int,
    lr: float, seed: int, threads: int, tap: Any, view: LiveView, client: httpx.Client, run: str,
) -> dict[int, float]:  # fmt: skip
    import torch

    from timwatch.monitor.trainer.logprobs import logprobs_and_entropy_from_logits
    from timwatch.monitor.trainer.losses import estr_ppo_loss
    from timwatch.sidecar.demo.tinylm import TinyLM

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    model = TinyLM(seed=seed, max_len=PROMPT_LEN + max_new_tokens)
    engine = copy.deepcopy(model).to(dtype).eval()
    old = copy.deepcopy(model).eval()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    history = {0: copy.deepcopy(model.state_dict())}
    gen = torch.Generator().manual_seed(seed + 1)
    rewards: dict[int, float] = {}
    for step in range(steps):
        behaviour = max(0, step - lag)
        engine.load_state_dict(history[behaviour])  # cast to the engine's dtype on load
        old.load_state_dict(history[behaviour])
        prompt = torch.randint(0, model.vocab, (batch, PROMPT_LEN), generator=gen)
        lengths = torch.randint(
            max(1, max_new_tokens // 4), max_new_tokens + 1, (batch,), generator=gen
        )
        roll = engine.generate(prompt, max_new_tokens, gen)
        tokens, mu = roll.tokens, roll.logp
        full = torch.cat([prompt, tokens], dim=1)
        mask = torch.arange(max_new_tokens)[None, :] < lengths[:, None]
        with torch.no_grad():
            logp_old, h_old = logprobs_and_entropy_from_logits(
                old(full)[:, PROMPT_LEN - 1 : -1], tokens
            )
        target = (tokens % 8 == 0).float()
        reward = (target * mask).sum(1) / lengths
        adv = ((reward - reward.mean()) / (reward.std() + 1e-6))[:, None].expand_as(mu)
        pi0 = h0 = None
        for _ in range(updates):
            logits = model(full)[:, PROMPT_LEN - 1 : -1]
            pi, h = logprobs_and_entropy_from_logits(logits, tokens)
            if pi0 is None:
                pi0, h0 = pi.detach(), h.detach()
            loss, _ = estr_ppo_loss(pi, logp_old, adv, mask, mu, h_old)
            opt.zero_grad()
            loss.backward()
            opt.step()
        history[step + 1] = copy.deepcopy(model.state_dict())
        history.pop(step + 1 - lag - 1, None)
        assert pi0 is not None and h0 is not None
        cu = torch.zeros(batch + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=cu[1:])
        tap.report(
            step, cu_seqlens=cu, logp_rollout=mu[mask], logp_train=pi0[mask], entropy=h0[mask],
            loss_mask=torch.ones(int(cu[-1]), dtype=torch.int8), token_ids=tokens[mask],
            token_ids_train=full[:, PROMPT_LEN:][mask],
            versions=torch.full((int(cu[-1]),), behaviour, dtype=torch.int64),
            logp_old=logp_old[mask], policy_version=step,
        )  # fmt: skip
        rewards[step] = float(reward.mean())
        rows = _fetch(client, run, last=3)
        view.update(step + 1, [{**r, "reward": rewards.get(r["step"])} for r in rows])
    return rewards


def demo(
    steps: Annotated[int, typer.Option(min=1, help="RL steps (rollout + updates)")] = 40,
    precision: Annotated[
        str, typer.Option(help="rollout engine precision: bf16, fp16, fp32")
    ] = "bf16",
    lag: Annotated[
        int, typer.Option(min=0, help="rollout uses weights this many versions old")
    ] = 1,
    port: Annotated[int, typer.Option(help="service port on 127.0.0.1 (0: any free port)")] = 0,
    db: Annotated[str, typer.Option(help="history store (SQLAlchemy URL)")] = DEFAULT_DB,
    run: Annotated[str, typer.Option(help="run name (suffixed if it already exists)")] = "demo",
    batch: Annotated[int, typer.Option(min=1, help="sequences per rollout")] = 32,
    max_new_tokens: Annotated[int, typer.Option(min=2, help="longest response")] = 40,
    updates: Annotated[int, typer.Option(min=1, help="optimizer steps per rollout")] = 2,
    lr: Annotated[float, typer.Option(help="Adam learning rate")] = 3e-4,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads")] = 2,
    live: Annotated[bool, typer.Option(help="rich live view (off: only the summary)")] = True,
    hold: Annotated[bool, typer.Option(help="keep serving after the run until Ctrl-C")] = False,
) -> None:
    """Train a tiny LM with a bf16 rollout engine and an fp32 trainer; watch the mismatch live."""
    if precision not in PRECISIONS:
        raise typer.BadParameter(f"--precision must be one of {', '.join(PRECISIONS)}")
    from timwatch.sidecar.tap import Tap

    started = time.monotonic()
    service = DemoService(db, port)
    run = _free_run_name(service.store, run)
    tap = Tap(service.url, run, rank=0)
    client = httpx.Client(base_url=service.url, timeout=30)
    title = f"timwatch demo · run {run} · {precision} engine vs fp32 trainer · lag {lag}"
    try:
        with LiveView(steps, title, enabled=live) as view:
            rewards = _train(
                steps=steps, precision=precision, lag=lag, batch=batch,
                max_new_tokens=max_new_tokens, updates=updates, lr=lr, seed=seed,
                threads=threads, tap=tap, view=view, client=client, run=run,
            )  # fmt: skip
            tap.flush(60)
            rows = _fetch(client, run, last=None)
            view.update(steps, [{**r, "reward": rewards.get(r["step"])} for r in rows])
        _summary(view, run, db, service.url, rows, tap.stats(), time.monotonic() - started)
        if hold:
            view.console.print(f"serving on {service.url} — Ctrl-C to stop")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    finally:
        tap.close(10)
        client.close()
        service.stop()


def _summary(
    view: LiveView, run: str, db: str, url: str, rows: list[dict[str, Any]],
    stats: dict[str, Any], wall_s: float,
) -> None:  # fmt: skip
    c = view.console
    if not view.enabled:
        c.print(view.table())

    def mean(col: str) -> float:
        vals = [r[col] for r in rows if r.get(col) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    c.print(
        f"\n[bold]{len(rows)} steps stored[/bold] in {wall_s:.1f} s · tap sent {stats['sent']}, "
        f"dropped {stats['dropped']}, failed {stats['failed']}"
    )
    c.print(
        f"mean mismatch_kl {mean('mismatch_kl'):.3g} · engine-only (discrepancy_kl) "
        f"{mean('discrepancy_kl'):.3g} · staleness_kl {mean('staleness_kl'):.3g} · "
        f"noise_scale σ̂² {mean('noise_scale'):.3g}"
    )
    c.print("\n[bold]Where to look[/bold]")
    c.print(f"  Prometheus   {url}/metrics   (while this process serves; --hold keeps it up)")
    c.print(f"  history API  curl '{url}/v1/runs/{run}/metrics?names=mismatch_kl,is_ratio_std'")
    c.print(f"  one step     curl '{url}/v1/runs/{run}/steps/0'")
    c.print(f"  CLI          timwatch query {run} --metric mismatch_kl --url {url}")
    c.print(
        f"  later        timwatch serve --db {db}   then   "
        f"timwatch query {run} --metric mismatch_kl --metric noise_scale"
    )


if __name__ == "__main__":
    typer.run(demo)
