"""The few lines a run starts with: what it trains on, what runs where, and when it is ready.

    data: 2,000 train prompts (125 steps of 16 per epoch), 100 validation prompts; steps 1-120 of 120
    Ray cluster: 1 node(s); colocated on 1 x 1 device slot(s) (CPU worker processes): trainer 1 rank(s)
        (TP1 PP1 DP1; actor), rollout 1 vLLM replica x TP1
    memory: actor full recompute (uniform, 1 layer per unit), distributed optimizer, packed sequences
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


def memory_line(cfg) -> str:
    """The memory features each trained role is built with: recompute (``override_transformer_config.recompute_*``,
    ``model.enable_gradient_checkpointing``, as the engine resolves them), offload, the distributed optimizer,
    sequence packing, token-budget micro-batches and LoRA, so that a key that saves memory shows it is on."""
    from megarl.settings.derived import critic_enabled
    from megarl.settings.engine import model_overrides

    roles = [("actor", cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model)]
    if critic_enabled(cfg):
        roles.append(("critic", cfg.critic, cfg.critic.model))
    parts = []
    for role, section, model in roles:
        parts.append(f"{role} " + ", ".join(_memory_features(model_overrides(cfg, role, typed=False), section, model)))
    return "memory: " + "; ".join(parts)


def _memory_features(overrides: dict, section, model) -> list[str]:
    megatron = section.megatron
    granularity = overrides.get("recompute_granularity")
    if granularity == "full":
        method, layers = overrides.get("recompute_method"), overrides.get("recompute_num_layers")
        features = [f"full recompute ({method}, {layers} layer{'s' if layers != 1 else ''} per unit)"
                    if method == "uniform" else f"full recompute ({method}: {layers} layer(s) per pipeline stage)"]
    elif granularity == "selective":
        features = [f"selective recompute ({', '.join(overrides.get('recompute_modules') or ['core_attn'])})"]
    else:
        features = ["no recompute"]
    offload = [name for name in ("param", "grad", "optimizer") if megatron.get(f"{name}_offload")]
    if offload:
        features.append(f"{'/'.join(offload)} offload")
    if megatron.use_distributed_optimizer:
        features.append("distributed optimizer")
    if megatron.use_remove_padding:
        features.append("packed sequences")
    if section.get("use_dynamic_bsz"):
        features.append("token-budget micro-batches")
    if model.get("lora") is not None and model.lora.rank > 0:
        features.append(f"LoRA rank {model.lora.rank} (frozen base)")
    return features


def ready_line(trainer_s: float, fleet_s: float, sync_s: float, fleet, sync) -> str:
    """How long the start took and what the fleet and the weight sync are."""
    infos = getattr(fleet, "replica_infos", None) or []
    dtype = str(infos[0]["dtype"]).removeprefix("torch.") if infos else "?"
    engines = "/".join(f"{info['start_seconds']:.0f}" for info in infos)
    return (f"ready in {duration(max(trainer_s, fleet_s) + sync_s)}: trainer {duration(trainer_s)} and rollout "
            f"{duration(fleet_s)} ({engine_label(fleet.backend.name)} {'GPU' if fleet.use_gpu else 'CPU'} {dtype}, engine "
            f"start {engines} s) side by side, "
            f"then weight sync {duration(sync_s)} ({sync.describe()})")
