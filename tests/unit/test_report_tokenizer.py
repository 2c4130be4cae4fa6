"""Token text from a Hugging Face tokenizer.json (monitor/report/tokenizer.py): byte-level BPE,
SentencePiece (Metaspace, byte fallback) and WordPiece vocabularies written here by hand, added
tokens, unknown ids, and the errors a bad file gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from timwatch.monitor.core.errors import ConfigError
from timwatch.monitor.report.tokenizer import load_tokenizer


def _write(tmp_path: Path, doc: Any) -> Path:
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(doc), encoding="utf-8")
    return p


def test_byte_level_pieces_decode_to_their_bytes(tmp_path: Path) -> None:
    # GPT-2's map: "Ġ" is the space byte, "Ċ" the newline, "Ã" "©" the bytes c3 a9 of "é"
    vocab = {"Ġhello": 0, "<script>": 1, "Ã©": 2, "Ã": 3, "Ċ": 4, "hi": 5}
    doc = {
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}]},
        "decoder": {"type": "ByteLevel"},
        "added_tokens": [{"id": 6, "content": "<|endoftext|>", "special": True}],
    }
    tok = load_tokenizer(_write(tmp_path, doc))
    assert tok.byte_level and not tok.metaspace and len(tok) == 7
    assert [tok(i) for i in range(7)] == [
        " hello", "<script>", "é", "\\xc3", "\n", "hi", "<|endoftext|>"
    ]  # fmt: skip
    assert tok(7) is None and tok(-1) is None


def test_sentencepiece_pieces_show_spaces_and_bytes(tmp_path: Path) -> None:
    doc = {
        "model": {
            "type": "Unigram",
            "vocab": [["<unk>", 0.0], ["▁the", -1.5], ["<0x0A>", -9.0], ["ing", -2.0]],
        },  # fmt: skip
        "decoder": {"type": "Sequence", "decoders": [{"type": "Metaspace", "replacement": "▁"}]},
    }
    tok = load_tokenizer(_write(tmp_path, doc))
    assert tok.metaspace and not tok.byte_level
    assert [tok(i) for i in range(4)] == ["<unk>", " the", "\n", "ing"]
    # a BPE vocabulary with byte fallback (Llama 2 style) reads the same way
    llama = {"model": {"type": "BPE", "vocab": {"▁a": 0, "<0xE4>": 1}, "byte_fallback": True}}
    tok = load_tokenizer(_write(tmp_path, llama))
    assert tok(0) == " a" and tok(1) == "\\xe4"


def test_wordpiece_pieces_are_shown_as_they_are(tmp_path: Path) -> None:
    doc = {"model": {"type": "WordPiece", "vocab": {"[CLS]": 0, "play": 1, "##ing": 2}},
           "decoder": {"type": "WordPiece"}}  # fmt: skip
    tok = load_tokenizer(_write(tmp_path, doc))
    assert [tok(i) for i in range(3)] == ["[CLS]", "play", "##ing"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read --tokenizer"),
        ("{not json", "is not a JSON file"),
        ('{"model": {"type": "BPE"}}', "has no vocabulary"),
        ("[1, 2]", "has no vocabulary"),
    ],
)
def test_a_bad_file_is_a_config_error_naming_it(
    tmp_path: Path, content: str | None, message: str
) -> None:
    p = tmp_path / "tok.json"
    if content is not None:
        p.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=message) as err:
        load_tokenizer(p)
    assert "tok.json" in str(err.value)


def test_the_app_refuses_a_bad_tokenizer_before_opening_the_store(tmp_path: Path) -> None:
    from timwatch.monitor.service.app import create_app
    from timwatch.monitor.service.settings import Settings

    db = tmp_path / "never.db"
    with pytest.raises(ConfigError, match="cannot read --tokenizer"):
        create_app(Settings(db_url=f"sqlite:///{db}", tokenizer=str(tmp_path / "missing.json")))
    assert not db.exists()
