"""Which of a rank's offloadable state each worker phase needs on the device.

verl's ``actor_rollout_ref.actor.megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload``,
``actor_rollout_ref.ref.megatron.param_offload`` and ``critic.megatron.*`` switch offload on per
model and kind; only those groups are ever moved (``megarl.engine.offload``). A phase names the
groups it needs; the rank's ``Residency`` offloads the others first, then reloads those. The
order of phases in one step, and who enters them, is in ``rollout_memory``.
"""
from __future__ import annotations

MODELS = ("actor", "ref", "critic")
KINDS = ("params", "grads", "optimizer")

# What each phase needs on the device. Groups are "<model>.<params|grads|optimizer>".
PHASES: dict[str, tuple[str, ...]] = {
    "log_prob": ("actor.params",),
    "ref": ("ref.params",),
    "refresh_reference": ("actor.params", "ref.params"),  # trainer.ref_update_freq: the actor's weights into the reference's
    "values": ("critic.params",),
    "update_critic": ("critic.params", "critic.grads", "critic.optimizer"),
    "update_actor": ("actor.params", "actor.grads", "actor.optimizer"),
    "sync": ("actor.params",),  # the weight sync reads the actor's weights; its grads and optimizer are out
    "rollout": (),  # the engines generate: everything with offload on is in host memory
    "load": tuple(f"{m}.{k}" for m in MODELS for k in KINDS),  # a checkpoint loads into device memory
}


def rank_residency(engines: dict, flags: dict[str, bool], rank: int):
    """A ``Residency`` over the groups with offload on of ``engines`` ({"actor": MegatronActor, ...}; None skipped)."""
    from megarl.engine.offload import Residency, model_offload_groups
    from megarl.engine.optimizer import initialize_optimizer_state

    groups = {}
    for name, engine in engines.items():
        if engine is None or not any(flags[f"{name}.{kind}"] for kind in KINDS):
            continue
        optimizer = getattr(engine, "optimizer", None)
        if optimizer is not None and flags[f"{name}.optimizer"]:
            initialize_optimizer_state(optimizer)  # the state exists from the start, so it always moves with the rest
        chunks = engine.model if hasattr(engine, "model") else engine.runner.chunks
        for kind, group in model_offload_groups(chunks, optimizer).items():
            if flags[f"{name}.{kind}"]:
                groups[f"{name}.{kind}"] = group
    return Residency(groups, rank)
