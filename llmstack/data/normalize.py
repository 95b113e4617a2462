"""Text normalization: mojibake repair and Unicode NFC (ftfy), character widths, then whitespace
and control characters.

Indentation is kept (code and poetry need it); what goes is invisible noise: control characters,
zero-width characters, exotic spaces, trailing spaces and runs of blank lines.

Widths (`fold_width`): full-width ASCII letters and digits (ＡＢＣ１２３, common in Chinese and
Japanese web text) become half-width, and half-width katakana (ｶﾀｶﾅ) become full-width, so the same
word is spelt one way for dedup and the statistics. Full-width punctuation (，。！？：) is how CJK
text is written and stays as it is.
"""

import re
import unicodedata
from collections import Counter
from functools import lru_cache
from types import ModuleType
from typing import Any

from llmstack.errors import require

from .document import Document

# Keep quotes and full-width forms as they are: they are content, not encoding damage.
_FULL_WIDTH_ALNUM = {
    c: c - 0xFEE0 for r in ((0xFF10, 0xFF19), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A)) for c in range(r[0], r[1] + 1)
}
_HALF_WIDTH_KANA = re.compile(r"[\uff61-\uff9f]+")

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200d\u2060\ufeff]")
_ASCII_NOT_CONTROL = bytes(c for c in range(128) if not _CONTROL.match(chr(c)))
_SPACE = re.compile(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_TRAILING = re.compile(r"[ \t]+\n")
_BLANK_LINES = re.compile(r"\n{3,}")


@lru_cache(maxsize=1)
def _ftfy() -> tuple[ModuleType, Any]:
    """ftfy and its settings: keep quotes and widths (folded below), NFC."""
    ftfy = require("ftfy", "data")
    return ftfy, ftfy.TextFixerConfig(
        uncurl_quotes=False, fix_character_width=False, normalization="NFC", explain=False
    )


def _ftfy_may_change(text: str) -> bool:
    """False when ftfy cannot change the text beyond what the steps below do anyway: ASCII carries no
    mojibake, ligatures, surrogates or C1 controls and is its own NFC, which leaves HTML entities and
    terminal escapes. ftfy is the slowest step by far (~1-2 MB/s), and most web text is ASCII."""
    return not text.isascii() or "&" in text or "\x1b" in text


def fold_width(text: str) -> str:
    """Full-width letters and digits to ASCII, half-width katakana (with their sound marks) to full-width."""
    text = text.translate(_FULL_WIDTH_ALNUM)
    return _HALF_WIDTH_KANA.sub(lambda m: unicodedata.normalize("NFKC", m.group()), text)


def normalize_text(text: str, fix_mojibake: bool = True, fold_widths: bool = True) -> str:
    if fix_mojibake and _ftfy_may_change(text):
        ftfy, settings = _ftfy()
        text = ftfy.fix_text(text, settings)
    is_ascii = text.isascii()  # known to the string object: free to ask
    if fold_widths and not is_ascii:
        text = fold_width(text)
    # Each pass only where it can change something (a substring test is far cheaper than a regex scan).
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not is_ascii or text.encode("ascii").translate(None, _ASCII_NOT_CONTROL):  # ASCII control characters left
        text = _CONTROL.sub("", text)
    if not is_ascii:  # every exotic space is outside ASCII
        text = _SPACE.sub(" ", text)
    if " \n" in text or "\t\n" in text:
        text = _TRAILING.sub("\n", text)
    if "\n\n\n" in text:
        text = _BLANK_LINES.sub("\n\n", text)
    return text.strip()


def normalize(doc: Document, counts: Counter, fix_mojibake: bool = True, fold_width: bool = True) -> str | None:
    """Stage: normalize the text in place; a document that is only noise is dropped as `empty`."""
    text = normalize_text(doc.text, fix_mojibake, fold_width)
    if text != doc.text:
        counts["changed"] += 1
    doc.text = text
    return None if text else "empty"
