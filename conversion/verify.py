"""Compare megatron-core logits with Hugging Face transformers on sample text.

    python -m conversion verify --hf HF_DIR [--megatron CHECKPOINT] [--tp 2 ...] [--text "..."]

The megatron side is the ``--megatron`` distributed checkpoint (a converted or training
checkpoint) or, without it, the HF directory itself loaded through the bridge, at the given
layout (``pp * lcm(tp, ep * etp)`` torchrun processes). Both sides run in fp32 on the same token
ids (the HF tokenizer's, right-padded into one batch, causal attention; a vision-language model gets an image
row too, ``conversion.verify_inputs``). The last pipeline stage
gathers the vocab slices of its TP ranks and one rank compares them with
``AutoModelForCausalLM``'s logits (``AutoModelForImageTextToText``'s for a vision-language model; for an FP8 block-quantised checkpoint: transformers' model on
the dequantised weights). Prints the max abs difference; exits 1 when it exceeds ``--tolerance``.

The default tolerance is transformers' own noise floor on the same input: its eager and sdpa
attention give logits that differ (7e-5 on SmolLM2-135M in fp32), and a conversion cannot be held
to more than that. It is ``NOISE_FACTOR`` times that gap, at least ``MIN_TOLERANCE`` (a wrong
mapping, a swapped head or KV group, moves logits by 1e-1 and more).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from conversion.common import (
    Progress,
    add_layout_args,
    describe,
    check_hf_dir,
    check_world_size,
    layout_from_args,
    start_model_parallel,
    stop_model_parallel,
)
from conversion.verify_inputs import VerifyBatch, verify_batch

MIN_TOLERANCE = 1e-5
NOISE_FACTOR = 4  # the tests' TP=3 tolerance on SmolLM2 is 3e-4 against an eager-vs-sdpa gap of 8.3e-5

SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 times 7? Let me think step by step.",
    "Megatron splits a model over tensor, pipeline and expert parallel ranks.",
    "def add(a, b):\n    return a + b",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", required=True, help="Hugging Face model directory: the reference model and tokenizer")
    parser.add_argument("--megatron", help="megatron checkpoint (dir or root with 'latest'); default: --hf via the bridge")
    add_layout_args(parser)
    parser.add_argument("--text", action="append", help="a sample text (repeatable); default: 4 built-in sentences")
    parser.add_argument("--tolerance", type=float, default=None,
                        help=f"largest accepted max |megatron - HF| (fp32); default: {NOISE_FACTOR} x transformers' own "
                             f"eager-vs-sdpa gap on the same texts, at least {MIN_TOLERANCE:g}")


def megatron_logits(models: list, inputs: VerifyBatch | torch.Tensor) -> torch.Tensor | None:
    """This rank's logits [batch, seq, vocab / tp] on the last pipeline stage, else None. ``inputs``: a
    ``VerifyBatch``, or a text model's token ids [batch, seq] (positions 0..seq-1)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if isinstance(inputs, torch.Tensor):
        inputs = VerifyBatch(inputs, torch.arange(inputs.shape[1]).unsqueeze(0))
    batch, seq = inputs.input_ids.shape
    outputs = []

    def forward_step(data_iterator, model):
        input_ids, position_ids, extra = next(data_iterator)
        output = model(input_ids, position_ids, None, **extra)

        def collect(output_tensor):
            outputs.append(output_tensor.detach())
            return output_tensor.sum() * 0, {}

        return output, collect

    micro_batches = inputs.micro_batches()
    iterators = [iter(micro_batches) for _ in models]
    for model in models:
        model.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(models) > 1 else iterators[0],
            model=models if len(models) > 1 else models[0],
            num_microbatches=batch,
            seq_length=seq,
            micro_batch_size=1,
            forward_only=True,
        )
    return torch.cat(outputs) if outputs else None


def full_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Concatenate the TP ranks' vocab slices (collective over the TP group)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def hf_logits(hf_dir, inputs: VerifyBatch, attn_implementation: str = "eager") -> torch.Tensor:
    with torch.no_grad():
        return hf_model(hf_dir, attn_implementation).eval()(inputs.input_ids, **inputs.hf_kwargs()).logits


def sdpa_gap(hf_dir, inputs: VerifyBatch, eager: torch.Tensor) -> float:
    """max |HF sdpa - HF eager| logits, the noise floor of fp32 attention; -1 where transformers has no SDPA
    attention for the architecture (gpt-oss's attention sinks)."""
    try:
        sdpa = hf_logits(hf_dir, inputs, "sdpa")
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        return -1.0
    return (sdpa.double() - eager.double()).abs().max().item()


