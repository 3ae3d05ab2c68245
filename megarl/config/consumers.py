"""Which code reads each key of the schema: the check that no accepted key is ignored.

``READERS`` maps every leaf key of ``megarl.config.schema`` to the functions (or classes) that
read it, as ``"module:qualname"``. ``unread_keys()`` checks the map against the code: a key with
no entry, an entry for a key the schema lacks, and a reader whose source never mentions the
key's name (as ``.name``, ``["name"]`` or the string ``"name"``) are all reported. So a new key
must name its reader, and a reader that stops reading a key shows up. ``INERT`` keys have no
effect by nature, with the reason; ``PENDING`` keys are read by code on another branch of this
issue (they must be empty when that branch is merged).
"""
from __future__ import annotations

import ast
import fnmatch
import importlib
import inspect
import textwrap
from functools import lru_cache

from megarl.config.schema import LAYOUT_KEYS
from megarl.config.screen import SECTION, schema_fields

ENGINE = "megarl.engine.settings"
WORKER = "megarl.trainer.megatron_worker"
VALIDATE = "megarl.checks.rules"
DERIVED = "megarl.config.derived"
CONTROLLER = "megarl.trainer.controller"
LOOP = "megarl.run.loop"
ROLES_WITH_ENGINE = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
LAYOUT = LAYOUT_KEYS

