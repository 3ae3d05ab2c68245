"""Settings that a run would accept and never use: each is refused, naming what would take effect.

A key's value is read only under some other setting (the KL controller only with KL in the reward,
the adaptive controller's target only by that controller, the tool files only with multi-turn on). Given at a value of its own while that
setting is off, it would change nothing, silently; megarl's rule is that every key is honoured or
refused with a message, so these are refused here, before any process starts.
"""
from __future__ import annotations

from megarl.config.errors import Problem


ROLLOUT = "actor_rollout_ref.rollout"


def cpu_notes(cfg) -> list[str]:
    """GPU-only values that a run on a CPU host accepts and runs without, said at start (a GPU config
    validated or run on CPU is common, so they are notes, not refusals)."""
    from megarl.config.schema import RolloutConfig
    from megarl.platform import has_cuda

    rollout = cfg.actor_rollout_ref.rollout
    if has_cuda() or rollout.gpu_memory_utilization == RolloutConfig.gpu_memory_utilization:
        return []
    return [f"{ROLLOUT}.gpu_memory_utilization={rollout.gpu_memory_utilization} sizes the vLLM engines' share of a "
            "GPU; on this CPU host each engine's KV cache holds max_num_seqs sequences of max_model_len tokens instead "
            "(64 MiB to 1 GiB: megarl.rollout.vllm.engine_config.cpu_kv_cache_bytes), "
            "so the value is not used here"]


def no_effect_problems(cfg) -> list[Problem]:
    return _kl_controller_problems(cfg.algorithm) + _tool_problems(cfg.actor_rollout_ref.rollout.multi_turn)


def _tool_problems(multi_turn) -> list[Problem]:
    """Tools are built only with ``multi_turn.enable`` (``megarl.agent.rollout.build_agent_context``)."""
    key = "actor_rollout_ref.rollout.multi_turn"
    given = [f"{key}.{name}={multi_turn[name]}" for name in ("tool_config_path", "function_tool_path") if multi_turn[name]]
    if given and not multi_turn.enable:
        return [Problem(f"{', '.join(given)} set, but {key}.enable=False: no tool is built and the rows run "
                        f"single-turn; set {key}.enable=True (verl's multi-turn configs set it) or drop the path.",
                        key=f"{key}.enable")]
    return []


def _kl_controller_problems(algorithm) -> list[Problem]:
    """``algorithm.kl_ctrl.*`` is read only with ``use_kl_in_reward``; ``target_kl`` and ``horizon`` only by
    the adaptive controller. A value of 0 for ``kl_coef`` asks for nothing (verl's launches give it)."""
    from megarl.config.schema import KLControlConfig

    defaults, ctrl, key = KLControlConfig(), algorithm.kl_ctrl, "algorithm.kl_ctrl"
    given = {name: ctrl[name] for name in ("type", "kl_coef", "target_kl", "horizon")
             if ctrl[name] != getattr(defaults, name) and not (name == "kl_coef" and ctrl[name] == 0)}
    if not algorithm.use_kl_in_reward:
        if not given:
            return []
        settings = ", ".join(f"{key}.{name}={value}" for name, value in given.items())
        return [Problem(f"{settings} set, but algorithm.use_kl_in_reward=False: the KL controller only scales a KL "
                        "penalty in the reward, so this would change nothing. Set algorithm.use_kl_in_reward=True, "
                        "or, for a KL term in the loss, actor_rollout_ref.actor.use_kl_loss=True with "
                        f"actor_rollout_ref.actor.kl_loss_coef (no controller), and drop {key}.*.", key=f"{key}.{next(iter(given))}")]
    unused = [f"{key}.{name}={given[name]}" for name in ("target_kl", "horizon") if name in given]
    if ctrl.type == "fixed" and unused:
        return [Problem(f"{', '.join(unused)} set, but {key}.type=fixed keeps kl_coef constant; only the adaptive "
                        f"controller reads them: set {key}.type=adaptive or drop them.", key=f"{key}.type")]
    return []
