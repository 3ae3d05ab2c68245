"""The heavy phase hands its modules to the two xdist workers slowest first, so that it ends soonest.

``make test`` runs the heavy tests whole modules per worker (``--dist loadfile``). By default pytest-xdist
hands out modules in the order of their number of tests, most first, which sends the slow modules with one
or two long tests (a run interrupted and resumed, a Slurm job) out last: one worker then runs them while
the other has nothing left (about 70 s of a 1,940 s phase, measured). Longest first is the classic answer
to this scheduling problem; it needs each module's time, which ``module_times.txt`` records (seconds and
path, slowest first, measured on a 2-core machine). ``scripts/run_tests.sh`` passes ``--no-loadscope-reorder``
to the heavy phase so that xdist keeps the order set here.

A module missing from the table (a new one) counts ``DEFAULT_S``; a stale table only costs time, never a
result, and a test holds it to modules that exist. Refresh it from a run's JUnit report(s)::

    .venv/bin/python -m pytest ... --junitxml=heavy.xml
    .venv/bin/python -m tests.module_order heavy.xml [more.xml ...]
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMES = Path(__file__).with_name("module_times.txt")
DEFAULT_S = 20.0  # about the median heavy module


def load_times(path: Path = TIMES) -> dict[str, float]:
    """``{module path relative to the repository: seconds}`` from the table (empty when it is missing)."""
    if not path.exists():
        return {}
    times = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            seconds, module = line.split()
            times[module] = float(seconds)
        except ValueError:
            raise ValueError(f"{path}:{number}: {line!r} is not 'SECONDS MODULE_PATH'") from None
    return times


def ordered(items: list, times: dict[str, float]) -> list:
    """``items`` with whole modules moved, slowest first; the tests of a module keep their order, and modules
    of equal time keep theirs."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(modules, key=lambda module: -times.get(module, DEFAULT_S))
    return [item for module in order for item in modules[module]]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    items[:] = ordered(items, load_times())


def module_of(classname: str) -> str | None:
    """The module path of a JUnit ``classname`` ("tests.trainer.test_e2e" or "...test_x.TestClass")."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    return None


def times_from_junit(reports: list[str]) -> dict[str, float]:
    """Each module's seconds (setup, call and teardown of all its tests) summed over the reports."""
    times: dict[str, float] = defaultdict(float)
    for report in reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            module = module_of(case.get("classname", ""))
            if module is not None:
                times[module] += float(case.get("time", 0))
    return dict(times)


def write_times(times: dict[str, float], path: Path = TIMES) -> None:
    lines = [f"{seconds:8.1f} {module}" for module, seconds in sorted(times.items(), key=lambda kv: (-kv[1], kv[0]))]
    path.write_text("# seconds per test module on 2 cores, slowest first (tests/module_order.py; refresh:\n"
                    "# python -m tests.module_order REPORT.xml)\n" + "\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    missing = [report for report in argv if not Path(report).is_file()]
    if missing:
        print(f"no such JUnit report: {', '.join(missing)}", file=sys.stderr)
        return 2
    times = times_from_junit(argv)
    if not times:
        print(f"no test of this repository in {', '.join(argv)}", file=sys.stderr)
        return 1
    write_times(times)
    print(f"wrote {TIMES.relative_to(ROOT)}: {len(times)} modules, {sum(times.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
