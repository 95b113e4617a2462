"""PII masking: e-mail addresses, public IP addresses, phone numbers and Chinese resident ID numbers.

Phone numbers are the hard part: ISBNs, DOIs, dates, IP addresses and version strings are also
digit groups. A candidate is masked only if it has 7..15 digits (E.164), is not preceded by an
ISBN/ISSN/DOI/arXiv label, is not a valid ISBN-10/13, a date or a dotted quad, and is not part of
a path or DOI (no '/', '.', '-' or word character right before or after it). A leading '+' or
'(' marks a country or area code, which no ISBN, date or address has.

Chinese formats are matched on their own, before the general phone rule, because Chinese text puts
digits right after a character (a letter to a regex) with no space: a mainland mobile number is
1[3-9] and 9 more digits (optionally +86, optionally split 3-4-4); a resident ID number (GB 11643)
is 17 digits and a check character whose ISO 7064 MOD 11-2 checksum must hold, with a real birth
date in digits 7-14. Neither may touch another ASCII letter or digit.
"""

import datetime
import ipaddress
import re
from collections import Counter
from collections.abc import Callable

from .document import Document

_EMAIL = re.compile(
    r"(?<![A-Za-z0-9.%+_-])[A-Za-z0-9.%+_-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![A-Za-z0-9-])"
)
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.])")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
_PHONE = re.compile(
    r"(?<![\w/.+-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]\d{2,6}){1,4}(?![\w/-]|\.\d)"
)
_LABEL_BEFORE = re.compile(r"(?:isbn(?:-1[03])?|issn|doi|arxiv)\W{0,3}$", re.IGNORECASE)
_DATE = re.compile(r"\d{4}[-./]\d{1,2}[-./]\d{1,2}|\d{1,2}[-./]\d{1,2}[-./]\d{4}")
_DOTTED_QUAD = re.compile(r"(?:\d{1,3}\.){3}\d{1,3}")
_CN_MOBILE = re.compile(r"(?<![0-9A-Za-z+])(?:(?:\+|00)?86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}(?![0-9A-Za-z])")
_CN_ID = re.compile(r"(?<![0-9A-Za-z])[1-9]\d{16}[0-9Xx](?![0-9A-Za-z])")
_DIGIT, _TWO_DIGITS = re.compile(r"\d"), re.compile(r"\d\d")
_CN_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)


def _is_public_ip(candidate: str) -> bool:
    try:
        return ipaddress.ip_address(candidate).is_global
    except ValueError:
        return False


def _is_isbn(digits: str) -> bool:
    if len(digits) == 10:
        check = sum((10 - i) * (10 if d in "Xx" else int(d)) for i, d in enumerate(digits))
        return check % 11 == 0
    if len(digits) == 13 and digits[:3] in ("978", "979"):
        return sum((3 if i % 2 else 1) * int(d) for i, d in enumerate(digits)) % 10 == 0
    return False


def is_resident_id(number: str) -> bool:
    """A mainland resident ID number: valid birth date and ISO 7064 MOD 11-2 check character."""
    try:
        datetime.date(int(number[6:10]), int(number[10:12]), int(number[12:14]))
    except ValueError:
        return False
    check = "10X98765432"[sum(w * int(d) for w, d in zip(_CN_ID_WEIGHTS, number)) % 11]
    return number[17].upper() == check


def _is_phone(match: re.Match[str], text: str) -> bool:
    candidate = match.group()
    digits = re.sub(r"\D", "", candidate)
    if not 7 <= len(digits) <= 15:
        return False
    if _LABEL_BEFORE.search(text, max(0, match.start() - 12), match.start()):
        return False
    if candidate.startswith(("+", "(")):  # a country or area code: never an ISBN, date or address
        return True
    return not (_is_isbn(digits) or _DATE.fullmatch(candidate) or _DOTTED_QUAD.fullmatch(candidate))


def mask_pii(
    text: str, email: str = "<EMAIL>", ip: str = "<IP_ADDRESS>", phone: str = "<PHONE>", id_number: str = "<ID_NUMBER>"
) -> tuple[str, Counter[str]]:
    """Return the masked text and how many of each kind were masked."""
    found: Counter[str] = Counter()

    def replace(
        kind: str, replacement: str, keep: Callable[[re.Match[str]], bool] = lambda m: True
    ) -> Callable[[re.Match[str]], str]:
        def sub(m: re.Match[str]) -> str:
            if not keep(m):
                return m.group()
            found[kind] += 1
            return replacement

        return sub

    if "@" in text:
        text = _EMAIL.sub(replace("emails", email), text)
    public = lambda m: _is_public_ip(m.group())  # noqa: E731
    if _DIGIT.search(text):
        text = _IPV4.sub(replace("ip_addresses", ip, public), text)
    if ":" in text:
        text = _IPV6.sub(replace("ip_addresses", ip, public), text)
    if not _TWO_DIGITS.search(text):  # every pattern below needs two digits in a row
        return text, found
    text = _CN_ID.sub(replace("id_numbers", id_number, lambda m: is_resident_id(m.group())), text)
    text = _CN_MOBILE.sub(replace("phone_numbers", phone), text)
    text = _PHONE.sub(replace("phone_numbers", phone, lambda m: _is_phone(m, text)), text)
    return text, found


def pii(
    doc: Document,
    counts: Counter,
    email: str = "<EMAIL>",
    ip: str = "<IP_ADDRESS>",
    phone: str = "<PHONE>",
    id_number: str = "<ID_NUMBER>",
) -> None:
    """Stage: mask PII in place (never drops); the number masked of each kind goes into `counts`."""
    doc.text, found = mask_pii(doc.text, email, ip, phone, id_number)
    counts.update(found)
    return None
