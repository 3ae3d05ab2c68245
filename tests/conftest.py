"""Suite-wide settings: one thread per process (2-core machines oversubscribe 40-fold otherwise), no hub."""
import os

for var, value in {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}.items():
    os.environ.setdefault(var, value)
