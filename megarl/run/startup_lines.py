"""The few lines a run starts with: what it trains on, what runs where, and when it is ready.

    data: 2,000 train prompts (125 steps of 16 per epoch), 100 validation prompts; steps 1-120 of 120
    Ray cluster: 1 node(s); colocated on 1 x 1 device slot(s) (CPU worker processes): trainer 1 rank(s)
        (TP1 PP1 DP1; actor), rollout 1 vLLM replica x TP1
    ready in 24 s: trainer 5.1 s, rollout 19 s (vLLM CPU float32, engine start 13 s), weight sync 0.1 s
        (gloo, full tensors, 1.6 MB in 1 bucket per step)
"""
from __future__ import annotations

from megarl.logging.progress import duration


def data_line(train_loader, val_dataset, start_step: int, total_steps: int, batch_size: int) -> str:
    text = f"data: {len(train_loader.dataset):,} train prompts ({len(train_loader):,} steps of {batch_size} per epoch)"
    text += f", {len(val_dataset):,} validation prompts" if val_dataset is not None else ", no validation set"
    return text + f"; steps {start_step + 1}-{total_steps} of {total_steps}" if start_step < total_steps else text


def layout_line(cfg, plan, use_gpu: bool, ray_nodes: int) -> str:
    """The Ray cluster, the trainer's layout, the fleet's replicas x TP and the placement."""
    from megarl.settings.derived import critic_enabled
    from megarl.settings.engine import needs_reference

    megatron = cfg.actor_rollout_ref.actor.megatron
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    dp = plan.trainer_world // max(1, tp * pp)
    dims = f"TP{tp} PP{pp} DP{dp}"
    if megatron.expert_model_parallel_size > 1:
        dims += f" EP{megatron.expert_model_parallel_size}"
    if (megatron.virtual_pipeline_model_parallel_size or 1) > 1:
        dims += f" VPP{megatron.virtual_pipeline_model_parallel_size}"
    roles = ["actor"] + (["ref"] if needs_reference(cfg) else []) + (["critic"] if critic_enabled(cfg) else [])
    slots = "GPUs" if use_gpu else "CPU worker processes"
    rollout = cfg.actor_rollout_ref.rollout
    replicas = len(plan.replicas)
    return (f"Ray cluster: {ray_nodes} node(s); {plan.mode} on {plan.nnodes} x {plan.per_node} device slot(s) "
            f"({slots}): trainer {plan.trainer_world} rank(s) ({dims}; {' + '.join(roles)}), rollout {replicas} "
            f"{engine_label(rollout.name)} replica{'s' if replicas != 1 else ''} x TP{rollout.tensor_model_parallel_size}")


def engine_label(name: str) -> str:
    """How a rollout backend (``rollout.name``) reads in these lines."""
    return {"vllm": "vLLM", "hf": "hf (transformers)"}.get(name, name)


def ready_line(trainer_s: float, fleet_s: float, sync_s: float, fleet, sync) -> str:
    """How long the start took and what the fleet and the weight sync are."""
    infos = getattr(fleet, "replica_infos", None) or []
    dtype = str(infos[0]["dtype"]).removeprefix("torch.") if infos else "?"
    engines = "/".join(f"{info['start_seconds']:.0f}" for info in infos)
    return (f"ready in {duration(max(trainer_s, fleet_s) + sync_s)}: trainer {duration(trainer_s)} and rollout "
            f"{duration(fleet_s)} ({engine_label(fleet.backend.name)} {'GPU' if fleet.use_gpu else 'CPU'} {dtype}, engine "
            f"start {engines} s) side by side, "
            f"then weight sync {duration(sync_s)} ({sync.describe()})")
