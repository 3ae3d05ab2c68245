r"""Reading and comparing final answers of competition-math problems.

- :func:`last_boxed_content` finds the last ``\boxed{...}`` (or ``\fbox{...}``,
  or ``\boxed 5``) and returns what is inside, nested braces included.
- :func:`normalize_answer` rewrites an answer to a canonical string: the rules
  of the MATH paper's ``is_equiv`` (``\dfrac`` -> ``\frac``, units and ``\text{}``
  dropped, ``\frac12`` -> ``\frac{1}{2}``, "x = 3" -> "3", ...) plus numeric
  canonicalisation ("1,000" -> "1000", "5.0" -> "5").
- :func:`answers_match` says whether two answers are equal: equal after
  normalisation, or, when the ``math-verify`` package is installed, mathematically
  equivalent according to it (``0.5`` and ``\frac{1}{2}``, ``\{1,2\}`` and
  ``\{2,1\}``, ...).
"""
from __future__ import annotations

import importlib.util
import logging
import re
import threading
from decimal import Decimal, InvalidOperation

logger = logging.getLogger(__name__)

# Optional: math-verify (sympy based) for a more complete equivalence check. It is
# imported on first use (about 1 s), so rewards that never compare LaTeX skip the cost.
HAVE_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


def last_boxed_content(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` / ``\fbox{...}`` in ``text``, or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i):  # "\boxed 5": the answer runs to the next space or "$"
        match = re.match(r" +([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced braces: the answer was cut off


def _fix_fracs(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{2}`` -> ``\frac{1}{2}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, rest = part[0], part[1:]
        if rest.startswith("{"):
            out += "{" + a + "}" + rest
        else:
            out += "{" + a + "}{" + rest[0] + "}" + rest[1:]
    return out


def _fix_sqrt(s: str) -> str:
    r"""``\sqrt3`` -> ``\sqrt{3}``."""
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def _canonical_number(s: str) -> str:
    """"1,000" -> "1000", "5.0" -> "5", "0.50" -> "0.5"; anything else unchanged."""
    plain = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    try:
        value = Decimal(plain)
    except InvalidOperation:
        return s
    if not value.is_finite():
        return s
    text = format(value.normalize(), "f")
    return text if text != "-0" else "0"


def normalize_answer(answer: str) -> str:
    """A canonical string for a final answer, so that equal answers compare equal."""
    s = str(answer).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    if "\\text{ " in s:  # trailing units, e.g. "5 \text{ cm}"
        s = s.split("\\text{ ")[0]
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and len(lhs.strip()) <= 2:  # "x = 3" -> "3"
        s = rhs
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s).rstrip(".")
    if re.fullmatch(r"-?\d+/\d+", s):  # "3/4" -> "\frac{3}{4}"
        num, den = s.split("/")
        s = f"\\frac{{{num}}}{{{den}}}"
    s = _canonical_number(s)
    return "\\frac{1}{2}" if s == "0.5" else s


def _math_verify_equal(gold: str, predicted: str) -> bool:
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify

    # math-verify's timeouts use signal.alarm, which works only in the main thread;
    # elsewhere they are off (math-verify logs a one-time warning saying so).
    in_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main else None
    gold_parsed = _mv_parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
    pred_parsed = _mv_parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(_mv_verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def answers_match(predicted: str | None, ground_truth: str) -> bool:
    """True when the predicted final answer equals the ground truth (see module docstring)."""
    if predicted is None:
        return False
    if normalize_answer(predicted) == normalize_answer(ground_truth):
        return True
    if HAVE_MATH_VERIFY:
        try:
            return _math_verify_equal(str(ground_truth), predicted)
        except Exception as exc:  # math-verify/sympy can fail on odd LaTeX: treat as "not equal"
            logger.debug("math-verify could not compare %r and %r: %s", predicted, ground_truth, exc)
    return False
