"""GPU check of the vision-language bridge (Qwen2.5-VL, Qwen3-VL): one line per family and layer spec.

    python3 bench/vision_language_gpu.py [--families qwen2_5_vl qwen3_vl]

On a lent machine carry the GPU check's wheels (``scripts/gpu_check.sh --prepare`` here, then there
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=$PWD:/tmp/site
python3 bench/vision_language_gpu.py``). For each tiny family (``megarl.devtools.tiny_model``; the batch of
``tests/models/vision_fixture.py``: images of different sizes, text-only rows) it builds the model at TP1 in
the platform's dtype (bf16 on CUDA, fp32 on CPU) with the local layer spec and, where Transformer Engine
imports, TE's, and prints:

* ``logprob_err``: max |log-softmax - HF fp32's| at the real tokens, beside ``hf_floor``, the same for
  transformers itself in that dtype on that device (the noise floor a bf16 model cannot beat);
* ``tower_grad``: whether one backward gives every vision-tower tensor a finite, non-zero gradient.

A missing piece prints ``skipped: <why>``; a failure ``FAILED: <error>`` and exit status 1. On CPU (here) it
checks the script's logic in fp32 (``logprob_err`` near 1e-6).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def hf_log_probs(checkpoint: Path, batch: dict, dtype: torch.dtype, device: str) -> torch.Tensor:
    from tests.models.vision_fixture import hf_model

    model = hf_model(checkpoint).to(device=device, dtype=dtype)
    inputs = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        return model(**inputs).logits.float().log_softmax(-1).cpu()


def megarl_check(checkpoint: Path, batch: dict, impl: str, reference: torch.Tensor) -> str:
    from megarl.models import ParallelLayout, build_model, model_dims, mrope_position_ids
    from megarl.platform import device

    dims = model_dims(checkpoint)
    [model] = build_model(checkpoint, ParallelLayout(), transformer_impl=impl)
    where = device()
    positions = mrope_position_ids(batch["input_ids"], batch["image_grid_thw"], batch["attention_mask"],
                                   image_token_id=dims.vision.image_token_id,
                                   spatial_merge_size=dims.vision.spatial_merge_size).to(where)
    args = (batch["input_ids"].to(where), positions, None)
    kwargs = dict(pixel_values=batch["pixel_values"].to(where), image_grid_thw=batch["image_grid_thw"].to(where))
    model.eval()
    with torch.no_grad():
        log_probs = model(*args, **kwargs).float().log_softmax(-1).cpu()
    real = batch["attention_mask"].bool()
    error = (log_probs - reference)[real].abs().max().item()
    model.train()
    model(*args, **kwargs).float()[real.to(where)].logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.visual.parameters()]
    healthy = all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    return f"logprob_err={error:.3g} tower_grad={'ok' if healthy else 'BAD'}"


def run_family(family: str, root: Path, impls: list[str]) -> bool:
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.platform import default_dtype, device
    from tests.models.vision_fixture import processed_batch

    checkpoint = make_tiny_model(family, "tiny", root / family, seed=0)
    try:
        batch = processed_batch(checkpoint, family)
    except Exception as error:  # the image processor needs torchvision / PIL on this machine
        print(f"{family}: skipped: the processor cannot run here ({error})")
        return True
    reference = hf_log_probs(checkpoint, batch, torch.float32, "cpu")
    dtype, where = default_dtype(), str(device())
    real = batch["attention_mask"].bool()
    floor = (hf_log_probs(checkpoint, batch, dtype, where) - reference)[real].abs().max().item()
    ok = True
    for impl in impls:
        try:
            print(f"{family} {impl} {dtype}: {megarl_check(checkpoint, batch, impl, reference)} hf_floor={floor:.3g}")
        except Exception:
            ok = False
            print(f"{family} {impl}: FAILED: {traceback.format_exc(limit=3)}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["qwen2_5_vl", "qwen3_vl"])
    args = parser.parse_args()
    from megarl import platform
    from megarl.models import default_transformer_impl

    platform.init_distributed()
    platform.initialize_model_parallel()
    impls = ["local"] + (["transformer_engine"] if default_transformer_impl() == "transformer_engine" else [])
    if impls == ["local"]:
        print("transformer_engine: skipped: TE does not import here or there is no CUDA")
    with tempfile.TemporaryDirectory() as root:
        results = [run_family(family, Path(root), impls) for family in args.families]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
