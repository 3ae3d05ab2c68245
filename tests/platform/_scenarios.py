"""Megatron-core scenarios on CPU, run in a fresh process by tests/platform (python or torchrun).

    python _scenarios.py SCENARIO [SCENARIO ...] [--without NAME,NAME]
    torchrun --nproc-per-node 2 _scenarios.py SCENARIO [SCENARIO ...] [--without NAME,NAME]

Rank 0 prints one line ``RESULT <json>``:
{"failures": {redirect: {"error", "where"}}, "ranks": [{scenario: result} for each rank]}.

``--without`` applies every CPU redirect but the named ones. Each time a scenario then fails
with the failure that belongs to one of them (see FAILURE_SIGNATURES), the failure is recorded,
that redirect is applied, and the scenario starts again from scratch. So one run shows both
that each named redirect is needed and that with it the scenarios work. Several scenarios share
one launch because starting a process (importing torch and megatron-core) costs more than they do.
"""

import argparse
import json
import linecache
import os
import re
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megarl import platform  # noqa: E402

SEED = 7

# How each redirect's absence shows: a test on (exception text, megatron-core source line that raised).
FAILURE_SIGNATURES = {
    "rng_tracker": lambda error, line: "get_rng_state" in line,
    "current_device": lambda error, line: "torch.cuda.current_device()" in line,
    "cuda_device_literals": lambda error, line: re.search(r"device=['\"]cuda['\"]", line) is not None,
    "tensor_cuda_method": lambda error, line: ".cuda()" in line,
    "synchronize": lambda error, line: "torch.cuda.synchronize()" in line,
    "streams": lambda error, line: "torch.cuda.Stream(" in line,
    "moe_split_sizes_numpy": lambda error, line: "incompatible function arguments" in error,
    "moe_router_without_te": lambda error, line: "name 'te_general_gemm' is not defined" in error,
    "cuda_type_names": lambda error, line: "torch.cuda.FloatTensor" in line + error,
    "sequence_parallel_norm": lambda error, line: "sequence parallel not supported" in error,
    "checkpoint_without_output_fp8": lambda error, line: "name 'FP8GlobalStateManager' is not defined" in error,
    "mla_without_te": lambda error, line: "isinstance() arg 2 must be a type" in error and "multi_latent_attention" in line,
    "grouped_gemm": lambda error, line: "Grouped GEMM is not available" in error,
}


