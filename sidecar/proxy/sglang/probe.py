"""Prefill probe: re-score a fraction of finished samples through SGLang's prefill path.

Decode (KV-cache, batched, possibly CUDA-graph) and prefill (one full-sequence forward) are
two numeric paths of the same engine. Their disagreement on the *same* tokens isolates engine
nondeterminism from trainer-side differences, so the sidecar reports it as its own run
(``<run>-prefill-probe``): ``logp_rollout`` = decode μ, ``logp_train`` = prefill log-prob.

The probe sends ``input_ids = prompt + output``, ``sampling_params.max_new_tokens = 0``,
``return_logprob = true``, ``logprob_start_len = 0``, ``top_logprobs_num = k`` and reads
``meta_info.input_token_logprobs``: entry j is ``[logprob of input_ids[j] given input_ids[:j],
input_ids[j], text]`` and entry 0 has a null logprob (SGLang's scheduler pads the first entry
with ``None`` and pops the last, the next-token one), so the output tokens' prefill log-probs
are entries ``len(prompt):``. ``meta_info.input_top_logprobs`` is aligned the same way (entry 0
null, entry j the top-k triples of the distribution that predicted ``input_ids[j]``; checked in
SGLang 0.5.2 ``scheduler_output_processor_mixin.add_input_logprob_return_values`` and 0.5.23
``logprob_result_processor``, nested unless ``return_flat_raw_top_logprobs``). SGLang returns no
entropy, so the prefill side's entropy is the top-k lower bound (`topk_entropy_bounds`).

Which samples are probed is decided by a hash of the rid, so a given rate probes the same
samples on every sidecar replica. Finished results go to an optional `ProbeSink` (the forwarder
to the monitor, `proxy.sglang.probe_forward`) and into a bounded deque for ``/timwatch/probes``.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import orjson

from ..http.client import Upstream, UpstreamError
from ..records import RolloutRecord, topk_entropy_bounds
from .wire import WireError, parse_logprob_triples

__all__ = [
    "DEFAULT_PROBE_TOPK",
    "ProbeResult",
    "ProbeSink",
    "Prober",
    "probe_selected",
    "parse_probe_answer",
]

# top_logprobs_num of a probe when the proxy runs without --topk: enough for a tight bound.
DEFAULT_PROBE_TOPK = 20

log = logging.getLogger(__name__)


def probe_selected(rid: str, rate: float) -> bool:
    """Deterministic Bernoulli(rate) choice keyed on the rid."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    return zlib.crc32(rid.encode()) / 2**32 < rate


@dataclass(frozen=True)
class ProbeResult:
    rid: str
    output_ids: tuple[int, ...]
    logp_decode: tuple[float, ...]
    logp_prefill: tuple[float, ...]
    versions: tuple[str | None, ...]
    prefill_weight_version: str | None
    # Top-k lower bound on the prefill distribution's entropy per output token (None when the
    # answer had no input_top_logprobs).
    entropy_prefill: tuple[float, ...] | None = None

    @property
    def same_version(self) -> bool:
        """False when the weights changed between decode and probe (then it measures staleness)."""
        return all(v == self.prefill_weight_version for v in self.versions)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "same_version": self.same_version}


def parse_probe_answer(record: RolloutRecord, answer: Any) -> ProbeResult:
    """Pair a probe's prefill log-probs with the record's decode log-probs."""
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise WireError("probe answer: meta_info missing")
    ids, logps = parse_logprob_triples(
        meta.get("input_token_logprobs"), "meta_info.input_token_logprobs"
    )
    prompt = [] if record.input_ids is None else record.input_ids.tolist()
    expected = prompt + record.output_ids.tolist()
    if ids != expected:
        first = next(
            (i for i, (a, b) in enumerate(zip(ids, expected, strict=False)) if a != b),
            min(len(ids), len(expected)),
        )
        raise WireError(
            f"meta_info.input_token_logprobs[{first}]: probe echoed other tokens than "
            f"prompt + output ({len(ids)} vs {len(expected)} tokens)"
        )
    tail = logps[len(prompt) :]
    for j, lp in enumerate(tail):
        if lp is None:
            raise WireError(f"meta_info.input_token_logprobs[{len(prompt) + j}][0]: null")
    entropy = _prefill_entropy(meta.get("input_top_logprobs"), len(prompt), len(expected))
    wv = meta.get("weight_version")
    return ProbeResult(
        rid=record.rid,
        output_ids=tuple(record.output_ids.tolist()),
        logp_decode=tuple(record.logp.tolist()),
        logp_prefill=tuple(float(lp) for lp in tail if lp is not None),
        versions=record.versions,
        prefill_weight_version=None if wv is None else str(wv),
        entropy_prefill=entropy,
    )


