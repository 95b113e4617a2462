"""Word-list and URL-blocklist filters. The lists are files the user supplies (one entry a line,
'#' starts a comment); nothing is downloaded."""

import re
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from llmstack.errors import UserError

from .document import Document, Stage


def read_list(path: Path | str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the blocklist {path}: {e}") from None
    entries = [line.split("#", 1)[0].strip().lower() for line in lines]
    return [e for e in entries if e]


def word_blocklist(path: Path | str, min_matches: int = 1) -> Stage:
    """Stage factory: drop documents with at least `min_matches` occurrences of listed words or
    phrases (whole words, case-insensitive)."""
    words = sorted(set(read_list(path)), key=len, reverse=True)
    if not words:
        raise UserError(f"the word blocklist {path} is empty")
    pattern = re.compile(r"\b(?:" + "|".join(map(re.escape, words)) + r")\b", re.IGNORECASE)

    def blocked_words(doc: Document, counts: Counter) -> str | None:
        matches = 0
        for _ in pattern.finditer(doc.text):
            matches += 1
            if matches >= min_matches:
                return "blocked_words"
        return None

    return blocked_words


def url_blocklist(path: Path | str, url_field: str = "url") -> Stage:
    """Stage factory: drop documents whose `meta[url_field]` host is a listed domain or a subdomain
    of one. Documents without a URL are kept."""
    domains = set(read_list(path))

    def blocked_url(doc: Document, counts: Counter) -> str | None:
        url = doc.meta.get(url_field)
        if not isinstance(url, str):
            return None
        host = (urlsplit(url if "//" in url else "//" + url).hostname or "").rstrip(".")
        parts = host.split(".")
        if any(".".join(parts[i:]) in domains for i in range(len(parts))):
            return "blocked_url"
        return None

    return blocked_url