def _megatron_line(error):
    """'file:line: source' of the deepest megatron-core frame of the exception, or ''."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "megatron/core" in frame.filename]
    if not frames:
        return ""
    frame = frames[-1]
    source = linecache.getline(frame.filename, frame.lineno).strip()
    return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno}: {source}"


def run_showing_failures(scenario, pending, failures):
    """Run ``scenario``; when it fails for want of a redirect in ``pending``, record that, apply it, retry.

    ``pending`` (names still left out) and ``failures`` (name -> what failed) are updated in place.
    """
    while True:
        try:
            return scenario()
        except Exception as error:  # the failure of a left-out redirect: record it, apply it, retry
            text = f"{type(error).__name__}: {error}"
            line = _megatron_line(error)
            matching = [name for name in pending if FAILURE_SIGNATURES[name](text, line)]
            if not matching:
                raise
            failures[matching[0]] = {"error": text[:300], "where": line}
            pending.remove(matching[0])
            platform.apply_cpu_compat(skip=pending)


def _reset_parallel(**sizes):
    platform.destroy_model_parallel()
    platform.initialize_model_parallel(seed=SEED, **sizes)


def _max_diff(a, b):
    return (a.detach().float() - b.detach().float()).abs().max().item()


# ---------------------------------------------------------------- TP=1, one process


def scenario_tp1():
    """Forward/backward at TP=1 against the plain-torch reference; RNG tracker semantics; dropout."""
    import _mcore_tiny as tiny
    import _reference_gpt as reference
    from megatron.core import tensor_parallel

    _reset_parallel()
    model = tiny.tiny_model(tiny.tiny_config())
    tiny.perturb_norms(model)
    tokens, positions, labels = tiny.batch(0)
    logits = model(tokens, positions, None)
    per_token_loss = model(tokens, positions, None, labels=labels)
    per_token_loss.mean().backward()

    weights = {name: value.requires_grad_() for name, value in tiny.full_state(model).items()}
    reference_logits = reference.reference_logits(weights, tokens, tiny.LAYERS, tiny.HEADS)
    reference_loss = torch.nn.functional.cross_entropy(
        reference_logits.flatten(0, 1), labels.flatten(), reduction="none"
    )
    reference_loss.mean().backward()
    grad_diff = max(_max_diff(param.grad, weights[name].grad) for name, param in model.named_parameters())

    # RNG tracker: the model-parallel state is a generator seeded with seed + 2718 + tp_rank (megatron's rule).
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    default_restored = torch.equal(torch.get_rng_state(), default_before)
    with tracker.fork():
        second = torch.rand(4)
    expected = torch.Generator().manual_seed(SEED + 2718)
    tracker_draws_match = torch.equal(first, torch.rand(4, generator=expected)) and torch.equal(
        second, torch.rand(4, generator=expected)
    )

    # Dropout: draws differ between passes and repeat after re-seeding.
    dropout_model = tiny.tiny_model(tiny.tiny_config(hidden_dropout=0.3, attention_dropout=0.3))
    platform.model_parallel_seed(SEED)
    out_a = dropout_model(tokens, positions, None)
    out_b = dropout_model(tokens, positions, None)
    platform.model_parallel_seed(SEED)
    out_c = dropout_model(tokens, positions, None)

    try:  # bad parallel sizes get a clear error
        platform.initialize_model_parallel(tp=2)
        bad_sizes_error = ""
    except ValueError as error:
        bad_sizes_error = str(error)
    return {
        "bad_sizes_error": bad_sizes_error,
        "logits_shape": list(logits.shape),
        "logits_diff": _max_diff(logits, reference_logits),
        "loss_diff": _max_diff(per_token_loss, reference_loss.view_as(per_token_loss)),
        "grad_diff": grad_diff,
        "default_generator_restored": default_restored,
        "tracker_draws_match": tracker_draws_match,
        "dropout_passes_differ": not torch.equal(out_a, out_b),
        "dropout_reseed_repeats": torch.equal(out_a, out_c),
    }


# ---------------------------------------------------------------- TP=2 (with and without SP), torchrun 2


def scenario_tp2():
    """TP=2 with and without sequence parallelism against TP=1: weights, logits, and grads after finalize."""
    import _mcore_tiny as tiny
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    tokens, positions, labels = tiny.batch(0)
    _reset_parallel(tp=1)
    reference = tiny.tiny_model(tiny.tiny_config())
    tiny.perturb_norms(reference)
    reference_state = tiny.full_state(reference)
    reference_logits = reference(tokens, positions, None)
    reference(tokens, positions, None, labels=labels).mean().backward()
    reference_grads = {name: param.grad for name, param in reference.named_parameters()}

    result = {}
    for sequence_parallel in (False, True):
        _reset_parallel(tp=2)
        config = tiny.tiny_config(sequence_parallel=sequence_parallel)
        model = tiny.tiny_model(config)
        tiny.perturb_norms(model)
        weight_diff = max(
            _max_diff(tiny.gather_tensor_parallel(param, param), reference_state[name])
            for name, param in model.named_parameters()
        )
        ddp_model = DistributedDataParallel(config, DistributedDataParallelConfig(), module=model)
        logits = ddp_model(tokens, positions, None)
        full_logits = tiny.gather_along(logits, dim=-1)  # vocab-parallel logits
        ddp_model(tokens, positions, None, labels=labels).mean().backward()
        norm_grad_diff_before_finalize = max(
            _max_diff(param.main_grad, reference_grads[name])
            for name, param in model.named_parameters()
            if "norm" in name
        )
        finalize_model_grads([ddp_model])
        grad_diffs = {
            name: _max_diff(tiny.gather_tensor_parallel(param.main_grad, param), reference_grads[name])
            for name, param in model.named_parameters()
        }
        key = "sp" if sequence_parallel else "no_sp"
        result[key] = {
            "weight_diff": weight_diff,
            "logits_diff": _max_diff(full_logits, reference_logits),
            "grad_diff": max(grad_diffs.values()),
            "norm_grad_diff": max(diff for name, diff in grad_diffs.items() if "norm" in name),
            "norm_grad_diff_before_finalize": norm_grad_diff_before_finalize,
            "norm_params_tagged": all(
                getattr(param, "sequence_parallel", False) for name, param in model.named_parameters() if "norm" in name
            ),
        }
    return result


# ---------------------------------------------------------------- MLA + DeepSeekMoE, one process


def scenario_mla():
    """DeepSeek-V3's MLA layers and sigmoid router with expert bias, forward and backward in training mode.

    Training mode runs the router's torch.compile'd expert-bias update (token counts per expert),
    which dynamo can trace only if torch.cuda.synchronize is a function of its own on CPU.
    """
    from megarl.models import ParallelLayout, build_model
    from megarl.devtools.tiny_model import build_config

    _reset_parallel()
    config = build_config("deepseek_v3", "tiny")
    [model] = build_model(config, ParallelLayout())
    model.train()
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(SEED))
    logits = model(tokens, torch.arange(24).unsqueeze(0), None)
    logits.float().logsumexp(-1).mean().backward()
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    counted = [float(router.local_tokens_per_expert.sum()) for router in routers]
    return {
        "logits_shape": list(logits.shape),
        "finite": bool(torch.isfinite(logits).all()),
        "tokens_counted": counted,  # 2 x 24 tokens, top-4 each, per MoE layer
        "grads": all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad),
        "synchronize_is_its_own": torch.cuda.synchronize is not torch.cpu.synchronize,
    }


# ---------------------------------------------------------------- PP=2 1F1B, torchrun 2


def _pipeline_losses(model, microbatches):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import _mcore_tiny as tiny

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, model):
        tokens, positions, labels = next(data_iterator)
        return model(tokens, positions, None, labels=labels), loss_func

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=tiny.SEQ,
        micro_batch_size=microbatches[0][0].shape[0],
        forward_only=False,
    )
    return [output["loss"].item() for output in outputs]


def scenario_pp2():
    """PP=2 with the 1F1B schedule against PP=1: per-microbatch losses and grads (tied embeddings included)."""
    import _mcore_tiny as tiny
    from megatron.core import parallel_state

    microbatches = [tiny.batch(seed) for seed in range(4)]
    _reset_parallel(pp=1)
    reference = tiny.tiny_model(tiny.tiny_config())
    tiny.perturb_norms(reference)
    reference_state = tiny.full_state(reference)
    reference_losses = _pipeline_losses(reference, microbatches)
    reference_grads = {name: param.grad for name, param in reference.named_parameters()}

    _reset_parallel(pp=2)
    model = tiny.tiny_model(tiny.tiny_config())
    stage = parallel_state.get_pipeline_model_parallel_rank()
    layer_offset = stage * (tiny.LAYERS // 2)

    def reference_name(name):
        if name == "output_layer.weight":  # the last stage's copy of the tied embedding
            return "embedding.word_embeddings.weight"
        match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}" if match else name

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(reference_state[reference_name(name)])
    losses = _pipeline_losses(model, microbatches)

    layer_grad_diff = max(
        _max_diff(param.grad, reference_grads[reference_name(name)])
        for name, param in model.named_parameters()
        if "word_embeddings" not in name and name != "output_layer.weight"
    )
    # Tied embeddings: the two stages' grads add up to the PP=1 embedding grad.
    tied = model.shared_embedding_or_output_weight()
    tied_grad = tied.grad.clone()
    dist.all_reduce(tied_grad, group=parallel_state.get_embedding_group())
    return {
        "stage": stage,
        "losses": losses,
        "reference_losses": reference_losses,
        "layer_grad_diff": layer_grad_diff,
        "tied_embedding_grad_diff": _max_diff(tied_grad, reference_grads["embedding.word_embeddings.weight"]),
    }


# ---------------------------------------------------------------- MoE EP=2 alltoall, torchrun 2


def scenario_moe_ep2():
    """MoE with the alltoall dispatcher at EP=2 against EP=1: logits, and grads of every param."""
    import _mcore_tiny as tiny
    from megatron.core import parallel_state

    moe = dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    rank = dist.get_rank()
    tokens, positions, labels = tiny.batch(100 + rank)  # each rank its own batch: tokens cross ranks

    _reset_parallel(ep=1)
    reference = tiny.tiny_model(tiny.tiny_config(**moe), num_experts=4)
    reference_state = tiny.full_state(reference)
    reference_logits = reference(tokens, positions, None)
    reference(tokens, positions, None, labels=labels).mean().backward()
    reference_grads = {}
    for name, param in reference.named_parameters():
        grad = param.grad.clone()
        if ".experts." in name:  # an expert sees the tokens of both ranks at EP=2
            dist.all_reduce(grad)
        reference_grads[name] = grad

    _reset_parallel(ep=2)
    model = tiny.tiny_model(tiny.tiny_config(**moe), num_experts=4)
    ep_rank = parallel_state.get_expert_model_parallel_rank()

    def reference_name(name):
        match = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", name)
        return f"{match.group(1)}{int(match.group(2)) + 2 * ep_rank}{match.group(3)}" if match else name

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(reference_state[reference_name(name)])
    logits = model(tokens, positions, None)
    model(tokens, positions, None, labels=labels).mean().backward()
    return {
        "logits_diff": _max_diff(logits, reference_logits),
        "grad_diff": max(
            _max_diff(param.grad, reference_grads[reference_name(name)]) for name, param in model.named_parameters()
        ),
    }


def _grouped(per_expert, shape):
    """GroupedMLP's ``weight1`` / ``weight2`` from SequentialMLP's per-expert weights: each transposed, the experts
    one after the other in memory (megatron views ``weight1`` [hidden, E * fc1] as [E, hidden, fc1])."""
    return torch.stack([weight.t() for weight in per_expert]).reshape(shape)


def scenario_grouped_gemm():
    """megatron's GroupedMLP experts (moe_grouped_gemm=True, the CPU stand-in of grouped_gemm) against
    SequentialMLP with the same weights: logits, and the grads of every expert weight."""
    import _mcore_tiny as tiny

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_router_load_balancing_type="none",
               moe_aux_loss_coeff=0.0)
    tokens, positions, labels = tiny.batch(7)
    _reset_parallel()
    runs = {}
    for grouped in (False, True):
        torch.manual_seed(SEED)
        model = tiny.tiny_model(tiny.tiny_config(**moe, moe_grouped_gemm=grouped), num_experts=4, grouped_gemm=grouped)
        if grouped:  # the same weights: GroupedMLP holds each expert's fc1 / fc2 transposed, experts side by side
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("experts.weight1") or name.endswith("experts.weight2"):
                        fc = "linear_fc1" if name.endswith("weight1") else "linear_fc2"
                        prefix = name.rsplit(".", 1)[0]
                        per_expert = [runs[False][0][f"{prefix}.local_experts.{e}.{fc}.weight"] for e in range(4)]
                        param.copy_(_grouped(per_expert, param.shape))
                    else:
                        param.copy_(runs[False][0][name])
        logits = model(tokens, positions, None)
        model(tokens, positions, None, labels=labels).mean().backward()
        weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        runs[grouped] = (weights, grads, logits.detach())
    (_, sequential_grads, sequential_logits), (_, grouped_grads, grouped_logits) = runs[False], runs[True]
    grad_diff = 0.0
    for name, grad in grouped_grads.items():
        if name.endswith("experts.weight1") or name.endswith("experts.weight2"):
            fc = "linear_fc1" if name.endswith("weight1") else "linear_fc2"
            prefix = name.rsplit(".", 1)[0]
            per_expert = [sequential_grads[f"{prefix}.local_experts.{e}.{fc}.weight"] for e in range(4)]
            expected = _grouped(per_expert, grad.shape)
        else:
            expected = sequential_grads[name]
        grad_diff = max(grad_diff, _max_diff(grad, expected))
    return {"logits_diff": _max_diff(grouped_logits, sequential_logits), "grad_diff": grad_diff,
            "expert_params": sorted(n.split("experts.")[-1] for n in grouped_grads if ".experts." in n)}


# ---------------------------------------------------------------- optimizer, one process


def scenario_optimizer():
    """Megatron's plain and distributed optimizer (torch Adam fallback) with grad clipping against torch Adam."""
    import _mcore_tiny as tiny
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    lr, max_norm, steps = 1e-2, 0.05, 2
    batches = [tiny.batch(200 + step) for step in range(steps)]
    result = {}
    for distributed in (False, True):
        _reset_parallel()
        config = tiny.tiny_config()
        model = tiny.tiny_model(config)
        reference = tiny.tiny_model(config)
        reference.load_state_dict(model.state_dict())
        ddp_model = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), module=model
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=max_norm, use_distributed_optimizer=distributed
            ),
            [ddp_model],
        )
        reference_optimizer = torch.optim.Adam(reference.parameters(), lr=lr)
        grad_norms, reference_norms = [], []
        for tokens, positions, labels in batches:
            ddp_model.zero_grad_buffer()
            optimizer.zero_grad()
            ddp_model(tokens, positions, None, labels=labels).mean().backward()
            finalize_model_grads([ddp_model])
            _, grad_norm, _ = optimizer.step()
            grad_norms.append(grad_norm)

            reference_optimizer.zero_grad()
            reference(tokens, positions, None, labels=labels).mean().backward()
            total_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in reference.parameters())).item()
            scale = max_norm / (total_norm + 1e-6)
            if scale < 1.0:
                for p in reference.parameters():
                    p.grad.mul_(scale)
            reference_optimizer.step()
            reference_norms.append(total_norm)
        reference_params = dict(reference.named_parameters())
        result["distributed" if distributed else "plain"] = {
            "grad_norms": grad_norms,
            "reference_grad_norms": reference_norms,
            "param_diff": max(_max_diff(param, reference_params[name]) for name, param in model.named_parameters()),
        }
    return result


