"""The typed config schema, with verl's key names and defaults.

Every YAML and every ``a.b.c=value`` override is checked against these dataclasses: values are
type-checked by OmegaConf, and a key that is not here is either one of verl's keys that
``megarl.config.verl_keys`` decides (another spelling, refused, or without effect) or unknown.
Keys that verl has keep verl's names and defaults, so a verl config carries over; keys that
megarl adds are marked "megarl:" in their comment. Every key is read by a check (``megarl.checks``) or a
settings constructor (``megarl.settings``): ``tests/config/test_key_readers.py`` records the reads.

On machines without GPUs, ``trainer.n_gpus_per_node`` counts worker processes (ranks)
per node, one CPU "device" each.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import II, MISSING


# ----------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    train_files: Any = MISSING  # a parquet path or a list of paths (verl format)
    val_files: Any = None
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per step
    val_batch_size: Optional[int] = None  # None: the whole validation set at once
    shuffle: bool = True
    seed: Optional[int] = 1  # None (verl's default: unseeded) draws with seed 1; resume needs a fixed seed
    filter_overlong_prompts: bool = True  # drop prompts over max_prompt_length (count logged)
    truncation: str = "error"  # error | left | right | middle (used when not filtering)
    apply_chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False  # the tokenizer (verl: the driver's tokenizer and processor)
    train_max_samples: int = -1  # -1: every row; N: the first N rows of the train files
    val_max_samples: int = -1
    drop_last: bool = True  # megarl: an incomplete last batch of an epoch is dropped
    image_key: str = "images"  # the column of each row's images (vision-language models: docs/data.md)
    video_key: str = "videos"  # a row with videos is refused: megarl does not train on video yet
    audio_key: str = "audios"  # a row with audio is refused: megarl does not train on audio yet


# ------------------------------------------------------------------- megatron layout
@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    sequence_parallel: bool = True
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    use_distributed_optimizer: bool = True
    # verl's Megatron key: packed micro-batches (megatron's THD format, no padding token computed) instead of
    # padded rows; context parallelism needs it (docs/megatron-engine.md: long sequences)
    use_remove_padding: bool = True
    # Between phases, keep the model's weights / gradients / optimizer state in host memory
    # (docs/megatron-engine.md: the offload timeline). The reference has weights only.
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 42
    use_dist_checkpointing: bool = True
    dist_checkpointing_path: Optional[str] = None  # pre-converted megatron checkpoint
    # megatron-core TransformerConfig fields (recompute_*, num_layers_in_first/last_pipeline_stage, ...);
    # verl lists recompute_granularity/method/num_layers: null and recompute_modules: [core_attn], which
    # are megatron's own defaults.
    override_transformer_config: Dict[str, Any] = field(default_factory=dict)
    # megarl (Megatron-LM's flag): the vocabulary is padded to a multiple of this x TP
    make_vocab_size_divisible_by: int = 128


# The keys that shape one megatron parallel layout (shared by actor, reference and critic).
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "context_parallel_size", "sequence_parallel", "expert_model_parallel_size", "expert_tensor_parallel_size",
                "make_vocab_size_divisible_by")


def shared_layout(prefix: str = "actor_rollout_ref.actor.megatron") -> MegatronConfig:
    """The reference and the critic run on the actor's ranks and megatron parallel state, so their
    layout defaults to the actor's (as in verl's megatron config)."""
    return MegatronConfig(**{k: II(f"{prefix}.{k}") for k in LAYOUT_KEYS})


def reference_megatron(prefix: str = "actor_rollout_ref.actor.megatron") -> MegatronConfig:
    """The reference: the actor's layout, and (as in verl) the actor's param_offload,
    override_transformer_config and use_remove_padding unless set."""
    keys = LAYOUT_KEYS + ("param_offload", "override_transformer_config", "use_remove_padding")
    return MegatronConfig(**{k: II(f"{prefix}.{k}") for k in keys})


@dataclass
class OptimConfig:
    optimizer: str = "adam"
    lr: float = 1e-6
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    lr_warmup_init: float = 0.0
    min_lr: float = 0.0
    min_lr_ratio: Optional[float] = None
    warmup_style: str = "constant"  # constant | cosine | linear (decay after warmup)
    lr_decay_style: Optional[str] = None  # megarl: overrides warmup_style's decay when set
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    clip_grad: float = 1.0
    total_training_steps: int = -1  # filled in by the trainer
    # megatron-core OptimizerConfig fields, e.g. optimizer_cpu_offload, optimizer_offload_fraction,
    # overlap_cpu_optimizer_d2h_h2d, use_precision_aware_optimizer (megatron's CPU optimizer, GPU only)
    override_optimizer_config: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LoRAConfig:
    """verl's Megatron LoRA keys (``model.lora.*``); ``rank: 0`` turns LoRA off. docs/lora.md."""

    type: str = "lora"  # lora: one A per fused linear; canonical_lora: one A per HF projection; dora / vlm_lora refused
    rank: int = 0
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    dropout_position: str = "pre"  # pre: dropout on the adapter's input (post is refused)
    # megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2, MLA's linear_q_down_proj, ...), HF names
    # (q_proj, ..., down_proj, w1, kv_b_proj), all-linear, or patterns on full megatron names
    target_modules: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    exclude_modules: List[str] = field(default_factory=list)
    lora_A_init_method: str = "xavier"  # xavier | kaiming | uniform | normal
    lora_B_init_method: str = "zero"  # zero | xavier | kaiming | uniform | normal
    adapter_path: Optional[str] = None  # start from an adapter: a PEFT directory or a megarl LoRA checkpoint