# (reader, key patterns it reads), fnmatch patterns; one of the readers listed for a key must read it.
READERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("megarl.data.loader:build_dataset", ("data.train_files", "data.val_files", "data.prompt_key", "data.reward_fn_key",
                                          "data.max_prompt_length", "data.truncation", "data.filter_overlong_prompts",
                                          "data.apply_chat_template_kwargs", "data.train_max_samples",
                                          "data.val_max_samples", "data.shuffle", "data.seed")),
    ("megarl.data.loader:build_train_loader", ("data.train_batch_size", "data.drop_last")),
    (f"{CONTROLLER}:RLTrainer.validate", ("data.val_batch_size",)),
    (f"{CONTROLLER}:RLTrainer.train_step", ("trainer.critic_warmup",
                                            "actor_rollout_ref.rollout.weight_sync.verify")),
    ("megarl.run.train:load_tokenizer", ("data.trust_remote_code", "actor_rollout_ref.model.tokenizer_path",
                                     "actor_rollout_ref.model.custom_chat_template")),
    ("megarl.run.train:run", ("trainer.default_local_dir",)),
    ("megarl.run.train:_run", ("actor_rollout_ref.model.path", "actor_rollout_ref.model.trust_remote_code",
                           "trainer.project_name", "trainer.experiment_name", "trainer.logger",
                           "trainer.ray_address", "ray_kwargs.ray_init.num_cpus", "ray_kwargs.timeline_json_file")),
    (f"{ENGINE}:actor_settings", ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size",
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.use_dynamic_bsz",
                                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.actor.ppo_epochs",
                                  "actor_rollout_ref.actor.shuffle", "actor_rollout_ref.actor.data_loader_seed",
                                  "actor_rollout_ref.actor.clip_ratio*", "actor_rollout_ref.actor.loss_agg_mode",
                                  "actor_rollout_ref.actor.entropy_coeff", "actor_rollout_ref.actor.use_kl_loss",
                                  "actor_rollout_ref.actor.kl_loss_*", "actor_rollout_ref.actor.grad_clip",
                                  "actor_rollout_ref.actor.policy_loss.loss_mode",
                                  "actor_rollout_ref.actor.megatron.use_remove_padding",
                                  "actor_rollout_ref.rollout.log_prob_*")),
    (f"{ENGINE}:optimizer_settings", ("actor_rollout_ref.actor.optim.*", "critic.optim.*",
                                      "actor_rollout_ref.actor.megatron.use_distributed_optimizer",
                                      "actor_rollout_ref.actor.megatron.optimizer_offload",
                                      "critic.megatron.use_distributed_optimizer", "critic.megatron.optimizer_offload")),
    (f"{ENGINE}:reference_settings", ("actor_rollout_ref.ref.log_prob_*", "actor_rollout_ref.ref.megatron.use_remove_padding")),
    (f"{ENGINE}:critic_settings", ("critic.ppo_*", "critic.use_dynamic_bsz", "critic.shuffle", "critic.cliprange_value",
                                   "critic.loss_agg_mode", "critic.grad_clip",
                                   "critic.megatron.seed", "critic.megatron.use_remove_padding")),
    ("megarl.settings.engine:layout_from_config", tuple(f"actor_rollout_ref.actor.megatron.{k}" for k in LAYOUT)),
    (f"{VALIDATE}:_check_layout_and_batches", tuple(f"{role}.megatron.{k}" for role in ROLES_WITH_ENGINE[1:]
                                                    for k in LAYOUT) + ("actor_rollout_ref.actor.megatron.context_parallel_size",)),
    (f"{WORKER}:MegatronWorker.setup", ("actor_rollout_ref.actor.megatron.seed", "critic.model.path")),
    ("megarl.settings.engine:initial_checkpoints", tuple(f"{role}.megatron.{k}" for role in ROLES_WITH_ENGINE
                                            for k in ("use_dist_checkpointing", "dist_checkpointing_path"))),
    (f"{VALIDATE}:_check_backends", ("*.strategy", "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.mode")),
    ("megarl.settings.derived:critic_enabled", ("critic.enable",)),
    (f"{DERIVED}:old_log_prob_pass", ("actor_rollout_ref.actor.recompute_old_log_prob",)),
    (f"{VALIDATE}:_check_rewards", ("reward_model.enable",)),
    ("megarl.checks.optimizer:optimizer_problems", ("actor_rollout_ref.actor.optim.optimizer", "critic.optim.optimizer")),
    ("megarl.rollout.sampling:resolve_sampling", ("actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.temperature",
                                                  "actor_rollout_ref.rollout.top_p", "actor_rollout_ref.rollout.top_k",
                                                  "actor_rollout_ref.rollout.do_sample", "actor_rollout_ref.rollout.stop",
                                                  "actor_rollout_ref.rollout.ignore_eos",
                                                  "actor_rollout_ref.rollout.val_kwargs.*")),
    ("megarl.rollout.vllm.engine_config:replica_spec", ("actor_rollout_ref.rollout.prompt_length",
                                                   "actor_rollout_ref.rollout.response_length",
                                                   "actor_rollout_ref.rollout.dtype",
                                                   "actor_rollout_ref.rollout.gpu_memory_utilization",
                                                   "actor_rollout_ref.rollout.enforce_eager",
                                                   "actor_rollout_ref.rollout.free_cache_engine",
                                                   "actor_rollout_ref.rollout.enable_chunked_prefill",
                                                   "actor_rollout_ref.rollout.enable_prefix_caching",
                                                   "actor_rollout_ref.rollout.max_num_*",
                                                   "actor_rollout_ref.rollout.max_model_len",
                                                   "actor_rollout_ref.rollout.logprobs_mode",
                                                   "actor_rollout_ref.rollout.scheduling_policy",
                                                   "actor_rollout_ref.rollout.disable_log_stats",
                                                   "actor_rollout_ref.rollout.seed",
                                                   "actor_rollout_ref.rollout.engine_kwargs.vllm")),
    ("megarl.cluster.placement:plan_from_config", ("actor_rollout_ref.rollout.tensor_model_parallel_size",
                                                   "actor_rollout_ref.rollout.num_replicas")),
    ("megarl.config.derived:cluster_shape", ("trainer.nnodes", "trainer.n_gpus_per_node", "trainer.placement",
                                                "trainer.rollout_gpus", "rollout.nnodes", "rollout.n_gpus_per_node")),
    ("megarl.trainer.asynchronous.batches:AsyncSettings.from_config", ("async_training.mode", "async_training.staleness_threshold",
                                                             "async_training.trigger_parameter_sync_step",
                                                             "async_training.partial_rollout",
                                                             "async_training.max_off_policy_strategy",
                                                             "async_training.wait_timeout_s")),
    (f"{DERIVED}:derive_async_keys", ("async_training.require_batches",)),
    ("megarl.weight_sync.session:WeightSyncSession.from_config", ("actor_rollout_ref.rollout.weight_sync.bucket_mb",
                                                               "actor_rollout_ref.rollout.weight_sync.transport",
                                                               "actor_rollout_ref.rollout.weight_sync.timeout_s")),
    ("megarl.rewards.manager_keys:manager_name", ("reward_model.reward_manager",)),
    ("megarl.rewards.reward_models.settings:settings_from_config", ("reward_model.enable", "reward_model.enable_resource_pool",
                                                             "reward_model.model.*", "reward_model.max_length")),
    ("megarl.cluster.placement:reward_pool_from_config", ("reward_model.n_gpus_per_node", "reward_model.nnodes")),
    ("megarl.rollout.vllm.engine_config:replica_spec", ("reward_model.rollout.*",)),  # the reward model's engines
    ("megarl.rewards.reward_models.settings:reward_model_problems", ("reward_model.rollout.name",)),
    ("megarl.rewards.reward_models.settings:JudgeSettings.from_config", ("reward_model.judge.*",)),
    ("megarl.rewards.rate_limit:LimitSettings.from_config", ("reward_model.max_concurrent", "reward_model.max_rpm",
                                                            "reward_model.max_tpm",
                                                            "reward_model.estimated_tokens_per_request",
                                                            "reward_model.timeout")),
    ("megarl.rewards.manager_keys:function_kwargs", ("reward_model.reward_kwargs",)),
    ("megarl.rewards.manager_keys:overlong_penalty", ("reward_model.reward_kwargs", "reward_model.overlong_buffer.*")),
    ("megarl.rewards.custom:load_reward_function", ("custom_reward_function.*",)),
    ("megarl.rewards.manager:RewardManager.from_config", ("reward.*",)),
    ("megarl.rewards.manager_keys:compute_score_timeout", ("reward.compute_score_timeout",)),
    ("megarl.trainer.advantage_step:compute_advantages", ("algorithm.gamma", "algorithm.lam", "algorithm.adv_estimator",
                                                          "algorithm.norm_adv_by_std_in_grpo", "algorithm.sppo_eta",
                                                          "algorithm.dpo_loss_type", "algorithm.dpo_label_smoothing",
                                                          "actor_rollout_ref.actor.dpo_beta")),
    (f"{ENGINE}:loss_options", ("actor_rollout_ref.actor.tau_*", "actor_rollout_ref.actor.sppo_eta",
                                "actor_rollout_ref.actor.policy_loss.clip_cov_*",
                                "actor_rollout_ref.actor.policy_loss.kl_cov_ratio",
                                "actor_rollout_ref.actor.policy_loss.ppo_kl_coef",
                                "actor_rollout_ref.actor.policy_loss.dro_beta")),
    (f"{CONTROLLER}:RLTrainer._reference_refresh_due", ("trainer.ref_update_freq",)),
    ("megarl.trainer.advantage_step:token_level_rewards", ("algorithm.use_kl_in_reward", "algorithm.kl_penalty")),
    ("megarl.algorithms.kl:get_kl_controller", ("algorithm.kl_ctrl.*",)),
    ("megarl.algorithms.rollout_correction:RolloutCorrection.from_config", ("algorithm.rollout_correction.*",)),
    (f"{CONTROLLER}:RLTrainer.collect_batch", ("algorithm.filter_groups.*",)),
    (f"{CONTROLLER}:total_training_steps", ("trainer.total_epochs", "trainer.total_training_steps")),
    ("megarl.run.loop:TrainingLoop.run", ("trainer.save_freq", "trainer.test_freq", "trainer.val_before_train",
                                        "trainer.val_only")),
    ("megarl.trainer.resume:resume_plan", ("trainer.resume_mode", "trainer.resume_from_path")),
    (f"{CONTROLLER}:RLTrainer.validate", ("trainer.log_val_generations",)),
    ("megarl.run.samples:SampleReporter.on_train_step", ("trainer.rollout_data_dir", "trainer.log_train_generations",
                                                             "trainer.log_train_generations_freq")),
    ("megarl.run.samples:SampleReporter.on_validation", ("trainer.validation_data_dir",)),
    ("megarl.run.train:main", ("trainer.log_level",)),
    (f"{WORKER}:MegatronWorker.setup", ("actor_rollout_ref.nccl_timeout",)),
    (f"{CONTROLLER}:RLTrainer.train_step", ("trainer.balance_batch",)),
    ("megarl.run.loop:TrainingLoop.save", ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep")),
    ("megarl.trainer.checkpointing:save_on_workers", ("trainer.save_timeout_s",)),
    (f"{WORKER}:MegatronWorker.save_checkpoint", ("actor_rollout_ref.actor.checkpoint.save_contents",
                                                  "critic.checkpoint.save_contents")),
    (f"{WORKER}:MegatronWorker.load_checkpoint", ("actor_rollout_ref.actor.checkpoint.load_contents",
                                                  "critic.checkpoint.load_contents")),
    ("megarl.engine.offload_phases:offload_flags", ("*.megatron.param_offload", "actor_rollout_ref.actor.megatron.grad_offload",
                                                     "actor_rollout_ref.actor.megatron.optimizer_offload",
                                                     "critic.megatron.grad_offload", "critic.megatron.optimizer_offload")),
    (f"{ENGINE}:model_overrides", ("*.megatron.override_transformer_config", "*.model.enable_gradient_checkpointing")),
    (f"{ENGINE}:optimizer_settings", ("*.optim.override_optimizer_config",)),
    ("megarl.agent.settings:MultiTurnSettings", ("actor_rollout_ref.rollout.multi_turn.enable",
                                                 "actor_rollout_ref.rollout.multi_turn.max_*",
                                                 "actor_rollout_ref.rollout.multi_turn.tool_*",
                                                 "actor_rollout_ref.rollout.multi_turn.function_tool_path",
                                                 "actor_rollout_ref.rollout.multi_turn.format",
                                                 "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",
                                                 "actor_rollout_ref.rollout.multi_turn.drift_action")),
    (f"{VALIDATE}:_check_agent", ("actor_rollout_ref.rollout.multi_turn.interaction_config_path",
                                  "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
                                  "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
                                  "actor_rollout_ref.rollout.agent.custom_async_server.*")),
    ("megarl.agent.rollout:AgentRollout.__init__", ("actor_rollout_ref.rollout.agent.num_workers",)),
    ("megarl.agent.rollout:default_loop_name", ("actor_rollout_ref.rollout.agent.default_agent_loop",)),
    ("megarl.agent.rollout:build_agent_context", ("actor_rollout_ref.rollout.agent.agent_loop_config_path",)),
    ("megarl.plan.check:plan_problems", ("trainer.plan_check",)),
    ("megarl.trainer.training_safety:SkippedSteps.from_config", ("trainer.max_consecutive_skipped_steps",)),
    (f"{ENGINE}:lora_settings", tuple(f"{section}.{k}" for section in ("actor_rollout_ref.model.lora", "critic.model.lora")
                                      for k in ("rank", "alpha", "dropout", "target_modules", "exclude_modules",
                                                "lora_A_init_method", "lora_B_init_method"))),
    ("megarl.checks.lora:lora_problems", ("*.model.lora.type", "*.model.lora.dropout_position")),
    (f"{WORKER}:MegatronWorker._build", ("*.model.lora.adapter_path",)),
    ("megarl.weight_sync.adapter_updates:weight_updates", ("actor_rollout_ref.model.lora.merge",)),
)

