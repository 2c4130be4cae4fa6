"""The incident report in a real browser: Debian's headless Chromium opens the page written by
``timwatch report --html`` (from a file, network off) and the page the service serves, driven
over the DevTools protocol. Nothing may be logged as an error or thrown, every image must
decode, and the file case must request nothing but itself and data URIs. A screenshot of each
lands in the test's tmp_path.

Chromium (Debian package `chromium`, installed by scripts/test.sh) is a hard requirement: the
test fails, never skips, without it.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import websocket

from tests.helpers.batches import random_batch
from tests.helpers.procs import REPO, ServerProc, stop_process
from tests.helpers.wire import as_batch
from timwatch.monitor.client import TimwatchClient

WRITE, READ = "browser-write", "browser-read"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("chromium not found: install Debian package `chromium` (scripts/test.sh)")


@dataclasses.dataclass
class Visit:
    """What one page load produced."""

    errors: list[str]
    requests: list[str]
    images: dict[str, Any]
    screenshot: Path


class DevTools:
    """A page target of a headless Chromium over its DevTools websocket."""

    def __init__(self, ws_url: str) -> None:
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                assert "error" not in msg, f"{method}: {msg['error']}"
                return dict(msg.get("result", {}))
            self.events.append(msg)

    def wait_for(self, method: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            assert time.monotonic() < deadline, f"no {method} within {timeout} s"
            self.events.append(json.loads(self.ws.recv()))

    def close(self) -> None:
        self.ws.close()


@contextmanager
def browser(tmp_path: Path) -> Iterator[str]:
    """A headless Chromium; yields the websocket URL of its first page."""
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen(
        [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
         "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
         "--remote-debugging-port=0", "--remote-allow-origins=*",
         f"--user-data-dir={profile}", "--window-size=1200,900", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, f"chromium exited with {proc.returncode}"
            assert time.monotonic() < deadline, "chromium never opened its DevTools port"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        while True:
            pages = [
                t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
                if t["type"] == "page"
            ]  # fmt: skip
            if pages:
                break
            assert time.monotonic() < deadline, "chromium opened no page"
            time.sleep(0.1)
        yield str(pages[0]["webSocketDebuggerUrl"])
    finally:
        stop_process(proc, grace=10)


def visit(
    ws_url: str, url: str, shot: Path, *, offline: bool, headers: dict[str, str] | None = None
) -> Visit:
    """Load `url`; collect console errors, exceptions, failed loads and every request."""
    dt = DevTools(ws_url)
    try:
        for domain in ("Page", "Runtime", "Log", "Network"):
            dt.call(f"{domain}.enable")
        if offline:
            dt.call(
                "Network.emulateNetworkConditions", offline=True, latency=0,
                downloadThroughput=-1, uploadThroughput=-1,
            )  # fmt: skip
        if headers:
            dt.call("Network.setExtraHTTPHeaders", headers=headers)
        dt.events.clear()
        dt.call("Page.navigate", url=url)
        dt.wait_for("Page.loadEventFired")
        images = dt.call(
            "Runtime.evaluate",
            expression="JSON.stringify({n: document.images.length, ok: Array.from("
            "document.images).filter(i => i.complete && i.naturalWidth > 0).length})",
            returnByValue=True,
        )["result"]["value"]
        png = dt.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        shot.write_bytes(base64.b64decode(png["data"]))
        errors, requests = [], []
        for e in dt.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                errors.append(
                    f"exception: {d.get('text')} {d.get('exception', {}).get('description')}"
                )
            elif m == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert", "warning"):
                errors.append(f"console.{p['type']}: {p.get('args')}")
            elif m == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
                errors.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
            elif m == "Network.loadingFailed":
                errors.append(f"load failed: {p.get('errorText')}")
            elif m == "Network.requestWillBeSent":
                requests.append(p["request"]["url"])
        return Visit(errors, requests, json.loads(images), shot)
    finally:
        dt.close()


def _served(server_factory: Callable[..., ServerProc]) -> ServerProc:
    srv = server_factory(env={"TIMWATCH_TOKEN": WRITE, "TIMWATCH_READ_TOKEN": READ}, token=WRITE)
    with TimwatchClient(srv.url, token=WRITE) as c:
        for s in range(12):
            raw = random_batch(np.random.default_rng(100 + s), n_seq=8, optional="all")
            raw = dataclasses.replace(raw, step=s, batch_id=f"s{s}", policy_version=s + 3)
            c.ingest("browse-1", as_batch(raw))
    return srv


def test_the_check_bites(tmp_path: Path) -> None:
    """A page that logs an error, throws and loads a remote image is caught on every count."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<!DOCTYPE html><html><head><link rel='icon' href='data:,'></head><body>"
        "<img src='https://timwatch.invalid/x.png'><script>console.error('boom');"
        "throw new Error('thrown')</script></body></html>"
    )
    with browser(tmp_path) as ws:
        v = visit(ws, bad.as_uri(), tmp_path / "bad.png", offline=True)
    text = "\n".join(v.errors)
    assert "console.error" in text and "thrown" in text and "load failed" in text, text
    assert "https://timwatch.invalid/x.png" in v.requests
    assert v.images == {"n": 1, "ok": 0}


def test_report_renders_without_errors_from_a_file_and_served(
    server_factory: Callable[..., ServerProc], tmp_path: Path
) -> None:
    srv = _served(server_factory)
    page = tmp_path / "report.html"
    p = subprocess.run(
        [sys.executable, "-m", "timwatch", "report", "browse-1", "--html", str(page),
         "--url", srv.url, "--token", READ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    served_url = f"{srv.url}/v1/runs/browse-1/report.html?from_step=2&to_step=9"
    with browser(tmp_path) as ws:
        offline = visit(ws, page.as_uri(), tmp_path / "file.png", offline=True)
        online = visit(
            ws, served_url, tmp_path / "served.png", offline=False,
            headers={"Authorization": f"Bearer {READ}"},
        )  # fmt: skip
    for v in (offline, online):
        assert v.errors == [], v.errors
        assert v.images == {"n": 8, "ok": 8}
        assert v.screenshot.stat().st_size > 20_000  # a rendered page, not a blank one
        assert v.screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert offline.requests and all(
        u == page.as_uri() or u.startswith("data:") for u in offline.requests
    ), offline.requests
    assert all(u == served_url or u.startswith("data:") for u in online.requests), online.requests