@dataclass
class ActorLoRAConfig(LoRAConfig):
    # verl: false = the fleet serves the base model plus the adapter (adapter-only weight updates through
    # vLLM's LoRA); true = the adapter is merged into the weights (W + alpha/r * B A in fp32) and synced
    merge: bool = False


@dataclass
class ModelOverrideConfig:
    # verl's key: Hugging Face config fields set before the models are built (every role of this checkpoint,
    # its HF exports and the rollout engines); fields that would change the tensors are refused
    # (docs/model-bridge.md: config overrides)
    model_config: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    path: str = MISSING  # HF checkpoint directory, or a hub id already in the HF cache
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False  # passed to the vLLM engines
    custom_chat_template: Optional[str] = None  # a Jinja chat template that replaces the tokenizer's
    enable_gradient_checkpointing: bool = False
    override_config: ModelOverrideConfig = field(default_factory=ModelOverrideConfig)
    lora: ActorLoRAConfig = field(default_factory=ActorLoRAConfig)  # verl's FSDP-style lora_rank/... map here


@dataclass
class RouterReplayConfig:
    # verl's key (January: actor.router_replay; mainline: actor.megatron.router_replay, read as this): MoE
    # routing replay. disabled | R2 (the update routes by the old-log-prob pass's choices) | R3 (the
    # rollout engine's choices; not carried yet, refused). docs/algorithms.md: router replay
    mode: str = "disabled"


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # registry name: vanilla | gspo | dppo_tv | cispo | sppo | ... (docs/algorithms.md)
    clip_cov_ratio: float = 0.0002  # clip_cov: the share of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: the covariance window of the candidates
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: the share of tokens that get the |log-ratio| penalty
    ppo_kl_coef: float = 0.1  # kl_cov: that penalty's coefficient
    dro_beta: Optional[float] = None  # dro: the quadratic log-ratio penalty (required, > 0)