INERT = {
    **{f"actor_rollout_ref.ref.megatron.{k}": "the reference model is frozen: it has no optimizer"
       for k in ("use_distributed_optimizer", "optimizer_offload", "grad_offload")},
    "data.max_response_length": "read as actor_rollout_ref.rollout.response_length, whose default is "
                                "${data.max_response_length} (verl's schema does the same)",
    "actor_rollout_ref.ref.megatron.seed": "the reference runs in the actor's parallel state (seeded by "
                                           "actor_rollout_ref.actor.megatron.seed) and has no dropout (eval mode)",
}

# Keys read by code not yet written (another branch of an issue in progress); empty on main.
PENDING: set[str] = set()


def leaf_keys() -> list[str]:
    return [key for key, kind in schema_fields().items() if kind != SECTION]


def _matches(key: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def readers_of(key: str, readers=READERS) -> list[str]:
    return [reader for reader, patterns in readers if _matches(key, patterns)]


def unread_keys(readers=READERS, inert=INERT, pending=PENDING, keys: list[str] | None = None) -> list[str]:
    """One line per key that nothing reads (or whose named reader does not read it)."""
    problems = []
    keys = leaf_keys() if keys is None else keys
    for key in keys:
        listed = readers_of(key, readers)
        excused = key in inert or _matches(key, pending)
        if excused and listed and not _matches(key, pending):
            problems.append(f"{key}: listed as inert but also read by {listed}")
        if excused:
            continue
        if not listed:
            problems.append(f"{key}: no reader named in megarl.config.consumers.READERS")
            continue
        leaf = key.rsplit(".", 1)[-1]
        if not any(leaf in names_read(reader) for reader in listed):
            problems.append(f"{key}: none of {listed} reads '{leaf}'")
    for reader, patterns in readers:
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(k, pattern) for k in keys):
                problems.append(f"{reader}: its pattern {pattern!r} matches no key of the schema")
    return problems


@lru_cache(maxsize=None)
def names_read(reader: str) -> frozenset[str]:
    """Attribute names and string constants in a reader's source: the keys it can read."""
    module_name, _, qualname = reader.partition(":")
    target = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    tree = ast.parse(textwrap.dedent(inspect.getsource(target)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)  # a settings dataclass filled field by field from its config section
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return frozenset(names)
