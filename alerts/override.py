"""Test override for timwatch's Prometheus rules: write a copy with every duration scaled.

The production rules wait minutes to hours (`for: 15m`, `[30m]` windows, `offset 30m`
baselines). An integration test against a real Prometheus cannot wait that long, so it loads a
copy in which every `for`, every range selector (`[10m]`, subquery `[1h:1m]`) and every `offset`
is multiplied by the same factor. Scaling all of them together, rather than only `for`, keeps the
rules' meaning: a rule that needs "30 min of growth against the hour before" still needs exactly
that, on a clock that runs `1 / factor` times faster. Thresholds are never touched.

This is the only sanctioned way to shorten the rules for tests (see alerts/README.md). Rule
authors keep it working by writing every time span as a PromQL duration literal, never as a
number of seconds.

It also links alerts to the incident report: ``--report-base-url URL`` adds the annotation
``report_url: URL/v1/runs/{{ $labels.run }}/report.html`` to every alert whose summary names
its run (`link_reports`); with the default factor 1 nothing else changes, so this is how a
deployment installs rules whose alerts link to its timwatch service.

Usage::

    python alerts/override.py --factor 0.016667 alerts/timwatch.rules.yml /tmp/rules.yml
    python alerts/override.py --factor 0.016667 --for 5s alerts/timwatch.rules.yml /tmp/rules.yml
    python alerts/override.py --report-base-url https://timwatch.example.org \\
        alerts/timwatch.rules.yml /etc/prometheus/rules/timwatch.rules.yml
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "REPORT_PATH",
    "format_duration",
    "link_reports",
    "parse_duration",
    "scale_duration",
    "scale_expr",
    "scale_rules",
    "write_scaled_rules",
    "main",
    "run_labelled",
]

#: the report page of an alert's run, appended to ``--report-base-url``
REPORT_PATH = "/v1/runs/{{ $labels.run }}/report.html"

_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_UNIT_MS["y"] = 365 * _UNIT_MS["d"]
_DURATION = r"(?:\d+(?:ms|[smhdwy]))+"
_DURATION_RE = re.compile(rf"^{_DURATION}$")
_PART_RE = re.compile(r"(\d+)(ms|[smhdwy])")
# `[5m]`, `[1h:1m]`, `[1h:]` and `offset 30m` / `offset -5m`
_RANGE_RE = re.compile(rf"\[\s*({_DURATION})\s*(?::\s*({_DURATION})?\s*)?\]")
_OFFSET_RE = re.compile(rf"\boffset(\s+)(-?)({_DURATION})\b")


def parse_duration(text: str) -> int:
    """Milliseconds of a Prometheus duration such as `1h30m` or `500ms`."""
    text = text.strip()
    if not _DURATION_RE.match(text):
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNIT_MS[u] for n, u in _PART_RE.findall(text))


def format_duration(ms: int) -> str:
    """Shortest Prometheus duration for a whole number of milliseconds (`0s` for zero)."""
    if ms < 0:
        raise ValueError(f"negative duration: {ms} ms")
    if ms == 0:
        return "0s"
    parts = []
    for unit in ("h", "m", "s", "ms"):
        n, ms = divmod(ms, _UNIT_MS[unit])
        if n:
            parts.append(f"{n}{unit}")
    return "".join(parts)


def scale_duration(text: str, factor: float, *, minimum_ms: int = 1) -> str:
    """`text` times `factor`, rounded to whole milliseconds, at least `minimum_ms` if non-zero."""
    ms = parse_duration(text)
    if ms == 0:
        return "0s"
    return format_duration(max(minimum_ms, round(ms * factor)))


def scale_expr(expr: str, factor: float, *, min_range_ms: int = 1) -> str:
    """PromQL `expr` with every range, subquery step and offset multiplied by `factor`.

    Ranges are kept at least `min_range_ms` long so that each still holds two scrapes.
    """

    def _range(m: re.Match[str]) -> str:
        rng = scale_duration(m.group(1), factor, minimum_ms=min_range_ms)
        if m.group(0).find(":") < 0:
            return f"[{rng}]"
        step = m.group(2)
        return f"[{rng}:{scale_duration(step, factor) if step else ''}]"

    def _offset(m: re.Match[str]) -> str:
        return f"offset{m.group(1)}{m.group(2)}{scale_duration(m.group(3), factor)}"

    return _OFFSET_RE.sub(_offset, _RANGE_RE.sub(_range, expr))


def scale_rules(
    doc: Mapping[str, Any],
    factor: float,
    *,
    for_: str | None = None,
    min_range: str | None = None,
) -> dict[str, Any]:
    """A scaled copy of a parsed rule file (`{"groups": [...]}`); `doc` is left unchanged.

    `for_`, when given, replaces every alert's `for` instead of scaling it. `min_range` is the
    shortest range a selector may be scaled to (e.g. four scrape intervals).
    """
    if not factor > 0:
        raise ValueError(f"factor must be positive, got {factor!r}")
    if for_ is not None:
        parse_duration(for_)
    min_range_ms = parse_duration(min_range) if min_range else 1
    groups = []
    for group in doc["groups"]:
        new_group = dict(group)
        if "interval" in group:
            new_group["interval"] = scale_duration(str(group["interval"]), factor)
        rules = []
        for rule in group["rules"]:
            new_rule = dict(rule)
            new_rule["expr"] = scale_expr(str(rule["expr"]), factor, min_range_ms=min_range_ms)
            if "alert" in rule:
                if for_ is not None:
                    new_rule["for"] = for_
                elif "for" in rule:
                    new_rule["for"] = scale_duration(str(rule["for"]), factor)
            rules.append(new_rule)
        new_group["rules"] = rules
        groups.append(new_group)
    return {**doc, "groups": groups}


def run_labelled(rule: Mapping[str, Any]) -> bool:
    """An alert whose summary names its run unconditionally (``{{ $labels.run }}``, not inside
    ``{{ with $labels.run }}``): every one of its alerts carries a ``run`` label."""
    summary = str((rule.get("annotations") or {}).get("summary", ""))
    return "alert" in rule and "{{ $labels.run }}" in summary


def link_reports(doc: Mapping[str, Any], base_url: str) -> dict[str, Any]:
    """A copy of a parsed rule file in which every `run_labelled` alert has the annotation
    ``report_url: <base_url>/v1/runs/{{ $labels.run }}/report.html``; `doc` is left unchanged.
    `base_url` is the timwatch service as the people reading the alerts reach it."""
    base = base_url.rstrip("/")
    if not re.match(r"^https?://[^\s{}]+$", base):
        raise ValueError(f"report base URL must be http(s)://host[:port][/path], got {base_url!r}")
    groups = []
    for group in doc["groups"]:
        rules = []
        for rule in group["rules"]:
            new_rule = dict(rule)
            if run_labelled(rule):
                new_rule["annotations"] = {
                    **rule["annotations"], "report_url": base + REPORT_PATH
                }  # fmt: skip
            rules.append(new_rule)
        groups.append({**group, "rules": rules})
    return {**doc, "groups": groups}


def write_scaled_rules(
    src: str | Path,
    dst: str | Path,
    factor: float,
    *,
    for_: str | None = None,
    min_range: str | None = None,
    report_base_url: str | None = None,
) -> Path:
    """Read the rule file `src`, write its scaled copy (with report links when
    `report_base_url` is given) to `dst` and return `dst`."""
    doc = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    scaled = scale_rules(doc, factor, for_=for_, min_range=min_range)
    if report_base_url is not None:
        scaled = link_reports(scaled, report_base_url)
    unscaled = factor == 1 and for_ is None and min_range is None
    what = "durations unchanged" if unscaled else "a test copy, not for production"
    links = f", report links to {report_base_url}" if report_base_url else ""
    out = Path(dst)
    out.write_text(
        f"# generated by alerts/override.py from {Path(src).name} (factor {factor!r}{links}); "
        f"{what}\n" + yaml.safe_dump(scaled, sort_keys=False, width=100, allow_unicode=True),
        encoding="utf-8",
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="rule file to read")
    parser.add_argument("dst", type=Path, help="scaled copy to write")
    parser.add_argument(
        "--factor", type=float, default=1.0, help="e.g. 0.016667 (1 min -> 1 s); default 1"
    )
    parser.add_argument("--for", dest="for_", help="replace every `for` with this duration")
    parser.add_argument("--min-range", help="shortest range after scaling, e.g. 4s")
    parser.add_argument(
        "--report-base-url",
        metavar="URL",
        help="add report_url: URL/v1/runs/{{ $labels.run }}/report.html to run-labelled alerts",
    )
    args = parser.parse_args(argv)
    try:
        write_scaled_rules(
            args.src, args.dst, args.factor, for_=args.for_, min_range=args.min_range,
            report_base_url=args.report_base_url,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
