"""The commit-msg hook: `scripts/check_commit_msg.py` refuses a subject over 72 characters or
run on into its body, and `.pre-commit-config.yaml` runs it at the commit-msg stage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_commit_msg.py"

hook = load_script(SCRIPT, "check_commit_msg")
MAX_SUBJECT, problems = hook.MAX_SUBJECT, hook.problems


def test_a_subject_of_72_characters_passes_and_73_fails() -> None:
    assert MAX_SUBJECT == 72
    assert problems("x" * 72 + "\n") == []
    assert problems("x" * 72 + "\n\nbody lines may be long " + "y" * 100 + "\n") == []
    (why,) = problems("x" * 73 + "\n")
    assert why.startswith("subject is 73 characters, at most 72")


def test_comments_and_leading_blank_lines_are_not_the_subject() -> None:
    message = "# Please enter the commit message\n\nFix the thing\n\n# " + "c" * 100 + "\n"
    assert problems(message) == []
    assert problems("# only a comment\n\n") == ["empty commit message"]
    assert problems("") == ["empty commit message"]


def test_the_body_is_separated_by_a_blank_line() -> None:
    assert problems("Fix the thing\ncontinued on the next line\n") == [
        "the subject is one line: leave a blank line before the body"
    ]
    assert problems("Fix the thing\n# a comment git strips\n") == []


@pytest.mark.parametrize("prefix", ["Merge ", 'Revert "', "fixup! ", "squash! ", "amend! "])
def test_subjects_git_writes_are_not_checked(prefix: str) -> None:
    assert problems(prefix + "z" * 100 + "\n") == []


def test_the_script_exits_1_naming_the_problem(tmp_path: Path) -> None:
    msg = tmp_path / "COMMIT_EDITMSG"
    msg.write_text("s" * 80 + "\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(SCRIPT), str(msg)], capture_output=True, text=True)
    assert done.returncode == 1
    assert "subject is 80 characters" in done.stderr
    msg.write_text("Short subject\n\nBody.\n", encoding="utf-8")
    done = subprocess.run([sys.executable, str(SCRIPT), str(msg)], capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "")


def test_pre_commit_runs_it_on_commit_messages() -> None:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    assert "commit-msg" in config["default_install_hook_types"]
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    subject = hooks["commit-subject"]
    assert subject["stages"] == ["commit-msg"]
    assert subject["entry"].split()[-1] == "scripts/check_commit_msg.py"
    assert all(h["stages"] == ["pre-commit"] for i, h in hooks.items() if i != "commit-subject")
