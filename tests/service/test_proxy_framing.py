"""The framing matrix: both proxies (``timwatch sidecar sglang`` and ``vllm``, real processes)
in front of (a) a real uvicorn upstream (`tests.helpers.replay_upstream`) and (b) a raw-socket
upstream run in this process that writes exact bytes, for every response framing RFC 9112
allows: content-length, chunked with extensions and trailers, close-delimited (HTTP/1.1 and
HTTP/1.0), HTTP/1.0 keep-alive, interim 1xx answers before the final one, 204, 304 and HEAD.

Each answer is one the engine stand-ins gave (`tests/helpers/fake_sglang.py`, vLLM's
`benchmarks/vllm_standin.py`), recorded once, for a request the proxy captures without
changing it, streamed and not. The client's body must equal a direct call's, the proxy must
capture the sample, and the raw upstream logs the connection each request came on: where the
framing lets a connection be reused, all requests share one; where it does not, each has its
own. An upstream that breaks off gives the client a 502 before the head, and after it a body
that ends without its end (an error to any HTTP client), counted in ``partial_streams``.
Every call has a timeout: nothing can hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.helpers.loopserver import LoopServer, running
from tests.helpers.procs import (
    fake_sglang_process,
    free_port,
    running_process,
    sglang_proxy_process,
    vllm_proxy_process,
    vllm_standin_process,
)

REQUESTS = {
    "sglang": (
        "/generate",
        {
            "input_ids": [5, 6, 7, 8],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 40},
        },
    ),
    "vllm": (
        "/v1/completions",
        {"prompt": [3, 1, 4], "max_tokens": 24, "logprobs": 0, "return_token_ids": True},
    ),
}
# framing -> whether the upstream lets the connection be reused after it
FRAMINGS = {
    "length": True,
    "chunked": True,
    "close": False,
    "http10": False,
    "http10-keep-alive": True,
    "interim": True,
}
TIMEOUT = 30.0
# answers without a body: 204, 304 (with the length it would have sent), HEAD's
BODYLESS = {
    "/nothing": b"HTTP/1.1 204 No Content\r\n\r\n",
    "/cached": b'HTTP/1.1 304 Not Modified\r\netag: "x"\r\ncontent-length: 9\r\n\r\n',
    "HEAD": b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\n",
}


def _answer_head(framing: str, ctype: bytes, size: int) -> bytes:
    ct = b"content-type: " + ctype + b"\r\n"
    if framing in ("length", "interim"):
        head = b"HTTP/1.1 200 OK\r\n" + ct + b"content-length: %d\r\n\r\n" % size
        if framing == "interim":
            early = b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n"
            head = b"HTTP/1.1 100 Continue\r\n\r\n" + early + head
        return head
    if framing == "chunked":
        return b"HTTP/1.1 200 OK\r\n" + ct + b"transfer-encoding: chunked\r\n\r\n"
    if framing == "close":
        return b"HTTP/1.1 200 OK\r\n" + ct + b"\r\n"
    if framing == "http10":
        return b"HTTP/1.0 200 OK\r\n" + ct + b"\r\n"
    assert framing == "http10-keep-alive"
    return (
        b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\n" + ct + b"content-length: %d\r\n\r\n" % size
    )


def _chunked(body: bytes, rng: random.Random) -> bytes:
    out, at = [], 0
    while at < len(body):
        part = body[at : at + rng.randint(1, 900)]
        ext = rng.choice([b"", b";e=1", b';a="b c"'])
        size = rng.choice([b"%x", b"%X", b"%04x"]) % len(part)
        out.append(size + ext + b"\r\n" + part + b"\r\n")
        at += len(part)
    return b"".join(out) + b"0\r\nx-trailer: 1\r\n\r\n"


class RawUpstream(LoopServer):
    """An upstream on asyncio streams answering with ``self.answers[(path, stream)]`` in
    ``self.framing``, written in pieces; ``self.log`` holds ``(x-tag, connection number)`` per
    request read (logged before its answer is written). ``framing`` ``"reset-head"`` closes the
    connection once the request is read, ``"reset-body"`` after half the body (content-length,
    or chunked for a stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.framing = "length"
        self.answers: dict[tuple[str, bool], tuple[bytes, bytes]] = {}
        self.log: list[tuple[str, int]] = []
        self._conns = 0

    async def _request(
        self, reader: asyncio.StreamReader
    ) -> tuple[str, str, dict[str, str], bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ")
        headers = {}
        for line in lines[1:]:
            if line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while size := int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16):
                parts.append((await reader.readexactly(size + 2))[:-2])
            await reader.readuntil(b"\r\n")
            body = b"".join(parts)
        else:
            body = b""
        return method, target, headers, body

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn, self._conns = self._conns, self._conns + 1
        rng = random.Random(conn)
        try:
            while True:
                method, path, headers, body = await self._request(reader)
                tag = headers.get("x-tag", "")
                # logged before the answer goes out, so a client that has its answer finds
                # its request here
                self.log.append((tag, conn))
                framing, keep = self.framing, True
                if path in ("/nothing", "/cached") or method == "HEAD":
                    wire = BODYLESS.get(path, BODYLESS["HEAD"])
                elif framing == "reset-head":
                    return
                else:
                    stream = bool(orjson.loads(body).get("stream"))
                    ctype, answer = self.answers[(path, stream)]
                    if framing == "reset-body":
                        framing = "chunked" if stream else "length"
                    wire = _answer_head(framing, ctype, len(answer))
                    wire += _chunked(answer, rng) if framing == "chunked" else answer
                    keep = FRAMINGS[framing]
                    if self.framing == "reset-body":
                        wire, keep = wire[: len(wire) - len(answer) // 2], False
                at = 0
                while at < len(wire):  # written in pieces: the proxy's reads end anywhere
                    step = rng.randint(1, 4000)
                    writer.write(wire[at : at + step])
                    at += step
                    await writer.drain()
                if not keep:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def raw_upstream() -> contextlib.AbstractContextManager[RawUpstream]:
    return running(RawUpstream())


def _post(url: str, kind: str, stream: bool, tag: str) -> httpx.Response:
    path, body = REQUESTS[kind]
    return httpx.post(
        url + path, json={**body, "stream": stream}, headers={"x-tag": tag}, timeout=TIMEOUT
    )


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the stand-ins answer each request, streamed and not, as files."""
    out = tmp_path_factory.mktemp("answers")
    for kind, upstream in (
        ("sglang", fake_sglang_process(False)),
        ("vllm", vllm_standin_process()),
    ):
        with upstream as url:
            path, _ = REQUESTS[kind]
            for stream in (False, True):
                resp = _post(url, kind, stream, "record")
                assert resp.status_code == 200
                name = path.strip("/").replace("/", "_")
                (out / f"{name}.{'stream' if stream else 'plain'}").write_bytes(resp.content)
    return out


def _load(up: RawUpstream, answers: Path) -> None:
    for path, _ in REQUESTS.values():
        name = path.strip("/").replace("/", "_")
        up.answers[(path, False)] = (b"application/json", (answers / f"{name}.plain").read_bytes())
        up.answers[(path, True)] = (b"text/event-stream", (answers / f"{name}.stream").read_bytes())


@pytest.fixture(scope="module")
def raw(answers: Path) -> Iterator[dict[str, Any]]:
    with raw_upstream() as up:
        _load(up, answers)
        with sglang_proxy_process(up.url) as sglang, vllm_proxy_process(up.url) as vllm:
            yield {"up": up, "sglang": sglang, "vllm": vllm}


@pytest.fixture(scope="module")
def replay(answers: Path) -> Iterator[dict[str, str]]:
    port = free_port()
    args = ["-m", "tests.helpers.replay_upstream", "--port", str(port), "--dir", str(answers)]
    url = f"http://127.0.0.1:{port}"
    with running_process(args, f"{url}/health"):
        with sglang_proxy_process(url) as sglang, vllm_proxy_process(url) as vllm:
            yield {"up": url, "sglang": sglang, "vllm": vllm}


def _counters(proxy: str) -> dict[str, Any]:
    return httpx.get(f"{proxy}/timwatch/counters", timeout=TIMEOUT).json()


def _gets(base: str, method: str, path: str) -> tuple[int, bytes, str]:
    resp = httpx.request(method, base + path, timeout=TIMEOUT)
    return resp.status_code, resp.content, resp.headers.get("etag", "")


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_uvicorn_upstream_answers_reach_the_client_whole_and_are_captured(
    replay: dict[str, str], kind: str, stream: bool
) -> None:
    proxy = replay[kind]
    direct = _post(replay["up"], kind, stream, "direct").content
    before = _counters(proxy)["capture"]["captured"]
    for i in range(3):
        resp = _post(proxy, kind, stream, f"proxy-{i}")
        assert resp.status_code == 200 and resp.content == direct
    assert _counters(proxy)["capture"]["captured"] == before + 3
    for method, path in (("HEAD", "/health"), ("GET", "/nothing"), ("GET", "/cached")):
        assert _gets(proxy, method, path) == _gets(replay["up"], method, path)


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("framing", list(FRAMINGS))
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_every_framing_reaches_the_client_whole_is_captured_and_reused_when_allowed(
    raw: dict[str, Any], kind: str, framing: str, stream: bool
) -> None:
    up, proxy = raw["up"], raw[kind]
    up.framing = framing
    direct = _post(up.url, kind, stream, "direct")
    assert direct.status_code == 200
    assert direct.content == up.answers[(REQUESTS[kind][0], stream)][1]
    before = _counters(proxy)
    tag = f"{kind}-{framing}-{stream}"
    for i in range(3):
        resp = _post(proxy, kind, stream, f"{tag}-{i}")
        assert resp.status_code == 200 and resp.content == direct.content, i
    after = _counters(proxy)
    assert after["capture"]["captured"] == before["capture"]["captured"] + 3
    assert after["proxy"]["upstream_errors"] == before["proxy"]["upstream_errors"]
    conns = [c for t, c in up.log if t.startswith(tag)]
    assert len(conns) == 3
    if FRAMINGS[framing]:
        assert len(set(conns)) == 1, conns  # one connection, reused
    else:
        assert len(set(conns)) == 3, conns  # each closed after its answer


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_bodyless_answers_pass_and_keep_the_connection(raw: dict[str, Any], kind: str) -> None:
    """204, 304 (with the content-length of what it would have sent) and the answer to HEAD
    (content-length and no body): the client gets status and headers, no body, and the next
    request goes out on the same upstream connection."""
    up, proxy = raw["up"], raw[kind]
    up.framing = "length"
    with httpx.Client(headers={"x-tag": f"bodyless-{kind}"}, timeout=TIMEOUT) as client:
        for method, path, status in (
            ("GET", "/nothing", 204),
            ("GET", "/cached", 304),
            ("HEAD", "/health", 200),
            ("GET", "/nothing", 204),
        ):
            resp = client.request(method, proxy + path)
            assert (resp.status_code, resp.content) == (status, b""), (method, path)
            direct = client.request(method, up.url + path)
            assert (direct.status_code, direct.content) == (status, b"")
            if path == "/cached":
                assert resp.headers["etag"] == '"x"'
            if method == "HEAD":
                assert resp.headers["content-length"] == "2"
    conns = [c for t, c in up.log if t == f"bodyless-{kind}"]
    assert len(conns) == 8
    proxied = conns[0::2]
    assert len(set(proxied)) == 1, conns


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_an_upstream_that_breaks_off_gives_a_clear_error_and_never_hangs(
    raw: dict[str, Any], kind: str
) -> None:
    up, proxy = raw["up"], raw[kind]
    before = _counters(proxy)["proxy"]
    # before the head: a 502 naming the upstream
    up.framing = "reset-head"
    for stream in (False, True):
        resp = _post(proxy, kind, stream, "reset-head")
        assert resp.status_code == 502
        assert up.url in resp.json()["error"]["message"]
    # mid-body of an answer read whole: the head has not gone out, a 502
    up.framing = "reset-body"
    resp = _post(proxy, kind, False, "reset-body")
    assert resp.status_code == 502
    assert "closed the connection" in resp.json()["error"]["message"]
    # mid-body of a relayed stream: the head went out, the body ends without its last chunk
    path, body = REQUESTS[kind]
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", proxy + path, json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                resp.read()
    after = _counters(proxy)["proxy"]
    assert after["partial_streams"] == before["partial_streams"] + 1
    assert after["upstream_errors"] == before["upstream_errors"] + 4
    # and the proxy goes on: the next answer arrives whole
    up.framing = "chunked"
    assert _post(proxy, kind, True, "after").content == up.answers[(path, True)][1]
