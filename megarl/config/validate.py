"""Cross-key checks run before any process or GPU is touched.

Each problem names the key, what is wrong and how to fix it; all problems are reported at
once. The batch arithmetic follows verl: ``ppo_mini_batch_size`` counts prompts, so one
mini-batch holds ``ppo_mini_batch_size * rollout.n`` samples spread over the data-parallel
ranks, and each rank splits its share into micro-batches (gradient accumulation steps).
"""
from __future__ import annotations

from omegaconf import DictConfig

from megarl.config.loader import ConfigError

GROUP_ESTIMATORS_NEEDING_N = {"grpo", "grpo_passk", "rloo"}
VALUE_ESTIMATORS = {"gae"}
LOGGERS = {"console", "tensorboard", "wandb", "jsonl"}


def devices_for(cfg: DictConfig) -> tuple[int, int]:
    """(trainer devices, rollout devices) for the configured placement."""
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if cfg.trainer.placement == "split":
        rollout = cfg.trainer.rollout_gpus or 0
        return world - rollout, rollout
    return world, world


def critic_enabled(cfg: DictConfig) -> bool:
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return cfg.algorithm.adv_estimator in VALUE_ESTIMATORS


def validate_config(cfg: DictConfig) -> None:
    problems: list[str] = []
    add = problems.append
    t, d, a = cfg.trainer, cfg.data, cfg.algorithm
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout

    # placement
    for key, value in (("trainer.nnodes", t.nnodes), ("trainer.n_gpus_per_node", t.n_gpus_per_node)):
        if value < 1:
            add(f"{key}={value}: must be >= 1.")
    if t.placement not in ("colocated", "split"):
        add(f"trainer.placement={t.placement!r}: use 'colocated' or 'split'.")
    world = t.nnodes * t.n_gpus_per_node
    if t.placement == "split" and not (t.rollout_gpus and 0 < t.rollout_gpus < world):
        add(f"trainer.rollout_gpus={t.rollout_gpus}: split placement needs 0 < rollout_gpus < "
            f"nnodes*n_gpus_per_node={world}; set trainer.rollout_gpus.")
    if problems:
        raise ConfigError(_format(problems))
    trainer_devices, _ = devices_for(cfg)

    # trainer layout and batch arithmetic
    _check_batches(add, "actor_rollout_ref.actor", actor, actor.megatron, trainer_devices,
                   d.train_batch_size, rollout.n)
    if critic_enabled(cfg):
        _check_batches(add, "critic", cfg.critic, cfg.critic.megatron, trainer_devices,
                       d.train_batch_size, rollout.n)
    layout_keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                   "virtual_pipeline_model_parallel_size", "context_parallel_size")
    actor_layout = {k: actor.megatron[k] for k in layout_keys}
    for section, megatron in (("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron), ("critic", cfg.critic.megatron)):
        if section == "critic" and not critic_enabled(cfg):
            continue
        other = {k: megatron[k] for k in layout_keys}
        if other != actor_layout:
            diff = ", ".join(f"{k}: {other[k]} vs {actor_layout[k]}" for k in layout_keys if other[k] != actor_layout[k])
            add(f"{section}.megatron must use the actor's parallel layout (they share one megatron parallel "
                f"state on the same ranks); differs in {diff}. Set the same sizes as actor_rollout_ref.actor.megatron.")
    if cfg.critic.enable is False and a.adv_estimator in VALUE_ESTIMATORS:
        add(f"critic.enable=False but algorithm.adv_estimator={a.adv_estimator!r} needs values; "
            "enable the critic or pick a critic-free estimator such as 'grpo'.")

    # rollout
    from megarl.trainer.placement import plan_from_config

    try:  # rollout TP divides the rollout devices, replicas fit, no replica spans two nodes
        plan_from_config(cfg)
    except ValueError as exc:
        add(f"{exc}.")
    if rollout.n < 1:
        add(f"actor_rollout_ref.rollout.n={rollout.n}: must be >= 1.")
    elif a.adv_estimator in GROUP_ESTIMATORS_NEEDING_N and rollout.n < 2:
        add(f"algorithm.adv_estimator={a.adv_estimator!r} compares responses within a group, so "
            f"actor_rollout_ref.rollout.n={rollout.n} gives all-zero advantages; set rollout.n >= 2.")
    if not 0 < rollout.gpu_memory_utilization <= 1:
        add(f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}: must be in (0, 1].")
    if rollout.max_model_len is not None and rollout.prompt_length + rollout.response_length > rollout.max_model_len:
        add(f"actor_rollout_ref.rollout.max_model_len={rollout.max_model_len} is below prompt_length + "
            f"response_length = {rollout.prompt_length + rollout.response_length}; raise it or shorten the lengths.")
    if rollout.weight_sync.transport not in ("auto", "nccl", "gloo", "cuda_ipc"):
        add(f"actor_rollout_ref.rollout.weight_sync.transport={rollout.weight_sync.transport!r}: "
            "use auto, nccl, gloo or cuda_ipc.")
    if rollout.weight_sync.bucket_mb < 1:
        add(f"actor_rollout_ref.rollout.weight_sync.bucket_mb={rollout.weight_sync.bucket_mb}: must be >= 1.")

    _check_agent(add, rollout)

    # data
    if d.max_prompt_length < 1 or d.max_response_length < 1:
        add("data.max_prompt_length and data.max_response_length must be >= 1.")
    if d.truncation not in ("error", "left", "right", "middle"):
        add(f"data.truncation={d.truncation!r}: use error, left, right or middle.")
    if d.train_batch_size < 1:
        add(f"data.train_batch_size={d.train_batch_size}: must be >= 1.")

    # algorithm names, checked against the registries
    _check_names(add, cfg)
    if a.kl_ctrl.type not in ("fixed", "adaptive"):
        add(f"algorithm.kl_ctrl.type={a.kl_ctrl.type!r}: use 'fixed' or 'adaptive'.")
    if a.filter_groups.enable and not a.filter_groups.metric:
        add("algorithm.filter_groups.enable=True needs algorithm.filter_groups.metric (acc, score or seq_reward).")

    # trainer bookkeeping
    if t.resume_mode not in ("auto", "disable", "resume_path"):
        add(f"trainer.resume_mode={t.resume_mode!r}: use auto, disable or resume_path.")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        add("trainer.resume_mode=resume_path needs trainer.resume_from_path.")
    for key in ("save_freq", "test_freq"):
        if t[key] == 0 or t[key] < -1:
            add(f"trainer.{key}={t[key]}: use -1 (never) or a positive step count.")
    unknown = sorted(set(t.logger) - LOGGERS)
    if unknown:
        add(f"trainer.logger has unknown entries {unknown}; known: {sorted(LOGGERS)}.")
    if cfg.reward.executor not in ("process", "thread"):
        add(f"reward.executor={cfg.reward.executor!r}: use 'process' or 'thread'.")
    if cfg.reward.num_workers < 1:
        add(f"reward.num_workers={cfg.reward.num_workers}: must be >= 1.")
    if cfg.reward.on_error not in ("zero", "raise"):
        add(f"reward.on_error={cfg.reward.on_error!r}: use 'zero' or 'raise'.")
    if cfg.reward_model.enable:
        add("reward_model.enable=True: model-based reward is not supported; use rule rewards or "
            "custom_reward_function.path.")

    if problems:
        raise ConfigError(_format(problems))


def _check_agent(add, rollout) -> None:
    """``rollout.multi_turn.*`` and ``rollout.agent.*`` (the agent loops, megarl.agent)."""
    import os

    from megarl.agent.settings import MultiTurnSettings

    prefix = "actor_rollout_ref.rollout"
    mt, agent = rollout.multi_turn, rollout.agent
    try:
        MultiTurnSettings.from_config(mt)
    except ValueError as exc:
        add(f"{prefix}.{exc}.")
    if mt.enable and not (mt.tool_config_path or mt.function_tool_path):
        add(f"{prefix}.multi_turn.enable=True needs tools: set {prefix}.multi_turn.tool_config_path (verl's tool "
            "YAML) or multi_turn.function_tool_path (a .py file of functions).")
    for key in ("tool_config_path", "function_tool_path"):
        if mt[key] and not os.path.isfile(os.path.expanduser(mt[key])):
            add(f"{prefix}.multi_turn.{key}={mt[key]}: file not found.")
    if mt.interaction_config_path:
        add(f"{prefix}.multi_turn.interaction_config_path: verl's interactions (a simulated user that answers the "
            "model) are not supported by megarl; tools are (multi_turn.tool_config_path). For the old spelling of "
            "the tool config, use multi_turn.tool_config_path.")
    if mt.use_inference_chat_template:
        add(f"{prefix}.multi_turn.use_inference_chat_template=True: megarl keeps the tokens of every turn as "
            "sampled and never re-renders earlier turns, so there is no template to choose; set it to false (the "
            "drift check, multi_turn.tokenization_sanity_check_mode, reports where a re-render would differ).")
    if mt.num_repeat_rollouts is not None:
        add(f"{prefix}.multi_turn.num_repeat_rollouts is not supported; use {prefix}.n for samples per prompt.")
    if agent.num_workers < 0:
        add(f"{prefix}.agent.num_workers={agent.num_workers}: use 0 (loops in the controller) or a count of workers.")
    if agent.agent_loop_config_path and not os.path.isfile(os.path.expanduser(agent.agent_loop_config_path)):
        add(f"{prefix}.agent.agent_loop_config_path={agent.agent_loop_config_path}: file not found.")
    if agent.custom_async_server.path or agent.custom_async_server.name:
        add(f"{prefix}.agent.custom_async_server: megarl's rollout replicas are vLLM AsyncLLM engines and cannot "
            "be replaced; register an agent loop instead (megarl.agent.register_agent_loop).")


def _check_batches(add, prefix: str, role, megatron, devices: int, train_batch_size: int, n: int) -> None:
    tp, pp, cp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size, megatron.context_parallel_size
    ep, etp = megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size or tp
    model_parallel = tp * pp * cp
    if min(tp, pp, cp, ep, etp) < 1:
        add(f"{prefix}.megatron: parallel sizes must be >= 1 (tp={tp}, pp={pp}, cp={cp}, ep={ep}, etp={etp}).")
        return
    if devices % model_parallel:
        add(f"trainer.n_gpus_per_node * trainer.nnodes = {devices} trainer devices is not divisible by "
            f"{prefix}.megatron TP x PP x CP = {tp} x {pp} x {cp} = {model_parallel}; change the node/GPU count "
            "or the parallel sizes.")
        return
    if (devices // pp) % (ep * etp):
        add(f"{prefix}.megatron expert_model_parallel_size x expert_tensor_parallel_size = {ep} x {etp} must divide "
            f"the {devices // pp} devices of one pipeline stage.")
    vpp = megatron.virtual_pipeline_model_parallel_size
    if vpp is not None and (vpp < 1 or pp < 2):
        add(f"{prefix}.megatron.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size >= 2.")
    dp = devices // model_parallel
    mini = role.ppo_mini_batch_size
    if mini < 1 or train_batch_size % mini:
        add(f"{prefix}.ppo_mini_batch_size={mini} must divide data.train_batch_size={train_batch_size}; "
            f"pick a divisor of {train_batch_size}.")
        return
    samples = mini * n
    if samples % dp:
        add(f"{prefix}.ppo_mini_batch_size * rollout.n = {mini} * {n} = {samples} samples per mini-batch "
            f"do not split evenly over the {dp} data-parallel ranks; make it a multiple of {dp}.")
        return
    per_rank = samples // dp
    if role.use_dynamic_bsz:
        return
    micro = role.ppo_micro_batch_size_per_gpu
    if micro is None:
        add(f"{prefix}.ppo_micro_batch_size_per_gpu is not set; set it (a divisor of the {per_rank} samples "
            f"each rank gets per mini-batch) or set {prefix}.use_dynamic_bsz=True.")
    elif micro < 1 or per_rank % micro:
        add(f"{prefix}.ppo_micro_batch_size_per_gpu={micro} must divide the {per_rank} samples each data-parallel "
            f"rank gets per mini-batch (ppo_mini_batch_size * rollout.n / DP = {mini} * {n} / {dp}); otherwise "
            "gradient accumulation would be fractional or 0 (NaN grad norms). Pick a divisor of "
            f"{per_rank}.")


def _check_names(add, cfg: DictConfig) -> None:
    try:
        from megarl import algorithms
    except ImportError:  # the algorithms package is optional for config-only use
        return
    checks = [
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator, getattr(algorithms, "ADVANTAGE_ESTIMATORS", None)),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", cfg.actor_rollout_ref.actor.policy_loss.loss_mode,
         getattr(algorithms, "POLICY_LOSSES", None)),
    ]
    for key, name, registry in checks:
        if registry is not None and name not in registry:
            add(f"{key}={name!r} is not registered; known: {sorted(registry)}.")
    agg_modes = getattr(algorithms, "LOSS_AGG_MODES", None)
    if agg_modes is not None and cfg.actor_rollout_ref.actor.loss_agg_mode not in agg_modes:
        add(f"actor_rollout_ref.actor.loss_agg_mode={cfg.actor_rollout_ref.actor.loss_agg_mode!r}; known: {sorted(agg_modes)}.")
    kl_types = getattr(algorithms, "KL_PENALTIES", None)
    if kl_types is not None:
        for key, name in (("actor_rollout_ref.actor.kl_loss_type", cfg.actor_rollout_ref.actor.kl_loss_type),
                          ("algorithm.kl_penalty", cfg.algorithm.kl_penalty)):
            if name not in kl_types:
                add(f"{key}={name!r}; known: {sorted(kl_types)}.")


def _format(problems: list[str]) -> str:
    if len(problems) == 1:
        return "invalid config: " + problems[0]
    return "invalid config:\n" + "\n".join(f"  - {p}" for p in problems)
