"""Several SGLang proxies behind a real HAProxy round robin, their join keyed across them.

SGLang needs a GPU, so the engine is the stand-in `tests.helpers.fake_sglang` (SGLang 0.5.x's
wire format; it keeps a client-given ``rid``). Three real ``timwatch sidecar sglang`` processes
each get ``--peer`` for all three (each skips its own address) and one more peer that accepts
connections but never answers (a hung proxy); HAProxy runs the committed
``deploy/sglang-proxies/haproxy.cfg`` with only the addresses and check interval replaced; the
monitor is a real ``timwatch serve``. Clients generate through HAProxy with their own rids and
the trainer posts every report to HAProxy too, so neither chooses a proxy. Checked:

- every report joins all its samples and is forwarded as one batch, though its samples were
  captured by all three proxies and it landed on any one of them; the monitor's per-step
  ``tokens`` and ``sequences`` equal what was generated; nothing is counted unjoined; the hung
  peer costs each report at most ``--peer-timeout`` and is counted in the peers' errors;
- after ``kill -9`` of one proxy, a report whose samples it held is answered (never a 5xx), the
  samples the dead proxy took with it are counted in ``unjoined_samples`` exactly once (by the
  proxy that received the report) and the rest of that step reaches the monitor; the next step,
  generated on the two survivors, joins completely.

The same with SGLang's own router (the ``sglang-router`` package, which runs without a GPU) in
front of two proxies, with its round-robin and its default cache-aware policy.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.procs import REPO, ServerProc, free_port, running_process, stop_process

RUN = "peers"


@pytest.fixture
def server(server_factory: Callable[..., ServerProc]) -> ServerProc:
    """A server of the test's own: every test here writes run `RUN` from step 1."""
    return server_factory()


PROXIES = 3
REPORT_TTL_S = 3.0
PEER_TIMEOUT_S = 1.0
HAPROXY_CFG = REPO / "deploy" / "sglang-proxies" / "haproxy.cfg"


def haproxy_config(listen: str, servers: list[str]) -> str:
    """The committed config with `listen` and `servers` (host:port) in place of its own, and
    checks every 200 ms; each replacement must apply."""
    text = HAPROXY_CFG.read_text(encoding="utf-8")
    for pattern, repl in (
        (r"^    bind \S+$", f"    bind {listen}"),
        (r"check inter 1s", "check inter 200ms"),
        (r"^    server .*\n", ""),
    ):
        text, n = re.subn(pattern, repl, text, flags=re.M)
        assert n, f"{HAPROXY_CFG} no longer has {pattern!r}"
    lines = "".join(f"    server proxy-{i} {addr}\n" for i, addr in enumerate(servers))
    return text.rstrip("\n") + "\n" + lines


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(found).exists():
        pytest.fail("haproxy is not installed (scripts/test.sh installs it)")
    return found