@dataclass
class CheckpointConfig:
    # model (megatron weights), optimizer (distributed-optimizer state), extra (LR schedule, RNG
    # states), hf_model (also an HF safetensors export in step_<N>/huggingface). The controller's
    # own state (step, data-loader position, KL controller) is always saved: it makes step_<N> resumable.
    save_contents: List[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: List[str] = II(".save_contents")


# ------------------------------------------------------------------------ profiling
@dataclass
class TorchProfilerScheduleConfig:
    active: int = 0  # > 0 (sampling update mini-batches) is refused: megarl records each profiled stage whole


@dataclass
class TorchProfilerToolConfig:
    contents: List[str] = field(default_factory=list)  # cuda, cpu, memory, shapes, stack ([]: cpu and cuda)
    discrete: bool = False  # one trace per stage (log-prob, ref, values, updates) instead of one per step
    schedule: TorchProfilerScheduleConfig = field(default_factory=TorchProfilerScheduleConfig)


@dataclass
class NsightToolConfig:
    discrete: Optional[bool] = None  # a capture range per stage; None: global_profiler.global_tool_config.nsys.discrete


@dataclass
class RoleToolConfig:
    torch: TorchProfilerToolConfig = field(default_factory=TorchProfilerToolConfig)
    nsys: NsightToolConfig = field(default_factory=NsightToolConfig)


@dataclass
class RoleProfilerConfig:
    """verl's ``<role>.profiler`` (actor, ref, critic): whether this role's worker compute is profiled,
    on which of the trainer's ranks (``megarl.settings.profiling``)."""

    tool: Optional[str] = None  # None: global_profiler.tool (another tool than the global one is refused)
    enable: bool = False
    all_ranks: bool = False
    ranks: List[int] = field(default_factory=list)  # [] and all_ranks=False: rank 0
    save_path: Optional[str] = None  # None: global_profiler.save_path (another path is refused)
    tool_config: RoleToolConfig = field(default_factory=RoleToolConfig)


def _worker_nsight_options() -> dict:
    return {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true", "cuda-graph-trace": "graph",
            "capture-range": "cudaProfilerApi", "capture-range-end": None, "kill": "none"}


@dataclass
class GlobalNsysConfig:
    discrete: bool = False
    worker_nsight_options: Dict[str, Any] = field(default_factory=_worker_nsight_options)  # Ray's runtime_env nsight


@dataclass
class GlobalToolConfig:
    nsys: GlobalNsysConfig = field(default_factory=GlobalNsysConfig)


@dataclass
class GlobalProfilerConfig:
    """verl's ``global_profiler``: the tool and the steps; the roles' ``profiler.enable`` pick the workers."""

    tool: Optional[str] = None  # torch | nsys (npu, torch_memory, precision_debugger: refused); None: off
    steps: Optional[List[int]] = None  # the training steps profiled (None: none)
    profile_continuous_steps: bool = False  # consecutive profiled steps share one trace (discrete=False)
    save_path: Optional[str] = None  # None: <trainer.default_local_dir>/profile (verl writes outputs/profile)
    global_tool_config: GlobalToolConfig = field(default_factory=GlobalToolConfig)


@dataclass
class ActorConfig:
    strategy: str = "megatron"
    ppo_mini_batch_size: int = 256  # prompts per mini-batch (times rollout.n samples)
    ppo_micro_batch_size: Optional[int] = None  # deprecated in verl: use the per-GPU key
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    data_loader_seed: Optional[int] = None
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    # None (verl writes token-mean): each term's own default, as verl computes it: the policy loss's
    # (token-mean; GSPO: seq-mean-token-mean), token-mean for the entropy bonus and KL loss. A value
    # given here applies to all three (and, through critic.loss_agg_mode, to the value loss).
    loss_agg_mode: Optional[str] = None
    entropy_coeff: float = 0.0
    tau_pos: float = 1.0  # sapo: the gate's temperature where the advantage is > 0
    tau_neg: float = 1.05  # sapo: elsewhere
    sppo_eta: float = 1.0  # sppo (verl's SPPO recipe): the loss's target is sppo_eta * advantage
    dpo_beta: float = 0.1  # spin (verl's SPIN recipe): DPO's beta
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    # a vision-language model's vision tower (and merger) stays as loaded: no gradients, no optimizer
    # state, not in the weight sync (the engines keep the checkpoint's, the same weights)
    freeze_vision_tower: bool = False
    # verl's megatron actor key. None: the separate old-log-prob pass runs only when needed (several
    # updates per batch, KL in the reward, dropout); on-policy the update's own forward gives them.
    # True: always run it. False: never (an error where they are needed). See validate.old_log_prob_pass.
    recompute_old_log_prob: Optional[bool] = None
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)


