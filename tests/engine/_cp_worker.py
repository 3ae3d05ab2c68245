"""Context parallelism in worker processes (torchrun, gloo); run by tests/engine/test_context_parallel.py.

    torchrun --nproc-per-node 2 _cp_worker.py cp2 WORK_DIR      # CP2 against CP1 x DP2: dense, LoRA, MoE x EP2, ...
    torchrun --nproc-per-node 4 _cp_worker.py cp2_mp WORK_DIR   # CP2 x TP2 (+SP), CP2 x PP2, CP2 x PP2 x VPP2

Each comparison runs one layout at CP=1 (its other ranks as data parallelism) and the same layout
with those ranks as CP=2, from the same weights and batch, and measures on rank 0: log-probs and
entropy, the gradients of one loss evaluation (every rank compares its own shards; the distributed
optimizer is off so that every rank holds the whole reduced gradient), the update's metrics and the
weights after it. Results go to ``WORK_DIR/<mode>.pt``.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _engine_data as _data  # noqa: E402
from _engine_worker import actor_for, dp_coords, gather_dp, run_worker_mode, weights  # noqa: E402

from megarl.engine import (BatchSettings, CriticSettings, MegatronActor, MegatronCritic,  # noqa: E402
                           MegatronReference, data_parallel_shard, load_checkpoint, save_checkpoint)
from megarl.models import ParallelLayout, build_model, export_hf_pieces  # noqa: E402
from megarl.models.lora import LoRASettings, LoRATransform  # noqa: E402
from megarl.platform import destroy_model_parallel, initialize_model_parallel  # noqa: E402

OPTIM = dataclasses.replace(_data.OPTIM, use_distributed_optimizer=False)


def setup(layout: ParallelLayout) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                              vpp=layout.vpp if layout.vpp > 1 else None, seed=7)


def loss_gradients(actor, batch, settings) -> dict[str, torch.Tensor]:
    """This rank's reduced gradients of one loss evaluation on its share of the batch."""
    from megarl.engine.update import global_batch_info

    for chunk in actor.runner.chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    loss = actor._loss_fn(global_batch_info(actor.runner, batch))
    actor.runner.run(batch, actor.runner.split(batch, settings.train), loss, forward_only=False)
    return {name: p.main_grad.clone() for chunk in actor.runner.chunks for name, p in chunk.named_parameters()
            if p.requires_grad}


def measure(work: Path, model: str, layout: ParallelLayout, batch, lora=None, **settings_kw) -> tuple[dict, dict]:
    """(rank-0 results, this rank's gradients) of one layout (with LoRA adapters when ``lora``)."""
    setup(layout)
    settings = _data.actor_settings(optim=OPTIM, **settings_kw)
    local = data_parallel_shard(batch, *dp_coords())
    transforms = [LoRATransform(lora)] if lora is not None else []
    actor = MegatronActor(build_model(work / model, layout, "actor", transforms=transforms), settings)
    log_probs, entropy = actor.compute_log_prob(local, with_entropy=True)
    grads = loss_gradients(actor, local, settings)
    metrics = actor.update_policy(local)
    first = actor.runner.model_inputs(local, actor.runner.split(local, settings.train), packed=True)[0].inputs
    return {"log_probs": gather_dp(log_probs), "entropy": gather_dp(entropy), "metrics": metrics,
            "weights": weights(actor.model, work / model, layout),
            "tokens": (first.tokens.shape[1], first.global_length)}, grads


