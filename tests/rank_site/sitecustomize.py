"""Run by Python at start-up in every process of a ``run_ranks`` launch (tests/ports.py puts this directory on
its ``PYTHONPATH``): torchrun and its ranks collect garbage as megarl's own processes do, with a first
threshold of 10,000 instead of 700 (megarl/platform/gc_tuning.py says why; about 1 CPU-second less per rank
on 2 cores). It imports nothing of megarl's, so a rank that tests megatron without megarl stays without it."""
import gc

_, _second, _third = gc.get_threshold()
gc.set_threshold(10_000, _second, _third)
