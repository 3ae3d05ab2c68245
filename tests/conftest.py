"""Suite-wide settings: one thread per process (2-core machines oversubscribe 40-fold otherwise), no hub."""
import os

for var, value in {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled",
                   # read by Ray at import time (test modules import it at collection): local clusters
                   # started by the tests stay on 127.0.0.1
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}.items():
    os.environ.setdefault(var, value)
