"""What a trainer runs, as one script: the numpy masks of a batch and a `Tap` that ships it to a
standard-library HTTP server on 127.0.0.1. Prints one JSON object: ``foreign`` (the top-level
modules loaded meanwhile that are neither the standard library, numpy, timwatch nor loaded
before the script began), ``posts`` (path and content type of each request the server got) and
``kept`` (kept positions per mask policy).

It imports nothing but the standard library, numpy and timwatch, so it runs as a file
(``python tests/helpers/trainer_paths.py``) in a virtualenv that has only ``pip install
timwatch`` (tests/stack/test_extras_install.py) and in the test one
(tests/unit/test_extras.py).
"""

from __future__ import annotations

import sys

_BEFORE = {name.partition(".")[0] for name in sys.modules}

import http.server  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402

from timwatch.monitor.core.batch import Batch  # noqa: E402
from timwatch.monitor.core.masks import keep_masks, tis_weights  # noqa: E402
from timwatch.sidecar.tap import Tap  # noqa: E402


class _Sink(http.server.BaseHTTPRequestHandler):
    posts: list[tuple[str, str | None]] = []

    def do_POST(self) -> None:  # noqa: N802 - the handler's protocol
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.posts.append((self.path, self.headers.get("Content-Type")))
        body = b'{"accepted": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    n = 12
    fields = {
        "cu_seqlens": np.array([0, 5, n], dtype=np.int64),
        "logp_rollout": -np.linspace(0.1, 1.2, n),
        "logp_train": -np.linspace(0.1, 1.2, n)[::-1].copy(),
        "entropy": np.linspace(0.5, 1.5, n),
        "loss_mask": np.ones(n, dtype=bool),
    }
    batch = Batch.from_json({k: v.tolist() for k, v in fields.items()})
    kept = {name: int(mask.sum()) for name, mask in keep_masks(batch).items()}
    kept["tis_weights_finite"] = int(
        np.isfinite(tis_weights(batch.logp_train, batch.logp_rollout)).sum()
    )
    tap = Tap(f"http://127.0.0.1:{server.server_address[1]}", "trainer-paths")
    tap.report(1, **fields)
    tap.close(timeout=60)
    server.shutdown()
    loaded = {name.partition(".")[0] for name in sys.modules}
    foreign = loaded - _BEFORE - set(sys.stdlib_module_names) - {"numpy", "timwatch"}
    print(json.dumps({"foreign": sorted(foreign), "posts": _Sink.posts, "kept": kept}))


if __name__ == "__main__":
    main()
