"""The heavy phase's module order (tests/module_order.py): slowest first, whole modules, from a table that names
modules that exist."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import module_order

ROOT = Path(module_order.__file__).resolve().parents[1]


def _items(*nodeids):
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_modules_go_slowest_first_and_keep_their_tests_in_order():
    items = _items("a.py::one", "a.py::two", "b.py::one", "c.py::one", "c.py::two", "d.py::one")
    times = {"a.py": 5.0, "b.py": 300.0, "c.py": 40.0}  # d.py is new: module_order.DEFAULT_S (20)
    assert [item.nodeid for item in module_order.ordered(items, times)] == [
        "b.py::one", "c.py::one", "c.py::two", "d.py::one", "a.py::one", "a.py::two"]


def test_the_table_names_modules_that_exist_slowest_first():
    times = module_order.load_times()
    assert len(times) > 40
    missing = [module for module in times if not (ROOT / module).is_file()]
    assert not missing, f"tests/module_times.txt names modules that are gone: {missing}; refresh it (tests/module_order.py)"
    assert list(times.values()) == sorted(times.values(), reverse=True)


def test_a_junit_report_becomes_the_table(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.trainer.test_e2e" name="test_a" time="30.5"/>'
        '<testcase classname="tests.trainer.test_e2e" name="test_b" time="10.0"/>'
        '<testcase classname="tests.devtools.test_module_order.TestGrouped" name="test_c" time="2.0"/>'
        '<testcase classname="elsewhere.test_gone" name="test_d" time="9.0"/>'
        '</testsuite></testsuites>')
    times = module_order.times_from_junit([str(report)])
    assert times == {"tests/trainer/test_e2e.py": 40.5, "tests/devtools/test_module_order.py": 2.0}
    table = tmp_path / "times.txt"
    module_order.write_times(times, table)
    assert module_order.load_times(table) == times
    assert list(module_order.load_times(table)) == ["tests/trainer/test_e2e.py", "tests/devtools/test_module_order.py"]


def test_a_bad_table_line_names_its_place(tmp_path):
    table = tmp_path / "times.txt"
    table.write_text("# header\n 12.0 tests/a.py\nfast tests/b.py\n")
    with pytest.raises(ValueError, match=r"times.txt:3: 'fast tests/b.py'"):
        module_order.load_times(table)
