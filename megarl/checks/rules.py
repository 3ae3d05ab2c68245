"""Cross-key rules of a typed config, checked before any process or GPU is touched.

They sit above every component (``megarl.checks``): the legal values each rule checks are the
component's own, imported from it.

``config_problems`` returns every problem at once, one line each, naming the key and the fix.
Names are checked against the registries the code runs with (estimators, losses, aggregation
modes, KL estimators and controllers, weight-sync transports, metric sinks, reward managers,
LR schedules, data truncation modes), never against lists kept here. The batch arithmetic
follows verl: ``ppo_mini_batch_size`` counts prompts, so one mini-batch holds
``ppo_mini_batch_size * rollout.n`` samples spread over the data-parallel ranks, and each rank
splits its share into micro-batches (gradient accumulation steps).
"""
from __future__ import annotations

from omegaconf import DictConfig

from megarl.config.derived import adapter_only, cluster_shape, devices_for
from megarl.settings.derived import critic_enabled, greedy_baselines, grouped_estimator, needs_values, old_log_prob_pass
from megarl.settings.engine import needs_reference
from megarl.config.errors import Problem, refusal

RESUME_MODES = ("auto", "disable", "resume_path")  # megarl.trainer.resume.resume_plan
ROLLOUT_MODES = ("sync", "async")


def config_problems(cfg: DictConfig, notes: list[str] | None = None) -> list[Problem]:
    """Every cross-key problem of ``cfg``; accepted settings worth a log line go to ``notes``."""
    problems: list[Problem] = []
    notes = [] if notes is None else notes
    def add(problem: Problem | str, key: str | None = None) -> None:
        problems.append(problem if isinstance(problem, Problem) else Problem(problem, key=key))

    _check_backends(cfg, add, notes)
    _check_async(cfg, add)
    _check_layout_and_batches(cfg, add)
    _check_rollout(cfg, add)
    _check_data(cfg, add, notes)
    _check_algorithm(cfg, add, notes)
    _check_rewards(cfg, add)
    _check_trainer(cfg, add)
    from megarl.checks.lora import lora_problems
    from megarl.checks.engine_keys import engine_key_problems

    for problem in lora_problems(cfg):
        add(problem)

    for problem in engine_key_problems(cfg, with_critic=critic_enabled(cfg)):  # megatron overrides, offload, checkpoints
        add(problem)
    from megarl.checks.no_effect import cpu_notes, no_effect_problems

    for problem in no_effect_problems(cfg):  # values read only under a setting that is off
        add(problem)
    notes += cpu_notes(cfg)  # GPU-only values a CPU host runs without
    return problems


# ------------------------------------------------------------------ backends megarl runs
def _check_backends(cfg, add, notes: list[str]) -> None:
    arr = cfg.actor_rollout_ref
    for key, value in (("actor_rollout_ref.actor.strategy", arr.actor.strategy),
                       ("actor_rollout_ref.ref.strategy", arr.ref.strategy), ("critic.strategy", cfg.critic.strategy)):
        if value in ("fsdp", "fsdp2"):
            add(refusal(f"{key}={value}", "the FSDP training backend", "megarl trains with Megatron-core: set "
                        "strategy=megatron and the layout in actor_rollout_ref.actor.megatron.*"))
        elif value != "megatron":
            add(f"{key}={value!r}: megarl's only training backend is 'megatron'", key)
    from megarl.rollout.backend import REFUSED_BACKENDS, backend_names, rollout_backend

    name = arr.rollout.name
    if name in REFUSED_BACKENDS:
        feature, instead = REFUSED_BACKENDS[name]
        add(refusal(f"actor_rollout_ref.rollout.name={name}", feature, instead))
    elif name not in backend_names():
        add(f"actor_rollout_ref.rollout.name={name!r}: megarl's rollout backends are {backend_names()}")
    elif rollout_backend(name).config_problems is not None:  # what this engine cannot do (hf: TP, LoRA adapters...)
        for problem in rollout_backend(name).config_problems(arr.rollout, arr.model.lora, notes):
            add(problem)
    mode = arr.rollout.mode
    if mode not in ROLLOUT_MODES:
        add(f"actor_rollout_ref.rollout.mode={mode!r}: use one of {ROLLOUT_MODES}")
    elif mode == "async":
        notes.append("actor_rollout_ref.rollout.mode=async: megarl's fleet generates each step's batch on all "
                     "replicas and waits for it, as verl's async server mode does within a step; generation "
                     "ahead of the trainer is async_training.mode (one_step_off, fully_async)")