@dataclass
class RefConfig:
    strategy: str = "megatron"
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    megatron: MegatronConfig = field(default_factory=reference_megatron)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)


@dataclass
class SamplingOverrides:
    n: int = 1
    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class WeightSyncConfig:
    """megarl: how trainer weights reach the rollout fleet after every step."""

    bucket_mb: int = 512  # verl: rollout.checkpoint_engine.update_weights_bucket_megabytes
    transport: str = "auto"  # auto | nccl | gloo | cuda_ipc
    timeout_s: float = 600.0
    verify: bool = True  # log rollout/logprob_diff every step


@dataclass
class EngineKwargsConfig:
    vllm: Dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM / EngineArgs fields


@dataclass
class MultiTurnConfig:
    """Multi-turn tool calling (the ``tool_agent`` loop); verl's keys and defaults."""

    enable: bool = False  # True: rows without agent_name use tool_agent (megarl.agent)
    max_assistant_turns: Optional[int] = None  # None: no limit but rollout.response_length
    max_user_turns: Optional[int] = None  # tool-response turns
    max_parallel_calls: int = 1  # calls executed per assistant turn
    max_tool_response_length: int = 256  # characters of one tool response
    tool_response_truncate_side: str = "middle"  # left (keep the start) | middle | right (keep the end)
    tool_config_path: Optional[str] = None  # verl's tool YAML (tools: class_name, config, tool_schema)
    function_tool_path: Optional[str] = None  # a .py file whose public functions are tools
    format: str = "hermes"  # tool-call format (registered name or module:Class)
    tokenization_sanity_check_mode: str = "strict"  # strict | ignore_strippable | disable
    drift_action: str = "warn"  # megarl: warn (metric agent/drift_ratio + one warning) | raise
    tool_timeout_s: float = 30.0  # megarl: a tool call running longer is stopped and reported to the model
    interaction_config_path: Optional[str] = None  # verl's simulated-user interactions: refused (not supported)
    use_inference_chat_template: bool = False  # refused when True: megarl never re-renders earlier turns
    num_repeat_rollouts: Optional[int] = None  # refused when set: use rollout.n


@dataclass
class CustomAsyncServerConfig:
    path: Optional[str] = None  # refused when set: megarl's fleet is vLLM's AsyncLLM
    name: Optional[str] = None


@dataclass
class AgentLoopConfig:
    num_workers: int = 0  # megarl: 0 runs the agent loops in the controller (verl: 8 Ray workers); N: N Ray actors
    default_agent_loop: str = "single_turn_agent"  # for rows without an agent_name column
    agent_loop_config_path: Optional[str] = None  # verl's YAML list of {name, _target_: module.Class}
    custom_async_server: CustomAsyncServerConfig = field(default_factory=CustomAsyncServerConfig)


@dataclass
class RolloutConfig:
    name: str = "vllm"  # the only engine megarl runs
    mode: str = "sync"  # sync | async: both generate each step's batch on the fleet and wait for it
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    prompt_length: int = II("data.max_prompt_length")
    response_length: int = II("data.max_response_length")
    stop: List[str] = field(default_factory=list)  # megarl: extra stop strings
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 2
    # verl's: vLLM's expert parallelism, 1 or the TP size (each routed expert whole on one TP rank; GPU only)
    expert_parallel_size: int = 1
    data_parallel_size: int = 1  # verl's: data parallelism inside one engine; refused above 1 (use num_replicas)
    num_replicas: Optional[int] = None  # megarl: None = rollout GPUs / rollout TP
    enforce_eager: bool = True
    free_cache_engine: bool = True  # sleep/wake the engine in colocated mode (GPU)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_model_len: Optional[int] = None
    ignore_eos: bool = False
    # processed_logprobs (verl's): the log-probs of the distribution sampled from (temperature applied, top-k /
    # top-p renormalised), which is what the trainer scores at temperature; raw_logprobs only where they agree
    logprobs_mode: str = "processed_logprobs"
    scheduling_policy: str = "fcfs"  # fcfs | priority
    disable_log_stats: bool = True
    seed: int = 0
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)
    val_kwargs: SamplingOverrides = field(default_factory=SamplingOverrides)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)


