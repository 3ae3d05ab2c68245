"""The suite's split (tests/process_guard.py): a test that is not heavy and starts a process fails,
naming the marker to add, unless torch.compile starts it; the markers that imply ``heavy`` select with it. Checked on a small suite run
by pytest in a subprocess, as make test runs the real one."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # runs pytest in a subprocess
REPO = Path(__file__).resolve().parents[2]

SUITE = textwrap.dedent(r'''
    import multiprocessing
    import os
    import subprocess

    import pytest


    def test_light_runs_a_command():
        subprocess.run(["true"], check=True)


    def test_light_spawns_a_process():
        process = multiprocessing.get_context("spawn").Process(target=print)
        process.start()
        process.join()


    def test_light_forks():
        if os.fork() == 0:
            os._exit(0)


    def test_light_computes():
        assert sum(range(4)) == 6


    def test_light_compiles_a_kernel(tmp_path):  # the C++ compiler torch.compile's inductor runs is allowed
        namespace = {}
        code = "import subprocess\ndef build():\n    subprocess.run(['true'], check=True)\n"
        exec(compile(code, str(tmp_path / "torch" / "_inductor" / "cpp_builder.py"), "exec"), namespace)
        namespace["build"]()


    @pytest.mark.ray
    def test_marked_ray_runs_a_command():
        subprocess.run(["true"], check=True)


    @pytest.mark.heavy
    def test_marked_heavy_runs_a_command():
        subprocess.run(["true"], check=True)
''')


def run_suite(root: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *args, str(root)],
                            cwd=root, env=env, capture_output=True, text=True, timeout=120)
    return result.stdout + result.stderr


def test_a_light_test_that_starts_a_process_fails_and_the_heavy_ones_run_apart(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from tests.process_guard import pytest_collection_modifyitems, pytest_runtest_protocol  # noqa: F401\n\n\n"
        "def pytest_configure(config):\n"
        "    for name in ('heavy', 'distributed', 'ray', 'vllm', 'slurm'):\n"
        "        config.addinivalue_line('markers', name + ': test')\n")
    (tmp_path / "test_suite.py").write_text(SUITE)

    everything = run_suite(tmp_path)
    assert "3 failed, 4 passed" in everything, everything
    for name in ("runs_a_command", "spawns_a_process", "forks"):
        assert (f"test_suite.py::test_light_{name} started a process but is not marked heavy" in everything
                and f"FAILED test_suite.py::test_light_{name}" in everything), everything
    assert "mark it (or its module: pytestmark = pytest.mark.heavy" in everything
    assert "PASSED test_suite.py::test_light_compiles_a_kernel" in everything, everything

    light = run_suite(tmp_path, "-m", "not heavy")  # the marker implied by ray is there before -m selects
    assert "3 failed, 2 passed, 2 deselected" in light, light
    heavy = run_suite(tmp_path, "-m", "heavy")
    assert "2 passed, 5 deselected" in heavy and "PASSED test_suite.py::test_marked_ray_runs_a_command" in heavy, heavy
