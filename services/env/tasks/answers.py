"""Answer parsers of the two common math data-set formats, so rewards and users' code read answers alike.

    GSM8K   the solution ends "#### 1,234": the answer is what follows the "####" (commas are thousands separators)
    MATH    the solution states its answer in \\boxed{...} (braces may nest: \\boxed{\\frac{1}{2}}); the last one counts
"""

from __future__ import annotations

import re
from fractions import Fraction

HASHES = "####"
# a number as people write it: optional sign, thousands commas, decimals ("-1,234.5", ".5", "18")
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
BOXED = re.compile(r"\\(?:boxed|fbox)\b")
MAX_NUMBER_CHARS = 64  # longer digit strings are not an answer a reward compares (and not worth a Fraction)


def after_hashes(text: str) -> str | None:
    """What follows the last "####" (stripped), or None when the text has none."""
    head, sep, tail = text.rpartition(HASHES)
    return tail.strip() if sep else None


def last_number(text: str) -> str | None:
    """The last number written in the text, commas removed ("... so 1,234 apples." -> "1234"), or None."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k_answer(text: str) -> str | None:
    """A GSM8K answer: the number after "####" when the text has one (else what follows it), otherwise the
    last number in the text; commas removed. None when there is no answer to read."""
    tail = after_hashes(text)
    if tail is None:
        return last_number(text)
    found = NUMBER.search(tail)
    if found:
        return found.group(0).replace(",", "")
    return tail or None


def to_number(text: str | None) -> Fraction | None:
    """A number as an exact fraction ("18.00" and "18" are equal), commas and a leading "$" ignored; else None."""
    if text is None:
        return None
    text = text.strip().replace(",", "").removeprefix("$").removesuffix(".")
    if not text or len(text) > MAX_NUMBER_CHARS:
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) whose braces balance, or None. Escaped braces
    (\\{ \\}) are content, not structure."""
    for match in reversed(list(BOXED.finditer(text))):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i >= len(text) or text[i] != "{":
            continue
        depth, start, j = 0, i + 1, i
        while j < len(text):
            c = text[j]
            if c == "\\":
                j += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:j].strip()
            j += 1
    return None


__all__ = ["after_hashes", "gsm8k_answer", "last_boxed", "last_number", "to_number"]