@dataclass
class ActorRolloutRefConfig:
    nccl_timeout: int = 600  # seconds: the trainer's torch.distributed groups (NCCL or gloo), megatron's included
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


# --------------------------------------------------------------------------- critic
@dataclass
class CriticModelConfig:
    path: Optional[str] = II("actor_rollout_ref.model.path")
    enable_gradient_checkpointing: bool = False
    override_config: ModelOverrideConfig = field(default_factory=ModelOverrideConfig)  # the critic's own, as verl's
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # the critic's own adapters; its value head trains whole


@dataclass
class CriticOptimConfig(OptimConfig):
    lr: float = 1e-5


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: on when algorithm.adv_estimator needs values (gae)
    strategy: str = "megatron"
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    ppo_mini_batch_size: int = II("actor_rollout_ref.actor.ppo_mini_batch_size")
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")
    ppo_max_token_len_per_gpu: int = 32768
    ppo_epochs: int = II("actor_rollout_ref.actor.ppo_epochs")
    shuffle: bool = II("actor_rollout_ref.actor.shuffle")
    cliprange_value: float = 0.5
    loss_agg_mode: Optional[str] = II("actor_rollout_ref.actor.loss_agg_mode")  # None: token-mean
    grad_clip: float = 1.0
    megatron: MegatronConfig = field(default_factory=shared_layout)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)


# -------------------------------------------------------------------------- rewards
@dataclass
class CustomRewardFunctionConfig:
    """verl's older spelling; its 2026 one, ``reward.custom_reward_function.*``, sets the same keys."""

    path: Optional[str] = None  # a .py file defining the function
    name: str = "compute_score"  # per-sample or batch form, told apart by its signature (megarl.rewards.custom)
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of every call


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None  # an HF ...ForSequenceClassification (one label) or ...ForCausalLM (a judge)
    # The tokenizer that decodes the policy's responses before the RM's chat template is applied to
    # them (verl's meaning); null: the RM reads the policy's token ids as they are (same tokenizer).
    input_tokenizer: Optional[str] = II("actor_rollout_ref.model.path")
    trust_remote_code: bool = False  # passed to the reward model's vLLM engines and tokenizer


@dataclass
class RewardEngineConfig:
    """verl's ``reward_model.rollout``: the vLLM engines that serve the reward model or judge."""

    name: str = "vllm"  # the only engine megarl runs
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU (verl: bfloat16)
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 2
    enforce_eager: bool = True
    free_cache_engine: bool = True  # colocated on GPU: the engines sleep outside the reward pass
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 8192  # tokens per engine step (verl's forward_max_token_len_per_gpu)
    max_num_seqs: int = 1024  # sequences per engine step (verl's micro_batch_size_per_gpu)
    max_model_len: Optional[int] = None  # None: prompt_length + response_length
    prompt_length: int = II("data.max_prompt_length")  # a judge's prompt budget (verl: 2048)
    response_length: int = II("data.max_response_length")  # a judge's answer budget (verl: 2048)
    disable_log_stats: bool = True
    seed: int = 0  # megarl: the engine's seed (a judge's sampled requests that give none)
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)


@dataclass
class JudgeClientConfig:
    """megarl: the judge client's requests (``megarl.rewards.reward_models.judge``)."""

    timeout_s: float = 60.0  # one HTTP request
    max_retries: int = 3  # after the first try, on server errors (5xx), timeouts and lost connections
    retry_backoff_s: float = 1.0  # exponential: 1, 2, 4, ... seconds (capped at 30), with jitter
    max_concurrent: int = 64  # requests in flight per process
    fallback_score: float = 0.0  # the score of a sample whose judge calls failed (counted: reward/judge_failures)


