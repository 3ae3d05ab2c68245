"""LoRA scenarios under torchrun (2 ranks, gloo); run by tests/engine/test_lora.py. It measures, the test asserts.

    torchrun --nproc-per-node 2 _lora_worker.py WORK_DIR

WORK_DIR holds the tiny checkpoints and ``lora_batch.pt`` (written by the test process). For each
scenario, rank 0 saves: the engine's log-probs and entropy of the batch (every data-parallel share
gathered), the merged export (``gather_hf_tensors``) and the adapter in PEFT names
(``gather_adapter_tensors``). Training scenarios also save metrics, what the optimizer holds and
the base weights after the steps; the checkpoint scenario what a LoRA checkpoint holds and the step
after resuming it under another layout.
"""
from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _engine_data as _data  # noqa: E402

from megarl.engine import MegatronActor, data_parallel_shard, load_checkpoint, save_checkpoint  # noqa: E402
from megarl.models import ParallelLayout, build_model, gather_hf_tensors  # noqa: E402
from megarl.models.lora import LoRASettings, LoRATransform, adapter_parameters, adapters_disabled  # noqa: E402
from megarl.models.lora.peft import gather_adapter_tensors  # noqa: E402
from megarl.platform import destroy_model_parallel, init_distributed, initialize_model_parallel  # noqa: E402

