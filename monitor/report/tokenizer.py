"""Token text for the report's worst tokens, read from a Hugging Face ``tokenizer.json``.

timwatch stores token ids only. A service started with ``--tokenizer FILE`` (or
``TIMWATCH_TOKENIZER``) shows each worst token's text beside its id, in the served page and so in
the file that ``timwatch report RUN --html FILE`` writes (the CLI fetches the served page).

Only the vocabulary is read, with the standard library: ``model.vocab`` (BPE, WordPiece,
WordLevel: piece → id; Unigram: a list of ``[piece, score]`` whose index is the id) and
``added_tokens``. Each piece is shown as the text it decodes to on its own:

* byte-level pieces (a ``ByteLevel`` decoder or pre-tokenizer, GPT-2 style: ``Ġ`` is a space)
  become their bytes decoded as UTF-8, a byte of an unfinished character written ``\\xNN``;
* SentencePiece pieces (a ``Metaspace`` decoder or pre-tokenizer, or ``byte_fallback``): ``▁``
  is a space and a byte piece ``<0xNN>`` that byte;
* anything else (WordPiece, added tokens) is the piece itself.

The text is untrusted (a tokenizer file can hold any string): the page escapes it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError

__all__ = ["TokenVocabulary", "load_tokenizer"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte ↔ printable-character map, reversed: printable bytes stand for themselves,
    the other 68 bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            out[chr(0x100 + extra)] = b
            extra += 1
    return out


def _types(node: Any) -> set[str]:
    """Every ``type`` in a decoder / pre-tokenizer node, through ``Sequence`` nodes."""
    if not isinstance(node, dict):
        return set()
    found = {str(node.get("type"))}
    for key in ("decoders", "pretokenizers"):
        for child in node.get(key) or ():
            found |= _types(child)
    return found


class TokenVocabulary:
    """id → text of one tokenizer; calling it with an id outside the vocabulary gives None."""

    def __init__(self, pieces: dict[int, str], *, byte_level: bool, metaspace: bool) -> None:
        self.byte_level, self.metaspace = byte_level, metaspace
        self._pieces = pieces
        self._bytes = _byte_decoder() if byte_level else {}

    def __len__(self) -> int:
        return len(self._pieces)

    def __call__(self, token_id: int) -> str | None:
        piece = self._pieces.get(token_id)
        if piece is None:
            return None
        if self.byte_level and all(c in self._bytes for c in piece):
            return bytes(self._bytes[c] for c in piece).decode("utf-8", "backslashreplace")
        if self.metaspace:
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)]).decode("utf-8", "backslashreplace")
            return piece.replace("▁", " ")
        return piece


def load_tokenizer(path: str | Path) -> TokenVocabulary:
    """The vocabulary of the ``tokenizer.json`` at ``path``; `ConfigError` naming the file when
    it cannot be read or holds no vocabulary."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read --tokenizer {str(path)!r}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--tokenizer {str(path)!r} is not a JSON file: {exc}") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pieces: dict[int, str] = {}
    if isinstance(vocab, dict):
        pieces = {int(i): str(p) for p, i in vocab.items() if isinstance(i, int)}
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the index is the id
        pieces = {i: str(e[0]) for i, e in enumerate(vocab) if isinstance(e, list) and e}
    for added in doc.get("added_tokens") or () if isinstance(doc, dict) else ():
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            pieces[added["id"]] = str(added.get("content", ""))
    if not pieces:
        raise ConfigError(
            f"--tokenizer {str(path)!r} has no vocabulary (model.vocab): not a Hugging Face "
            "tokenizer.json"
        )
    kinds = _types(doc.get("decoder")) | _types(doc.get("pre_tokenizer"))
    return TokenVocabulary(
        pieces,
        byte_level="ByteLevel" in kinds,
        metaspace="Metaspace" in kinds or bool(model.get("byte_fallback")),  # type: ignore[union-attr]
    )
