"""A monitor stand-in for the trainer tap's failure-mode tests: a tiny ``http.server`` on
loopback that answers from a script of statuses and records every request it gets.

It stands in for nothing but "a server that answers what the test scripts and records
requests": what the real `timwatch serve` cannot be made to do on demand (503 with Retry-After,
hanging, a 5xx storm, an endpoint that another branch adds). Happy paths use the real server.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from timwatch.monitor.core.batch import Batch

__all__ = ["StandIn"]


class StandIn:
    """Answers POSTs from `script` ((status, headers) or (status, headers, json_body)), 200 when
    it is empty; records ``{"path", "headers", "batch"}`` per request (``batch`` is None for a
    body that is not a batch). While `gate` is clear every request waits (a hanging monitor)."""

    def __init__(self) -> None:
        self.script: list[tuple[Any, ...]] = []
        self.requests: list[dict[str, Any]] = []
        self.arrived = 0  # requests whose body was read (counted before waiting on the gate)
        self.gate = threading.Event()
        self.gate.set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.arrived += 1
                outer.gate.wait(30)
                batch = Batch.from_safetensors(body) if self.path.endswith("/batches") else None
                outer.requests.append(
                    {"path": self.path, "headers": dict(self.headers), "batch": batch}
                )
                entry = outer.script.pop(0) if outer.script else (200, {})
                status, headers = entry[0], entry[1]
                answer = entry[2] if len(entry) > 2 else {"detail": f"stand-in {status}"}
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                payload = json.dumps(answer).encode()
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def batches(self) -> list[dict[str, Any]]:
        """The batch POSTs, in arrival order."""
        return [r for r in self.requests if r["batch"] is not None]

    def close(self) -> None:
        self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()