def compare(work: Path, model: str, reference: ParallelLayout, cp: ParallelLayout, batch, **settings_kw) -> dict:
    """Both layouts' results on rank 0, and the largest gradient difference over all ranks' shards."""
    ours, grads = measure(work, model, cp, batch, **settings_kw)
    theirs, reference_grads = measure(work, model, reference, batch, **settings_kw)
    assert grads.keys() == reference_grads.keys()
    diff = torch.tensor([max((grads[n] - reference_grads[n]).abs().max().item() for n in grads)], dtype=torch.float64)
    size = torch.tensor([float(sum(g.abs().sum() for g in grads.values()))], dtype=torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    dist.all_reduce(size, op=dist.ReduceOp.MIN)
    return {"cp": ours, "cp1": theirs, "grad_diff": diff.item(), "grad_size": size.item()}


def cp2(work: Path, data: dict) -> dict:
    batch, results = data["batches"][_data.DENSE], {}
    results["dense"] = compare(work, _data.DENSE, ParallelLayout(), ParallelLayout(cp=2), batch)
    results["dynamic"] = compare(work, _data.DENSE, ParallelLayout(), ParallelLayout(cp=2), batch,
                                 micro_batch_size=None, use_dynamic_bsz=True, max_token_len=24)
    results["lora"] = compare(work, _data.DENSE, ParallelLayout(), ParallelLayout(cp=2), batch,
                              lora=LoRASettings(rank=4, alpha=8.0, lora_B_init_method="kaiming", seed=3))
    results["moe_ep2"] = compare(work, _data.MOE, ParallelLayout(ep=2), ParallelLayout(cp=2, ep=2),
                                 data["batches"][_data.MOE])
    results["roles"] = other_roles(work, batch)
    results["replicas"] = replicas(work, batch)
    return results


def other_roles(work: Path, batch) -> dict:
    """The critic's values and update and the reference's log-probs at CP2 and at CP1 x DP2."""
    out = {}
    for name, layout in (("cp", ParallelLayout(cp=2)), ("cp1", ParallelLayout())):
        setup(layout)
        local = data_parallel_shard(batch, *dp_coords())
        settings = CriticSettings(train=BatchSettings(micro_batch_size=2), values=BatchSettings(micro_batch_size=3))
        critic = MegatronCritic(build_model(work / _data.CRITIC, layout, "critic"), settings)
        reference = MegatronReference(build_model(work / _data.DENSE, layout, "ref"), BatchSettings(micro_batch_size=3))
        out[name] = {"values": gather_dp(critic.compute_values(local)),
                     "ref": gather_dp(reference.compute_ref_log_prob(local)),
                     "critic_update": critic.update_critic(local)}
    return out


def replicas(work: Path, batch) -> dict:
    """CP ranks hold replicas: the exporter yields every HF element once over the CP group, and a
    checkpoint saved at CP2 (after a step) loads at CP1 with the same weights."""
    layout = ParallelLayout(cp=2)
    setup(layout)
    actor = actor_for(work, _data.DENSE, layout, _data.actor_settings(optim=OPTIM))
    actor.update_policy(batch)
    pieces = [(p.hf_name, [(s.start, s.stop) for s in p.hf_slice]) for p in
              export_hf_pieces([getattr(m, "module", m) for m in actor.model], work / _data.DENSE, layout)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    saved = weights(actor.model, work / _data.DENSE, layout)
    root = work / "cp_checkpoints"
    save_checkpoint(root, 1, actor.model, actor.optimizer, actor.scheduler)
    setup(ParallelLayout())
    fresh = actor_for(work, _data.DENSE, ParallelLayout(), _data.actor_settings(optim=OPTIM))
    load_checkpoint(root, fresh.model, fresh.optimizer, fresh.scheduler)
    return {"pieces": gathered, "saved": saved, "loaded": weights(fresh.model, work / _data.DENSE, ParallelLayout())}


def cp2_mp(work: Path, data: dict) -> dict:
    batch = data["batches"][_data.DENSE]
    return {
        "tp2": compare(work, _data.DENSE, ParallelLayout(tp=2, sequence_parallel=True),
                       ParallelLayout(tp=2, cp=2, sequence_parallel=True), batch),
        "pp2": compare(work, _data.DENSE, ParallelLayout(pp=2), ParallelLayout(pp=2, cp=2), batch),
        "pp2_vpp2": compare(work, _data.DENSE_SMALL, ParallelLayout(pp=2, vpp=2), ParallelLayout(pp=2, vpp=2, cp=2),
                            data["batches"][_data.DENSE_SMALL], micro_batch_size=1),
    }


if __name__ == "__main__":
    run_worker_mode({"cp2": cp2, "cp2_mp": cp2_mp})
