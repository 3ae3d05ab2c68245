"""``actor_rollout_ref.actor.router_replay.mode`` (verl's MoE routing replay), checked before start.

``R2`` is honoured: the old-log-prob pass records each token's experts and the update routes by them
(``megarl.engine.router_replay``). ``R3`` (the rollout engine's choices) is refused until the fleet
carries vLLM's ``routed_experts`` into the step data. What needs the model's config.json (a mixture of
experts) is checked by ``model_problems`` with the other layout checks.
"""
from __future__ import annotations

from megarl.config.errors import Problem, refusal
from megarl.settings.derived import old_log_prob_pass

KEY = "actor_rollout_ref.actor.router_replay.mode"
MODES = ("disabled", "R2", "R3")


def router_replay_problems(cfg, notes: list[str]) -> list[Problem]:
    mode = cfg.actor_rollout_ref.actor.router_replay.mode
    if mode not in MODES:
        return [Problem(f"{KEY}={mode!r} is not one of {MODES}", key=KEY)]
    if mode == "R3":
        return [refusal(f"{KEY}=R3", "router replay from the rollout engine (R3)", "megarl's fleet does not return "
                        "the rollout's routing yet (vLLM's enable_return_routed_experts); use R2, which replays the "
                        "old-log-prob pass's routing in the update")]
    if mode == "disabled":
        return []
    problems = []
    if cfg.algorithm.rollout_correction.bypass_mode:
        problems.append(Problem(f"{KEY}=R2 replays the routing the old-log-prob pass records, and "
                                "algorithm.rollout_correction.bypass_mode=True skips that pass (the rollout's "
                                "log-probs are the old ones); turn one of them off", key=KEY))
    overrides = cfg.actor_rollout_ref.actor.megatron.override_transformer_config or {}
    if overrides.get("moe_router_fusion"):
        problems.append(Problem(f"{KEY}=R2 cannot run with override_transformer_config.moe_router_fusion=True: "
                                "Transformer Engine's fused top-k takes no given choice; drop moe_router_fusion",
                                key=KEY))
    if overrides.get("moe_router_load_balancing_type") == "sinkhorn":
        problems.append(Problem(f"{KEY}=R2 cannot run with sinkhorn routing, which takes no given choice", key=KEY))
    if not problems and old_log_prob_pass(cfg) is None:
        notes.append(f"{KEY}=R2: each batch takes one on-policy optimizer step, so the update's own forward is the "
                     "old-log-prob pass and routes exactly as it; there is nothing to replay until a batch takes "
                     "several steps (ppo_mini_batch_size < data.train_batch_size, or ppo_epochs > 1)")
    return problems


def model_problems(cfg, dims) -> list[Problem]:
    """Replay needs a mixture of experts: ``dims`` are the actor model's."""
    mode = cfg.actor_rollout_ref.actor.router_replay.mode
    if mode in ("R2", "R3") and not dims.is_moe:
        return [Problem(f"{KEY}={mode} replays MoE routing, but actor_rollout_ref.model.path="
                        f"{cfg.actor_rollout_ref.model.path} is a dense model; set mode=disabled", key=KEY)]
    return []
