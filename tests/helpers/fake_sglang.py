"""A stand-in SGLang server for tests: SGLang needs a GPU, this machine has none.

It answers ``POST /generate`` in SGLang 0.5.x's wire format, checked field by field against
SGLang's source (0.5.23 release; ``sglang/srt/managers/io_struct.py`` for the request fields,
``sglang/srt/managers/tokenizer_manager.py`` ``_handle_batch_output``,
``add_logprob_to_meta_info``, ``detokenize_logprob_tokens``, ``_handle_abort_req``,
``_stream_batch_responses`` for the answers, ``sglang/srt/entrypoints/http_server.py``
``generate_request`` / ``model_info`` / ``update_weight_version`` / ``abort_request`` for the
HTTP layer, ``sglang/srt/utils/weight_versions.py`` for the spans, ``sglang/srt/managers/
schedule_batch.py`` ``FINISH_*`` for finish reasons and ``sglang/srt/managers/
scheduler_components/logprob_result_processor.py`` for the leading null input logprob):

* answer ``{"text", "output_ids", "meta_info", ["prompt_token_ids"], ["index"]}``; meta_info in
  SGLang's key order: id, finish_reason, prompt_tokens, weight_version, num_retractions, the
  logprob keys (``[logprob, token_id, null]`` triples, ``output_token_logprobs_length``, top-k
  rows), reasoning_tokens, completion_tokens, cached_tokens, weight_versions, e2e_latency;
* streaming ``data: <compact json>\\n\\n`` frames, cumulative unless started with
  ``--incremental-streaming-output``, then ``data: [DONE]\\n\\n``; batch answers are lists and
  streamed batch chunks carry ``index``; an abort answers the abort path's full lists;
* finish reasons ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``,
  ``{"type": "abort", "message": ..., "status_code": ..., "err_type": ...}``.

The "model" is a deterministic function of the token prefix with a tiny vocabulary, so tests can
compute exact log-probs and entropies in float64: decode samples from `distribution`; the prefill
path (input log-probs: ``logprob_start_len >= 0``, e.g. the sidecar's probe with
``max_new_tokens: 0``) scores with `prefill_distribution`, the same logits plus a small
deterministic perturbation (``PREFILL_NOISE``, settable as ``prefill_noise``), renormalised, so
decode-vs-prefill mismatch is non-zero and known exactly. Input-side lists follow SGLang's
scheduler: ``input_token_logprobs`` and ``input_top_logprobs`` have one entry per input token from
``logprob_start_len`` on, the first entry null (``[null, id, null]`` and ``null``), entry j
scoring ``input_ids[j]`` given ``input_ids[:j]``; top-k rows are ``[logprob, id, null]`` triples
sorted by logprob. Test-only knobs live under ``/fake/``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import zlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

VOCAB = 48
EOS = VOCAB - 1
_SCALES = (0.2, 1.0, 2.5, 6.0)
PREFILL_NOISE = 0.05


def tokenize(text: str) -> list[int]:
    return [ord(c) % (VOCAB - 1) for c in text]


def detok(ids: list[int]) -> str:
    return "".join(chr(97 + t % 26) for t in ids)


def distribution(prefix: list[int]) -> list[float]:
    """Next-token log-probs after ``prefix`` (float64, exact)."""
    rng = random.Random(zlib.crc32(json.dumps(prefix).encode()))
    scale = _SCALES[len(prefix) % len(_SCALES)]
    logits = [rng.gauss(0.0, 1.0) * scale for _ in range(VOCAB)]
    logits[EOS] -= 4.0
    top = max(logits)
    lse = top + math.log(math.fsum(math.exp(x - top) for x in logits))
    return [x - lse for x in logits]


def prefill_distribution(prefix: list[int], noise: float = PREFILL_NOISE) -> list[float]:
    """Next-token log-probs after ``prefix`` as the prefill path computes them (float64, exact)."""
    logits = [
        lp + noise * math.sin(1.7 * t + len(prefix)) for t, lp in enumerate(distribution(prefix))
    ]
    top = max(logits)
    lse = top + math.log(math.fsum(math.exp(x - top) for x in logits))
    return [x - lse for x in logits]


def entropy(logps: list[float]) -> float:
    return -math.fsum(math.exp(lp) * lp for lp in logps)


def _top(logps: list[float], k: int) -> list[list[Any]]:
    order = sorted(range(VOCAB), key=lambda t: -logps[t])[:k]
    return [[logps[t], t, None] for t in order]


class Fake:
    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental
        self.version = "default"
        self.config: dict[str, Any] = {}
        self.aborted: set[str] = set()
        self.counter = 0
        self.requests: list[dict[str, Any]] = []

    def new_rid(self) -> str:
        self.counter += 1
        return f"fake-{self.counter:06d}"


class Sample:
    """One generation in progress, mirroring TokenizerManager's ReqState."""

    def __init__(self, fake: Fake, rid: str, prompt: list[int], seed: int, sp: dict[str, Any]):
        self.fake, self.rid, self.prompt = fake, rid, prompt
        self.rng = random.Random(seed)
        self.max_new = int(sp.get("max_new_tokens", 8))
        self.ids: list[int] = []
        self.logps: list[float] = []
        self.tops: list[list[float]] = []
        self.spans: list[dict[str, Any]] = []
        self.finish: dict[str, Any] | None = None
        self.abort_path = False

    def step(self) -> None:
        fake = self.fake
        if self.rid in fake.aborted or len(self.ids) >= fake.config.get("abort_after", 10**9):
            self.finish = {
                "type": "abort",
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            }
            self.abort_path = True
            return
        if self.max_new == 0:
            self.finish = {"type": "length", "length": 0}
            return
        switch = fake.config.get("switch_at")
        if switch is not None and len(self.ids) == switch:
            fake.version = fake.config.pop("next_version")
            fake.config.pop("switch_at")
        if not self.spans or self.spans[-1]["version"] != fake.version:
            self.spans.append({"version": fake.version, "start": len(self.ids)})
        logps = distribution(self.prompt + self.ids)
        tok = self.rng.choices(range(VOCAB), weights=[math.exp(x) for x in logps])[0]
        self.ids.append(tok)
        self.logps.append(logps[tok])
        self.tops.append(logps)
        if tok == EOS:
            self.finish = {"type": "stop", "matched": EOS}
        elif len(self.ids) >= self.max_new:
            self.finish = {"type": "length", "length": self.max_new}

    def visible_spans(self) -> list[dict[str, Any]]:
        n = len(self.ids)
        out = []
        for i, span in enumerate(self.spans):
            end = self.spans[i + 1]["start"] if i + 1 < len(self.spans) else n
            out.append({"version": span["version"], "start": span["start"], "end": end})
        return out or [{"version": self.fake.version, "start": 0, "end": 0}]

    def answer(self, req: dict[str, Any], item: int, lo: int) -> dict[str, Any]:
        """The out dict SGLang emits for this sample; ``lo`` is the incremental offset."""
        rl = req.get("return_logprob")
        want_lp = bool(rl[item] if isinstance(rl, list) else rl)
        tk = req.get("top_logprobs_num")
        k = int((tk[item] if isinstance(tk, list) else tk) or 0)
        finished = self.finish is not None
        inc = bool(req.get("stream")) and self.fake.incremental and not self.abort_path
        n = len(self.ids)
        if self.abort_path:
            meta: dict[str, Any] = {
                "id": self.rid,
                "finish_reason": self.finish,
                "weight_version": self.fake.version,
                "e2e_latency": 0.5,
            }
            meta["weight_versions"] = self.visible_spans()
            meta["weight_version"] = meta["weight_versions"][-1]["version"]
        else:
            meta = {
                "id": self.rid,
                "finish_reason": self.finish,
                "prompt_tokens": len(self.prompt),
                "weight_version": self.fake.version,
                "num_retractions": 0,
            }
        if want_lp:
            start = req.get("logprob_start_len", -1)
            start = start[item] if isinstance(start, list) else start
            inp: list[list[Any]] = []
            inp_top: list[list[list[Any]] | None] = []
            if start is not None and start >= 0:
                noise = self.fake.config.get("prefill_noise", PREFILL_NOISE)
                for j in range(start, len(self.prompt)):
                    if j == start:  # SGLang pads the first entry: no logits before it
                        inp.append([None, self.prompt[j], None])
                        inp_top.append(None)
                        continue
                    dist = prefill_distribution(self.prompt[:j], noise)
                    inp.append([dist[self.prompt[j]], self.prompt[j], None])
                    inp_top.append(_top(dist, k) if k > 0 else None)
            out = [[lp, t, None] for lp, t in zip(self.logps, self.ids, strict=True)]
            meta["input_token_logprobs"] = inp
            meta["output_token_logprobs"] = out[lo:] if inc else out
            meta["output_token_logprobs_length"] = n
            if k > 0:
                meta["input_top_logprobs"] = inp_top
                tops = [_top(row, k) for row in self.tops]
                meta["output_top_logprobs"] = tops[lo:] if inc else tops
        if self.abort_path:
            meta["completion_tokens"] = n
        else:
            meta.update({"reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0})
            meta["weight_versions"] = self.visible_spans()
            meta["weight_version"] = meta["weight_versions"][-1]["version"]
            if finished:
                meta["e2e_latency"] = round(0.01 * n, 6)
        ids = self.ids[lo:] if inc else list(self.ids)
        if self.abort_path and req.get("stream") and self.fake.incremental:
            ids = self.ids[-1:]
        text = detok(self.ids[lo:] if inc else self.ids)
        result: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
        if req.get("return_prompt_token_ids"):
            result["prompt_token_ids"] = list(self.prompt)
        return result


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _build(fake: Fake, req: dict[str, Any]) -> tuple[list[Sample], list[int], bool]:
    text, input_ids = req.get("text"), req.get("input_ids")
    if input_ids is not None:
        batch = isinstance(input_ids[0], list)
        prompts = input_ids if batch else [input_ids]
    else:
        batch = isinstance(text, list)
        prompts = [tokenize(t) for t in (text if batch else [text])]
    sps = req.get("sampling_params") or {}
    rids = req.get("rid")
    samples, items = [], []
    for i, prompt in enumerate(prompts):
        sp = sps[i] if isinstance(sps, list) else sps
        n = int(sp.get("n", 1))
        batch = batch or n > 1
        for j in range(n):
            rid = rids[i] if isinstance(rids, list) else rids
            rid = rid if rid is not None and n == 1 else fake.new_rid()
            seed = zlib.crc32(_dumps([prompt, j, sp.get("seed", 0)]))
            samples.append(Sample(fake, rid, list(prompt), seed, sp))
            items.append(i)
    return samples, items, batch


async def generate(request: Request) -> Response:
    fake: Fake = request.app.state.fake
    req = await request.json()
    fake.requests.append(req)
    if fake.config.get("delay_s"):
        await asyncio.sleep(fake.config["delay_s"])
    fail = fake.config.get("fail_status")
    if fail == 400:
        return JSONResponse({"error": {"message": "fake: bad request"}}, status_code=400)
    if fail:
        body = {
            "object": "error",
            "message": "fake: engine failure",
            "type": "Internal Server Error",
            "param": None,
            "code": fail,
        }
        return JSONResponse(body, status_code=fail)
    samples, items, batch = _build(fake, req)
    if not req.get("stream"):
        for s in samples:
            while s.finish is None:
                s.step()
        outs = [s.answer(req, items[i], 0) for i, s in enumerate(samples)]
        return Response(_dumps(outs if batch else outs[0]), media_type="application/json")

    async def frames() -> AsyncIterator[bytes]:
        offsets = [0] * len(samples)
        live = list(range(len(samples)))
        while live:
            for i in list(live):
                s = samples[i]
                s.step()
                out = s.answer(req, items[i], offsets[i])
                offsets[i] = len(s.ids)
                if batch:
                    out["index"] = i
                yield b"data: " + _dumps(out) + b"\n\n"
                if s.finish is not None:
                    live.remove(i)
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream")


async def model_info(request: Request) -> Response:
    fake: Fake = request.app.state.fake
    info = {
        "model_path": "fake/tiny",
        "tokenizer_path": "fake/tiny",
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": fake.version,
    }
    return JSONResponse(info)


async def update_weight_version(request: Request) -> Response:
    fake: Fake = request.app.state.fake
    body = await request.json()
    fake.version = body["new_version"]
    msg = f"Weight version updated to {fake.version}"
    return JSONResponse({"success": True, "message": msg, "new_version": fake.version})


async def abort_request(request: Request) -> Response:
    request.app.state.fake.aborted.add((await request.json()).get("rid", ""))
    return Response(status_code=200)


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def fake_config(request: Request) -> Response:
    fake: Fake = request.app.state.fake
    fake.config = await request.json()
    return JSONResponse({"ok": True})


async def fake_requests(request: Request) -> Response:
    return JSONResponse(request.app.state.fake.requests)


def create_app(incremental: bool = False) -> Starlette:
    app = Starlette(
        routes=[
            Route("/generate", generate, methods=["POST", "PUT"]),
            Route("/model_info", model_info, methods=["GET"]),
            Route("/update_weight_version", update_weight_version, methods=["POST"]),
            Route("/abort_request", abort_request, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/fake/config", fake_config, methods=["POST"]),
            Route("/fake/requests", fake_requests, methods=["GET"]),
        ]
    )
    app.state.fake = Fake(incremental)
    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--incremental-streaming-output", action="store_true")
    args = parser.parse_args()
    app = create_app(args.incremental_streaming_output)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