@dataclass
class RewardModelConfig:
    """verl's older spelling; ``reward.reward_manager.name``, ``reward.reward_kwargs`` and
    ``reward.reward_model.*`` (verl 2026, ``model_path`` for ``model.path``) set the same keys."""

    enable: bool = False  # model-based rewards: a reward model or an LLM judge (megarl.rewards.reward_models)
    enable_resource_pool: bool = False  # True: its own devices (nnodes x n_gpus_per_node); False: the trainer's
    n_gpus_per_node: int = 0
    nnodes: int = 0
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    max_length: Optional[int] = None  # tokens of a reward-model input; longer ones are cut on the right (counted)
    rollout: RewardEngineConfig = field(default_factory=RewardEngineConfig)
    judge: JudgeClientConfig = field(default_factory=JudgeClientConfig)
    reward_manager: str = "naive"  # naive | dapo | batch | rate_limited (also: limited)
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)  # the manager's: dapo takes max_resp_len, overlong_buffer_cfg
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO recipe's place
    # the rate_limited manager's (verl's keys): reward-function calls in flight, requests and
    # tokens per minute, and a per-call time limit (a call over it scores judge.fallback_score)
    max_concurrent: int = 1
    max_rpm: Optional[int] = None
    max_tpm: Optional[int] = None
    estimated_tokens_per_request: int = 2000
    timeout: float = 300.0


@dataclass
class RewardConfig:
    """How reward functions are run (``num_workers`` is verl's key too; its other ``reward.*`` keys
    are the 2026 spellings of ``reward_model.*`` / ``custom_reward_function.*``)."""

    num_workers: int = 1  # 1: score in the controller process; N: a pool of N workers
    executor: str = "process"  # process | thread (for num_workers > 1)
    on_error: str = "zero"  # zero: score 0, count and log the error | raise: stop the run
    # megarl (verl: the naive manager's reward_kwargs.compute_score_timeout): seconds one reward-function call may
    # take; a call past it is stopped and scores 0 like an error (reward/num_timeouts); null or 0: no limit
    compute_score_timeout: Optional[float] = 30.0


