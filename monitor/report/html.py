"""The report page: one self-contained HTML document (inline CSS, PNG data URIs, no script, no
external resource of any kind: it opens offline and from a file).

Every string that comes from a user or the store (run name, tags, batch ids, the diagnosis'
texts) goes through `html.escape`; numbers are formatted here.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from ..core.masks import TOKEN_POLICIES
from ..core.numfmt import sig3
from ..core.scalars import CANONICAL, HEALTH
from . import plots
from .data import DETAIL_STEPS, MAX_POINTS, ReportData
from .thresholds import MASK_POLICY_THRESHOLDS, SERIES_THRESHOLDS

__all__ = ["diagnosis_section", "render"]

#: token id → text (None for an id it does not know); None: no tokenizer is known, the table
#: shows ids only (`timwatch.monitor.report.tokenizer` reads one from a tokenizer.json)
TokenText = Callable[[int], str | None] | None

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;
max-width:1040px;color:#1d1d1f;padding:0 12px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;border-bottom:1px solid #ddd;
padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0;font-size:12.5px}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f6}td.n{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;display:block;margin:6px 0}
.meta{color:#555}.note{color:#666;font-style:italic}
.v-likely,.v-confirmed{color:#b00020;font-weight:600}.v-possible{color:#b26a00}
.v-unlikely,.v-ruled_out{color:#2e7d32}
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(v: Any) -> str:
    """A cell or inline number: integers (steps, counts) exact, floats by `sig3`, a missing
    value as a dash; anything else escaped as text."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return _e(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return sig3(v)
    return _e(v)


