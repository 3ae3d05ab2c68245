"""What megarl does with each verl key that is not in its own schema.

verl's fully resolved Megatron config has about 600 keys; the ones megarl implements are fields of
``megarl.config.schema``. Every other verl key is named here by exactly one rule:

* ``Alias``: another spelling of a megarl key (verl's 2026 ``reward.*`` names, the sync bucket
  size, the FSDP-style ``model.lora_rank``); the value moves to the megarl key, and the two given
  with different values is an error. An alias with ``active`` moves only while that holds (verl's
  FSDP LoRA keys only while ``lora_rank > 0``: its defaults, e.g. ``lora_alpha: 16``, stay inert);
* ``Mapped``: a verl key whose values are settings of megarl keys (``trainer.v1.trainer_mode=
  separate_async`` is ``async_training.mode=fully_async`` with ``trainer.placement=split``); each
  value sets its keys as an alias would, and a value without a mapping is an error;
* ``Refused``: asks for a feature megarl does not have. The key is accepted only at a value that
  asks for nothing (``off``: verl's default, which turns the feature off), so a full verl config
  loads, and refused otherwise with what megarl does instead and the issue that plans the feature;
* ``Renamed``: a deprecated verl spelling that megarl does not convert; the message names the key to set;
* ``Noted``: a verl implementation option with no counterpart and no effect on results (speed or
  start-up of verl's own code); accepted, and its note is logged once when the key is given;
* ``Parameters``: settings of a feature whose switch is refused (or checked) elsewhere, e.g.
  ``lora.alpha`` next to ``lora.rank``; accepted as they are, as verl does while the feature is off.

The first rule whose pattern matches a key decides (``fnmatch``: ``*`` also matches dots).
A key that no rule and no schema field knows is unknown, and ``POINTERS`` helps name the right one.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Union

ARR, ACTOR, REF, ROLLOUT, MODEL = ("actor_rollout_ref", "actor_rollout_ref.actor", "actor_rollout_ref.ref",
                                   "actor_rollout_ref.rollout", "actor_rollout_ref.model")
TRAINED = (ACTOR, "critic")  # roles with an optimizer
ENGINES = (ACTOR, REF, "critic")  # roles with a megatron engine
ENGINE_FREE = (ROLLOUT, "reward_model")  # roles whose work runs in vLLM engines, not in megarl's workers

Off = Union[tuple, Callable[[Any, Callable[[str], Any]], bool]]


def _each(prefixes: tuple[str, ...], *suffixes: str) -> tuple[str, ...]:
    return tuple(f"{p}.{s}" for p in prefixes for s in suffixes)


@dataclass(frozen=True)
class Alias:
    key: str  # a key, or a section whose keys all move (prefix alias)
    target: str
    note: str | None = None  # logged once when the key is given (an old spelling: say it is read as ``target``)
    active: Callable[[Callable[[str], Any]], bool] | None = None  # None: always; else moves only when true


def _fsdp_lora_on(model: str) -> Callable[[Callable[[str], Any]], bool]:
    """verl's FSDP LoRA (``<model>.lora_rank`` and friends) is on when ``lora_rank > 0``."""
    return lambda get: (get(f"{model}.lora_rank") or 0) > 0


def _fsdp_lora_aliases(model: str) -> tuple[Alias, ...]:
    on = _fsdp_lora_on(model)
    return tuple(Alias(f"{model}.{key}", f"{model}.lora.{target}", active=on) for key, target in (
        ("lora_rank", "rank"), ("lora_alpha", "alpha"), ("target_modules", "target_modules"),
        ("exclude_modules", "exclude_modules"), ("lora_adapter_path", "adapter_path")))


def _v1_async(get: Callable[[str], Any]) -> bool:
    return get("trainer.v1.trainer_mode") not in (None, "sync")


@dataclass(frozen=True)
class Mapped:
    keys: tuple[str, ...]
    values: dict  # verl value -> {megarl key: value}
    note: str | None = None


@dataclass(frozen=True)
class Refused:
    keys: tuple[str, ...]
    feature: str
    instead: str
    off: Off = ()  # values that ask for nothing; None, {}, [] and ${...} interpolations always do
    issue: int | None = None
    note: str | None = None  # logged once when the key is given at an accepted value that may not hold everywhere

    def asks(self, value: Any, get: Callable[[str], Any]) -> bool:
        if value is None or value == {} or value == [] or (isinstance(value, str) and value.startswith("${")):
            return False
        if callable(self.off):
            return not self.off(value, get)
        return value not in self.off


@dataclass(frozen=True)
class Renamed:
    keys: tuple[str, ...]
    use: str  # what to set instead


@dataclass(frozen=True)
class Noted:
    keys: tuple[str, ...]
    note: str


@dataclass(frozen=True)
class Parameters:
    keys: tuple[str, ...]
    of: str  # the feature they parameterise


Rule = Union[Alias, Mapped, Refused, Renamed, Noted, Parameters]

PROFILING = ("megarl profiles the trainer's workers (<role>.profiler.enable for actor, ref, critic with "
             "global_profiler.tool and steps); the engines' time is in the timing_s/gen metric")
MODEL_REWARD = ("rule and custom reward functions score the responses (custom_reward_function.path), with a "
                "reward model or LLM judge (reward_model.enable)")