# ------------------------------------------------------------------ asynchronous training
def _check_async(cfg, add) -> None:
    """``async_training.*`` (``megarl.trainer.asynchronous.batches``): values, and the combinations that cannot work."""
    from megarl.config.schema import AsyncTrainingConfig
    from megarl.trainer.asynchronous.batches import MODES
    from megarl.algorithms.staleness import STRATEGIES

    a, p = cfg.async_training, "async_training"
    defaults = AsyncTrainingConfig()
    if a.mode not in MODES:
        add(f"{p}.mode={a.mode!r}: use one of {MODES} (verl: trainer.v1.trainer_mode=sync|colocate_async|"
            "separate_async).", f"{p}.mode")
        return
    if a.max_off_policy_strategy not in STRATEGIES:
        add(f"{p}.max_off_policy_strategy={a.max_off_policy_strategy!r}: use one of {STRATEGIES}.",
            f"{p}.max_off_policy_strategy")
    for key, ok, rule in (("staleness_threshold", a.staleness_threshold >= 0, ">= 0"),
                          ("trigger_parameter_sync_step", a.trigger_parameter_sync_step >= 1, ">= 1"),
                          ("require_batches", a.require_batches >= 1, ">= 1"), ("wait_timeout_s", a.wait_timeout_s > 0, "> 0")):
        if not ok:
            add(f"{p}.{key}={a[key]}: must be {rule}.", f"{p}.{key}")
    tuned = [f"{p}.{k}={a[k]}" for k in ("staleness_threshold", "trigger_parameter_sync_step", "partial_rollout",
                                           "max_off_policy_strategy") if a[k] != getattr(defaults, k)]
    if a.mode == "sync":
        if tuned:
            add(f"{', '.join(tuned)} set, but {p}.mode=sync trains on-policy, one step at a time: set {p}.mode="
                "fully_async (verl's fully-async recipe, or trainer.v1.trainer_mode=separate_async / colocate_async) "
                f"or {p}.mode=one_step_off.", f"{p}.mode")
        return
    if a.mode == "one_step_off" and tuned:
        add(f"{p}.mode=one_step_off is staleness 1, one step per sync, no partial rollouts, batches in prompt order; "
            f"{', '.join(tuned)} asks for something else: use {p}.mode=fully_async for it.", f"{p}.mode")
    try:
        placement = cluster_shape(cfg)[2]
    except ValueError:
        placement = None  # reported by the layout check
    if a.mode == "one_step_off" and placement == "colocated":
        add(f"{p}.mode=one_step_off overlaps generation with training, which colocated GPUs cannot (the engines sleep "
            "while the trainer works): set trainer.placement=split with trainer.rollout_gpus (verl: actor_rollout_ref."
            f"hybrid_engine=False with rollout.nnodes / rollout.n_gpus_per_node), or {p}.mode=fully_async "
            "(verl's colocate_async: long generations continue across steps).", "trainer.placement")
    mode = f"{p}.mode={a.mode}"
    if cfg.trainer.critic_warmup > 0:
        add(f"trainer.critic_warmup={cfg.trainer.critic_warmup} with {mode}: the warm-up steps keep the actor (and "
            "the fleet's version) still, which the staleness bound counts on; set critic_warmup=0 or use "
            f"{p}.mode=sync.", "trainer.critic_warmup")
    if a.partial_rollout and adapter_only(cfg):
        add(f"{p}.partial_rollout=True with adapter-only LoRA updates (actor_rollout_ref.model.lora.merge=False): "
            "vLLM swaps a LoRA adapter between requests, so a running generation cannot continue on the new one; "
            "set lora.merge=True (merged weights, synced sharded) or partial_rollout=False.", f"{p}.partial_rollout")
    if greedy_baselines(cfg):
        add(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} with {mode}: its baselines (ReMax's greedy baselines) are generated with the step's "
            f"weights, not with the ones that sampled the responses; use {p}.mode=sync or another estimator.",
            "algorithm.adv_estimator")
    off_policy = a.mode == "one_step_off" or a.staleness_threshold > 0 or a.trigger_parameter_sync_step > 1
    c = cfg.algorithm.rollout_correction
    corrects = c.rollout_is is not None or c.rollout_rs is not None or c.bypass_mode
    if off_policy and not corrects:
        add(f"{mode} trains on samples that older weights generated, and no correction is chosen: set "
            "algorithm.rollout_correction.rollout_is (token | sequence: truncated importance weights) or "
            "rollout_rs (rejection), or bypass_mode=True (the PPO ratio to the rollout policy; verl: "
            "async_training.use_rollout_log_probs=True).", "algorithm.rollout_correction")
    data, mini = cfg.data, cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if a.require_batches != 1 and data.train_batch_size != a.require_batches * mini:
        add(f"{p}.require_batches={a.require_batches} makes a step require_batches x ppo_mini_batch_size = "
            f"{a.require_batches * mini} prompts, but data.train_batch_size={data.train_batch_size}; set "
            "data.train_batch_size=0 (verl's fully-async form) or give one of them.", f"{p}.require_batches")


