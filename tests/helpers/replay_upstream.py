"""A real uvicorn upstream that answers recorded bytes: the framing matrix's uvicorn side
(`tests/service/test_proxy_framing.py`).

``POST /generate`` and ``POST /v1/completions`` answer ``DIR/<name>.plain`` (``application/json``,
with a content-length) or, when the request's JSON has ``"stream": true``, ``DIR/<name>.stream``
(``text/event-stream``, chunked, one chunk per ``data:`` frame as an engine writes them), where
``<name>`` is the path without slashes. ``GET /health`` answers ``ok`` (and ``HEAD`` its head),
``GET /nothing`` 204 and ``GET /cached`` 304.

    python -m tests.helpers.replay_upstream --port 8000 --dir DIR
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


def create_app(directory: Path) -> Starlette:
    async def answer(request: Request) -> Response:
        name = request.url.path.strip("/").replace("/", "_")
        if json.loads(await request.body()).get("stream"):
            frames = (directory / f"{name}.stream").read_bytes().split(b"\n\n")[:-1]

            async def each() -> AsyncIterator[bytes]:
                for frame in frames:
                    yield frame + b"\n\n"

            return StreamingResponse(each(), media_type="text/event-stream")
        body = (directory / f"{name}.plain").read_bytes()
        return Response(body, media_type="application/json")

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def nothing(request: Request) -> Response:
        return Response(status_code=204)

    async def cached(request: Request) -> Response:
        return Response(status_code=304, headers={"etag": '"x"'})

    return Starlette(
        routes=[
            Route("/generate", answer, methods=["POST"]),
            Route("/v1/completions", answer, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/nothing", nothing, methods=["GET"]),
            Route("/cached", cached, methods=["GET"]),
        ]
    )


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    app = create_app(args.dir)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
