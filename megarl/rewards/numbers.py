"""Find and compare plain numbers in model output ("1,234", "$18", "-3", "2.50", "18.").

Shared by the GSM8K and arithmetic rewards. Numbers are compared as decimals, so
"18", "18.0" and "18.00" are equal, and a sentence-ending period never sticks to
a number.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number never starts right after an ASCII letter, digit, "_" or "." ("km2" and "v1.5" hold
# no number to grade). A minus counts only under the same rule ("5-3" is 5 and 3, "x = -3" is
# -3). Commas are accepted only as thousands separators ("1,234"), so a list "3,4" reads as two
# numbers. A trailing "." without digits is not part of the number ("18." is 18).
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
NUMBER_PATTERN = re.compile(rf"(?<![A-Za-z0-9_.])-?(?:{_NUMBER})")


def find_numbers(text: str) -> list[str]:
    """Every number in ``text``, left to right, as written (commas kept)."""
    return NUMBER_PATTERN.findall(text)


def to_decimal(text: str) -> Decimal | None:
    """Parse a number, ignoring thousands commas, a leading "$", spaces and a trailing "."; None if not a number."""
    cleaned = str(text).strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if not cleaned:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def same_number(predicted: str | None, ground_truth: object) -> bool:
    """True when both parse to the same number; falls back to exact string equality for non-numbers."""
    if predicted is None:
        return False
    a, b = to_decimal(predicted), to_decimal(str(ground_truth))
    if a is not None and b is not None:
        return a == b
    return str(predicted).strip() == str(ground_truth).strip()
