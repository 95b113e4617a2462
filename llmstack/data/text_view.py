"""What several quality stages need of one document's text, worked out once per text.

The Gopher quality and repetition rules and FineWeb's rules each look at the same words and lines;
`view(text, segmenter)` hands every stage the same `TextView` while the text is unchanged (the
object itself: a stage that rewrites `doc.text` makes a new string, and so a new view), so the
text is split into words and lines once, not once a stage.
"""

from .languages import words
from .ngrams import RepeatedNgrams


class TextView:
    """A text's words (by `segmenter`, see `languages.words`), non-empty lines and repeated
    n-grams, each computed when first asked for (plain attributes: functools.cached_property
    takes a lock on Python 3.11, which costs more than splitting a short text)."""

    def __init__(self, text: str, segmenter: str) -> None:
        self.text, self.segmenter = text, segmenter
        self._words: list[str] | None = None
        self._lines: list[str] | None = None
        self._ngrams: RepeatedNgrams | None = None

    @property
    def words(self) -> list[str]:
        if self._words is None:
            self._words = words(self.text, self.segmenter)
        return self._words

    @property
    def word_chars(self) -> int:
        """Characters in the words."""
        return len("".join(self.words))

    @property
    def lines(self) -> list[str]:
        """The lines that are not blank."""
        if self._lines is None:
            self._lines = [line for line in self.text.split("\n") if line and not line.isspace()]
        return self._lines

    @property
    def ngrams(self) -> RepeatedNgrams:
        if self._ngrams is None:
            self._ngrams = RepeatedNgrams(self.words)
        return self._ngrams


_recent: list[TextView] = []  # the last few views: the stages of one document share them


def view(text: str, segmenter: str) -> TextView:
    """The view of `text` (this very string object) under `segmenter`, made once."""
    for found in _recent:
        if found.text is text and found.segmenter == segmenter:
            return found
    made = TextView(text, segmenter)
    _recent.insert(0, made)
    del _recent[4:]
    return made
