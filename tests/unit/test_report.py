"""The incident report's parts without a server: thresholds against the rules file, the
diagnosis section from a hand-made diagnosis, downsampling, merging of step details, escaping."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from timwatch.monitor.report.data import MAX_POINTS, ReportData, downsample, merge_details
from timwatch.monitor.report.html import diagnosis_section, render
from timwatch.monitor.report.thresholds import MASK_POLICY_THRESHOLDS, SERIES_THRESHOLDS

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "timwatch.rules.yml"
_NUMBER = r"([0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?)"


def _alert_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"] if "alert" in r}


def _comparisons(expr: str) -> set[tuple[str, float]]:
    """Every ``< N`` / ``> N`` whose right side is a bare number (not ``N * series``)."""
    pattern = rf"([<>])\s*{_NUMBER}(?![\w.])(?!\s*[*/])"
    return {(op, float(n)) for op, n in re.findall(pattern, expr)}


def test_series_thresholds_are_those_of_the_rules_file() -> None:
    exprs = _alert_exprs()
    for series, thresholds in SERIES_THRESHOLDS.items():
        for t in thresholds:
            assert t.alert in exprs, f"{series}: no alert {t.alert}"
            got = {v for _, v in _comparisons(exprs[t.alert])}
            assert t.value in got, f"{series}: {t.alert} compares with {sorted(got)}, not {t.value}"


def test_mask_thresholds_are_those_of_the_rules_file() -> None:
    expr = _alert_exprs()["TimwatchMaskRatioHigh"]
    found: dict[str, float] = {}
    for matcher, value in re.findall(rf'\{{policy=~?"([^"]+)"\}}\s*>\s*{_NUMBER}', expr):
        for policy in matcher.split("|"):
            found[policy] = float(value)
    assert len(found) >= 5
    assert found == {p: v for p, v in MASK_POLICY_THRESHOLDS.items() if v is not None}


def test_the_threshold_check_bites() -> None:
    """The parsing above reads what it should: a changed number would be noticed."""
    assert _comparisons("x > 0.01 and y > 2 * z and w < 0.4 * v or u < 2e-2") == {
        (">", 0.01), ("<", 0.02),
    }  # fmt: skip
    assert 0.011 not in {v for _, v in _comparisons(_alert_exprs()["TimwatchMismatchKLHigh"])}


DIAGNOSIS: dict[str, Any] = {
    "run": "grpo-7b",
    "from_step": 100,
    "to_step": 400,
    "steps": 301,
    "causes": [
        {
            "cause": "engine_precision",
            "score": 0.31,
            "verdict": "possible",
            "action": "compare fp32 lm_head",
            "evidence": [],
        },
        {
            "cause": "stale_rollouts",
            "score": 0.87,
            "verdict": "likely",
            "action": "lower the <staleness> bound",
            "evidence": [
                {
                    "metric": "version_lag_max",
                    "steps": [120, 390],
                    "value": 6.0,
                    "trend": "rising",
                    "detail": "lag 6 > 4 <b>bold</b>",
                }
            ],
        },
    ],
    "not_checked": [{"cause": "token_id_drift", "reason": "no token_ids sent"}],
}


def test_diagnosis_section_renders_a_hand_made_diagnosis() -> None:
    page = diagnosis_section(DIAGNOSIS, None)
    # by descending score
    assert page.index("stale_rollouts") < page.index("engine_precision")
    assert "steps 100–400, 301 steps examined" in page
    assert "<code>version_lag_max</code> steps 120–390: 6" in page and "(rising)" in page
    assert 'class="v-likely">likely<' in page
    assert "token_id_drift</b>: no token_ids sent" in page
    # user strings are escaped
    assert "&lt;staleness&gt;" in page and "&lt;b&gt;bold&lt;/b&gt;" in page
    assert "<b>bold</b>" not in page


def test_diagnosis_numbers_are_shown_to_three_digits() -> None:
    """Evidence values and trends come from the store as full floats; the page shows `sig3`."""
    evidence = {
        "metric": "mismatch_kl",
        "steps": [3, 12345],
        "value": 0.17254273745832444,
        "trend": 1.0833333333333333,
        "detail": "",
    }
    cause = dict(DIAGNOSIS["causes"][0], score=0.87654, evidence=[evidence])
    page = diagnosis_section(dict(DIAGNOSIS, causes=[cause]), None)
    assert "<code>mismatch_kl</code> steps 3–12345: 0.173 (1.08)" in page
    assert '<td class="n">0.877</td>' in page
    assert "0.1725" not in page and "1.083" not in page
    missing = dict(evidence, value=None, trend=None)
    page = diagnosis_section(dict(DIAGNOSIS, causes=[dict(cause, evidence=[missing])]), None)
    assert "steps 3–12345: – (–)" in page


def test_no_diagnosis_says_so() -> None:
    assert "diagnosis not available" in diagnosis_section(None, None)
    empty = dict(DIAGNOSIS, causes=[], not_checked=[])
    assert "no cause found" in diagnosis_section(empty, None)


def test_a_failing_diagnosis_is_named_on_the_page_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from timwatch.monitor.report import data

    def broken(*_a: object, **_k: object) -> None:
        raise ValueError("no series")

    monkeypatch.setattr(data, "diagnose_run", broken)
    diag, note = data.diagnose(None, "r", None, None)  # type: ignore[arg-type]
    assert diag is None and note == "diagnosis failed: ValueError: no series"


def test_downsample_bounds_points_and_keeps_spikes() -> None:
    n = 10_000
    steps = np.arange(n, dtype=np.float64)
    ys = np.full(n, 1e-3)
    ys[7777] = 5.0  # a one-step spike
    ys[100:200] = np.nan
    xs, out = downsample(steps, ys, MAX_POINTS)
    assert len(xs) == len(out) <= MAX_POINTS
    assert np.nanmax(out) == 5.0 and 7777.0 in xs
    assert np.all(np.diff(xs) >= 0)
    short_x, short_y = downsample(steps[:50], ys[:50], MAX_POINTS)
    assert len(short_x) == 50 and np.array_equal(short_y, ys[:50])


def _detail(step: int, scale: int, kl: float) -> dict[str, Any]:
    grid = [[scale] * 6 for _ in range(7)]
    return {
        "step": step,
        "heatmap": {
            "entropy_edges": [0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0],
            "abs_log_ratio_edges": [0.0, 0.0001, 0.001, 0.01, 0.1, 1.0],
            "all": grid,
            "estr_rejected": [[0] * 6 for _ in range(7)],
        },
        "length_buckets": {
            "3": {
                "sequences": scale,
                "tokens": 10 * scale,
                "seq_log_ratio_abs_mean": kl,
                "mismatch_kl": kl,
            },
        },  # fmt: skip
        "lag_buckets": None,
        "worst_tokens": [
            {
                "seq": 0,
                "pos": i,
                "index": i,
                "token_id": step * 100 + i,
                "score": kl * i,
                "step": step,
                "batch_id": f"b{step}",
            }
            for i in range(10)
        ],  # fmt: skip
    }


def test_merged_details_add_counts_and_weight_means() -> None:
    merged = merge_details([_detail(1, 1, 0.1), _detail(2, 3, 0.5)])
    assert merged["heatmap"]["all"][0][0] == 4
    b = merged["length_buckets"]["3"]
    assert b["sequences"] == 4 and b["tokens"] == 40
    assert b["mismatch_kl"] == pytest.approx((10 * 0.1 + 30 * 0.5) / 40)
    assert merged["lag_buckets"] is None
    worst = merged["worst_tokens"]
    assert len(worst) == 16 and worst[0]["token_id"] == 209  # step 2 has the larger scores
    assert [t["score"] for t in worst] == sorted((t["score"] for t in worst), reverse=True)


def test_page_escapes_the_run_and_tags_and_has_no_external_resource() -> None:
    steps = np.arange(5, dtype=np.float64)
    from timwatch.monitor.report.data import PLOT_SERIES

    data = ReportData(
        run="r<1>",
        info={"run": "r<1>", "tags": {"model": '"><script>alert(1)</script>'}},
        from_step=None,
        to_step=None,
        total_steps=5,
        span=(0, 4),
        series={name: (steps, np.linspace(0.001, 0.02, 5)) for name in PLOT_SERIES},
        detail_steps=[3, 4],
        **merge_details([_detail(3, 1, 0.1), _detail(4, 2, 0.2)]),
        diagnosis=DIAGNOSIS,
    )
    page = render(data)
    assert "<script" not in page and "&lt;script&gt;" in page
    assert "r&lt;1&gt;" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert page.count('src="data:image/png;base64,') == 8  # 6 series, heatmap, buckets
    assert "Token ids are shown without text" in page
    with_text = render(data, token_text=lambda i: f"tok{i}")
    assert "&#x27;tok409&#x27;" in with_text and "--tokenizer file" in with_text
    # token text is untrusted: a hostile piece is shown, escaped, and injects nothing
    hostile = render(data, token_text=lambda i: '</code></td><script>alert(1)</script><td x="')
    assert "<script" not in hostile and "</code></td><script" not in hostile
    assert "&lt;/code&gt;&lt;/td&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in hostile
    # an id the tokenizer does not know shows no text
    unknown = render(data, token_text=lambda i: None)
    assert "&#x27;" not in unknown.split('id="worst"')[1]
