"""A fast stand-in for vLLM 0.32's OpenAI-compatible server, for benchmarks and fast tests.

NOT evidence of compatibility with vLLM: it answers in the shape vLLM 0.32 writes (member
names and order of ``CompletionResponse``, ``ChatCompletionResponse``, their stream chunks and
``/inference/v1/generate``'s tokens mode; a field the request did not ask for is ``null``; -inf
written as -9999.0; a chat stream sends a chunk with an empty ``delta`` for a token without text
only when log-probs or token ids were asked for), but its bytes come from orjson, not pydantic,
and its "model" is a fixed token sequence. The real-engine tests (tests/engine) are the evidence.

Answers are built from cached byte runs so the stand-in is not the bottleneck: token ``i`` is
``(i·7919 + 13) mod 151936`` with log-prob ``-|sin(0.37 i)|·3 - 0.001``, except every 997th
token, which gets ``-9999.0`` (a token the engine gave probability 0). ``X-Request-Id`` sets the
answer's id (else a counter); ``created`` is the current second. With ``--versions`` every
answer reports two weight versions (``"1"`` for the first half of the tokens, ``"2"`` after).
Streams send one frame per token, 64 frames per write.

    python benchmarks/vllm_standin.py --port 8000 [--versions]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import time
from typing import Any

import orjson
from standin_http import HttpRequest, Joined, serve

VOCAB = 151_936
MODEL = b"standin"
_ids = itertools.count()


def token(i: int) -> tuple[int, float, bytes]:
    """Token ``i``: (id, log-prob, text)."""
    tid = (i * 7919 + 13) % VOCAB
    lp = -9999.0 if i % 997 == 996 else -abs(math.sin(i * 0.37)) * 3.0 - 1e-3
    return tid, lp, b"" if i % 7 == 6 else chr(97 + tid % 26).encode()


class Pieces:
    """Per-token byte runs for ``n`` tokens, in each endpoint's log-prob shape."""

    def __init__(self, n: int) -> None:
        toks = [token(i) for i in range(n)]
        self.n = n
        self.texts = [t for _, _, t in toks]
        self.ids = Joined([b"%d" % t for t, _, _ in toks])
        self.lps = Joined([orjson.dumps(lp) for _, lp, _ in toks])
        self.tokens = Joined([orjson.dumps(t.decode()) for _, _, t in toks])
        self.tops = Joined(
            [b"{%s:%s}" % (orjson.dumps(t.decode()), orjson.dumps(lp)) for _, lp, t in toks]
        )
        offsets, at = [], 0
        for text in self.texts:
            offsets.append(b"%d" % at)
            at += len(text)
        self.offsets = Joined(offsets)
        self.chat = Joined(
            [
                b'{"token":%s,"logprob":%s,"bytes":%s,"top_logprobs":[]}'
                % (orjson.dumps(t.decode()), orjson.dumps(lp), orjson.dumps(list(t)))
                for _, lp, t in toks
            ]
        )
        self.gen = Joined(
            [
                b'{"token_id":%d,"logprob":%s,"rank":1,"top_logprobs":[{"token_id":%d,'
                b'"logprob":%s,"rank":1}]}' % (tid, orjson.dumps(lp), tid, orjson.dumps(lp))
                for tid, lp, _ in toks
            ]
        )

    def text(self, lo: int, hi: int) -> bytes:
        return orjson.dumps(b"".join(self.texts[lo:hi]).decode())


_CACHE: dict[int, Pieces] = {}


def pieces(n: int) -> Pieces:
    if n not in _CACHE:
        _CACHE[n] = Pieces(n)
    return _CACHE[n]


def _spans(n: int, versions: bool) -> bytes:
    if not versions:
        return b"null"
    h = n // 2
    return b'[{"version":"1","start":0,"end":%d},{"version":"2","start":%d,"end":%d}]' % (h, h, n)