LLAMA, MOE, MLA = "llama", "qwen3_moe", "deepseek_v3"
# non-zero B: the adapter changes the model from the start, so every check sees the adapter path
KAIMING_B = LoRASettings(rank=4, alpha=8.0, lora_B_init_method="kaiming", seed=3)
SUBSET = dataclasses.replace(KAIMING_B, target_modules=("q_proj", "v_proj", "gate_proj", "o_proj"))
ZERO_B = LoRASettings(rank=4, alpha=8.0, seed=3)
ALL_LINEAR = dataclasses.replace(KAIMING_B, target_modules=("all-linear",))
CANONICAL = dataclasses.replace(KAIMING_B, type="canonical_lora")  # one A per projection, as PEFT trains them
# PEFT's usual target list for Llama, every projection its own A and B (written by PEFT itself, in the test)
PEFT_ANY = dataclasses.replace(CANONICAL, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"))
LAYOUTS = {"tp1": ParallelLayout(), "tp2": ParallelLayout(tp=2), "tp2_sp": ParallelLayout(tp=2, sequence_parallel=True),
           "pp2": ParallelLayout(pp=2), "ep2": ParallelLayout(ep=2),
           "tp2_ep2_sp": ParallelLayout(tp=2, ep=2, sequence_parallel=True)}
FORWARD = [(LLAMA, KAIMING_B, name) for name in ("tp1", "tp2", "tp2_sp", "pp2")] + [
    (LLAMA, SUBSET, "tp1"), (LLAMA, SUBSET, "tp2_sp"), (LLAMA, CANONICAL, "tp1"), (LLAMA, CANONICAL, "tp2_sp"),
    (MOE, CANONICAL, "tp1"), (MOE, CANONICAL, "tp2_ep2_sp"),
    (MOE, KAIMING_B, "tp1"), (MOE, KAIMING_B, "ep2"), (MOE, KAIMING_B, "tp2_ep2_sp"),
    (MLA, ALL_LINEAR, "tp1"), (MLA, ALL_LINEAR, "tp2_sp")]
# adapters move visibly in 2 steps; Adam's eps 1e-3: an element's update is lr * g / (|g| + eps), so with a
# small eps the elements of near-zero gradient would turn fp32 noise of two correct layouts into ~1e-5
OPTIM = dataclasses.replace(_data.OPTIM, lr=1e-2, eps=1e-3)
# no PPO clipping: the clip switches a token's gradient off at a ratio of 1 +- 0.2, and noise of 1e-7 in
# the log-probs of two layouts can flip that for a token near the boundary (a jump in the gradient);
# without it every quantity compared here is a smooth function of the adapters
LOSS = dataclasses.replace(_data.LOSS, clip_ratio=10.0, clip_ratio_c=100.0)


def setup(layout: ParallelLayout) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel(tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp, seed=7)


def gather_dp(tensor: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    size = parallel_state.get_data_parallel_world_size()
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_data_parallel_group())
    return torch.cat(parts)


def local_share(batch):
    from megatron.core import parallel_state

    return data_parallel_shard(batch, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())


def actor(work: Path, model: str, layout: ParallelLayout, settings: LoRASettings | None, **build) -> MegatronActor:
    transforms = [LoRATransform(settings)] if settings is not None else []
    chunks = build_model(work / model, layout, "actor", transforms=transforms, **build)
    return MegatronActor(chunks, _data.actor_settings(optim=OPTIM, loss=LOSS))


def log_probs(engine: MegatronActor, batch) -> dict:
    lp, entropy = engine.compute_log_prob(local_share(batch), with_entropy=True)
    return {"log_probs": gather_dp(lp), "entropy": gather_dp(entropy)}


def exports(engine: MegatronActor, work: Path, model: str, layout: ParallelLayout, settings) -> dict:
    chunks = [c.module for c in engine.model]
    return {"merged": dict(gather_hf_tensors(chunks, work / model, layout)),
            "peft": dict(gather_adapter_tensors(chunks, work / model, layout, settings))}


def forward_scenarios(work: Path, batches: dict) -> dict:
    results = {}
    for model, settings, name in FORWARD:
        layout = LAYOUTS[name]
        setup(layout)
        engine = actor(work, model, layout, settings)
        record = log_probs(engine, batches[model])
        record.update(exports(engine, work, model, layout, settings))
        label = {id(SUBSET): "subset", id(ALL_LINEAR): "all_linear", id(CANONICAL): "canonical"}.get(id(settings),
                                                                                                  "kaiming_b")
        results[f"{model}/{label}/{name}"] = record
    # B = 0 adds exact zeros; the adapters-off switch gives the base model back (TP2+SP)
    layout = LAYOUTS["tp2_sp"]
    setup(layout)
    base = log_probs(actor(work, LLAMA, layout, None), batches[LLAMA])
    zero = log_probs(actor(work, LLAMA, layout, ZERO_B), batches[LLAMA])
    adapted = actor(work, LLAMA, layout, KAIMING_B)
    with adapters_disabled(adapted.model):
        disabled = log_probs(adapted, batches[LLAMA])
    results["base_model"] = {"base": base, "zero_b": zero, "disabled": disabled, "adapted": log_probs(adapted, batches[LLAMA])}
    return results


def adapter_grads(work: Path, batch, layout: ParallelLayout) -> dict:
    """The adapters' gradients of one mini-batch (after megatron's gradient finalisation: DP all-reduce,
    the TP all-reduce of sequence-parallel-tagged tensors), as full PEFT-named tensors on rank 0."""
    from megarl.engine.update import global_batch_info
    from megarl.models.export import _sources, gather_pieces
    from megarl.models.loading import unwrap
    from megarl.models.lora import lora_shards
    from megarl.models.lora.peft import this_rank_adapters

    setup(layout)
    plain = dataclasses.replace(OPTIM, use_distributed_optimizer=False)  # whole reduced grads on every rank
    chunks = build_model(work / LLAMA, layout, "actor", transforms=[LoRATransform(KAIMING_B)])
    engine = MegatronActor(chunks, _data.actor_settings(optim=plain, loss=LOSS))
    share = local_share(batch)
    for chunk in engine.model:
        chunk.zero_grad_buffer()
    loss = engine._loss_fn(global_batch_info(engine.runner, share))
    engine.runner.run(share, engine.runner.split(share, engine.settings.train), loss, forward_only=False)
    local = {}
    for spec in this_rank_adapters(work / LLAMA, layout, KAIMING_B, "actor", "local"):
        module = unwrap(engine.model[spec.base.vpp_chunk]).get_submodule(spec.module)
        local[(spec.base.vpp_chunk, spec.a.name)] = module.lora_A.main_grad
        local[(spec.base.vpp_chunk, spec.b.name)] = module.lora_B.main_grad
    every = lora_shards(work / LLAMA, layout, KAIMING_B)
    shapes = {p.hf_name: p.hf_shape for spec in every for t in (spec.a, spec.b) for p in t.pieces}
    sources = _sources([t for spec in every for t in (spec.a, spec.b)])
    return dict(gather_pieces(shapes, sources, local, 0, lambda spec: torch.float32))


def optimizer_contents(engine: MegatronActor) -> dict:
    """This rank's share of the optimizer: the names of the parameters it updates, and the elements of
    its Adam moments (the distributed optimizer splits them over data-parallel ranks)."""
    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    names = {id(p): n for chunk in engine.model for n, p in chunk.module.named_parameters()}
    held = sorted(names[id(p)] for o in optimizers for p in o.model_param_group_index_map)
    moments = sum(state["exp_avg"].numel() for o in optimizers for state in o.optimizer.state.values())
    return {"held": held, "moment_elements": moments, "adapters": sorted(n for n, _ in adapter_parameters(
        [c.module for c in engine.model])), "adapter_elements": sum(p.numel() for _, p in adapter_parameters(engine.model))}


def peft_start(work: Path, batches: dict, layout: ParallelLayout) -> dict:
    """Start from the adapter PEFT wrote (``work/peft_any``, each projection its own A), at ``layout``."""
    from megarl.models.lora.peft import load_peft_adapter

    setup(layout)
    engine = actor(work, LLAMA, layout, PEFT_ANY)
    chunks = [c.module for c in engine.model]
    load_peft_adapter(chunks, work / "peft_any", work / LLAMA, layout, PEFT_ANY)
    record = {**log_probs(engine, batches[LLAMA]), **exports(engine, work, LLAMA, layout, PEFT_ANY)}
    engine.update_policy(local_share(batches[LLAMA]))
    record["trained_peft"] = exports(engine, work, LLAMA, layout, PEFT_ANY)["peft"]
    record["trained_log_probs"] = log_probs(engine, batches["second"])["log_probs"]
    return record


def train(work: Path, batches: dict, layout: ParallelLayout, steps: int = 2, settings: LoRASettings = KAIMING_B,
          **build) -> dict:
    setup(layout)
    engine = actor(work, LLAMA, layout, settings, **build)
    metrics = [engine.update_policy(local_share(b)) for b in (batches[LLAMA], batches["second"])[:steps]]
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, optimizer_contents(engine))
    frozen_grads = sum(int(p.grad is not None or getattr(p, "main_grad", None) is not None)
                       for c in engine.model for p in c.parameters() if not p.requires_grad)
    return {"metrics": metrics, "optimizer": shares, "frozen_with_grads": frozen_grads,
            **exports(engine, work, LLAMA, layout, settings), **log_probs(engine, batches[LLAMA])}


