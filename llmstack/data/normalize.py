"""Text normalization: mojibake repair and Unicode NFC (ftfy), then whitespace and control characters.

Indentation is kept (code and poetry need it); what goes is invisible noise: control characters,
zero-width characters, exotic spaces, trailing spaces and runs of blank lines.
"""

import re
from collections import Counter

import ftfy

# Keep quotes and full-width forms as they are: they are content, not encoding damage.
_FTFY = ftfy.TextFixerConfig(uncurl_quotes=False, fix_character_width=False, normalization="NFC", explain=False)

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200d\u2060\ufeff]")
_SPACE = re.compile(r"[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_TRAILING = re.compile(r"[ \t]+\n")
_BLANK_LINES = re.compile(r"\n{3,}")


def normalize_text(text: str, fix_mojibake: bool = True) -> str:
    if fix_mojibake:
        text = ftfy.fix_text(text, _FTFY)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    text = _SPACE.sub(" ", text)
    text = _TRAILING.sub("\n", text)
    text = _BLANK_LINES.sub("\n\n", text)
    return text.strip()


def normalize(doc, counts: Counter, fix_mojibake: bool = True):
    """Stage: normalize the text in place; a document that is only noise is dropped as `empty`."""
    text = normalize_text(doc.text, fix_mojibake)
    if text != doc.text:
        counts["changed"] += 1
    doc.text = text
    return None if text else "empty"
