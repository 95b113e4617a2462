"""Rebuild tests/data/debian_reference.jsonl.gz: real prose paragraphs of the Debian Reference.

Source: the Debian packages debian-reference-{en,de,fr,es,ja,zh-cn} (Debian Reference version 2,
by Osamu Aoki and its translators; GPL-2+, see /usr/share/doc/debian-reference-en/copyright),
files /usr/share/debian-reference/debian-reference.LANG.txt.gz. A paragraph is a block of
indented lines between blank lines; wrapped lines are joined (without a space between two CJK
characters). Kept: paragraphs of 100..1500 characters (40.. in Chinese and Japanese) that end in terminal
punctuation and look
like prose (no table rules, no shell prompts), written in the book's language: translations leave
some paragraphs in English, so a paragraph sharing over a third of its word 3-grams with the English
book is left out, and a Chinese or Japanese one needs CJK characters for at least half of its
letters. Every PER_LANGUAGE-th paragraph is taken, at most
LIMIT per language, so the sample spans the whole book.

    python tests/data/make_debian_reference.py   # needs the Debian packages installed
"""

import gzip
import json
import re
from pathlib import Path

LANGUAGES = {"en": "en", "de": "de", "fr": "fr", "es": "es", "ja": "ja", "zh-cn": "zh"}
LIMIT = {"en": 240, "zh": 240, "ja": 240}  # quality and dedup tests; other languages: language ID only
DEFAULT_LIMIT = 80
CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uff00-\uffef\u3000-\u303f]")
END = tuple(".!?。！？．")


def join_lines(lines):
    text = lines[0]
    for line in lines[1:]:
        text += line if CJK.match(line[:1]) or CJK.match(text[-1:]) else " " + line
    return text


def paragraphs(path):
    block = []
    for raw in gzip.open(path, "rt", encoding="utf-8"):
        line = raw.rstrip("\n")
        if line.startswith("    ") and line.strip():
            block.append(line.strip())
            continue
        if block:
            yield join_lines(block)
        block = []


def prose(paragraph):
    shortest = 40 if CJK.search(paragraph) else 100  # a CJK character carries about a word
    return (
        shortest <= len(paragraph) <= 1500
        and paragraph.endswith(END)
        and "|" not in paragraph
        and not paragraph.startswith(("$", "#", "+", "*"))
        and "  " not in paragraph
    )


def word_trigrams(text):
    words = re.findall(r"\w+", text.lower())
    return set(zip(words, words[1:], words[2:]))


def in_language(paragraph, english_trigrams, cjk):
    if cjk:
        letters = sum(c.isalnum() for c in paragraph)
        return len(CJK.findall(paragraph)) >= 0.5 * letters
    grams = word_trigrams(paragraph)
    return len(grams & english_trigrams) <= len(grams) / 3


def main():
    english = set().union(*map(word_trigrams, paragraphs("/usr/share/debian-reference/debian-reference.en.txt.gz")))
    out = Path(__file__).with_name("debian_reference.jsonl.gz")
    with gzip.open(out, "wt", encoding="utf-8") as f:
        for package, language in LANGUAGES.items():
            found = [
                p
                for p in paragraphs(f"/usr/share/debian-reference/debian-reference.{package}.txt.gz")
                if prose(p) and (language == "en" or in_language(p, english, language in ("zh", "ja")))
            ]
            limit = LIMIT.get(language, DEFAULT_LIMIT)
            step = max(1, len(found) // limit)
            for i, text in enumerate(found[::step][:limit]):
                f.write(
                    json.dumps({"id": f"{language}-{i}", "language": language, "text": text}, ensure_ascii=False) + "\n"
                )
            print(language, len(found), min(limit, len(found[::step])))
    print(out, out.stat().st_size)


if __name__ == "__main__":
    main()