class Stack:
    """The stand-in engine, ``proxies`` proxies with ``--peer`` for each other (and, with
    ``hung``, a peer that never answers) and the monitor; `front` adds HAProxy or SGLang's
    router in front of them at `balancer`."""

    def __init__(
        self, server: ServerProc, stack: ExitStack, *, proxies: int = PROXIES, hung: bool = True
    ) -> None:
        self.server, self.stack = server, stack
        fport = free_port()
        self.engine = f"http://127.0.0.1:{fport}"
        stack.enter_context(
            running_process(
                ["-m", "tests.helpers.fake_sglang", "--port", str(fport)], f"{self.engine}/health"
            )
        )
        extra = []
        if hung:  # a peer that accepts connections (the kernel's backlog) and never answers
            self.hung = socket.socket()
            self.hung.bind(("127.0.0.1", 0))
            self.hung.listen(64)
            stack.callback(self.hung.close)
            extra = [f"http://127.0.0.1:{self.hung.getsockname()[1]}"]
        ports = [free_port() for _ in range(proxies)]
        self.proxies = [f"http://127.0.0.1:{p}" for p in ports]
        peers = [a for url in [*self.proxies, *extra] for a in ("--peer", url)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for port, url in zip(ports, self.proxies, strict=True):
            args = [
                "-m", "timwatch", "sidecar", "sglang", "--upstream", self.engine,
                "--listen", f"127.0.0.1:{port}", "--monitor", server.url, "--run", RUN,
                "--report-ttl", str(REPORT_TTL_S), "--peer-timeout", str(PEER_TIMEOUT_S),
                *peers,
            ]  # fmt: skip
            self.procs.append(stack.enter_context(running_process(args, f"{url}/timwatch/healthz")))
        self.balancer = ""

    def haproxy(self, tmp: Path) -> None:
        hport = free_port()
        self.balancer = f"http://127.0.0.1:{hport}"
        cfg = tmp / "haproxy.cfg"
        cfg.write_text(
            haproxy_config(f"127.0.0.1:{hport}", [u.split("//")[1] for u in self.proxies])
        )
        subprocess.run([haproxy_binary(), "-c", "-q", "-f", str(cfg)], check=True)
        log = (tmp / "haproxy.log").open("wb")
        ha = subprocess.Popen([haproxy_binary(), "-db", "-f", str(cfg)], stdout=log, stderr=log)
        self.stack.callback(stop_process, ha)
        self.wait_backends(len(self.proxies))

    def sglang_router(self, policy: str) -> None:
        """SGLang's own router (``sglang-router``, Rust; it needs no GPU) with the proxies as
        its workers."""
        rport = free_port()
        self.balancer = f"http://127.0.0.1:{rport}"
        args = [
            "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(rport),
            "--worker-urls", *self.proxies, "--policy", policy, "--log-level", "warn",
        ]  # fmt: skip
        self.stack.enter_context(running_process(args, f"{self.balancer}/health"))

    def wait_backends(self, n: int) -> None:
        """Until `n` consecutive requests through HAProxy reached `n` different proxies."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen = set()
            for _ in range(n):
                try:
                    r = httpx.get(f"{self.balancer}/timwatch/v1/join", timeout=5)
                except httpx.HTTPError:
                    break
                if r.status_code == 200:
                    seen.add(tuple(sorted(r.json()["peers"])))
            if len(seen) == n:
                return
            time.sleep(0.2)
        pytest.fail(f"HAProxy never spread over {n} proxies")

    def generate(self, rids: list[str], prompt_of: int) -> dict[str, list[int]]:
        """One request per rid through the balancer, each on a new connection as concurrent
        rollout clients would be (HAProxy balances a connection's first request; the next ones
        on a kept-alive connection may stay on its proxy); the sampled ids of each."""
        out = {}
        for k, rid in enumerate(rids):
            body = {
                "input_ids": [1 + (prompt_of + k) % 7, 2, 3],
                "rid": rid,
                "sampling_params": {"max_new_tokens": 3 + k % 6},
            }
            r = httpx.post(f"{self.balancer}/generate", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["id"] == rid
            out[rid] = list(r.json()["output_ids"])
        return out

    def report(
        self, step: int, outputs: dict[str, list[int]], to: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Post the trainer's report through HAProxy (or to ``to``): (index of the proxy it
        landed on, answer)."""
        samples = [
            {"rid": rid, "token_ids": ids, "logp_train": [-0.5] * len(ids),
             "entropy": [1.0] * len(ids)}
            for rid, ids in outputs.items()
        ]  # fmt: skip
        r = httpx.post(
            f"{to or self.balancer}/timwatch/v1/trainer_reports",
            json={"step": step, "samples": samples},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        landed = self.proxies.index(to) if to else int(r.headers["X-Timwatch-Proxy"][6:])
        return landed, dict(r.json())

    def held(self, proxy: str) -> set[str]:
        got = httpx.get(f"{proxy}/timwatch/records", timeout=10).json()["records"]
        return {r["rid"] for r in got}

    def joins(self, alive: list[int]) -> list[dict[str, Any]]:
        return [httpx.get(f"{self.proxies[i]}/timwatch/v1/join", timeout=10).json() for i in alive]

    def step_row(self, step: int, sequences: int) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        with self.server.client() as c:
            while True:
                got = c.get(f"/v1/runs/{RUN}/steps/{step}")
                if got.status_code == 200 and got.json()["row"]["sequences"] >= sequences:
                    return dict(got.json())
                if time.monotonic() > deadline:
                    pytest.fail(f"step {step} never reached {sequences} sequences: {got.text}")
                time.sleep(0.1)


@pytest.fixture
def stack(server: ServerProc, tmp_path: Path) -> Iterator[Stack]:
    with ExitStack() as es:
        s = Stack(server, es)
        s.haproxy(tmp_path)
        yield s


def total(joins: list[dict[str, Any]], key: str) -> int:
    return sum(int(j["join"][key]) for j in joins)


def test_round_robin_proxies_join_everything_and_count_a_dead_ones_samples(stack: Stack) -> None:
    # Two steps generated and reported through HAProxy: every sample joins somewhere.
    sent: dict[int, dict[str, list[int]]] = {}
    for step in (1, 2):
        sent[step] = stack.generate([f"s{step}-{k}" for k in range(12)], prompt_of=step)
    holders = [stack.held(p) for p in stack.proxies]
    assert all(holders), [len(h) for h in holders]  # round robin spread them over all three
    from_peers = 0
    for step in (1, 2):
        landed, answer = stack.report(step, sent[step])  # the hung peer fails nothing
        from_peers += len(set(sent[step]) - holders[landed])
        tokens = sum(len(v) for v in sent[step].values())
        assert answer["status"] == "forwarded", answer
        assert answer["joined"] == 12 and answer["tokens"] == tokens
        detail = stack.step_row(step, 12)
        assert detail["batches"] == 1  # one batch per report, as with a single proxy
        assert detail["row"]["tokens"] == tokens and detail["row"]["sequences"] == 12
    joins = stack.joins([0, 1, 2])
    assert total(joins, "joined_samples") == 24
    assert total(joins, "unjoined_samples") == 0
    assert total(joins, "peer_joined_samples") == from_peers > 0
    assert sum(j["given"]["records"] for j in joins) == from_peers
    assert all(not stack.held(p) for p in stack.proxies)  # nothing left behind
    hung = [u for u in joins[0]["peers"] if u not in stack.proxies]
    assert len(hung) == 1 and set(joins[0]["peers"]) == {*stack.proxies[1:], *hung}
    assert sum(j["peers"][hung[0]]["errors"] for j in joins) >= 2

    # Step 3 generated on all three, then proxy 2 is killed with its records.
    sent[3] = stack.generate([f"s3-{k}" for k in range(9)], prompt_of=3)
    lost = stack.held(stack.proxies[2])
    assert lost
    stack.procs[2].kill()
    stack.procs[2].wait(10)
    landed, answer = stack.report(3, sent[3])  # HAProxy redispatches a refused connection
    assert landed != 2
    assert answer["status"] == "pending" and answer["joined"] == 9 - len(lost), answer
    assert set(answer["missing"]) == lost
    kept = {rid: ids for rid, ids in sent[3].items() if rid not in lost}
    detail = stack.step_row(3, len(kept))  # forwarded once the report's TTL is over
    assert detail["row"]["tokens"] == sum(len(v) for v in kept.values())
    assert detail["row"]["sequences"] == len(kept) and detail["batches"] == 1
    joins = stack.joins([0, 1])
    assert total(joins, "unjoined_samples") == len(lost)  # counted once, by one proxy
    assert joins[landed]["join"]["unjoined_samples"] == len(lost)
    assert total(joins, "expired_reports") == 1
    dead = stack.proxies[2]
    assert sum(j["peers"][dead]["errors"] for j in joins) >= 1
    joined_before = total(joins, "joined_samples")

    # The survivors keep joining: step 4 is generated and reported through HAProxy.
    stack.wait_backends(2)
    sent[4] = stack.generate([f"s4-{k}" for k in range(8)], prompt_of=4)
    _, answer = stack.report(4, sent[4])
    assert answer["status"] == "forwarded" and answer["joined"] == 8, answer
    detail = stack.step_row(4, 8)
    assert detail["row"]["tokens"] == sum(len(v) for v in sent[4].values())
    joins = stack.joins([0, 1])
    assert total(joins, "unjoined_samples") == len(lost)
    assert total(joins, "joined_samples") == joined_before + 8


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_sglang_router_in_front_of_the_proxies(server: ServerProc, policy: str) -> None:
    """SGLang's router routes only SGLang's own paths (``/timwatch/...`` answers 404), so the
    trainer posts its report to one proxy's own address; the peers do the rest."""
    with ExitStack() as es:
        stack = Stack(server, es, proxies=2, hung=False)
        stack.sglang_router(policy)
        sent = stack.generate([f"{policy}-{k}" for k in range(10)], prompt_of=0)
        holders = [stack.held(p) for p in stack.proxies]
        assert set().union(*holders) == set(sent)
        if policy == "round_robin":
            assert all(holders), [len(h) for h in holders]
        lost = httpx.post(f"{stack.balancer}/timwatch/v1/trainer_reports", json={}, timeout=10)
        assert lost.status_code == 404
        _, answer = stack.report(1, sent, to=stack.proxies[0])
        assert answer["status"] == "forwarded" and answer["joined"] == 10, answer
        detail = stack.step_row(1, 10)
        assert detail["row"]["tokens"] == sum(len(v) for v in sent.values())
        joins = stack.joins([0, 1])
        assert total(joins, "unjoined_samples") == 0
        assert total(joins, "peer_joined_samples") == len(holders[1])
