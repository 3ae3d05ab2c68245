"""Config problems: one line each, collected over a whole check and raised together.

Every check of the config (composition, key names, types, cross-key rules, files) appends
``Problem``s to a list instead of raising at the first one, so a user sees every mistake of a
launch in one run. A problem that refuses a feature megarl does not have carries the feature's
name and, where one is planned, its issue number; tests and tools tell refusals from mistakes
by those fields.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    message: str  # one line: the key(s), what is wrong, and the fix (or what megarl does instead)
    key: str | None = None
    feature: str | None = None  # set on a refusal: the feature megarl does not have
    issue: int | None = None  # the issue that plans the refused feature, if any

    @property
    def is_refusal(self) -> bool:
        return self.feature is not None

    def __str__(self) -> str:
        return self.message


def refusal(setting: str, feature: str, instead: str, issue: int | None = None) -> Problem:
    """``setting`` (``key=value``, or several) asks for ``feature``, which megarl does not have;
    ``instead`` says what it does."""
    planned = f" (planned: issue {issue})" if issue is not None else " (not planned yet)"
    return Problem(f"{setting}: {feature} is not supported{planned}; {instead}", key=setting.split("=")[0],
                   feature=feature, issue=issue)


class ConfigError(ValueError):
    """An unusable config; ``problems`` holds every problem found, one line each."""

    def __init__(self, problems: list[Problem] | Problem | str):
        if isinstance(problems, (str, Problem)):
            problems = [problems]
        self.problems = [p if isinstance(p, Problem) else Problem(str(p)) for p in problems]
        super().__init__(self._format())

    def _format(self) -> str:
        lines = [p.message for p in self.problems]
        if len(lines) == 1:
            return "invalid config: " + lines[0]
        return f"invalid config ({len(lines)} problems):\n" + "\n".join(f"  - {line}" for line in lines)

    @property
    def refusals(self) -> list[Problem]:
        return [p for p in self.problems if p.is_refusal]