def scenario_selective_recompute():
    """Selective recompute of the norms and the MLP (megatron's CheckpointWithoutOutput): the same grads."""
    import _mcore_tiny as tiny

    grads = {}
    for name, overrides in (("plain", {}), ("recompute", {"recompute_granularity": "selective",
                                                          "recompute_modules": ["layernorm", "mlp", "core_attn"]})):
        _reset_parallel()
        model = tiny.tiny_model(tiny.tiny_config(**overrides))
        model.train()
        tokens, positions, labels = tiny.batch(0)
        model(tokens, positions, None, labels=labels).mean().backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"grad_diff": max(_max_diff(grads["plain"][n], grads["recompute"][n]) for n in grads["plain"])}


SCENARIOS = {
    "mla": scenario_mla,
    "tp1": scenario_tp1,
    "selective_recompute": scenario_selective_recompute,
    "tp2": scenario_tp2,
    "pp2": scenario_pp2,
    "moe_ep2": scenario_moe_ep2,
    "optimizer": scenario_optimizer,
    "grouped_gemm": scenario_grouped_gemm,
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    parser.add_argument("--without", default="", help="comma-separated redirect names to leave out at first")
    args = parser.parse_args()
    pending = [name for name in args.without.split(",") if name]
    platform.apply_cpu_compat(skip=pending)
    platform.init_distributed(timeout_s=120)
    failures = {}
    results = {name: run_showing_failures(SCENARIOS[name], pending, failures) for name in args.scenarios}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, results)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"failures": failures, "ranks": ranks}), flush=True)
    platform.destroy()


if __name__ == "__main__":
    main()