def checkpoint(work: Path, batches: dict) -> dict:
    """Step 1 at TP2+SP, save (the trained tensors only); step 2 there; a fresh PP2 actor resumes and does step 2."""
    from megatron.core import dist_checkpointing

    root, result = work / "lora_checkpoints", {}
    layout = LAYOUTS["tp2_sp"]
    setup(layout)
    engine = actor(work, LLAMA, layout, KAIMING_B)
    engine.update_policy(local_share(batches[LLAMA]))
    path = save_checkpoint(root, 1, engine.model, engine.optimizer, engine.scheduler, model_part="trainable",
                           meta={"lora": KAIMING_B.to_dict()})
    result["keys"] = sorted(dist_checkpointing.load_tensors_metadata(str(path)))
    result["saved_peft"] = exports(engine, work, LLAMA, layout, KAIMING_B)["peft"]
    result["continued"] = engine.update_policy(local_share(batches["second"]))
    result["continued_peft"] = exports(engine, work, LLAMA, layout, KAIMING_B)["peft"]
    for name, pp_layout in (("pp2", LAYOUTS["pp2"]),):
        setup(pp_layout)
        fresh = actor(work, LLAMA, pp_layout, ZERO_B)  # other initial adapters: all of them must come from the checkpoint
        load_checkpoint(root, fresh.model, fresh.optimizer, fresh.scheduler)
        result[f"{name}_loaded_peft"] = exports(fresh, work, LLAMA, pp_layout, KAIMING_B)["peft"]
        result[f"{name}_resumed"] = fresh.update_policy(local_share(batches["second"]))
        result[f"{name}_resumed_peft"] = exports(fresh, work, LLAMA, pp_layout, KAIMING_B)["peft"]
    setup(LAYOUTS["tp1"])
    try:
        load_checkpoint(root, actor(work, LLAMA, LAYOUTS["tp1"], None).model)
        result["full_model_load_error"] = None
    except ValueError as exc:
        result["full_model_load_error"] = str(exc)
    return result


def main() -> None:
    work = Path(sys.argv[1])
    init_distributed()
    batches = torch.load(work / "lora_batch.pt", weights_only=False)
    try:
        results = {"forward": forward_scenarios(work, batches),
                   "grads": {name: adapter_grads(work, batches[LLAMA], LAYOUTS[name])
                             for name in ("tp1", "tp2", "tp2_sp", "pp2")},
                   "train/tp1": train(work, batches, LAYOUTS["tp1"]),
                   "train/tp2_sp": train(work, batches, LAYOUTS["tp2_sp"]),
                   "train/tp2_sp_recompute": train(work, batches, LAYOUTS["tp2_sp"], config_overrides={
                       "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
                   "train/canonical_tp1": train(work, batches, LAYOUTS["tp1"], settings=CANONICAL),
                   "train/canonical_tp2_sp": train(work, batches, LAYOUTS["tp2_sp"], settings=CANONICAL),
                   "peft_start/tp1": peft_start(work, batches, LAYOUTS["tp1"]),
                   "peft_start/tp2_sp": peft_start(work, batches, LAYOUTS["tp2_sp"]),
                   "checkpoint": checkpoint(work, batches)}
    except Exception:
        traceback.print_exc()
        raise
    if dist.get_rank() == 0:
        torch.save(results, work / "lora.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
