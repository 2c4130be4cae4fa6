"""Generate the committed Grafana dashboard JSON from the Python definitions.

Run from the repository root::

    python -m dashboards.generate          # rewrite dashboards/*.json
    python -m dashboards.generate --check  # exit 1 if the committed JSON is stale

The JSON is rendered with sorted keys and a trailing newline so that regenerating is
byte-for-byte stable and diffs in review show only real changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from dashboards import estr_view, fleet, run_overview

__all__ = ["DASHBOARDS", "render", "render_all", "main"]

OUT_DIR = Path(__file__).resolve().parent

#: file name → builder; the file stem is the dashboard uid.
DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    f"{run_overview.UID}.json": run_overview.build,
    f"{fleet.UID}.json": fleet.build,
    f"{estr_view.UID}.json": estr_view.build,
}


def render(builder: Dashboard) -> str:
    """Serialise one dashboard the way it is committed."""
    return json.dumps(builder.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def render_all() -> dict[str, str]:
    """File name → JSON text for every dashboard."""
    return {name: render(build()) for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    parser.add_argument(
        "--check", action="store_true", help="compare with the files instead of writing them"
    )
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)} (run python -m dashboards.generate)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
