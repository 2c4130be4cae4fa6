"""A commit message's subject: at most 72 characters, followed by a blank line when a body
follows. Run by pre-commit's ``commit-msg`` stage (``.pre-commit-config.yaml``) with the path of
the message file; exits 1 with the reason on stderr, 0 otherwise.

The subject is the first line that is neither blank nor a ``#`` comment (git strips those when
it writes the commit). Subjects git writes itself (``Merge …``, ``Revert "…"``) and autosquash
markers (``fixup! …``, ``squash! …``, ``amend! …``) are not checked: their length is the
original subject's plus a prefix.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_SUBJECT = 72
_EXEMPT = ("Merge ", 'Revert "', "fixup! ", "squash! ", "amend! ")

__all__ = ["MAX_SUBJECT", "problems"]


def problems(message: str) -> list[str]:
    """Why ``message`` is refused; empty when it is accepted."""
    lines = [line.rstrip("\r") for line in message.splitlines()]
    text = [(i, line) for i, line in enumerate(lines) if not line.startswith("#")]
    nonblank = [(i, line) for i, line in text if line.strip()]
    if not nonblank:
        return ["empty commit message"]
    at, subject = nonblank[0]
    if subject.startswith(_EXEMPT):
        return []
    out = []
    if len(subject) > MAX_SUBJECT:
        out.append(
            f"subject is {len(subject)} characters, at most {MAX_SUBJECT}: put figures and "
            "reasons in the body"
        )
    following = [line for i, line in text if i > at]
    if following and following[0].strip() and len(nonblank) > 1:
        out.append("the subject is one line: leave a blank line before the body")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: check_commit_msg.py COMMIT_MSG_FILE", file=sys.stderr)
        return 2
    found = problems(Path(args[0]).read_text(encoding="utf-8"))
    for problem in found:
        print(f"commit message: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
