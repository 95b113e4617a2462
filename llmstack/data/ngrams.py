"""The repeated word n-grams of one document, for the Gopher repetition rules, without counting
every n-gram.

An n-gram occurs more than once only if the two (n-1)-grams inside it (at its position and one
word later) each occur more than once. So level n is built from level n-1's repeated positions
alone, and in prose these shrink to nothing within a few levels: most words, bigrams and trigrams
of a text occur once. A level maps each position whose n-gram repeats to the position where that
n-gram first occurs (an exact name for the n-gram: equal names, equal n-grams).
"""

from collections import Counter
from collections.abc import Sequence
from itertools import compress, count, repeat
from operator import gt


class RepeatedNgrams:
    """`top_chars(n)` and `duplicate_chars(n)` of a list of words, levels built as asked."""

    def __init__(self, words: Sequence[str]) -> None:
        self.words = words
        occurrences = Counter(words)
        repeated = list(compress(count(), map(gt, map(occurrences.__getitem__, words), repeat(1))))
        first: dict[str, int] = {}
        # level n: {position: position of the n-gram's first occurrence}, for repeated n-grams only
        # (built with map and zip: these run at C speed, where a comprehension would not)
        level = dict(zip(repeated, map(first.setdefault, map(words.__getitem__, repeated), repeated)))
        self._levels: list[dict[int, int]] = [{}, level]

    def _level(self, n: int) -> dict[int, int]:
        levels = self._levels
        while len(levels) <= n:
            below = levels[-1]
            if not below:  # no repeated n-gram: no longer one either
                return below
            pairs = {i: (g, below[i + 1]) for i, g in below.items() if i + 1 in below}
            occurrences = Counter(pairs.values())
            first: dict[tuple[int, int], int] = {}
            levels.append({i: first.setdefault(pair, i) for i, pair in pairs.items() if occurrences[pair] > 1})
        return levels[n]

    def top_chars(self, n: int) -> int:
        """Characters in all occurrences of the most frequent n-gram (of equally frequent ones, the
        first to occur), if it occurs more than once; else 0."""
        if n < 1:
            return 0
        level = self._level(n)
        if not level:
            return 0
        occurrences = Counter(level.values())  # first position -> number of occurrences
        most = max(occurrences.values())
        if most < 2:
            return 0
        start = min(first for first, times in occurrences.items() if times == most)
        return sum(map(len, self.words[start : start + n])) * most

    def duplicate_chars(self, n: int) -> int:
        """Characters of the words covered by an n-gram that already occurred earlier (each word once)."""
        if n < 1:
            return 0
        level = self._level(n)
        if not level:
            return 0
        covered = bytearray(len(self.words))
        for position, first in level.items():
            if first != position:
                covered[position : position + n] = b"\x01" * n
        return sum(compress(map(len, self.words), covered)) if any(covered) else 0