def default_tolerance(noise_floor: float) -> float:
    return max(MIN_TOLERANCE, NOISE_FACTOR * noise_floor)


def hf_model(hf_dir, attn_implementation: str = "eager"):
    """transformers' model of ``hf_dir`` in fp32, eager attention by default (its SDPA path drops Gemma-2's
    attention soft-cap). An FP8 block-quantised or MXFP4 checkpoint is built from its
    config without ``quantization_config`` and given the dequantised weights (transformers' own FP8
    loader cannot dequantise a ragged last block, e.g. DeepSeek-V3's 576-row kv_a_proj_with_mqa). A
    vision-language checkpoint is ``AutoModelForImageTextToText``'s (the tower, M-RoPE and all)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from megarl.models import load_hf_config, model_dims
    from megarl.models.fp8 import checkpoint_quantization, dequantized_tensors

    config = load_hf_config(hf_dir)
    if model_dims(config).vision is not None:
        return AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                           attn_implementation=attn_implementation)
    if checkpoint_quantization(config) is None:
        return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                    attn_implementation=attn_implementation)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    missing, unexpected = model.load_state_dict(dict(dequantized_tensors(hf_dir)), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{hf_dir}: tensors the model lacks {unexpected[:5]}, tensors missing {sorted(set(missing) - tied)[:5]}")
    model.tie_weights()
    return model


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Compare (collective); returns the exit code: 0 within tolerance, 1 above it."""
    from megatron.core import parallel_state as ps

    from megarl.engine import load_checkpoint
    from megarl.models import build_model

    layout = layout_from_args(args)
    hf_dir = check_hf_dir(args.hf, need_weights=True, layout=layout)
    check_world_size(layout, "verify", argv)
    checkpoint = stored = None
    if args.megatron:
        from conversion.megatron_to_hf import resolve_checkpoint, stored_tensors

        checkpoint = resolve_checkpoint(args.megatron)
        stored = stored_tensors(checkpoint)
    inputs = verify_batch(hf_dir, args.text or SAMPLE_TEXTS)
    input_ids = inputs.input_ids
    if layout.vpp > 1 and input_ids.shape[0] % layout.pp:
        raise ValueError(f"the interleaved schedule needs a multiple of pp={layout.pp} rows (texts, and a "
                         f"vision-language model's image row), got {input_ids.shape[0]}")
    progress = Progress(3)
    start_model_parallel(layout)
    try:
        if checkpoint is None:
            models = build_model(hf_dir, layout, "actor", params_dtype=torch.float32)
        else:
            from conversion.megatron_to_hf import check_matches

            models = build_model(hf_dir, layout, "actor", load_weights=False, params_dtype=torch.float32)
            check_matches(models, stored, checkpoint, hf_dir)
            load_checkpoint(checkpoint, models, load_rng=False)
        progress.step(f"megatron model ready ({checkpoint or hf_dir}, {describe(layout)})")
        logits = megatron_logits(models, inputs)
        difference = torch.zeros(2, dtype=torch.float64)  # max |megatron - HF|, max |HF eager - HF sdpa|
        if logits is not None:
            logits = full_vocab(logits)
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                reference = hf_logits(hf_dir, inputs)
                logits = logits[..., : reference.shape[-1]]  # the vocabulary padding (masked) is not HF's
                if reference.shape != logits.shape:
                    raise ValueError(f"logit shapes differ: megatron {tuple(logits.shape)} vs HF {tuple(reference.shape)}")
                difference[0] = (logits.double() - reference.double()).abs().max()
                if args.tolerance is None:
                    difference[1] = sdpa_gap(hf_dir, inputs, reference)
        image = " (the last with an image)" if inputs.image_rows else ""
        progress.step(f"ran both models on {input_ids.shape[0]} row(s){image} x {input_ids.shape[1]} tokens")
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)
        max_diff, noise = difference.tolist()
        tolerance = args.tolerance if args.tolerance is not None else default_tolerance(max(noise, 0.0))
        source = "--tolerance" if args.tolerance is not None else (
            f"{NOISE_FACTOR} x transformers' eager-vs-sdpa gap {noise:.1e}, at least {MIN_TOLERANCE:.0e}"
            if noise >= 0 else f"{MIN_TOLERANCE:.0e}: transformers has no SDPA attention for this architecture")
        ok = max_diff <= tolerance
        progress.step(f"max |megatron - HF| logits = {max_diff:.3e} (tolerance {tolerance:.1e}: {source}): "
                      f"{'OK' if ok else 'FAILED'}")
    finally:
        stop_model_parallel()
    return 0 if ok else 1