class Req:
    """What the stand-in reads of one request."""

    def __init__(self, kind: str, body: dict[str, Any], rid: bytes, versions: bool) -> None:
        self.kind, self.rid, self.versions = kind, rid, versions
        if kind == "generate":
            sp = body.get("sampling_params") or {}
            self.n = int(sp.get("max_tokens") or 16)
            self.lp = sp.get("logprobs") is not None
            self.ids = True
            self.prompt = orjson.dumps(body.get("token_ids") or [])
            self.want_prompt = bool(body.get("return_token_ids"))
        else:
            self.n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            self.lp = (
                body.get("logprobs") is not None
                if kind == "completions"
                else bool(body.get("logprobs"))
            )
            self.ids = bool(body.get("return_token_ids"))
            prompt = body.get("prompt")
            self.prompt = orjson.dumps(prompt if isinstance(prompt, list) else [1, 2, 3, 4])
            self.want_prompt = self.ids
        self.created = b"%d" % int(time.time())
        self.p = pieces(self.n)


def _logprobs(r: Req, lo: int, hi: int) -> bytes:
    p = r.p
    if not r.lp:
        return b"null"
    if r.kind == "completions":
        return b'{"text_offset":[%s],"token_logprobs":[%s],"tokens":[%s],"top_logprobs":[%s]}' % (
            p.offsets.run(lo, hi),
            p.lps.run(lo, hi),
            p.tokens.run(lo, hi),
            p.tops.run(lo, hi),
        )
    runs = p.chat if r.kind == "chat" else p.gen
    return b'{"content":[%s]}' % runs.run(lo, hi)


def _ids_or_null(r: Req, lo: int, hi: int) -> bytes:
    return b"[%s]" % r.p.ids.run(lo, hi) if r.ids else b"null"


def _usage(r: Req, done: int) -> bytes:
    return (
        b'{"prompt_tokens":4,"total_tokens":%d,"completion_tokens":%d,'
        % (
            4 + done,
            done,
        )
        + b'"prompt_tokens_details":null,"completion_tokens_details":null}'
    )


def answer(r: Req) -> bytes:
    """The non-streamed answer (vLLM: ``JSONResponse(content=response.model_dump())``)."""
    n, prompt = r.n, r.prompt if r.want_prompt else b"null"
    if r.kind == "completions":
        choice = (
            b'{"index":0,"text":%s,"logprobs":%s,"finish_reason":"length","stop_reason":null,'
            % (
                r.p.text(0, n),
                _logprobs(r, 0, n),
            )
            + b'"token_ids":%s,"prompt_logprobs":null,"prompt_token_ids":%s,"routed_experts":null}'
            % (
                _ids_or_null(r, 0, n),
                prompt,
            )
        )
        return (
            b'{"id":"cmpl-%s","object":"text_completion","created":%s,"model":"%s","choices":[%s],'
            b'"service_tier":null,"system_fingerprint":null,"usage":%s,"kv_transfer_params":null,'
            b'"ec_transfer_params":null,"metrics":null}'
            % (r.rid, r.created, MODEL, choice, _usage(r, n))
        )
    if r.kind == "chat":
        message = (
            b'{"role":"assistant","content":%s,"refusal":null,"annotations":null,"audio":null,'
            b'"function_call":null,"tool_calls":[],"reasoning":null}' % r.p.text(0, n)
        )
        choice = b'{"index":0,"message":%s,"logprobs":%s,"finish_reason":"length",' % (
            message,
            _logprobs(r, 0, n),
        ) + b'"stop_reason":null,"token_ids":%s,"routed_experts":null}' % _ids_or_null(r, 0, n)
        return (
            b'{"id":"chatcmpl-%s","object":"chat.completion","created":%s,"model":"%s",'
            b'"choices":[%s],"service_tier":null,"system_fingerprint":null,"usage":%s,'
            b'"prompt_logprobs":null,"prompt_token_ids":%s,"prompt_text":null,'
            b'"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
            % (r.rid, r.created, MODEL, choice, _usage(r, n), prompt)
        )
    choice = (
        b'{"index":0,"finish_reason":"length","stop_reason":null,"token_ids":[%s],'
        b'"routed_experts":null,"sampling_mask":null,"weight_versions":%s,"logprobs":%s}'
        % (r.p.ids.run(0, n), _spans(n, r.versions), _logprobs(r, 0, n))
    )
    return (
        b'{"request_id":"generate-tokens-%s","created":%s,"model":"%s","usage":%s,'
        b'"prompt_logprobs":null,"prompt_token_id_logprobs":null,"prompt_token_ids":%s,'
        b'"output_mode":"tokens","choices":[%s]}'
        % (r.rid, r.created, MODEL, _usage(r, n), prompt, choice)
    )


