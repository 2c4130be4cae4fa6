"""The gate's and the comparison's output for CI: JUnit XML (one test case per gated metric,
valid against the Jenkins/Ant JUnit schema, tests/fixtures/junit-10.xsd) and Markdown (a job
summary; the report page renders the same text). Standard library only.

Invariants: the XML has one ``testcase`` per check, a ``failure`` exactly on the checks that did
not pass, ``tests``/``failures`` counting them; the Markdown's first line says PASS or FAIL.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from typing import Any

from .comparison import Comparison, fmt_ratio
from .gate import Check, GateResult

__all__ = ["comparison_markdown", "fmt", "junit_xml", "markdown", "markdown_html"]


def fmt(x: float | None) -> str:
    """Three significant digits; ``-`` for None or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3g}"


def _line(c: Check) -> str:
    rel = fmt_ratio(c.ratio)
    return (
        f"{c.metric} = {fmt(c.mean)} over {c.n} steps, baseline {fmt(c.baseline.mean)} ({rel}); "
        f"limit {fmt(c.limit)} = max({fmt(c.baseline.mean)}×{c.baseline.max_ratio:g}, "
        f"{fmt(c.baseline.mean)}+{c.baseline.max_abs:g}) + noise {fmt(c.noise)}"
    )


def junit_xml(result: GateResult) -> str:
    """The JUnit XML document (UTF-8 text with its declaration)."""
    failures = sum(not c.passed for c in result.checks)
    suites = ET.Element("testsuites")
    suite = ET.SubElement(
        suites, "testsuite", name=f"timwatch gate {result.run}", tests=str(len(result.checks)),
        failures=str(failures), errors="0", skipped="0", time="0",
    )  # fmt: skip
    props = ET.SubElement(suite, "properties")
    for k, v in (
        ("model", result.baseline.model), ("engine", result.baseline.engine),
        ("baseline_run", result.baseline.run), ("run", result.run),
        ("steps", f"{result.steps[0]}-{result.steps[1]}"),
    ):  # fmt: skip
        ET.SubElement(props, "property", name=k, value=v)
    for c in result.checks:
        case = ET.SubElement(
            suite, "testcase", classname=f"timwatch.gate.{result.baseline.model}",
            name=c.metric, time="0",
        )  # fmt: skip
        if not c.passed:
            f = ET.SubElement(case, "failure", message=f"{c.metric} above its limit", type="gate")
            f.text = _line(c)
        else:
            ET.SubElement(case, "system-out").text = _line(c)
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(result: GateResult) -> str:
    """The gate as Markdown: a PASS/FAIL heading line, then one table row per metric."""
    word = "PASS" if result.passed else "FAIL"
    b = result.baseline
    lines = [
        f"**timwatch gate: {word}** — run `{_cell(result.run)}` (steps {result.steps[0]}–"
        f"{result.steps[1]}) against baseline `{_cell(b.run)}` ({_cell(b.model)} on "
        f"{_cell(b.engine)})",
        "",
        "| metric | run | baseline | ratio | limit | noise | steps | result |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in result.checks:
        lines.append(
            f"| {c.metric} | {fmt(c.mean)} | {fmt(c.baseline.mean)} | {fmt_ratio(c.ratio)} | "
            f"{fmt(c.limit)} | {fmt(c.noise)} | {c.n} | {'pass' if c.passed else '**FAIL**'} |"
        )
    return "\n".join(lines) + "\n"


def comparison_markdown(cmp: Comparison | dict[str, Any]) -> str:
    """A comparison as Markdown: the verdict line, the metrics table, the buckets."""
    d = cmp.to_dict() if isinstance(cmp, Comparison) else cmp
    lines = [
        f"**{_cell(d['verdict'])}**",
        "",
        f"| metric | A: `{_cell(d['a'])}` | B: `{_cell(d['b'])}` | B/A | 95 % interval |",
        "|---|---:|---:|---:|---|",
    ]
    for m in d["metrics"]:
        iv = "-" if m["lo"] is None else f"{fmt_ratio(m['lo'])}–{fmt_ratio(m['hi'])}"
        lines.append(
            f"| {m['metric']} | {fmt(m['a'])} | {fmt(m['b'])} | {fmt_ratio(m['ratio'])} | {iv} |"
        )
    if d["where"]:
        lines += ["", "| where | A | B | B/A |", "|---|---:|---:|---:|"]
        for w in d["where"]:
            lines.append(
                f"| {w['label']} | {fmt(w['a'])} | {fmt(w['b'])} | {fmt_ratio(w['ratio'])} |"
            )
    if d.get("rough"):
        lines += ["", "_fewer than 5 steps in a run: the interval is rough_"]
    return "\n".join(lines) + "\n"


def _inline(text: str) -> str:
    """Escaped text with ``**bold**``, ``_italic_`` (a whole cell or line) and ```code```."""
    import html
    import re

    out = html.escape(text.replace("\\|", "|"), quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"^_(.+)_$", r"<em>\1</em>", out)


def _split_row(line: str) -> list[str]:
    import re

    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def markdown_html(md: str) -> str:
    """HTML of the Markdown that `markdown` and `comparison_markdown` write: paragraphs and
    pipe tables (header, alignment row, body), inline bold, italic and code. Not a general
    Markdown renderer: it renders exactly the subset these functions produce."""
    parts: list[str] = []
    blocks = [b for b in md.strip().split("\n\n") if b.strip()]
    for block in blocks:
        lines = block.strip().splitlines()
        if len(lines) >= 2 and lines[0].startswith("|") and set(lines[1]) <= set("|-: "):
            aligns = ["right" if c.endswith(":") else "left" for c in _split_row(lines[1])]
            head = "".join(f"<th>{_inline(c)}</th>" for c in _split_row(lines[0]))
            body = "".join(
                "<tr>" + "".join(
                    f'<td style="text-align:{a}">{_inline(c)}</td>'
                    for c, a in zip(_split_row(row), aligns, strict=False)
                ) + "</tr>"
                for row in lines[2:]
            )  # fmt: skip
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            parts.append("<p>" + "<br>".join(_inline(x) for x in lines) + "</p>")
    return "\n".join(parts)