# ------------------------------------------------------------------ layout and batch arithmetic
def _check_layout_and_batches(cfg, add) -> None:
    from megarl.settings.cluster import plan_from_config

    d, a = cfg.data, cfg.algorithm
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    from megarl.checks.batches import batch_problems

    try:  # placement mode, node sizes, rollout TP divides the rollout devices, replicas fit
        plan_from_config(cfg)
    except ValueError as exc:
        add(f"{exc}.")  # the batch checks below still run: one pass reports every problem
    try:
        trainer_devices: int | None = devices_for(cfg)[0]
    except ValueError:  # the cluster's shape itself is wrong (reported above): checked without the DP size
        trainer_devices = None
    batch_problems(add, "actor_rollout_ref.actor", actor, actor.megatron, trainer_devices, d.train_batch_size, rollout.n)
    if critic_enabled(cfg):
        batch_problems(add, "critic", cfg.critic, cfg.critic.megatron, trainer_devices, d.train_batch_size, rollout.n)
    layout_keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                   "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size", "context_parallel_size",
                   "sequence_parallel", "make_vocab_size_divisible_by")  # schema.LAYOUT_KEYS
    actor_layout = {k: actor.megatron[k] for k in layout_keys}
    for section, megatron in (("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron), ("critic", cfg.critic.megatron)):
        if section == "critic" and not critic_enabled(cfg):
            continue
        other = {k: megatron[k] for k in layout_keys}
        if other != actor_layout:
            diff = ", ".join(f"{k}: {other[k]} vs {actor_layout[k]}" for k in layout_keys if other[k] != actor_layout[k])
            add(f"{section}.megatron must use the actor's parallel layout (they share one megatron parallel "
                f"state on the same ranks); differs in {diff}. Set the same sizes as actor_rollout_ref.actor.megatron.")
    _check_context_parallel(cfg, add)
    if cfg.critic.enable is False and needs_values(cfg):
        add(f"critic.enable=False but algorithm.adv_estimator={a.adv_estimator!r} needs values; "
            "enable the critic or pick a critic-free estimator such as 'grpo'.")
    ref = cfg.actor_rollout_ref.ref
    if needs_reference(cfg) and not ref.log_prob_use_dynamic_bsz and ref.log_prob_micro_batch_size_per_gpu is None:
        add("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu is not set, and the reference model runs "
            "(use_kl_loss, use_kl_in_reward, or an estimator that reads its log-probs: spin); set it (samples per forward on one device) or "
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True.")
    for key, value in (("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", ref.log_prob_micro_batch_size_per_gpu),
                       ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                        rollout.log_prob_micro_batch_size_per_gpu)):
        if value is not None and value < 1:
            add(f"{key}={value}: must be >= 1.")


def _check_context_parallel(cfg, add) -> None:
    """Context parallelism splits packed sequences: every Megatron role must pack them."""
    cp = cfg.actor_rollout_ref.actor.megatron.context_parallel_size
    if cp <= 1:
        return
    roles = [("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.megatron),
             ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron)]
    if critic_enabled(cfg):
        roles.append(("critic", cfg.critic.megatron))
    for section, megatron in roles:
        if not megatron.use_remove_padding:
            add(refusal(f"{section}.megatron.use_remove_padding=False", "context parallelism over padded (BSHD) "
                        "batches", f"context_parallel_size={cp} splits packed sequences over the CP ranks: set "
                        f"{section}.megatron.use_remove_padding=True (verl's default)"))


def _check_agent(add, rollout) -> None:
    """``rollout.multi_turn.*`` and ``rollout.agent.*`` (the agent loops, megarl.agent)."""
    import os

    from megarl.settings.agent import multi_turn_settings

    prefix = "actor_rollout_ref.rollout"
    mt, agent = rollout.multi_turn, rollout.agent
    try:
        multi_turn_settings(mt)
    except ValueError as exc:
        add(f"{prefix}.{exc}.")
    if mt.enable and not (mt.tool_config_path or mt.function_tool_path):
        add(f"{prefix}.multi_turn.enable=True needs tools: set {prefix}.multi_turn.tool_config_path (verl's tool "
            "YAML) or multi_turn.function_tool_path (a .py file of functions).")
    for key in ("tool_config_path", "function_tool_path"):
        if mt[key] and not os.path.isfile(os.path.expanduser(mt[key])):
            add(f"{prefix}.multi_turn.{key}={mt[key]}: file not found.")
    if mt.interaction_config_path:
        add(refusal(f"{prefix}.multi_turn.interaction_config_path={mt.interaction_config_path}",
                    "verl's interactions (a simulated user that answers the model)",
                    "megarl's multi-turn loop calls tools (multi_turn.tool_config_path); for the old spelling of the "
                    "tool config, use multi_turn.tool_config_path"))
    if mt.use_inference_chat_template:
        add(refusal(f"{prefix}.multi_turn.use_inference_chat_template=True", "re-rendering earlier turns with the "
                    "inference chat template", "megarl keeps the tokens of every turn as sampled (the drift check, "
                    "multi_turn.tokenization_sanity_check_mode, reports where a re-render would differ)"))
    if mt.num_repeat_rollouts is not None:
        add(refusal(f"{prefix}.multi_turn.num_repeat_rollouts={mt.num_repeat_rollouts}", "repeated multi-turn "
                    "rollouts", f"use {prefix}.n for samples per prompt"))
    if agent.num_workers < 0:
        add(f"{prefix}.agent.num_workers={agent.num_workers}: use 0 (loops in the controller) or a count of workers.")
    if agent.agent_loop_config_path and not os.path.isfile(os.path.expanduser(agent.agent_loop_config_path)):
        add(f"{prefix}.agent.agent_loop_config_path={agent.agent_loop_config_path}: file not found.")
    if agent.custom_async_server.path or agent.custom_async_server.name:
        add(refusal(f"{prefix}.agent.custom_async_server", "custom rollout servers", "megarl's rollout replicas "
                    "are vLLM AsyncLLM engines; register an agent loop instead (megarl.agent.register_agent_loop)"))


# ------------------------------------------------------------------ rollout and weight sync
def _check_rollout(cfg, add) -> None:
    from megarl.rollout.vllm.engine_config import LOGPROBS_MODES, SCHEDULING_POLICIES, engine_kwargs_problems
    from megarl.weight_sync.transport import TRANSPORTS

    a, rollout = cfg.algorithm, cfg.actor_rollout_ref.rollout

    if rollout.n < 1:
        add(f"actor_rollout_ref.rollout.n={rollout.n}: must be >= 1.")
    elif grouped_estimator(cfg) and rollout.n < 2 and not (
            cfg.distillation.enabled and not cfg.distillation.distillation_loss.use_task_rewards):
        # (distilling without task rewards: the distillation loss is the whole loss, the advantages go unused)
        add(f"algorithm.adv_estimator={a.adv_estimator!r} compares responses within a group, so "
            f"actor_rollout_ref.rollout.n={rollout.n} gives all-zero advantages; set rollout.n >= 2.")
    if not 0 < rollout.gpu_memory_utilization <= 1:
        add(f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}: must be in (0, 1].")
    if rollout.max_model_len is not None and rollout.prompt_length + rollout.response_length > rollout.max_model_len:
        add(f"actor_rollout_ref.rollout.max_model_len={rollout.max_model_len} is below prompt_length + "
            f"response_length = {rollout.prompt_length + rollout.response_length}; raise it or shorten the lengths.")
    if rollout.logprobs_mode not in LOGPROBS_MODES:
        add(f"actor_rollout_ref.rollout.logprobs_mode={rollout.logprobs_mode!r}: use one of {LOGPROBS_MODES}.")
    elif rollout.logprobs_mode == "raw_logprobs" and rollout.do_sample and (
            rollout.temperature not in (0, 1) or rollout.top_p < 1 or rollout.top_k > 0):
        add(f"actor_rollout_ref.rollout.logprobs_mode=raw_logprobs reports log-probs before temperature, top-k and "
            f"top-p, but the rollout samples at temperature={rollout.temperature}, top_p={rollout.top_p}, "
            f"top_k={rollout.top_k} and the trainer scores at that temperature: rollout/logprob_diff and every "
            "importance weight would compare different distributions. Use logprobs_mode=processed_logprobs "
            "(the default, verl's).", "actor_rollout_ref.rollout.logprobs_mode")
    if rollout.scheduling_policy not in SCHEDULING_POLICIES:
        add(f"actor_rollout_ref.rollout.scheduling_policy={rollout.scheduling_policy!r}: use one of {SCHEDULING_POLICIES}.")
    if rollout.name == "vllm":  # other backends refuse vLLM's engine arguments (their config_problems)
        for message in engine_kwargs_problems(rollout.engine_kwargs.vllm):
            add(message)
    _check_engine_parallelism(add, rollout)
    sync = rollout.weight_sync
    if sync.transport != "auto" and sync.transport not in TRANSPORTS:
        add(f"actor_rollout_ref.rollout.weight_sync.transport={sync.transport!r}: use auto or one of {sorted(TRANSPORTS)}.")
    if sync.bucket_mb < 1:
        add(f"actor_rollout_ref.rollout.weight_sync.bucket_mb={sync.bucket_mb}: must be >= 1 (MiB).")
    _check_agent(add, rollout)


def _check_engine_parallelism(add, rollout) -> None:
    """verl's rollout ``data_parallel_size`` (refused above 1) and ``expert_parallel_size`` (1 or the TP size); whether
    the model has experts is the layout check's (``megarl.checks.preflight``), the CPU host's the fleet's."""
    from megarl.rollout.vllm.engine_config import ENGINE_DATA_PARALLEL, ENGINE_DATA_PARALLEL_INSTEAD, engine_parallelism

    key = "actor_rollout_ref.rollout"
    if rollout.data_parallel_size != 1:
        add(refusal(f"{key}.data_parallel_size={rollout.data_parallel_size}", ENGINE_DATA_PARALLEL,
                    ENGINE_DATA_PARALLEL_INSTEAD, issue=26))
        return
    for message in engine_parallelism(rollout, on_gpu=None)[1]:
        add(message, f"{key}.expert_parallel_size")
    if rollout.expert_parallel_size > 1 and rollout.name != "vllm":
        add(f"{key}.expert_parallel_size={rollout.expert_parallel_size}: expert parallelism is vLLM's; the "
            f"rollout.name={rollout.name} engines hold every expert: leave it at 1.", f"{key}.expert_parallel_size")


# ------------------------------------------------------------------ data
def _check_data(cfg, add, notes: list[str]) -> None:
    from megarl.data import TRUNCATION_MODES

    d = cfg.data
    if d.seed is None:
        notes.append("data.seed=null (verl: unseeded): megarl draws batches with seed 1, since an exact resume "
                     "needs a fixed order; set data.seed to choose another")
    if d.max_prompt_length < 1 or d.max_response_length < 1:
        add("data.max_prompt_length and data.max_response_length must be >= 1.")
    if d.truncation not in TRUNCATION_MODES:
        add(f"data.truncation={d.truncation!r}: use one of {TRUNCATION_MODES}.")
    if d.train_batch_size < 1:
        add(f"data.train_batch_size={d.train_batch_size}: must be >= 1.")
    for key in ("train_max_samples", "val_max_samples"):
        if d[key] == 0 or d[key] < -1:
            add(f"data.{key}={d[key]}: use -1 (every row) or a positive row count.")


# ------------------------------------------------------------------ algorithm names and settings
def _check_algorithm(cfg, add, notes: list[str]) -> None:
    from megarl import algorithms

    a, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    checks = [("algorithm.adv_estimator", a.adv_estimator, algorithms.ADVANTAGE_ESTIMATORS),
              ("actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, algorithms.POLICY_LOSSES),
              ("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, algorithms.LOSS_AGG_MODES),
              ("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, algorithms.KL_PENALTIES),
              ("algorithm.kl_penalty", a.kl_penalty, algorithms.KL_PENALTIES),
              ("algorithm.kl_ctrl.type", a.kl_ctrl.type, algorithms.KL_CONTROLLERS)]
    if critic_enabled(cfg):
        checks.append(("critic.loss_agg_mode", cfg.critic.loss_agg_mode, algorithms.LOSS_AGG_MODES))
    from megarl.checks.losses import loss_problems, name_hint

    for key, name, registry in checks:
        if name not in registry and not (key.endswith("loss_agg_mode") and name is None):  # None: the defaults
            add(f"{key}={name!r} is not registered; known: {sorted(registry)}.{name_hint(key, name)}")
    for problem in loss_problems(cfg, notes):  # the loss's and estimator's own options, SPIN's and SPPO's combinations
        add(problem)
    if actor.policy_loss.loss_mode == "gspo" and actor.loss_agg_mode not in (None, "seq-mean-token-mean"):
        notes.append(f"GSPO aggregates its policy term with actor_rollout_ref.actor.loss_agg_mode={actor.loss_agg_mode}; "
                     "verl's GSPO always uses seq-mean-token-mean there (the paper's form): set "
                     "loss_agg_mode=seq-mean-token-mean to match verl")
    _check_rollout_correction(cfg, add)
    from megarl.checks.router_replay import router_replay_problems

    for problem in router_replay_problems(cfg, notes):
        add(problem)
    from megarl.settings.profiling import profiler_problems

    for problem in profiler_problems(cfg):  # global_profiler.* and <role>.profiler.*
        add(problem)
    needed_by = old_log_prob_pass(cfg) if actor.recompute_old_log_prob is False else None
    if needed_by is not None:
        add(f"actor_rollout_ref.actor.recompute_old_log_prob=False, but the old log-probs are needed before the update "
            f"({needed_by}); unset it (null: skipped exactly when the update is on-policy) or make the "
            "update on-policy (ppo_mini_batch_size = data.train_batch_size, ppo_epochs=1, no KL in the reward).",
            key="actor_rollout_ref.actor.recompute_old_log_prob")
    if a.filter_groups.enable and not a.filter_groups.metric:
        add("algorithm.filter_groups.enable=True needs algorithm.filter_groups.metric (acc, score or seq_reward).")
    from megarl.checks.optimizer import optimizer_problems

    for problem in optimizer_problems(cfg, notes):  # each trained role's optim.*: schedule, Adam's values
        add(problem)


def _check_rollout_correction(cfg, add) -> None:
    """``algorithm.rollout_correction``: names, thresholds, and combinations that would not do what they say."""
    from megarl.algorithms.rollout_correction import RolloutCorrection, correction_problems

    c, prefix = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    settings = RolloutCorrection.__new__(RolloutCorrection)  # unchecked: every problem is reported below
    for key in ("rollout_is", "rollout_is_threshold", "rollout_is_threshold_lower", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold",
                "rollout_rs_threshold_lower", "rollout_token_veto_threshold", "bypass_mode", "loss_type"):
        object.__setattr__(settings, key, c[key])
    for message in correction_problems(settings):
        add(message + ".", prefix)
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if c.bypass_mode and c.loss_type == "ppo_clip" and c.rollout_is is not None:
        add(f"{prefix}.rollout_is={c.rollout_is} with bypass_mode=True and loss_type=ppo_clip would count the "
            "correction twice: the PPO ratio is already pi_theta / pi_rollout. Set rollout_is=null (rejection "
            "sampling, rollout_rs, still applies) or loss_type=reinforce.", f"{prefix}.rollout_is")
    if c.bypass_mode and c.loss_type == "reinforce" and loss_mode not in ("vanilla", "reinforce", "gpg"):
        add(f"{prefix}.loss_type=reinforce trains the REINFORCE loss, but actor_rollout_ref.actor.policy_loss."
            f"loss_mode={loss_mode}; set loss_mode=vanilla (or reinforce) or loss_type=ppo_clip.", f"{prefix}.loss_type")
    if not c.bypass_mode and c.loss_type != "ppo_clip":
        add(f"{prefix}.loss_type={c.loss_type} is bypass mode's loss; with bypass_mode=False the loss is "
            "actor_rollout_ref.actor.policy_loss.loss_mode. Set bypass_mode=True or drop loss_type.", f"{prefix}.loss_type")


# ------------------------------------------------------------------ rewards
def _check_rewards(cfg, add) -> None:
    from megarl.rewards.manager import EXECUTORS, ON_ERROR_MODES
    from megarl.settings.rewards import reward_manager_problems
    if cfg.reward.executor not in EXECUTORS:
        add(f"reward.executor={cfg.reward.executor!r}: use one of {EXECUTORS}.")
    if cfg.reward.num_workers < 1:
        add(f"reward.num_workers={cfg.reward.num_workers}: must be >= 1.")
    if cfg.reward.on_error not in ON_ERROR_MODES:
        add(f"reward.on_error={cfg.reward.on_error!r}: use one of {ON_ERROR_MODES}.")
    from megarl.settings.reward_models import reward_model_problems

    for problem in reward_model_problems(cfg):  # reward_model.enable: a reward model or LLM judge
        add(problem)
    if cfg.reward_model.enable:
        from megarl.settings.cluster import plan_from_config, reward_pool_from_config

        try:
            plan_from_config(cfg)  # a colocated reward model's TP must fit the trainer's devices
            reward_pool_from_config(cfg)
        except ValueError as exc:
            add(f"{exc}.")
    for problem in reward_manager_problems(cfg):
        add(problem)
    from megarl.settings.distillation import distillation_problems

    for problem in distillation_problems(cfg):  # distillation.enabled: teachers and their loss
        add(problem)


# ------------------------------------------------------------------ trainer bookkeeping
def _check_trainer(cfg, add) -> None:
    from megarl.logging import SINKS
    from megarl.logging.console import check_log_level

    t = cfg.trainer
    if t.resume_mode not in RESUME_MODES:
        add(f"trainer.resume_mode={t.resume_mode!r}: use one of {RESUME_MODES}.")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        add("trainer.resume_mode=resume_path needs trainer.resume_from_path.")
    for key in ("save_freq", "test_freq"):
        if t[key] == 0 or t[key] < -1:
            add(f"trainer.{key}={t[key]}: use -1 (never) or a positive step count.")
    if t.max_consecutive_skipped_steps < 0:
        add(f"trainer.max_consecutive_skipped_steps={t.max_consecutive_skipped_steps}: use 0 (never stop) or a "
            "positive step count.")
    if t.stale_weights_warn_threshold is not None and not t.stale_weights_warn_threshold >= 0:
        add(f"trainer.stale_weights_warn_threshold={t.stale_weights_warn_threshold}: use null (by the rollout's dtype), "
            "0 (never warn) or a positive mean log-prob difference.")
    if t.max_restarts < 0:
        add(f"trainer.max_restarts={t.max_restarts}: use 0 (a lost worker stops the run) or the number of times the "
            "run may restart itself from its last checkpoint.")
    if t.max_replica_failures < 0:
        add(f"trainer.max_replica_failures={t.max_replica_failures}: use 0 (a lost rollout replica stops the run) or "
            "the number of replica losses the run may survive.")
    if not t.save_timeout_s > 0:
        add(f"trainer.save_timeout_s={t.save_timeout_s}: must be > 0 (seconds a checkpoint save may take).")
    unknown = sorted(set(t.logger) - set(SINKS))
    if unknown:
        add(f"trainer.logger has unknown entries {unknown}; known: {sorted(SINKS)}.")
    if t.log_val_generations < 0:
        add(f"trainer.log_val_generations={t.log_val_generations}: must be >= 0.")
    elif t.log_val_generations and not cfg.data.val_files:
        add(f"trainer.log_val_generations={t.log_val_generations} logs validation samples, but data.val_files "
            "is not set; set it or drop the key.")
    if t.val_only and not cfg.data.val_files:
        add("trainer.val_only=True needs data.val_files.")
    if t.log_train_generations < 0:
        add(f"trainer.log_train_generations={t.log_train_generations}: must be >= 0.")
    if t.log_train_generations and t.log_train_generations_freq < 1:
        add(f"trainer.log_train_generations_freq={t.log_train_generations_freq}: use a positive step count.")
    if t.validation_data_dir and not cfg.data.val_files:
        add(f"trainer.validation_data_dir={t.validation_data_dir} dumps validation samples, but data.val_files "
            "is not set; set it or drop the key.")
    problem = check_log_level(t.log_level)
    if problem:
        add(problem)
    cpus = cfg.ray_kwargs.ray_init.num_cpus
    if cpus is not None and cpus < 1:
        add(f"ray_kwargs.ray_init.num_cpus={cpus}: must be >= 1.")
