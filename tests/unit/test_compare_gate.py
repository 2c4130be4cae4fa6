"""The gate (monitor/compare/gate.py), its baseline file, its JUnit XML (validated against the
Jenkins/Ant JUnit schema with xmlschema) and Markdown, and the comparison's verdict, on
synthetic step series with hand-computed figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timwatch.monitor.compare import (
    Baseline,
    MetricBaseline,
    compare_series,
    comparison_markdown,
    gate,
    junit_xml,
    markdown,
    markdown_html,
)
from timwatch.monitor.compare.gate import Z, make_baseline
from timwatch.monitor.core.errors import InputError
from timwatch.monitor.diagnosis import StepSeries

#: junit-10.xsd of jenkinsci/xunit-plugin at commit 8c515de2 (MIT, its notice inside the file):
#: the Jenkins/Ant JUnit schema CI systems read
XSD = Path(__file__).resolve().parents[1] / "fixtures" / "junit-10.xsd"


def series(run: str, kl: list[float], **cols: list[float]) -> StepSeries:
    return StepSeries.build(run, list(range(len(kl))), {"mismatch_kl": kl, **cols})


def test_limit_and_verdict_hand_computed() -> None:
    # baseline: mean 2, sd 1 over 4 steps (values 1, 2, 2, 3: sample variance 2/3 → sd 0.8165)
    base = make_baseline(series("a", [1.0, 2.0, 2.0, 3.0]), model="m", engine="e")
    b = base.metrics["mismatch_kl"]
    assert (b.mean, b.n) == (2.0, 4)
    assert b.sd == pytest.approx(math.sqrt(2 / 3), rel=1e-15)
    # bound max(2·1.5, 2+0) = 3, set by the ratio: the candidate's sd at the bound is
    # 1.5·√(2/3) = √1.5, whatever its own (0 here): noise = 3·√(2/3/4 + 1.5/4) = 3·√(13/24)
    # = 2.2079
    res = gate(series("b", [3.0] * 4), base)
    c = res.checks[0]
    assert (c.sd, c.null_sd) == (0.0, pytest.approx(math.sqrt(1.5), rel=1e-15))
    assert c.noise == pytest.approx(Z * math.sqrt(13 / 24), rel=1e-15)
    assert c.limit == pytest.approx(3.0 + 2.2079402165819615, rel=1e-12)
    assert res.passed and res.exit_code == 0
    # 5.21 is above 5.2079: fails
    res = gate(series("c", [5.21] * 4), base)
    assert not res.passed and res.exit_code == 1
    # an absolute allowance wider than the ratio decides: max(2·1.5, 2+3) = 5, and the
    # candidate's sd is the baseline's unscaled: noise 3·√(2/3/4 + 2/3/4) = 3·√(1/3) = 1.7321
    wide = make_baseline(series("a", [1.0, 2.0, 2.0, 3.0]), model="m", engine="e", max_abs=3.0)
    c = gate(series("c", [6.7] * 4), wide).checks[0]
    assert c.null_sd == pytest.approx(math.sqrt(2 / 3), rel=1e-15)
    assert c.limit == pytest.approx(5.0 + 1.7320508075688772, rel=1e-12) and c.passed
    assert not gate(series("c", [6.74] * 4), wide).passed


def test_a_noisy_candidate_cannot_excuse_a_mean_far_above_the_bound() -> None:
    # the vLLM tier's case: an fp32 baseline at ~1e-12 per step, a bf16 candidate at ~1e-3
    # whose steps vary by twice their mean (sd/mean 2.2 over 6 steps). With the candidate's
    # own sd the noise would be 3·sd₁/√6 = 2.7·mean₁ and the run would pass.
    base = make_baseline(series("a", [2.4e-12, 2.5e-12, 2.6e-12, 2.5e-12]), model="m", engine="e")
    bf16 = [1e-4, 2e-4, 1.5e-4, 3e-4, 9e-3, 2e-4]
    c = gate(series("b", bf16), base).checks[0]
    assert Z * c.sd / math.sqrt(6) > c.mean  # the old noise term alone would have passed it
    assert c.noise < 1e-12 and not c.passed
    # where the baseline shows no variance (a mask ratio that stayed 0 in every step) there is
    # no scale to take from it, and a candidate with one masked token in 20 steps is noise:
    # its own sd is used (mean 0.0006, sd 0.0027: noise 3·0.0027/√20 = 0.0018)
    zero = make_baseline(series("a", [0.0] * 20), model="m", engine="e")
    one = [0.0] * 19 + [0.012]
    c = gate(series("b", one), zero).checks[0]
    assert c.null_sd == c.sd == pytest.approx(0.012 / math.sqrt(20), rel=1e-12)
    assert c.passed and not gate(series("b", [0.012] * 20), zero).passed


def test_baseline_of_several_runs_hand_computed() -> None:
    # run a: 1, 3 (mean 2); run b: 4, 6, 8 (mean 6). Mean of the run means 4; their sd
    # √((2-4)² + (6-4)²) / 1 = 2.8284; within-run sd √((1+1 + 4+0+4) / (5-2)) = √(10/3)
    base = make_baseline(
        [series("a", [1.0, 3.0]), series("b", [4.0, 6.0, 8.0])], model="m", engine="e"
    )
    b = base.metrics["mismatch_kl"]
    assert (b.mean, b.n, b.runs) == (4.0, 5, 2)
    assert b.run_sd == pytest.approx(math.sqrt(8.0), rel=1e-15)
    assert b.sd == pytest.approx(math.sqrt(10 / 3), rel=1e-15)
    assert base.run == "a, b" and base.steps == (0, 2)
    # candidate 6, 6: its sd at the bound 1.5·√(10/3), so
    # noise = 3·√(10/3/5 + 2.25·10/3/2 + 8·(1 + 1/2)) = 3·√(16.4167) = 12.155
    c = gate(series("c", [6.0, 6.0]), base).checks[0]
    assert c.noise == pytest.approx(Z * math.sqrt(10 / 3 / 5 + 7.5 / 2 + 8.0 * 1.5), rel=1e-15)
    assert c.limit == pytest.approx(6.0 + 12.155245781143218, rel=1e-12)
    # one run: the spread term is 0, the limit is the one-run formula
    one = make_baseline([series("a", [1.0, 3.0])], model="m", engine="e")
    assert (
        one.metrics["mismatch_kl"]
        == make_baseline(series("a", [1.0, 3.0]), model="m", engine="e").metrics["mismatch_kl"]
    )
    assert (one.metrics["mismatch_kl"].runs, one.metrics["mismatch_kl"].run_sd) == (1, 0.0)
    with pytest.raises(InputError, match="run 'b' has no value of 'mismatch_kl'"):
        make_baseline(
            [series("a", [1.0]), StepSeries.build("b", [0], {"mismatch_kl": [None]})],
            model="m", engine="e",
        )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(0.0, 1e3, allow_nan=False), min_size=1, max_size=12),
        min_size=1,
        max_size=6,
    )
)
def test_baseline_of_runs_equals_a_float64_reference(runs: list[list[float]]) -> None:
    b = MetricBaseline.of_runs(runs)
    means = [math.fsum(r) / len(r) for r in runs]
    n = sum(len(r) for r in runs)
    within = math.fsum((x - m) ** 2 for r, m in zip(runs, means, strict=True) for x in r)
    assert (b.n, b.runs) == (n, len(runs))
    assert b.mean == pytest.approx(math.fsum(means) / len(means), rel=1e-12, abs=1e-12)
    want_sd = math.sqrt(within / (n - len(runs))) if n > len(runs) else 0.0
    assert b.sd == pytest.approx(want_sd, rel=1e-9, abs=1e-9)
    mu = math.fsum(means) / len(means)
    want_run_sd = (
        math.sqrt(math.fsum((m - mu) ** 2 for m in means) / (len(means) - 1))
        if len(means) > 1
        else 0.0
    )
    assert b.run_sd == pytest.approx(want_run_sd, rel=1e-9, abs=1e-9)


def test_errors_name_the_problem(tmp_path: Path) -> None:
    base = make_baseline(series("a", [1.0, 2.0]), model="m", engine="e")
    with pytest.raises(InputError, match="engine 'e', the run is engine 'vllm'"):
        gate(series("b", [1.0]), base, model="m", engine="vllm")
    with pytest.raises(InputError, match="no steps"):
        gate(series("b", []), base)
    with pytest.raises(InputError, match="has no value of 'mismatch_kl'"):
        gate(StepSeries.build("b", [0], {"mismatch_kl": [None]}), base)
    with pytest.raises(InputError, match="unknown metric 'kl'"):
        make_baseline(series("a", [1.0]), model="m", engine="e", metrics=["kl"])


def test_baseline_file_round_trip_and_refusals(tmp_path: Path) -> None:
    base = make_baseline(series("a", [1.0, 2.0, 4.0]), model="m", engine="e", max_abs=0.5)
    path = tmp_path / "b.json"
    base.dump(path)
    assert Baseline.load(path) == base
    good = json.loads(path.read_text())
    cases = {
        "format": {**good, "format": "other/1"},
        "model": {**good, "model": ""},
        "steps": {**good, "steps": [0]},
        "metrics.mismatch_kl.sd": {
            **good, "metrics": {"mismatch_kl": {**good["metrics"]["mismatch_kl"], "sd": "x"}}
        },
        "metrics.mismatch_kl.n": {
            **good, "metrics": {"mismatch_kl": {**good["metrics"]["mismatch_kl"], "n": 0}}
        },
        "metrics.mismatch_kl.runs": {
            **good, "metrics": {"mismatch_kl": {**good["metrics"]["mismatch_kl"], "runs": 4}}
        },
        "metrics.mismatch_kl.run_sd": {
            **good, "metrics": {"mismatch_kl": {**good["metrics"]["mismatch_kl"], "run_sd": -1}}
        },
    }  # fmt: skip
    for field, obj in cases.items():
        path.write_text(json.dumps(obj))
        with pytest.raises(InputError, match=field.replace(".", r"\.")):
            Baseline.load(path)
    # a file written before runs and run_sd existed: one run, no spread
    metric = {
        k: v for k, v in good["metrics"]["mismatch_kl"].items() if k not in ("runs", "run_sd")
    }
    path.write_text(json.dumps({**good, "metrics": {"mismatch_kl": metric}}))
    assert Baseline.load(path) == base
    path.write_text('{"format": "timwatch-base')  # truncated

    with pytest.raises(InputError, match="not JSON"):
        Baseline.load(path)
    with pytest.raises(InputError, match="No such file"):
        Baseline.load(tmp_path / "missing.json")


def _results() -> tuple[object, object]:
    base = make_baseline(
        series("fp32", [1e-9, 2e-9, 1.5e-9], seq_log_ratio_abs_mean=[1e-4, 2e-4, 1e-4]),
        model="tiny <llama>", engine="vllm & co",
    )  # fmt: skip
    ok = gate(series("fp32-b", [1e-9] * 3, seq_log_ratio_abs_mean=[1e-4] * 3), base)
    bad = gate(series("bf16", [1e-3] * 3, seq_log_ratio_abs_mean=[1e-4] * 3), base)
    return ok, bad


def test_junit_xml_validates_against_the_junit_schema() -> None:
    import xml.etree.ElementTree as ET

    import xmlschema

    schema = xmlschema.XMLSchema(str(XSD))
    ok, bad = _results()
    for res, failures in ((ok, 0), (bad, 1)):
        doc = junit_xml(res)  # type: ignore[arg-type]
        schema.validate(doc)  # raises on any violation
        suite = ET.fromstring(doc).find("testsuite")
        assert suite is not None
        assert suite.get("tests") == "2" and suite.get("failures") == str(failures)
        cases = suite.findall("testcase")
        assert [c.get("name") for c in cases] == ["mismatch_kl", "seq_log_ratio_abs_mean"]
        assert [c.find("failure") is not None for c in cases] == [failures == 1, False]
    # the schema does reject what it should: a testcase without its name
    broken = junit_xml(bad).replace('name="mismatch_kl"', "")  # type: ignore[arg-type]
    assert not schema.is_valid(broken)


def test_markdown_and_its_html() -> None:
    ok, bad = _results()
    md = markdown(bad)  # type: ignore[arg-type]
    assert md.startswith("**timwatch gate: FAIL**")
    assert "| mismatch_kl | 0.001 | 1.5e-09 | 666667× |" in md
    assert markdown(ok).startswith("**timwatch gate: PASS**")  # type: ignore[arg-type]
    html = markdown_html(md)
    assert "<strong>timwatch gate: FAIL</strong>" in html
    assert "<th>metric</th>" in html and '<td style="text-align:right">0.001</td>' in html
    assert "tiny &lt;llama&gt; on vllm &amp; co" in html  # escaped
    assert html.count("<tr>") == 3  # header + two metrics


def test_comparison_verdict_and_where() -> None:
    lb = {"length_buckets": {"2": {"tokens": 100, "mismatch_kl": 1e-4},
                             "9": {"tokens": 100, "mismatch_kl": 1e-4}}}  # fmt: skip
    lb_b = {"length_buckets": {"2": {"tokens": 100, "mismatch_kl": 2e-4},
                               "9": {"tokens": 100, "mismatch_kl": 5e-3}}}  # fmt: skip
    a = StepSeries.build("A", range(10), {"mismatch_kl": [1e-4] * 10}, {0: lb})
    b = StepSeries.build(
        "B", range(10), {"mismatch_kl": list(np.linspace(1.2e-3, 1.6e-3, 10))}, {0: lb_b}
    )
    cmp = compare_series(a, b)
    m = cmp.metric("mismatch_kl")
    assert m.interval is not None and m.interval.point == pytest.approx(14.0, rel=1e-12)
    assert 12 < m.interval.lo < 14 < m.interval.hi < 16
    assert cmp.metric("discrepancy_kl").interval is None  # neither run has it
    assert cmp.verdict.startswith("B's mismatch_kl is 14× A's (")
    # the 512–1023 bucket is 50×, over 1.5 × the overall 14×: named as where the excess sits
    assert "concentrated at lengths 512–1023 (50×)" in cmp.verdict
    assert [w.label for w in cmp.where] == ["lengths 4–7", "lengths 512–1023"]
    same = compare_series(a, a)
    assert same.verdict.endswith("no clear difference")
    md = comparison_markdown(cmp)
    assert "| mismatch_kl | 0.0001 | 0.0014 | 14× |" in md