# ------------------------------------------------------------------------ algorithm
@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    enable: bool = False  # DAPO dynamic sampling
    metric: Optional[str] = None  # acc | score | seq_reward | seq_final_reward
    max_num_gen_batches: int = 0  # 0: no limit


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction``: importance weights (TIS) and rejection (MIS) for tokens the
    behaviour policy sampled (``megarl.algorithms.rollout_correction``)."""

    rollout_is: Optional[str] = None  # null | token | sequence: truncated importance weights pi_old / pi_rollout
    rollout_is_threshold: float = 2.0  # the truncation bound (IcePop: the upper bound)
    rollout_is_threshold_lower: Optional[float] = None  # set: IcePop, weights outside [lower, threshold] are 0
    rollout_is_batch_normalize: bool = False  # rescale the weights to mean 1 over the batch
    rollout_rs: Optional[str] = None  # null | token | sequence | geometric: reject ratios outside the bounds
    rollout_rs_threshold: Optional[float] = None  # upper bound of accepted ratios (required with rollout_rs)
    rollout_rs_threshold_lower: Optional[float] = None  # lower bound; null: 1 / rollout_rs_threshold
    rollout_token_veto_threshold: Optional[float] = None  # reject a sample with any token ratio below it
    bypass_mode: bool = False  # the rollout's log-probs are the old log-probs (no trainer forward before the update)
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip (the ratio to the rollout, clipped) | reinforce


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: Optional[str] = "gae"  # null (verl's SPIN and SPPO recipe configs) is refused with a pointer
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    sppo_eta: float = 1.0  # sppo (verl's SPPO recipe): the soft mean's beta that centres the rewards
    dpo_loss_type: str = "sigmoid"  # spin (verl's SPIN recipe): sigmoid | ipo
    dpo_label_smoothing: float = 0.0  # spin: the sigmoid loss's label smoothing


# -------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    project_name: str = "megarl"
    experiment_name: str = "default"
    logger: List[str] = field(default_factory=lambda: ["console", "tensorboard"])
    nnodes: int = 1
    n_gpus_per_node: int = 8  # GPUs (or, on CPU machines, worker processes) per node
    placement: str = "colocated"  # megarl: colocated | split
    rollout_gpus: Optional[int] = None  # megarl (split placement): GPUs given to rollout
    total_epochs: int = 30
    total_training_steps: Optional[int] = None
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False  # validate once (before training) and stop
    critic_warmup: int = 0
    # verl's SPIN recipe key: the reference takes the actor's weights at the start of every step that is a multiple
    # of it (1: the reference is the step's starting policy, its log-probs the old ones); <= 0: never
    ref_update_freq: int = -1
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_actor_ckpt_to_keep: Optional[int] = None  # keep the newest N step_<N> dirs (None or 0: all)
    max_critic_ckpt_to_keep: Optional[int] = None
    balance_batch: bool = True  # reorder samples so every data-parallel rank gets a similar token count
    log_val_generations: int = 0  # validation samples to print and write (TensorBoard text, JSONL)
    log_train_generations: int = 0  # megarl: training samples to print and write every log_train_generations_freq steps
    log_train_generations_freq: int = 10  # megarl
    rollout_data_dir: Optional[str] = None  # every training step's samples as <dir>/<step>.jsonl (verl's dump)
    validation_data_dir: Optional[str] = None  # every validation's samples as <dir>/<step>.jsonl
    log_level: str = "INFO"  # megarl: the console; INFO (a few lines), DEBUG (everything, as --verbose), WARNING
    ray_address: Optional[str] = None  # megarl: None = $RAY_ADDRESS or a local cluster
    save_timeout_s: float = 3600.0  # megarl: the longest a checkpoint save may take before the run fails
    # megarl: before a launch on a machine with a GPU, refuse a run whose memory plan (megarl plan) does not
    # fit that GPU, naming the keys that would make it fit; skipped on machines without a GPU
    plan_check: bool = True
    # megarl: stop the run (exit 1, naming the cause and the last checkpoint) after this many training steps in a row
    # whose optimizer steps (actor's or critic's) were all skipped for non-finite gradients; 0: never stop
    max_consecutive_skipped_steps: int = 3
    # megarl: warn on the console when, after a weight sync, the fleet's log-probs of the sampled tokens differ from the
    # trainer's by more than this on average (rollout/logprob_diff; stale or partly loaded weights give ~1), at the
    # first such step and every 10th after; null: by the rollout's dtype, 1e-3 in float32, 0.1 in bfloat16/float16;
    # 0: never. Not in the asynchronous modes, nor with top_p < 1 or top_k > 0 (the gap is not noise there)
    stale_weights_warn_threshold: Optional[float] = None
    # megarl: SIGTERM or SIGUSR1 (Slurm's --signal warning) while training steps run saves a checkpoint of the step in
    # progress when it ends, then stops (exit 128 + the signal, as an interrupt); false: they stop the run at once
    save_on_preempt: bool = True
    # megarl: a worker process of the run that dies (a trainer rank killed, its node lost) restarts the whole run from
    # its last complete checkpoint, in the same driver, at most this many times; 0: the run stops, naming the rank
    max_restarts: int = 0
    # megarl: rollout replicas the run may lose (an engine or its actor dies, its node goes) and replace before it
    # stops: a lost replica's requests go to the others, a replacement starts in its slot before the next weight sync
    # and serves after it (fleet/replica_failures, fleet/replicas_alive); 0: the first loss stops the run
    max_replica_failures: int = 3


@dataclass
class AsyncTrainingConfig:
    """Asynchronous (off-policy) training: verl's ``async_training.*`` keys (its fully-async recipe), honoured,
    and megarl's ``mode``. docs/training.md, Asynchronous training."""

    mode: str = "sync"  # megarl: sync | one_step_off | fully_async (verl: trainer.v1.trainer_mode)
    staleness_threshold: float = 1.0  # fully_async: groups generated ahead, in train batches; versions a group may lag
    trigger_parameter_sync_step: int = 1  # training steps between two weight syncs
    require_batches: int = 1  # with data.train_batch_size=0 (verl's fully-async form): the step's ppo mini-batches
    partial_rollout: bool = False  # fully_async: a sync aborts running generations, which continue on the new weights
    max_off_policy_strategy: str = "wait"  # megarl's place for verl's trainer.v1.sampler key: wait | drop
    wait_timeout_s: float = 3600.0  # megarl: the longest a step waits for rollout groups


