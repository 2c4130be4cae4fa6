"""docs/performance.md is rendered from the benchmarks' JSON (docs/generate_performance.py): the
committed page is current, a missing result reads "not measured yet" and never a number, a
result no section renders or a section for no benchmark stops the generator, and every
benchmark that can write JSON has its section."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "docs" / "generate_performance.py"


gen = load_script(GENERATOR, "generate_performance")


def test_committed_page_is_current() -> None:
    """The command CI and contributors run, exactly: it exits 0 on the committed tree."""
    done = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_check_names_the_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "performance.md"
    stale.write_text(gen.render() + "a figure typed by hand: 1.0 ms\n")
    monkeypatch.setattr(gen, "OUT", stale)
    assert gen.main(["--check"]) == 1
    stale.write_text(gen.render())
    assert gen.main(["--check"]) == 0


def test_a_missing_result_is_not_measured_and_has_no_number(tmp_path: Path) -> None:
    text = gen.render("# t\n\n@@bench:relay_floor@@\n", results=tmp_path)
    section = text.split("# t", 1)[1]
    assert "Not measured yet" in section
    assert not re.search(r"\d", section.replace("results/", "").replace("benchmarks/", "")), section


def test_a_result_renders_its_command_machine_and_figures(tmp_path: Path) -> None:
    record = {
        "benchmark": "relay_floor",
        "command": "python benchmarks/relay_floor.py --seconds 1.5",
        "date": "2026-12-05 17:00 UTC",
        "machine": {"cpu": "Some CPU", "cores": 2, "load_average": 0.5, "commit": "abc"},
        "figures": {"cumulative stream, splice, ms CPU": 81.234},
        "ratios": {"cumulative / plain answer, splice": 1987.6},
        "rows": [{"answer": "plain", "MB": 0.165319}],
        "note": "",
    }
    (tmp_path / "relay_floor.json").write_text(json.dumps(record))
    text = gen.render("@@bench:relay_floor@@\n", results=tmp_path)
    assert "`python benchmarks/relay_floor.py --seconds 1.5`: 2026-12-05 17:00 UTC" in text
    assert "Some CPU (2 cores, load average 0.500), commit `abc`" in text
    assert "- cumulative stream, splice, ms CPU: **81.2**" in text
    assert "- cumulative / plain answer, splice: **1,990×**" in text
    assert "| plain | 0.165 |" in text


def test_orphan_results_and_unknown_benchmarks_stop_the_generator(tmp_path: Path) -> None:
    (tmp_path / "relay_floor.json").write_text("{}")
    with pytest.raises(ValueError, match=r"results no marker renders: \['relay_floor.json'\]"):
        gen.render("# nothing\n", results=tmp_path)
    with pytest.raises(ValueError, match="do not exist"):
        gen.render("@@bench:no_such_benchmark@@\n", results=tmp_path / "none")
    with pytest.raises(ValueError, match="has no 'benchmark'"):
        gen.render("@@bench:relay_floor@@\n", results=tmp_path)


def test_every_benchmark_that_writes_json_has_a_section() -> None:
    template = gen.TEMPLATE.read_text()
    writers = sorted(
        p.stem
        for p in (ROOT / "benchmarks").glob("*.py")
        if "bench_json.write(" in p.read_text() and p.stem != "bench_json"
    )
    assert writers, "no benchmark writes JSON"
    missing = [name for name in writers if f"@@bench:{name}@@" not in template]
    assert missing == []


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.0012345, "0.00123"), (1.0, "1.00"), (12.345, "12.3"), (1234.5, "1,230"),
     (4_120_000.0, "4,120,000"), (7, "7"), (12_345, "12,345"), ("C", "C")],
)  # fmt: skip
def test_figures_print_to_three_significant_digits(value: object, text: str) -> None:
    assert gen.fmt(value) == text
