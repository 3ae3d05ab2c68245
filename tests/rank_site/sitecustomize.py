"""Run by Python at start-up in every process of a ``run_ranks`` launch (tests/ports.py puts this directory on
its ``PYTHONPATH``): torchrun and its ranks collect garbage as megarl's own processes do
(megarl/platform/gc_tuning.py says why; about 1 CPU-second less per rank on 2 cores). That module is loaded
from its file, not imported as ``megarl.platform.gc_tuning``: importing the package would install megarl's
import hook, and a rank that tests megatron without megarl must stay without it."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_megarl_gc_tuning", Path(__file__).resolve().parents[2] / "megarl" / "platform" / "gc_tuning.py")
_gc_tuning = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gc_tuning)
_gc_tuning.tune_gc()