@dataclass
class RolloutPoolConfig:
    """verl's separate rollout pool (one-step-off / fully-async recipes): ``rollout.nnodes`` nodes of
    ``rollout.n_gpus_per_node`` GPUs next to the trainer's ``trainer.nnodes`` x ``trainer.n_gpus_per_node``
    (0: no separate pool; megarl's own form is trainer.placement=split with trainer.rollout_gpus)."""

    nnodes: int = 0
    n_gpus_per_node: int = 0


@dataclass
class RayInitConfig:
    num_cpus: Optional[int] = None  # CPUs of a local Ray cluster; None: this machine's (or the slots')


@dataclass
class RayKwargsConfig:
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    timeline_json_file: Optional[str] = None  # write Ray's task timeline here when the run ends


# --------------------------------------------------------------------- distillation
@dataclass
class DistillationLossConfig:
    """verl's ``distillation.distillation_loss`` (``megarl.algorithms.distillation``)."""

    # k3 / low_var_kl, k2 / mse, abs: a direct loss; k1 / kl: a reward (use_policy_gradient); forward_kl_topk: the
    # forward KL over the teacher's top-k tokens at each position (docs/algorithms.md: on-policy distillation)
    loss_mode: str = "k3"
    topk: int = 32  # forward_kl_topk: the teacher's most likely tokens per position
    use_task_rewards: bool = True  # keep the task's policy loss and add the distillation loss times the coefficient
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = None  # each token's loss is clamped to [-c, c]
    log_prob_min_clamp: Optional[float] = None  # forward_kl_topk: both models' log-probs are clamped from below
    use_policy_gradient: bool = False  # True: -loss per token is the advantage of a PPO-clip loss
    policy_loss_mode: str = "vanilla"  # the only one, as in verl
    clip_ratio: float = 0.2  # the reward's PPO clip range where clip_ratio_low / _high are null
    clip_ratio_low: Optional[float] = 0.2
    clip_ratio_high: Optional[float] = 0.2


@dataclass
class TeacherEngineConfig:
    """verl's ``distillation.teacher_models.<name>.inference``: the engines that score with the teacher."""

    name: str = II("actor_rollout_ref.rollout.name")  # vllm, or hf (transformers)
    dtype: str = II("actor_rollout_ref.rollout.dtype")
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 2
    enforce_eager: bool = True
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_model_len: Optional[int] = None  # None: prompt_length + response_length (the student's whole sample)
    prompt_length: int = II("actor_rollout_ref.rollout.prompt_length")
    response_length: int = II("actor_rollout_ref.rollout.response_length")
    disable_log_stats: bool = True
    seed: int = 0
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)


@dataclass
class TeacherModelConfig:
    key: Optional[str] = None  # the teacher_key value of the samples it scores (several teachers)
    model_path: Optional[str] = None
    num_replicas: int = 0  # several teachers: each one's; one teacher fills the pool
    inference: TeacherEngineConfig = field(default_factory=TeacherEngineConfig)


def _teacher_defaults() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(TeacherModelConfig))  # interpolations kept as written


@dataclass
class DistillationConfig:
    """verl's on-policy distillation (``distillation.*``): teachers on a pool of their own score the student's samples."""

    enabled: bool = False
    n_gpus_per_node: int = 8  # the teachers' pool: nnodes x n_gpus_per_node devices (on CPU: worker processes)
    nnodes: int = 0
    # name -> a TeacherModelConfig's keys (read and checked by megarl.settings.distillation, which applies
    # verl's rules for the keys of its own that megarl's teachers lack)
    teacher_models: Dict[str, Any] = field(default_factory=lambda: {"teacher_model": _teacher_defaults()})
    teacher_key: str = "data_source"  # the sample field that picks a sample's teacher (several teachers)
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)


@dataclass
class MegaRLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