ALIASES: tuple[Alias, ...] = (
    Alias("reward.custom_reward_function", "custom_reward_function"),
    Alias("reward.reward_manager.name", "reward_model.reward_manager"),
    Alias("reward_manager.name", "reward_model.reward_manager"),  # verl's 2025 top-level section
    Alias("reward.reward_kwargs", "reward_model.reward_kwargs"),
    Alias("reward.reward_model.model_path", "reward_model.model.path"),  # verl 2026
    Alias("reward.reward_model", "reward_model"),  # verl 2026: enable, enable_resource_pool, nnodes, rollout.*, ...
    Alias("reward_model.num_workers", "reward.num_workers"),
    # verl's legacy reward-model worker sized its forwards with these; megarl's vLLM engines batch by
    # sequences and tokens per step (an interpolation, verl's default wiring, moves nowhere)
    Alias("reward_model.micro_batch_size_per_gpu", "reward_model.rollout.max_num_seqs",
          note="read as reward_model.rollout.max_num_seqs: sequences per step of the reward model's vLLM engines"),
    Alias("reward_model.forward_max_token_len_per_gpu", "reward_model.rollout.max_num_batched_tokens",
          note="read as reward_model.rollout.max_num_batched_tokens: tokens per step of the reward model's vLLM engines"),
    Alias(f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes", f"{ROLLOUT}.weight_sync.bucket_mb"),
    Alias(f"{ACTOR}.megatron.router_replay.mode", f"{ACTOR}.router_replay.mode"),  # verl's mainline spelling
    # verl 2026: the separate rollout pool's size also under actor_rollout_ref.rollout (one-step-off / fully async)
    Alias(f"{ROLLOUT}.nnodes", "rollout.nnodes"),
    Alias(f"{ROLLOUT}.n_gpus_per_node", "rollout.n_gpus_per_node"),
    Alias("data.function_tool_path", f"{ROLLOUT}.multi_turn.function_tool_path"),  # verl 2026 repeats it under data
    # verl 2026's optim.use_precision_aware_optimizer is megatron-core's OptimizerConfig field of that name
    *(Alias(f"{role}.optim.use_precision_aware_optimizer",
            f"{role}.optim.override_optimizer_config.use_precision_aware_optimizer",
            active=lambda get, role=role: get(f"{role}.optim.use_precision_aware_optimizer") is True)
      for role in TRAINED),
    *_fsdp_lora_aliases(MODEL),
    *_fsdp_lora_aliases("critic.model"),
)

RULES: tuple[Rule, ...] = ALIASES + (
    Parameters(("_target_", "*._target_"), of="verl's config class names"),
    # ---------------------------------------------------------------- verl's 2026 engine selector and groups
    # verl >= mid-2026 picks the training engine with a top-level Hydra group (`model_engine=megatron`; the
    # deprecated ppo_megatron_trainer.yaml sets it) and composes actor/ref/critic from `<engine>_actor` etc.;
    # megatron is what megarl always runs, so that value is honoured and every other engine is refused
    Refused(("model_engine", *_each(ENGINES, "model_engine")), "training engines other than megatron-core",
            "megarl trains every role with megatron-core, which is verl's model_engine=megatron "
            "(set model_engine=megatron or leave it out)", off=("megatron",)),
    Refused(_each(ENGINES, "megatron.use_megatron_fsdp"), "Megatron-FSDP (megatron-core's fully sharded "
            "data parallelism)", "megarl shards the optimizer state with the distributed optimizer and can offload "
            "(megatron.param_offload, grad_offload, optimizer_offload)", off=(False,)),
    Refused(_each(TRAINED, "checkpoint.strict"), "lenient checkpoint loads (missing or unexpected tensors skipped)",
            "megarl loads a checkpoint strictly: every tensor of the model must be in it", off=(True,)),
    Refused(_each(TRAINED, "checkpoint.mbridge_config.*"), "mbridge's checkpoint options",
            "megarl saves and exports through its own bridge (megarl/models)"),
    Refused(_each(ENGINES, "megatron.dist_ckpt_optim_fully_reshardable"), "fully reshardable optimizer checkpoints "
            "(resuming the optimizer state under another TP/PP/EP layout)", "megarl saves the optimizer state in "
            "megatron-core's default dist-checkpoint format; the weights reshard through the bridge", off=(False,)),
    Parameters(_each(ENGINES, "megatron.distrib_optim_fully_reshardable_mem_efficient"),
               of="fully reshardable optimizer checkpoints"),
    Refused(_each(ENGINES, "megatron.dynamic_context_parallel"), "dynamic context-parallel scheduling",
            "context parallelism splits every packed micro-batch over megatron.context_parallel_size ranks",
            off=(False,)),
    Parameters(_each(ENGINES, "megatron.max_seqlen_per_dp_cp_rank"), of="dynamic context parallelism"),
    Noted(_each(ENGINES, "megatron.pad_to_length", "megatron.pad_to_length_bucket", "megatron.pad_bshd_to_minibatch_max"),
          "verl's padding-shape options (fewer kernel recompilations; speed only): megarl packs each micro-batch's "
          "sequences (THD) with its own padding"),
    Noted(_each(ENGINES, "entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size",
                "megatron.entropy_from_logits_with_chunking", "megatron.entropy_from_logits_chunk_size"),
          "megarl computes entropy with its own vocab-parallel kernels, a TP shard of the vocabulary at a time "
          "(verl's chunking saves the same memory)"),
    Refused(_each(ENGINES, "megatron.qat.enable", "qat.enable") + (f"{ROLLOUT}.qat",),
            "quantization-aware training (QAT)", "megarl trains in bf16 and serves the trainer's weights in "
            "rollout.dtype", off=(False,)),
    Parameters(_each(ENGINES, "megatron.qat.*", "qat.*"), of="quantization-aware training"),
    Refused(_each(TRAINED, "optim.use_layer_wise_distributed_optimizer"), "megatron-core's layer-wise distributed "
            "optimizer", "the distributed optimizer shards the optimizer state over data-parallel ranks",
            off=(False,)),
    Refused(_each(TRAINED, "optim.main_grads_dtype", "optim.exp_avg_dtype", "optim.exp_avg_sq_dtype"),
            "low-precision gradient buffers or Adam moments", "the optimizer keeps fp32 main gradients and moments "
            "(megatron-core's defaults); to save memory, offload them (megatron.optimizer_offload)",
            off=("fp32", "float32")),
    Parameters(_each(TRAINED, "optim.muon_*"), of="the Muon optimizer (picked by optim.optimizer)"),
    Refused((f"{ACTOR}.calculate_sum_pi_squared",), "the sum of squared token probabilities (verl's optimal token "
            "baseline)", "megarl computes the log-probs and the entropy of each token", off=(False,)),
    # ---------------------------------------------------------------- model and bridge
    Noted(_each(ENGINES, "megatron.use_mbridge", "megatron.vanilla_mbridge")
          + ("reward_model.megatron.use_mbridge", "reward_model.megatron.vanilla_mbridge"),
          "megarl loads and exports Hugging Face checkpoints with its own bridge (megarl/models); "
          "mbridge and Megatron-Bridge are not used"),
    Noted((f"{MODEL}.use_fused_kernels", f"{ACTOR}.use_fused_kernels", f"{MODEL}.fused_kernel_options.*",
           "critic.model.use_fused_kernels", "critic.model.fused_kernel_options.*"),
          "megarl computes log-probs and entropy with its own vocab-parallel kernels (full-vocab logits are "
          "never gathered over TP); verl's fused kernels are not used"),
    Noted((f"{MODEL}.use_remove_padding", "critic.model.use_remove_padding"),
          "verl's FSDP workers read model.use_remove_padding; its Megatron workers, like megarl, pack sequences "
          "by <role>.megatron.use_remove_padding (actor, ref, critic; default True)"),
    Noted(_each((ACTOR, REF), "use_torch_compile"), "megarl does not torch.compile its kernels (speed only)"),
    Noted(_each(ENGINES, "calculate_entropy"), "megarl computes the entropy metric every step"),
    Noted((f"{MODEL}.use_shm", "data.use_shm", "critic.model.use_shm"), "megarl reads checkpoints and data files in place"),
    Noted((f"{MODEL}.use_liger", f"{MODEL}.tiled_mlp.*", "critic.model.use_liger", "critic.model.tiled_mlp.*"),
          "FSDP-only options in verl; its Megatron workers do not use them either"),
    Refused(("critic.model.tokenizer_path",), "a critic tokenizer apart from the actor's",
            "the critic scores the actor's token ids", off=lambda value, get: value in (
                get(f"{MODEL}.tokenizer_path"), get(f"{MODEL}.path"), get("critic.model.path"))),
    Noted(("critic.model.trust_remote_code",),
          "the bridge builds the critic from config.json and the safetensors; no remote code runs"),
    Parameters(_each(ENGINES, "megatron.forward_only", "rollout_n"), of="verl's per-role internals"),
    Refused(_each(ENGINES, "megatron.dtype"), "training in a dtype other than bf16",
            "megarl trains in bf16 on GPUs and fp32 on CPUs (megarl.platform.default_dtype)", off=("bfloat16", "bf16"),
            note="megarl trains in bf16 on GPUs; on a CPU host it trains in fp32 whatever this key says (bf16 matmuls "
                 "are 2-3x slower on CPUs)"),
    Refused(_each(ENGINES, "megatron.dist_checkpointing_prefix"), "a key prefix in dist checkpoints",
            "megarl's dist checkpoints use the bridge's parameter names", off=("",)),
    Refused(_each(ENGINES, "megatron.override_ddp_config.*"), "overriding megatron's DDPConfig",
            "megarl builds the DDP config itself (overlapped grad reduce, distributed optimizer)"),
    Refused(_each(ENGINES, "megatron.override_mcore_model_config.*"), "overriding megatron's model arguments",
            "the bridge derives the GPTModel from config.json"),
    Refused(_each(ENGINES, "load_weight"), "random initialisation instead of the checkpoint's weights",
            "the models start from model.path (or a dist checkpoint)", off=(True,)),
    Refused((f"{MODEL}.hf_config_path", "critic.model.hf_config_path"), "a config.json apart from the weights",
            "actor_rollout_ref.model.path must hold config.json and the safetensors"),
    Refused((f"{MODEL}.external_lib", "critic.model.external_lib"), "importing external model code",
            "models must belong to a bridge family (megarl.models.families)"),
    Refused((f"{MODEL}.override_config.moe_config.freeze_moe_router",
             "critic.model.override_config.moe_config.freeze_moe_router"),
            "freezing the MoE router", "the router trains with the rest of the model", off=(False,)),
    Refused((f"{MODEL}.override_config.*", "critic.model.override_config.*"), "Hugging Face config fields "
            "directly under override_config (verl's FSDP form)", "set them under <model>.override_config.model_config, "
            "where megarl reads them for every model of the run, as verl's Megatron workers do",
            off=lambda value, get: False),
    Refused((f"{MODEL}.enable_activation_offload", "critic.model.enable_activation_offload"), "activation offload",
            "use activation recompute (megatron.override_transformer_config.recompute_*)", off=(False,)),
    Refused(_each((MODEL, "critic.model"), "mtp.enable", "mtp.enable_train", "mtp.enable_rollout"),
            "multi-token prediction (MTP) layers", "a checkpoint's MTP tensors are skipped and named in one log line "
            "(DeepSeek-V3, Kimi-K2, GLM-4.5, Qwen3-Next): megarl trains and serves the main model, and an export "
            "copies them from the source checkpoint unchanged", off=(False,), issue=24),
    Parameters((f"{MODEL}.mtp.*", "critic.model.mtp.*", f"{ROLLOUT}.mtp"), of="multi-token prediction"),
    Refused(("critic.model.custom_chat_template",), "a critic chat template apart from the actor's",
            "the critic scores the actor's token ids", off=lambda value, get: value == get(f"{MODEL}.custom_chat_template")),
    Noted(("critic.model.lora.merge",), "the critic's weights never reach a rollout engine: lora.merge applies to "
          "the actor's adapters only"),
    Noted(("data.image_patch_size",), "megarl resizes each image once, by the model's image processor (the patch "
          "size, merge size and min/max pixels of its preprocessor_config.json); verl's pre-resize to multiples of "
          "2 x data.image_patch_size is not done"),
    Noted(("data.return_multi_modal_inputs",), "the dataset keeps each row's resized images; pixel values are made "
          "from them where they are needed (megarl.data.images.pixel_inputs)"),
    Refused(("data.mm_processor_kwargs",), "processor arguments per call", "images are resized once, at load, by "
            "the model's image processor: set min_pixels / max_pixels in its preprocessor_config.json"),
    # ---------------------------------------------------------------- LoRA (the FSDP-style lora_rank, ...: ALIASES)
    Refused(_each((MODEL, "critic.model"), "lora.a2a_experimental"), "Megatron-Bridge's experimental all-to-all "
            "LoRA for experts", "expert adapters run inside megatron's token dispatcher", off=(False,)),
    Refused(_each((MODEL, "critic.model"), "lora.dtype"), "an adapter dtype apart from the model's",
            "adapters are in the model's dtype (bf16 on GPU, fp32 on CPU); merges are computed in fp32"),
    Parameters(_each((MODEL, "critic.model"), "lora.freeze_vision_model", "lora.freeze_vision_projection",
                     "lora.freeze_language_model"), of="vision-language LoRA (lora.type=vlm_lora is refused)"),
    # ---------------------------------------------------------------- actor loss and optimizer
    Refused((f"{ACTOR}.loss_scale_factor", "critic.loss_scale_factor"), "a custom loss_scale_factor",
            "seq-mean-token-sum-norm divides by the padded response length (verl's default)"),
    Refused((f"{ACTOR}.use_prefix_grouper",), "the prefix grouper (shared-prompt attention)",
            "each sample is computed with its own prompt", off=(False,)),
    Refused(("algorithm.dpo_beta",), "DPO's beta under algorithm (verl's SPIN trainer passes it on, but its update "
            "reads actor_rollout_ref.actor.dpo_beta)", f"set {ACTOR}.dpo_beta",
            off=lambda value, get: value == get(f"{ACTOR}.dpo_beta")),
    Refused(_each((REF, "critic", f"{REF}.megatron", "critic.megatron"), "router_replay.mode"),
            "router replay outside the actor", "the reference and the critic route live; the actor replays "
            f"({ACTOR}.router_replay.mode)", off=("disabled",)),
    Refused(_each((ACTOR, f"{ACTOR}.megatron"), "router_replay.record_file", "router_replay.replay_file"),
            "routing tables in files", "the routing travels with the step's data (RLBatch.routed_experts)"),
    Parameters(_each(ENGINES, "router_replay.*", "megatron.router_replay.*"), of="router replay"),
    Refused(_each(TRAINED, "optim.lr_decay_steps"), "a decay horizon apart from the run's length",
            "the LR decays over optim.total_training_steps (the run's steps)"),
    Refused(_each(TRAINED, "optim.weight_decay_incr_style"), "weight-decay schedules",
            "weight decay stays at optim.weight_decay", off=("constant",)),
    Refused(_each(TRAINED, "optim.use_checkpoint_opt_param_scheduler"), "taking the LR schedule's settings from a checkpoint",
            "the schedule's shape comes from the config, its position from the checkpoint", off=(False,)),
    Parameters(_each(TRAINED, "optim.lr_wsd_decay_style", "optim.lr_wsd_decay_steps"),
               of="the WSD schedule (refused by the lr_decay_style check)"),
    Refused(_each(TRAINED, "checkpoint.async_save"), "asynchronous checkpoint saves",
            "checkpoints are written synchronously through step_<N>.tmp and a rename", off=(False,)),
    Renamed((f"{REF}.log_prob_micro_batch_size",), f"{REF}.log_prob_micro_batch_size_per_gpu"),
    Renamed((f"{ROLLOUT}.log_prob_micro_batch_size",), f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"),
    Renamed(("critic.ppo_micro_batch_size",), "critic.ppo_micro_batch_size_per_gpu"),
    Renamed(("data.tokenizer",), f"{MODEL}.tokenizer_path"),
    Refused(("critic.forward_max_token_len_per_gpu",), "a separate token budget for the critic's value pass",
            "values are computed with critic.ppo_max_token_len_per_gpu",
            off=lambda value, get: value == get("critic.ppo_max_token_len_per_gpu")),
    Refused(("critic.data_loader_seed",), "a critic shuffle seed apart from the actor's",
            "the critic's mini-batches are shuffled with critic.megatron.seed",
            off=lambda value, get: value == get(f"{ACTOR}.data_loader_seed")),
    Refused(("critic.nccl_timeout",), "a critic process-group timeout apart from the actor's",
            "the critic runs in the actor's process groups: set actor_rollout_ref.nccl_timeout",
            off=lambda value, get: value == get(f"{ARR}.nccl_timeout")),
    Mapped((f"{ARR}.hybrid_engine",), {True: {}, False: {"trainer.placement": "split"}}),
    # ---------------------------------------------------------------- profiling (honoured: megarl.settings.profiling)
    Refused(_each(ENGINE_FREE, "profiler.enable"), "profiling the rollout or reward-model engines", PROFILING,
            off=(False,)),
    Parameters(_each(ENGINE_FREE, "profiler.*"), of="profiling the vLLM engines (refused by <role>.profiler.enable)"),
    Refused(_each(ENGINES, "profiler.relocate_results") + ("global_profiler.relocate_results",),
            "moving nsys reports out of Ray's session directory", "the reports stay where Ray's Nsight plugin "
            "writes them (<ray session dir>/logs/nsight); copy them after the run", off=(False,)),
    Refused(_each(ENGINES, "profiler.finish_hook_cmd") + ("global_profiler.finish_hook_cmd",),
            "a command run on the workers after profiling", "run it after the job on global_profiler.save_path"),
    Parameters(_each(ENGINES, "profiler.finish_hook_all_ranks", "profiler.finish_hook_ranks")
               + ("global_profiler.finish_hook_all_ranks", "global_profiler.finish_hook_ranks"),
               of="the profiler's finish hook (refused by finish_hook_cmd)"),
    Refused(_each(ENGINES, "profiler.tool_config.torch.profile_token_start", "profiler.tool_config.torch.profile_token_end",
                  "profiler.tool_config.npu.profile_token_start", "profiler.tool_config.npu.profile_token_end"),
            "profiling a window of response tokens (the rollout's)", "megarl profiles the trainer's stages whole"),
    Parameters(_each(ENGINES, "profiler.tool_config.torch.schedule.*"),
               of="the torch profiler's schedule (only active > 0 asks for it, and is refused)"),
    Parameters(_each(ENGINES, "profiler.tool_config.npu.*", "profiler.tool_config.torch_memory.*",
                     "profiler.tool_config.precision_debugger.*")
               + ("global_profiler.global_tool_config.torch_memory.*", "global_profiler.global_tool_config.precision_debugger.*",
                  "global_profiler.global_tool_config.precision_debugger"),
               of="profiler tools megarl refuses by global_profiler.tool (npu, torch_memory, precision_debugger)"),
    Noted(("global_profiler.global_tool_config.nsys.controller_nsight_options.*",),
          "megarl's controller is the driver process, not a Ray actor: to trace it too, launch megarl under "
          "`nsys profile`; the workers run under global_tool_config.nsys.worker_nsight_options"),
    # ---------------------------------------------------------------- rollout
    Noted((f"{ROLLOUT}.multi_stage_wake_up", "reward_model.rollout.multi_stage_wake_up"),
          "megarl always wakes the weights first, then the KV cache"),
    Noted((f"{ROLLOUT}.layered_summon", "reward_model.rollout.layered_summon"), "an FSDP option of verl's (gathering "
          "the weights layer by layer): megarl sends the weights bucket by bucket (rollout.weight_sync.bucket_mb)"),
    Refused((f"{ROLLOUT}.full_determinism", "reward_model.rollout.full_determinism"), "bitwise-deterministic "
            "rollouts", "the engines are seeded (rollout.seed), not batch-invariant", off=(False,)),
    Refused((f"{ROLLOUT}.moe_load_balance_metrics_interval",), "the rollout's MoE load-balance metrics",
            "they need the rollout's routing, which the fleet does not return (enable_rollout_routing_replay)",
            off=(0,)),
    Refused((f"{ROLLOUT}.disaggregation.enabled", "reward_model.rollout.disaggregation.enabled"),
            "prefill/decode disaggregation", "each replica prefills and decodes its own requests", off=(False,)),
    Parameters((f"{ROLLOUT}.disaggregation.*", "reward_model.rollout.disaggregation.*"), of="disaggregated serving"),
    Refused((f"{ROLLOUT}.checkpoint_engine.custom_backend_module",), "verl's checkpoint engines",
            "megarl syncs weights with its own layer: set actor_rollout_ref.rollout.weight_sync.transport "
            "(auto, nccl, gloo or cuda_ipc)"),
    # verl 2026's reward-model engines take the rollout's sampling keys; megarl's judge and reward-model requests
    # carry their own (temperature 0 unless reward_model.judge says otherwise), so only verl's defaults pass
    Refused(("reward_model.rollout.do_sample", "reward_model.rollout.temperature", "reward_model.rollout.top_k",
             "reward_model.rollout.top_p", "reward_model.rollout.n", "reward_model.rollout.ignore_eos"),
            "engine-wide sampling settings for the reward model", "a judge's requests carry their sampling "
            "(reward_model.judge; greedy by default) and a reward model scores without sampling",
            off=(True, False, 1.0, 1, -1)),
    Refused(("reward_model.rollout.scheduling_policy",), "a scheduling policy for the reward model's engines",
            "they serve requests first come, first served", off=("fcfs",)),
    Refused(("reward_model.rollout.pipeline_model_parallel_size",), "pipeline parallelism in the reward model's "
            "engines", "raise reward_model.rollout.tensor_model_parallel_size", off=(1,)),
    Refused(("reward_model.rollout.quantization",), "quantized reward-model weights",
            "the engines serve reward_model.model.path's weights in reward_model.rollout.dtype"),
    Parameters(("reward_model.rollout.quantization_config_file", "reward_model.rollout.mtp"),
               of="quantized or speculative reward-model serving"),
    Noted((f"{ROLLOUT}.skip_tokenizer_init",), "the fleet keeps vLLM's tokenizer (stop strings and response texts need it)"),
    Noted((f"{ROLLOUT}.calculate_log_probs",), "the fleet always returns the sampled tokens' log-probs (rollout/logprob_diff)"),
    Noted((f"{ROLLOUT}.layer_name_map.*",), "megarl derives vLLM's fused parameter names from the model family"),
    Refused((f"{ROLLOUT}.load_format",), "vLLM load formats other than auto", "the engines load model.path's "
            "safetensors, then receive the trainer's weights", off=("auto", "dummy", "safetensors")),
    Refused((f"{ROLLOUT}.moe_tensor_parallel_size",), "a tensor-parallel size for the rollout's experts apart "
            "from the engine's", "in vLLM (verl allows this key for TensorRT-LLM only) every expert is split over "
            "the engine's TP ranks, or with actor_rollout_ref.rollout.expert_parallel_size=tensor_model_parallel_size "
            "each expert is whole on one rank", off=(1,)),
    Refused((f"{ROLLOUT}.pipeline_model_parallel_size",), "pipeline parallelism in the rollout engines",
            "raise actor_rollout_ref.rollout.tensor_model_parallel_size (a replica may span nodes)", off=(1,)),
    Refused((f"{ROLLOUT}.cudagraph_capture_sizes",), "this key for CUDA-graph sizes",
            "pass actor_rollout_ref.rollout.engine_kwargs.vllm.cudagraph_capture_sizes"),
    Refused((f"{ROLLOUT}.over_sample_rate",), "over-sampling (aborting the slowest requests)",
            "every request of a step runs to its end", off=(0,)),
    Refused((f"{ROLLOUT}.quantization",), "quantized rollout weights",
            "the engines serve the trainer's weights in rollout.dtype"),
    Parameters((f"{ROLLOUT}.quantization_config_file",), of="quantized rollout"),
    Refused((f"{ROLLOUT}.engine_kwargs.sglang.*", f"{ROLLOUT}.engine_kwargs.trtllm.*"),
            "SGLang and TensorRT-LLM engine arguments", "the rollout engine is vLLM: use rollout.engine_kwargs.vllm"),
    Refused((f"{ROLLOUT}.checkpoint_engine.backend",), "verl's checkpoint engines",
            "megarl syncs weights with its own layer: set actor_rollout_ref.rollout.weight_sync.transport "
            "(auto, nccl, gloo or cuda_ipc)", off=("naive",)),
    Refused((f"{ROLLOUT}.checkpoint_engine.engine_kwargs.*",), "checkpoint-engine arguments",
            "see actor_rollout_ref.rollout.weight_sync.*"),
    Refused((f"{ROLLOUT}.trace.backend",), "rollout tracing", "samples are logged by trainer.log_val_generations"),
    Parameters((f"{ROLLOUT}.trace.*",), of="rollout tracing"),
    Refused((f"{ROLLOUT}.skip_rollout", "skip.*.enable"), "replaying dumped rollouts",
            "every step generates its rollouts", off=(False,)),
    Parameters((f"{ROLLOUT}.skip_dump_dir", "skip.*"), of="rollout replay"),
    Refused((f"{ROLLOUT}.enable_rollout_routing_replay",), "MoE routing replay from the rollout",
            "the trainer routes the tokens itself", off=(False,)),
    Refused((f"{ROLLOUT}.prometheus.enable",), "Prometheus metrics of the rollout servers",
            "megarl's metrics go to trainer.logger", off=(False,)),
    Parameters((f"{ROLLOUT}.prometheus.*",), of="rollout Prometheus metrics"),
    # ---------------------------------------------------------------- multi-turn and agents (issue 13)
    Alias(f"{ROLLOUT}.tool_kwargs.tools_config_file", f"{ROLLOUT}.multi_turn.tool_config_path",
          note=f"an old spelling, read as {ROLLOUT}.multi_turn.tool_config_path"),
    Parameters(("data.tool_config_path",), of="multi-turn rollouts (megarl reads rollout.multi_turn.tool_config_path)"),
    # ---------------------------------------------------------------- data
    Noted(("data.dataloader_num_workers", "data.filter_overlong_prompts_workers"),
          "megarl tokenises the dataset once at start-up, in the driver"),
    Noted(("data.return_raw_chat", "data.return_raw_input_ids", "data.return_full_prompt"),
          "megarl keeps every row's chat messages and token ids; the flag changes nothing here"),
    Noted(("data.validation_shuffle",), "validation scores every row once; the order does not change the scores"),
    Refused(("data.custom_cls.path",), "custom dataset classes",
            "megarl reads verl-format parquet rows (prompt, reward_model, data_source, extra_info)"),
    Refused(("data.sampler.class_path",), "custom samplers (curricula)", "batches are drawn by data.shuffle / data.seed"),
    Refused(("data.datagen.path",), "generated datasets", "the prompts come from data.train_files"),
    Parameters(("data.custom_cls.*", "data.sampler.*", "data.datagen.*"), of="custom data classes"),
    # ---------------------------------------------------------------- rewards
    Refused(("reward_manager.source", "reward.reward_manager.source"), "reward managers from other sources",
            "reward managers: naive, dapo, batch, rate_limited; custom scoring goes in custom_reward_function",
            off=("register",)),
    Refused(("reward_manager.module.path", "reward.reward_manager.module.path"), "custom reward manager classes",
            "reward managers: naive, dapo, batch, rate_limited; custom scoring goes in custom_reward_function"),
    Parameters(("reward_manager.module.*", "reward.reward_manager.module.*"), of="custom reward managers"),
    Refused(("reward_model.sandbox_fusion.url", "sandbox_fusion.url", "reward.sandbox_fusion.url"),
            "code-execution rewards (sandbox fusion)", MODEL_REWARD),
    Parameters(("reward_model.sandbox_fusion.*", "sandbox_fusion.*", "reward.sandbox_fusion.*"), of="sandbox fusion"),
    Noted(("reward_model.launch_reward_fn_async",),
          "megarl scores in the controller after generation, in parallel with reward.num_workers"),
    # ---------------------------------------------------------------- reward models (megarl.rewards.reward_models)
    Renamed(("reward_model.micro_batch_size",), "reward_model.micro_batch_size_per_gpu"),
    Noted(("reward_model.use_dynamic_bsz", "reward_model.strategy"),
          "megarl serves reward models with vLLM, as verl's reward loop does: its engines batch the requests by "
          "sequences and tokens (reward_model.rollout.max_num_seqs, max_num_batched_tokens)"),
    Refused(("reward_model.use_reward_loop",), "verl's legacy reward-model worker (a training-engine forward)",
            "megarl serves reward models with vLLM scoring replicas, as verl's reward loop does (faster here: "
            "docs/rewards.md, Reward models)", off=(True,)),
    Refused(_each(("reward_model.megatron",), "tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "context_parallel_size", "expert_model_parallel_size", "virtual_pipeline_model_parallel_size"),
            "a Megatron layout for the reward model", "the reward model runs on vLLM: set "
            "reward_model.rollout.tensor_model_parallel_size", off=(1,)),
    Parameters(("reward_model.megatron.*", "reward_model.load_weight", "reward_model.nccl_timeout"),
               of="verl's legacy reward-model worker (reward_model.use_reward_loop=False is refused)"),
    Refused(("reward_model.reward_loop_source",), "reward managers from other sources",
            "reward managers: naive, dapo, batch, rate_limited; custom scoring goes in custom_reward_function",
            off=("register",)),
    Refused(("reward_model.reward_loop_module_path", "reward_model.reward_loop_class_name"),
            "custom reward manager classes",
            "reward managers: naive, dapo, batch, rate_limited; custom scoring goes in custom_reward_function"),
    Refused(("reward_model.model.external_lib",), "importing external model code",
            "the reward model is served by vLLM from its config.json and safetensors"),
    Refused(("reward_model.model.override_config.*",), "overriding Hugging Face config fields",
            "edit config.json in a copy of the reward model's checkpoint"),
    Refused(("reward_model.rollout.skip_tokenizer_init",), "a reward model engine without its tokenizer",
            "the reward model's engines need their tokenizer (chat templates, judge texts)", off=(False,)),
    Refused(("reward_model.rollout.load_format",), "vLLM load formats other than auto",
            "the reward model's engines load reward_model.model.path's safetensors", off=("auto",)),
    Refused(("reward_model.rollout.data_parallel_size", "reward_model.rollout.expert_parallel_size"),
            "data or expert parallelism inside one reward-model engine",
            "each replica is one engine; the count follows from the devices and reward_model.rollout."
            "tensor_model_parallel_size", off=(1,)),
    Refused(("reward_model.rollout.cudagraph_capture_sizes",), "this key for CUDA-graph sizes",
            "pass reward_model.rollout.engine_kwargs.vllm.cudagraph_capture_sizes"),
    Parameters(("reward_model.rollout.limit_images",), of="vision-language reward models (refused by the model check)"),
    Refused(("reward_model.rollout.engine_kwargs.sglang.*", "reward_model.rollout.engine_kwargs.trtllm.*"),
            "SGLang and TensorRT-LLM engine arguments", "the reward model's engine is vLLM: use "
            "reward_model.rollout.engine_kwargs.vllm"),
    # ---------------------------------------------------------------- algorithm
    Refused(("algorithm.filter_groups.max_inflight_gen_batches",), "several DAPO generation batches in flight",
            "DAPO generates further batches one after another until enough groups remain "
            "(algorithm.filter_groups.max_num_gen_batches bounds them)", off=(1,)),
    Refused(("algorithm.use_pf_ppo",), "PF-PPO (reweighted sampling of the batch)",
            "every sample of the batch is trained on once per epoch", off=(False,)),
    Parameters(("algorithm.pf_ppo.*",), of="PF-PPO"),
    # ---------------------------------------------------------------- asynchronous training (megarl's async_training.*)
    Mapped(("trainer.v1.trainer_mode",), {
        "sync": {"async_training.mode": "sync"},
        "colocate_async": {"async_training.mode": "fully_async", "trainer.placement": "colocated"},
        "separate_async": {"async_training.mode": "fully_async", "trainer.placement": "split"}}),
    # (the sampler's bounds mean something in verl's asynchronous modes only: its sync trainer is on-policy)
    Alias("trainer.v1.sampler.max_off_policy_threshold", "async_training.staleness_threshold", active=_v1_async),
    Alias("trainer.v1.sampler.max_off_policy_strategy", "async_training.max_off_policy_strategy", active=_v1_async),
    Alias("trainer.v1.separate_async.parameter_sync_step", "async_training.trigger_parameter_sync_step",
          active=lambda get: get("trainer.v1.trainer_mode") == "separate_async"),
    Alias("trainer.v1.colocate_async.parameter_sync_step", "async_training.trigger_parameter_sync_step",
          active=lambda get: get("trainer.v1.trainer_mode") == "colocate_async"),
    Alias("async_training.use_rollout_log_probs", "algorithm.rollout_correction.bypass_mode",
          note="read as algorithm.rollout_correction.bypass_mode (the rollout's log-probs are the old log-probs)"),
    Alias(f"{ACTOR}.use_rollout_log_probs", "algorithm.rollout_correction.bypass_mode",
          note="read as algorithm.rollout_correction.bypass_mode (the rollout's log-probs are the old log-probs)"),
    Refused(("async_training.compute_prox_log_prob", "async_training.recompute_old_log_prob"),
            "this spelling of decoupled PPO", "set algorithm.rollout_correction.bypass_mode=False: the trainer's "
            "log-probs are then the proximal policy and rollout_is / rollout_rs correct for the rollout's",
            off=(False,)),
    Refused(("async_training.max_queue_size",), "a separate bound on the sample queue",
            "async_training.staleness_threshold bounds the groups generated ahead of the trainer"),
    Refused(("trainer.v1.colocate_async.num_warmup_batches", "trainer.v1.separate_async.num_warmup_batches"),
            "a warm-up other than one batch", "the producer runs as far ahead as async_training.staleness_threshold "
            "allows from the first step on", off=(1,)),
    Refused(("trainer.v1.sampler.custom_sampler.path",), "custom replay-buffer samplers",
            "groups train earliest deadline first (async_training.max_off_policy_strategy)"),
    Refused(("trainer.v1.separate_async.hybrid_rollout.enable_switch",), "lending idle trainer GPUs to generation "
            "(verl's hybrid rollout switch)", "the split placement keeps trainer and rollout devices apart "
            "(trainer.rollout_gpus sizes the rollout's share)", off=(False,)),
    Parameters(("trainer.v1.separate_async.hybrid_rollout.*",), of="verl's hybrid rollout switch"),
    Refused(("trainer.v1.*",), "this option of verl's v1 trainer", "megarl's asynchronous loop is configured by "
            "async_training.* (docs/training.md, Asynchronous training)", off=(False, 0)),
    Parameters(("trainer.v1.sampler.custom_sampler.*",), of="custom samplers"),
    Noted(("trainer.use_v1", "trainer.use_legacy_worker_impl"), "megarl has one trainer; verl's implementation "
          "switches change nothing here"),
    Alias("rollout.n", f"{ROLLOUT}.n"),  # verl's fully-async recipe repeats it in its rollout pool section
    Alias("rollout.total_epochs", "trainer.total_epochs"),
    Refused(("rollout.total_rollout_steps",), "counting the run in rollout samples",
            "set trainer.total_training_steps (verl: total_rollout_steps / data.train_batch_size)"),
    Refused(("rollout.test_freq",), "validation counted in weight syncs", "set trainer.test_freq (in steps)"),
    Refused(("data.gen_batch_size",), "a generation batch apart from the train batch",
            "megarl generates data.train_batch_size prompts per step (DAPO: further batches until enough groups "
            "remain; the asynchronous modes stream group by group)",
            off=lambda value, get: value in (1, get("data.train_batch_size"))),
    # on-policy distillation: verl's teacher engine keys that megarl's teachers do not take
    Refused(("distillation.teacher_models.*.inference.data_parallel_size",
             "distillation.teacher_models.*.inference.expert_parallel_size"),
            "data or expert parallelism inside a teacher's engine", "a teacher's replicas are TP groups "
            "(inference.tensor_model_parallel_size); more replicas come from num_replicas or the pool's size",
            off=(1,)),
    Refused(("distillation.teacher_models.*.inference.pipeline_model_parallel_size",),
            "pipeline parallelism inside a teacher's engine", "use inference.tensor_model_parallel_size", off=(1,)),
    Refused(("distillation.teacher_models.*.inference.temperature",), "scoring with a teacher at a temperature",
            "the teacher's log-probs are its own distribution's (temperature 1)", off=(1.0, 1)),
    Noted(("distillation.teacher_models.*.inference.free_cache_engine",),
          "a teacher has devices of its own (distillation.nnodes x n_gpus_per_node) and never sleeps"),
    Noted(("distillation.teacher_models.*.inference.cudagraph_capture_sizes",
           "distillation.teacher_models.*.inference.load_format",
           "distillation.teacher_models.*.inference.skip_tokenizer_init",
           "distillation.teacher_models.*.inference.limit_images"),
          "a teacher engine's start-up option of verl's; megarl's teacher engines score token ids with their "
          "defaults (enforce_eager picks CUDA graphs)"),
    Noted(("distillation.distillation_loss.use_chunked_topk",),
          "megarl's top-k loss never builds a log_softmax over the vocabulary: it reduces the normaliser per "
          "tensor-parallel vocabulary shard and gathers the k logits (megarl.engine.vocab_parallel)"),
    Parameters(("distillation.distillation_loss.chunked_topk_chunk_size",), of="verl's chunked top-k (noted)"),
    # ---------------------------------------------------------------- trainer
    Refused(("trainer.default_hdfs_dir",), "HDFS checkpoint copies", "checkpoints go to trainer.default_local_dir"),
    Refused(("trainer.del_local_ckpt_after_load",), "deleting a checkpoint after loading it",
            "checkpoints stay; trainer.max_actor_ckpt_to_keep bounds them", off=(False,)),
    Refused(("trainer.esi_redundant_time",), "ESI elastic-instance checkpoints", "use trainer.save_freq", off=(0,)),
    Refused(("trainer.device",), "devices other than CUDA GPUs",
            "megarl runs on CUDA GPUs, or on CPU where there is none", off=("cuda",)),
    Noted(("trainer.ray_wait_register_center_timeout",), "megarl's workers need no register center"),
    Refused(("transfer_queue.enable",), "the TransferQueue data plane", "batches move as Ray objects", off=(False,)),
    Parameters(("transfer_queue.*",), of="TransferQueue"),
    Refused(("hydra.*",), "Hydra's job settings (run directories, job logging)",
            "megarl writes under trainer.default_local_dir and logs to the console"),
    # verl's 2026 launches run the driver and Ray's workers through `uv run --extra <rollout> --extra megatron`
    # and say so here; megarl's workers run in the driver's interpreter, i.e. in that same uv environment when
    # megarl is launched under `uv run` (a cluster started beforehand: the interpreter that started it)
    Refused(("ray_kwargs.ray_init.runtime_env.py_executable",), "running Ray's workers under another interpreter",
            "megarl's workers run in the driver's Python environment (or the one that started the cluster): "
            "launch megarl under the interpreter you need",
            off=lambda value, get: isinstance(value, str) and value.split()[:1] == ["uv"] and " run" in value,
            note="megarl's Ray workers run in the driver's interpreter: launched under `uv run ...`, that is the "
                 "uv environment this key names"),
    Refused(("ray_kwargs.ray_init.runtime_env.*",), "Ray runtime environments set from the config",
            "start Ray in the environment you need (launch/ray_local.sh, slurm/launch.sh)"),
)

# Keys of megarl's schema that verl reads with ``config.get`` but its default config lacks, so verl's
# users add them with '+' (Hydra refuses '+' on a key that exists): '+' sets them here too.
ADDED_WITH_PLUS = frozenset(f"reward_model.{k}" for k in (
    "max_concurrent", "max_rpm", "max_tpm", "estimated_tokens_per_request", "timeout"))  # verl's rate_limited manager

# Leaf names other frameworks (and verl habits) use for a megarl key: the leaf to look for instead.
POINTERS = {
    "lr": "optim.lr", "learning_rate": "optim.lr", "weight_decay": "optim.weight_decay",
    "warmup_steps": "optim.lr_warmup_steps", "lr_warmup_steps": "optim.lr_warmup_steps",
    "max_grad_norm": "grad_clip", "grad_norm": "grad_clip", "clip_grad_norm": "grad_clip",
    "num_generations": "rollout.n", "num_samples": "rollout.n", "group_size": "rollout.n",
    "max_new_tokens": "data.max_response_length", "max_tokens": "data.max_response_length",
    "kl_coef": "kl_loss_coef", "beta": "kl_loss_coef", "epsilon": "clip_ratio", "cliprange": "clip_ratio",
    "batch_size": "data.train_batch_size", "mini_batch_size": "ppo_mini_batch_size",
    "micro_batch_size": "ppo_micro_batch_size_per_gpu", "micro_batch_size_per_gpu": "ppo_micro_batch_size_per_gpu",
    "tp": "tensor_model_parallel_size", "tp_size": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size", "pp_size": "pipeline_model_parallel_size",
    "ep": "expert_model_parallel_size", "gradient_checkpointing": "enable_gradient_checkpointing",
    "epochs": "trainer.total_epochs", "num_epochs": "trainer.total_epochs",
    "gpus_per_node": "trainer.n_gpus_per_node", "num_nodes": "trainer.nnodes",
}


# vLLM engine arguments verl's launches pass in rollout.engine_kwargs.vllm that are megarl keys of their own:
# moved there (given both ways with different values: an error). Other such arguments stay errors that name
# the key (megarl.rollout.vllm.engine_config.OWNED_ENGINE_ARGS).
ENGINE_ARG_KEYS = {
    "actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len": "actor_rollout_ref.rollout.max_model_len",
}


# verl (2026) lets these ratio thresholds be strings: a float-like string is the upper bound, and
# "lower_upper" (e.g. "0.5_5.0") a pair of bounds. megarl's keys are floats: screen_keys converts them,
# and a pair sets the lower-bound key too (rollout_is_threshold's pair is verl's IcePop weighting).
THRESHOLD_STRINGS = {
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_correction.rollout_is_threshold_lower",
    "algorithm.rollout_correction.rollout_rs_threshold": "algorithm.rollout_correction.rollout_rs_threshold_lower",
}


# verl 2026 names rollout_rs's levels by the divergence they bound; its ratio-bound (k1) levels are megarl's
ROLLOUT_RS_NAMES = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}
ROLLOUT_RS_DIVERGENCES = (
    "rejection by a divergence bound (verl's k2 / k3 and seq_max levels) or by several levels at once",
    "megarl rejects by ratio bounds at one level: rollout_rs=token (verl: token_k1), sequence (seq_sum_k1) or "
    "geometric (seq_mean_k1)")


def threshold_pair(value: str) -> tuple[float | None, float] | None:
    """verl's string form of a ratio threshold -> (lower or None, upper); None if it is neither form."""
    spec = value.strip()
    lower, sep, upper = spec.partition("_")
    try:
        return (float(lower), float(upper)) if sep else (None, float(spec))
    except ValueError:
        return None


def mapped_targets(rule: Mapped, key: str, value: Any) -> dict | None:
    """The megarl settings of ``key=value`` under ``rule`` (None: the value has no mapping)."""
    for verl_value, targets in rule.values.items():
        if value == verl_value and type(value) is type(verl_value):
            return targets
    return None


def rule_for(key: str) -> Rule | None:
    """The rule that decides ``key`` (a dotted verl key), or None. A pattern ``a.b.*`` also
    matches ``a.b`` itself (an empty section, as verl's defaults write ``override_ddp_config: {}``)."""
    for rule in RULES:
        if isinstance(rule, Alias):
            if key == rule.key or key.startswith(rule.key + "."):
                return rule
        elif any(fnmatch.fnmatchcase(key, pattern) or (pattern.endswith(".*") and fnmatch.fnmatchcase(key, pattern[:-2]))
                 for pattern in rule.keys):
            return rule
    return None


def alias_target(rule: Alias, key: str) -> str:
    return rule.target + key[len(rule.key):]