def frames(r: Req) -> list[bytes]:
    """The stream's ``data: ...`` frames, one per token (vLLM's stream interval 1)."""
    n, out = r.n, []
    if r.kind == "completions":
        head = (
            b'{"id":"cmpl-%s","object":"text_completion","created":%s,"model":"%s","choices":['
            % (
                r.rid,
                r.created,
                MODEL,
            )
        )
        for i in range(n):
            fin = b'"length"' if i == n - 1 else b"null"
            pids = r.prompt if (i == 0 and r.want_prompt) else b"null"
            out.append(
                head
                + b'{"index":0,"text":%s,"logprobs":%s,"finish_reason":%s,"stop_reason":null,'
                % (r.p.text(i, i + 1), _logprobs(r, i, i + 1), fin)
                + b'"prompt_token_ids":%s,"token_ids":%s}]}' % (pids, _ids_or_null(r, i, i + 1))
            )
    elif r.kind == "chat":
        head = (
            b'{"id":"chatcmpl-%s","object":"chat.completion.chunk","created":%s,"model":"%s",'
            % (
                r.rid,
                r.created,
                MODEL,
            )
        )
        out.append(
            head + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":%s}'
            % (r.prompt if r.want_prompt else b"null")
        )
        for i in range(n):
            last = i == n - 1
            text = r.p.texts[i]
            if not text and not last and not (r.lp or r.ids):
                continue  # vLLM skips a token without text unless asked for its details
            delta = b'{"content":%s}' % r.p.text(i, i + 1) if text else b"{}"
            fin = b'"length"' if last else b"null"
            out.append(
                head
                + b'"choices":[{"index":0,"delta":%s,"logprobs":%s,"finish_reason":%s,'
                % (
                    delta,
                    _logprobs(r, i, i + 1),
                    fin,
                )
                + b'"token_ids":%s}]}' % _ids_or_null(r, i, i + 1)
            )
    else:
        for i in range(n):
            last = i == n - 1
            pids = b',"prompt_token_ids":%s' % r.prompt if (i == 0 and r.want_prompt) else b""
            out.append(
                b'{"request_id":"generate-tokens-%s","usage":null%s,"output_mode":"tokens",'
                % (r.rid, pids)
                + b'"choices":[{"index":0,"finish_reason":%s,"stop_reason":null,"token_ids":[%s],'
                % (b'"length"' if last else b"null", r.p.ids.run(i, i + 1))
                + b'"routed_experts":null,"sampling_mask":null,"weight_versions":%s,'
                b'"logprobs":%s}]}'
                % (_spans(n, r.versions) if last else b"null", _logprobs(r, i, i + 1))
            )
    return [b"data: " + f + b"\n\n" for f in out] + [b"data: [DONE]\n\n"]


_KINDS = {
    b"/v1/completions": "completions",
    b"/v1/chat/completions": "chat",
    b"/inference/v1/generate": "generate",
}


async def _handle(req: HttpRequest, writer: asyncio.StreamWriter, versions: bool) -> None:
    kind = _KINDS.get(req.url.split(b"?")[0])
    if kind is None:
        status = b"200 OK" if req.url.startswith(b"/health") else b"404 Not Found"
        writer.write(b"HTTP/1.1 %s\r\ncontent-length: 0\r\n\r\n" % status)
        return
    body = orjson.loads(bytes(req.body))
    rid = req.headers.get(b"x-request-id") or b"%032x" % next(_ids)
    r = Req(kind, body, rid, versions)
    if not body.get("stream"):
        out = answer(r)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(out) + out
        )
    else:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        fs = frames(r)
        for at in range(0, len(fs), 64):
            group = b"".join(fs[at : at + 64])
            writer.write(b"%x\r\n%s\r\n" % (len(group), group))
            if writer.transport.get_write_buffer_size() > 1 << 20:
                await writer.drain()
            else:
                await asyncio.sleep(0)
        writer.write(b"0\r\n\r\n")
    await writer.drain()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--versions", action="store_true", help="report two weight versions")
    args = ap.parse_args()
    serve(args.port, lambda req, w: _handle(req, w, args.versions))


if __name__ == "__main__":
    main()
