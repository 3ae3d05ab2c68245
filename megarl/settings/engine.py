"""What a config says about the Megatron engines: their parallel layout, whether a reference
model runs, and the megatron checkpoints they start from (read by the workers, the planner and
the checks alike).
"""
from __future__ import annotations


def layout_from_config(megatron, num_layers: int | None = None) -> "ParallelLayout":  # noqa: F821
    """The layout of ``megatron`` (a ``*.megatron`` section); ``num_layers`` (the model's) is needed
    to turn ``override_transformer_config.account_for_*_in_pipeline_split`` into stage sizes."""
    from omegaconf import OmegaConf

    from megarl.engine.overrides import pipeline_stage_layers
    from megarl.models import ParallelLayout

    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    vpp = megatron.virtual_pipeline_model_parallel_size or 1
    overrides = OmegaConf.to_container(megatron.override_transformer_config, resolve=True) \
        if OmegaConf.is_config(megatron.override_transformer_config) else megatron.override_transformer_config
    if num_layers is None and any((overrides or {}).get(k) for k in ("account_for_embedding_in_pipeline_split",
                                                                     "account_for_loss_in_pipeline_split")):
        raise ValueError("account_for_*_in_pipeline_split needs the model's layer count")
    first, last = pipeline_stage_layers(overrides, num_layers or 0, pp, vpp)
    return ParallelLayout(
        tp=tp, pp=pp, ep=megatron.expert_model_parallel_size, etp=megatron.expert_tensor_parallel_size or 1,
        vpp=vpp, cp=megatron.context_parallel_size, sequence_parallel=bool(megatron.sequence_parallel and tp > 1),
        first_stage_layers=first, last_stage_layers=last,
        make_vocab_size_divisible_by=megatron.make_vocab_size_divisible_by)


def needs_reference(cfg) -> bool:
    """Whether a reference model runs: for the KL loss, the KL in the reward, or an estimator that reads its
    log-probs (SPIN)."""
    from megarl.settings.derived import estimator_reads_log_probs

    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
                or estimator_reads_log_probs(cfg))


def initial_checkpoints(cfg) -> dict[str, str | None]:
    """The megatron dist checkpoint each model starts from (None: its HF checkpoint).

    ``actor_rollout_ref.actor.megatron.dist_checkpointing_path`` (e.g. written by ``conversion
    hf-to-megatron`` under any layout) starts the actor, and the reference unless
    ``actor_rollout_ref.ref.megatron.dist_checkpointing_path`` names its own; the critic only
    loads ``critic.megatron.dist_checkpointing_path`` (a value model has its own head).
    """
    def path_of(megatron) -> str | None:
        return megatron.dist_checkpointing_path if megatron.use_dist_checkpointing else None

    actor = path_of(cfg.actor_rollout_ref.actor.megatron)
    return {"actor": actor, "ref": path_of(cfg.actor_rollout_ref.ref.megatron) or actor,
            "critic": path_of(cfg.critic.megatron)}