def _prefill_entropy(rows: Any, start: int, total: int) -> tuple[float, ...] | None:
    """Top-k entropy lower bounds for input positions ``start:`` (None without top-k rows)."""
    if rows is None:
        return None
    where = "meta_info.input_top_logprobs"
    if not isinstance(rows, list) or len(rows) != total:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise WireError(f"{where}: expected {total} rows (one per input token), got {got}")
    tops = []
    for j in range(start, total):
        row = rows[j]
        if row is None or row == []:
            return None  # SGLang had no top-k for this position: no bound
        tops.append(parse_logprob_triples(row, f"{where}[{j}]")[1])
    return tuple(topk_entropy_bounds(tops)[0].tolist())


class ProbeSink(Protocol):
    """Where finished probes go besides the debug deque
    (`timwatch.sidecar.proxy.sglang.probe_forward`)."""

    def add(self, result: ProbeResult) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class Prober:
    """Schedules probes in the background of the proxy's event loop; never blocks a client."""

    def __init__(
        self,
        client: Upstream,
        rate: float,
        *,
        topk: int = DEFAULT_PROBE_TOPK,
        sink: ProbeSink | None = None,
        max_in_flight: int = 4,
        max_results: int = 1_000,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"probe rate must be in [0, 1], got {rate}")
        self.client = client
        self.rate = rate
        self.topk = topk
        self.sink = sink
        self.max_in_flight = max_in_flight
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._results: deque[ProbeResult] = deque(maxlen=max_results)
        self.counters = {"scheduled": 0, "done": 0, "failed": 0, "skipped_busy": 0}

    def maybe_probe(self, record: RolloutRecord) -> bool:
        """Start a probe for this record if it is selected and has its prompt ids."""
        if not record.num_tokens or record.input_ids is None or not len(record.input_ids):
            return False
        if not probe_selected(record.rid, self.rate):
            return False
        if self._in_flight >= self.max_in_flight:
            self.counters["skipped_busy"] += 1
            return False
        self._in_flight += 1
        self.counters["scheduled"] += 1
        task = asyncio.get_running_loop().create_task(self._run(record))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _run(self, record: RolloutRecord) -> None:
        prompt = [] if record.input_ids is None else record.input_ids.tolist()
        body = {
            "input_ids": prompt + record.output_ids.tolist(),
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": self.topk,
        }
        headers = [("content-type", "application/json")]
        try:
            resp = await self.client.request("POST", "/generate", headers, orjson.dumps(body))
            try:
                answer = await resp.read()
            finally:
                resp.release()
            if resp.status != 200:
                raise UpstreamError(f"{resp.status} from {self.client.url}/generate")
            result = parse_probe_answer(record, orjson.loads(answer))
        except (UpstreamError, ValueError) as exc:
            self.counters["failed"] += 1
            log.warning("prefill probe for rid %s failed: %s", record.rid, exc)
        else:
            self._results.append(result)
            self.counters["done"] += 1
            if self.sink is not None:
                try:
                    self.sink.add(result)
                except Exception:  # noqa: BLE001 - a sink failure must not touch the proxy
                    log.exception("probe sink failed for rid %s", record.rid)
        finally:
            self._in_flight -= 1

    def results(self) -> list[ProbeResult]:
        """The most recent finished probes (read-only; the sink gets every one)."""
        return list(self._results)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