def _trend(v: Any) -> str:
    """An evidence's trend (late/early, a float) or its label (``rising``); a dash for none."""
    return _e(v) if isinstance(v, str) else _num(v)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``head`` and cells are HTML already (escaped by the caller)."""
    th = "".join(f"<th>{h}</th>" for h in head)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _td(v: Any, numeric: bool = False) -> str:
    return f'<td class="n">{_num(v)}</td>' if numeric else f"<td>{_e(v)}</td>"


def diagnosis_section(diagnosis: dict[str, Any] | None, note: str | None) -> str:
    """The diagnosis (`Diagnosis.to_dict()`): causes by descending score with their evidence,
    then the causes not checked and why; a note when there is no diagnosis."""
    if diagnosis is None:
        return f'<p class="note">{_e(note or "diagnosis not available")}</p>'
    causes = sorted(
        diagnosis.get("causes") or [],
        key=lambda c: -float(c["score"]) if isinstance(c.get("score"), (int, float)) else 0.0,
    )
    rows = []
    for c in causes:
        items = []
        for ev in c.get("evidence") or []:
            span = ev.get("steps") or []
            where = f"steps {_num(span[0])}–{_num(span[1])}" if len(span) == 2 else ""
            items.append(
                f"<li><code>{_e(ev.get('metric', ''))}</code> {where}: {_num(ev.get('value'))}"
                f" ({_trend(ev.get('trend'))}) {_e(ev.get('detail', ''))}</li>"
            )
        verdict = str(c.get("verdict", ""))
        rows.append([
            _td(c.get("cause", "")),
            f'<td class="v-{_e(verdict.lower().replace(" ", "_"))}">{_e(verdict)}</td>',
            _td(c.get("score"), numeric=True),
            _td(c.get("action", "")),
            f"<td><ul>{''.join(items)}</ul></td>" if items else "<td>–</td>",
        ])  # fmt: skip
    span = f"steps {_num(diagnosis.get('from_step'))}–{_num(diagnosis.get('to_step'))}"
    examined = diagnosis.get("steps")
    examined = len(examined) if isinstance(examined, list) else examined
    out = [f'<p class="meta">{span}, {_num(examined)} steps examined</p>']
    if rows:
        out.append(_table(["cause", "verdict", "score", "action", "evidence"], rows))
    else:
        out.append('<p class="note">no cause found</p>')
    skipped = diagnosis.get("not_checked") or []
    if skipped:
        lis = "".join(
            f"<li><b>{_e(s.get('cause', ''))}</b>: {_e(s.get('reason', ''))}</li>" for s in skipped
        )
        out.append(f"<p>Not checked:</p><ul>{lis}</ul>")
    return "".join(out)


def _img(uri: str, alt: str) -> str:
    return f'<img src="{uri}" alt="{_e(alt)}">'


def _mask_lines(policies: list[str]) -> list[tuple[float, str]]:
    """One line per distinct threshold of `policies`, naming the policies it holds for."""
    by_value: dict[float, list[str]] = {}
    for p in policies:
        value = MASK_POLICY_THRESHOLDS[p]
        if value is not None:
            by_value.setdefault(value, []).append(p)
    return [
        (v, f"TimwatchMaskRatioHigh: {', '.join(ps)} > {sig3(v)}")
        for v, ps in sorted(by_value.items())
    ]


def _plots(data: ReportData) -> str:
    def curve(name: str, label: str | None = None) -> plots.Curve:
        x, y = data.series[name]
        return (label or name, x, y)

    def lines(name: str) -> list[tuple[float, str]]:
        return [(t.value, f"{t.alert}: {t.label}") for t in SERIES_THRESHOLDS[name]]

    token = [p for p in MASK_POLICY_THRESHOLDS if p in TOKEN_POLICIES]
    seq = [p for p in MASK_POLICY_THRESHOLDS if p not in token]
    figs = [
        ("mismatch KL (mean k3)", [curve("mismatch_kl")], lines("mismatch_kl"), True),
        ("IS-ratio std", [curve("is_ratio_std")], lines("is_ratio_std"), False),
        (
            "token mask ratios (share of masked tokens rejected)",
            [curve(f"mask_ratio_{p}", p) for p in token],
            _mask_lines(token),
            False,
        ),
        (
            "sequence mask ratios",
            [curve(f"mask_ratio_{p}", p) for p in seq],
            _mask_lines(seq),
            False,
        ),
        ("entropy mean (nats)", [curve("entropy_mean")], lines("entropy_mean"), False),
        ("version lag max", [curve("version_lag_max")], lines("version_lag_max"), False),
    ]
    return "".join(
        _img(plots.series_png(title, cs, th, log=log), title) for title, cs, th, log in figs
    )


def _scalars(data: ReportData) -> str:
    """The trainer's own scalars, by kind; says plainly they are the trainer's numbers."""
    if not data.scalars:
        return (
            '<p class="note">no trainer scalars in this range '
            "(Tap.log, POST /v1/runs/{run}/scalars)</p>"
        )
    sources = sorted({s for s in data.scalar_sources.values() if s}) or ["canonical names"]
    out = [
        f'<p class="note">These series came from the trainer\'s own logged scalars (source: '
        f"{_e(', '.join(sources))}), mapped onto timwatch's names; timwatch did not compute them "
        "from per-token data. A name of kind metric has the formula of the per-token series of "
        "the same name (docs/reference/metrics.md).</p>"
    ]
    for kind, title in (
        ("metric", "mismatch, from trainer scalars"),
        ("correction", "the trainer's own correction numbers"),
    ):
        names = [n for n in data.scalars if CANONICAL[n].kind == kind]
        if names:
            cs = [(n, *data.scalars[n]) for n in names]
            out.append(_img(plots.series_png(title, cs, []), title))
    for name in HEALTH:
        if name in data.scalars:
            title = f"{name} (trainer health)"
            out.append(_img(plots.series_png(title, [(name, *data.scalars[name])], []), title))
    return "".join(out)


def _details(data: ReportData) -> str:
    if not data.detail_steps:
        return '<p class="note">no step details in this range</p>'
    a, z, n = data.detail_steps[0], data.detail_steps[-1], len(data.detail_steps)
    out = [f'<p class="meta">merged over {n} step(s), {a}–{z} (at most the last '
           f"{DETAIL_STEPS} steps of the range)</p>"]  # fmt: skip
    if data.heatmap is not None:
        out.append("<h3>Entropy × |δ| heatmap</h3>")
        out.append(_img(plots.heatmap_png(data.heatmap), "entropy by |delta| token counts"))
    out.append("<h3>Length and lag buckets</h3>")
    if data.length_buckets or data.lag_buckets:
        out.append(_img(plots.buckets_png(data.length_buckets, data.lag_buckets), "buckets"))
    rows = [
        [_td(f"2^{k}"), *(_td(b[c], numeric=True) for c in
          ("sequences", "tokens", "seq_log_ratio_abs_mean", "mismatch_kl"))]
        for k, b in data.length_buckets.items()
    ]  # fmt: skip
    out.append(_table(["length bucket", "sequences", "tokens", "mean |L_s|", "mean k3"], rows))
    if data.lag_buckets is None:
        out.append('<p class="note">no version lags (batches without versions)</p>')
    else:
        rows = [
            [_td(k), _td(b["tokens"], numeric=True), _td(b["mismatch_kl"], numeric=True)]
            for k, b in data.lag_buckets.items()
        ]
        out.append(_table(["version lag", "tokens", "mean k3"], rows))
    return "".join(out)


def _worst(data: ReportData, token_text: TokenText) -> str:
    if not data.worst_tokens:
        return '<p class="note">no tokens in this range</p>'
    note = (
        "Token ids are shown without text: timwatch stores ids only and the service was started "
        "without --tokenizer."
        if token_text is None
        else "Text: each token decoded on its own with the service's --tokenizer file, quoted "
        "as Python writes strings (escapes show whitespace and bytes of unfinished characters)."
    )
    rows = []
    for t in data.worst_tokens:
        tid = t.get("token_id")
        text = token_text(int(tid)) if token_text is not None and tid is not None else None
        rows.append([
            _td(t.get("step"), True), _td(t.get("batch_id") or "–"), _td(t.get("seq"), True),
            _td(t.get("pos"), True), _td(tid, True),
            f"<td><code>{_e(repr(text))}</code></td>" if text is not None else "<td>–</td>",
            *(_td(t.get(k), True) for k in ("logp_rollout", "logp_train", "entropy", "score")),
        ])  # fmt: skip
    head = ["step", "batch", "seq", "pos", "token id", "text", "μ (rollout)", "π (train)", "H",
            "S = δ²/(H+ε)"]  # fmt: skip
    return f'<p class="note">{note}</p>' + _table(head, rows)


def comparison_section(against: str, md: str) -> str:
    """The comparison with run ``against``: its Markdown (`compare.formats`) as HTML."""
    from ..compare.formats import markdown_html

    return (
        f'<h2 id="compare">Compared with <code>{_e(against)}</code></h2>'
        f'<p class="note">B = this run, A = {_e(against)}; B/A with a 95 % bootstrap interval '
        f"over steps (docs/compare.md).</p>" + markdown_html(md)
    )


def render(
    data: ReportData, *, token_text: TokenText = None, now: float | None = None,
    comparison: tuple[str, str] | None = None,
) -> str:  # fmt: skip
    """The whole page for `data` (with ``comparison`` = (run A, Markdown): that section first)."""
    when = datetime.fromtimestamp(
        now if now is not None else datetime.now(timezone.utc).timestamp(), tz=timezone.utc
    ).strftime("%Y-%m-%d %H:%M:%S UTC")
    tags = ", ".join(f"{k}={v}" for k, v in (data.info.get("tags") or {}).items())
    span = f"steps {data.span[0]}–{data.span[1]}" if data.span else "no steps in this range"
    asked = ""
    if data.from_step is not None or data.to_step is not None:
        asked = f" (asked: from {_num(data.from_step)} to {_num(data.to_step)})"
    finished = data.info.get("finished_at")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<link rel="icon" href="data:,">',
        f"<title>timwatch report: {_e(data.run)}</title><style>{_CSS}</style></head><body>",
        f"<h1>timwatch incident report: <code>{_e(data.run)}</code></h1>",
        f'<p class="meta">{data.total_steps} steps, {_e(span)}{asked} · generated {when}'
        f"{' · finished' if finished else ''}{' · tags: ' + _e(tags) if tags else ''}</p>",
        comparison_section(*comparison) if comparison else "",
        '<h2 id="diagnosis">Diagnosis</h2>',
        diagnosis_section(data.diagnosis, data.diagnosis_note),
        '<h2 id="series">Series</h2>',
        (
            '<p class="note">This run has no per-token batches in this range: its metrics came '
            "from the trainer's scalars only (see Trainer scalars below).</p>"
            if data.total_steps == 0 and data.scalars
            else ""
        ),
        f'<p class="note">Red lines: the alert thresholds of alerts/timwatch.rules.yml (the '
        f"alerts compare 10 to 30 min means, the plots show per-step values). Long ranges are "
        f"drawn as the min and max of {MAX_POINTS // 2} step buckets.</p>",
        _plots(data),
        '<h2 id="scalars">Trainer scalars</h2>',
        _scalars(data),
        '<h2 id="details">Step details</h2>',
        _details(data),
        '<h2 id="worst">Worst tokens</h2>',
        _worst(data, token_text),
        "</body></html>",
    ]
    return "\n".join(parts)
