"""Run tags (``?tag=key=value`` on ingest): bounded in count and size, so a client cannot grow a
run's row without limit.

Invariants: a key is 1–`MAX_TAG_KEY` characters of ``[A-Za-z0-9_.:-]``; a value is at most
`MAX_TAG_VALUE` characters and has no control characters; a run holds at most `MAX_TAGS` tags
after merging (checked by the store in the batch's transaction, against the tags it already has).
Every refusal is an `InputError` on field ``tag`` whose message names the tag.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence

from .errors import InputError

__all__ = ["MAX_TAGS", "MAX_TAG_KEY", "MAX_TAG_VALUE", "check_tag_count", "parse_tags"]

MAX_TAGS = 64
MAX_TAG_KEY = 64
MAX_TAG_VALUE = 256
_KEY_RE = re.compile(r"[A-Za-z0-9_.:\-]+")


def _shown(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:80] + "…")


def _check(key: str, value: str) -> None:
    if not key or len(key) > MAX_TAG_KEY or not _KEY_RE.fullmatch(key):
        raise InputError(
            "tag",
            f"tag key {_shown(key)} must be 1-{MAX_TAG_KEY} characters of letters, digits "
            "and . _ : -",
        )
    if len(value) > MAX_TAG_VALUE:
        raise InputError(
            "tag",
            f"tag {key!r}: value is {len(value)} characters long; at most {MAX_TAG_VALUE} "
            "are allowed",
        )
    if any(unicodedata.category(ch) == "Cc" for ch in value):
        raise InputError("tag", f"tag {key!r}: value contains a control character")


def parse_tags(raw: Sequence[str]) -> dict[str, str]:
    """``["k=v", ...]`` → ``{k: v}`` (a later duplicate key wins), every tag checked."""
    tags: dict[str, str] = {}
    for item in raw:
        key, eq, value = item.partition("=")
        if not eq:
            raise InputError("tag", f"tag {_shown(item)} must be key=value")
        _check(key, value)
        tags[key] = value
    check_tag_count(tags)
    return tags


def check_tag_count(tags: Mapping[str, str], run: str | None = None) -> None:
    """Refuse a tag set over `MAX_TAGS`, naming the first tag past the limit."""
    if len(tags) > MAX_TAGS:
        extra = list(tags)[MAX_TAGS]
        where = f"run {run!r} would have" if run is not None else "the request has"
        raise InputError(
            "tag",
            f"tag {extra!r}: {where} {len(tags)} tags; at most {MAX_TAGS} are allowed per run",
        )
