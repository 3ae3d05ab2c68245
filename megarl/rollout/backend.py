"""Rollout backends: the engines a fleet runs, picked by ``actor_rollout_ref.rollout.name``.

A backend is one folder of this package (``vllm/``, ``hf/``) and one registry entry. The fleet
(``fleet.py``) is the same for every backend: it places the replicas, splits requests, checks
token lists, collects versions; the backend says what one replica is.

What a backend declares (``RolloutBackend``):

* ``replica_class``: ``"module:Class"`` of the Ray actor that owns one engine (imported only when
  a fleet starts, so the config check never imports an engine);
* ``replica_spec(request)``: the picklable settings one replica starts from, built in the driver
  from the fleet's ``ReplicaRequest`` (rollout config, model, device facts);
* ``replica_env(spec, on_gpu)``: the replica process's environment, set before the engine imports;
* ``tensor_splits(model_path)``: how each HF tensor is split over the engine's TP ranks, for the
  weight sync's shard mode (``None``: the engine receives full tensors only);
* ``config_problems(rollout, lora, notes)``: what a config's rollout and LoRA sections ask of this
  backend that it cannot do, as ``megarl.config.errors.Problem``s (the config check reports them before anything starts),
  plus notes for settings it takes but reads differently;
* traits: ``needs_gpu`` (no CPU build: refused on a CPU cluster), ``sleeps`` (frees device memory
  between generations), ``adapters`` (serves LoRA adapters), ``pooling`` (scores with a pooling
  head: reward models), ``images`` (serves vision-language prompts: ``generate``'s ``images``).

The replica actor's methods (every backend has them, ``REPLICA_METHODS``; coroutines, the actor is
async; a backend with the ``pooling`` trait also has ``POOLING_METHODS``):

    info() -> {index, pid, on_gpu, max_model_len, vocab_size, dtype, import_seconds, start_seconds[, image_token_id]}
    generate(requests=[(prompt_index, prompt_ids, seed)], sampling_kwargs[, images={prompt_index: [PIL image]}])
        -> [RolloutSample]                                                 # images: with the ``images`` trait
    generate_tokens(prompt_ids, sampling_kwargs, seed) -> Generation       # one request (agent loops)
    generate_group(prompt_ids, sampling_kwargs, seed) -> [Generation]      # n samples, k-th seeded seed + k
    score(sequences, skip) -> [[log-prob of each token after the first `skip`]]
    sync_connect(plan, first_rank, world, addr, port, transport, timeout_s, position)
        / sync_receive(version, in_flight) / sync_close()                  # the weight sync's receiving end
    weights_version() -> int; pause(in_flight) / resume(); sleep(level) / wake_up(tags)
    alive() -> True, or raises ReplicaLost (the fleet's health check; GatedReplica has it)
    load_adapter(adapter, version)                                          # with the ``adapters`` trait
    close()
    classify(sequences) -> [float]; serve_http(host) -> "host:port"        # with the ``pooling`` trait

``sampling_kwargs`` is ``Sampling.engine_kwargs()``: vLLM's ``SamplingParams`` names, which every
backend reads (``n``, ``temperature``, ``top_p``, ``top_k``, ``max_tokens``, ``stop``,
``stop_token_ids``, ``ignore_eos``, ``logprobs``).

Adding SGLang is a folder ``sglang/`` with its replica actor and one ``register_rollout_backend``
line; it is refused today because it has no CPU build (its engine imports CUDA-only kernels).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from megarl.config.registry import Registry

ROLLOUT_BACKENDS = Registry("rollout backend", "actor_rollout_ref.rollout.name",
                            traits={"needs_gpu": False, "sleeps": False, "adapters": False, "pooling": False,
                                    "images": False})
# What the fleet, its clients and the weight sync call on a replica actor (the list above).
REPLICA_METHODS = ("info", "generate", "generate_tokens", "generate_group", "score", "sync_connect", "sync_receive",
                   "sync_close", "weights_version", "alive", "pause", "resume", "sleep", "wake_up", "load_adapter", "close")
POOLING_METHODS = ("classify", "serve_http")  # reward models' replicas (``pooling`` trait)
# Engines verl runs that megarl does not, with what to use instead (checked before anything starts).
REFUSED_BACKENDS = {
    "sglang": ("SGLang as the rollout engine", "SGLang has no CPU build here (its engine imports CUDA-only kernels), "
               "so it could not be tested; megarl runs vLLM (rollout.name=vllm) or Hugging Face generate "
               "(rollout.name=hf). A backend is one folder in megarl/rollout/ plus one registry line"),
    "trtllm": ("TensorRT-LLM as the rollout engine", "megarl runs vLLM (rollout.name=vllm) or Hugging Face "
               "generate (rollout.name=hf)"),
}


@dataclass(frozen=True)
class ReplicaRequest:
    """What the fleet knows when it asks a backend for a replica's spec."""

    config: Any  # actor_rollout_ref.rollout (DictConfig or a dataclass)
    model_path: str
    use_gpu: bool
    tokenizer_path: str | None = None
    cpus_per_replica: int = 1
    cpu_kv_cache_gib: float | None = None  # CPU only; None: what max_num_seqs sequences need, at most 1 GiB
    trust_remote_code: bool = False
    logprobs_mode: str | None = None
    sleep_mode: bool | None = None
    spans_nodes: bool = False  # a replica's TP covers whole nodes
    lora_rank: int = 0  # > 0: adapter-only LoRA updates of this rank
    hf_overrides: dict | None = None  # HF config fields the trainer's models are built with (override_config)


@dataclass(frozen=True)
class RolloutBackend:
    name: str
    description: str
    replica_class: str  # "module:Class"
    replica_spec: Callable[[ReplicaRequest], Any]
    replica_env: Callable[[Any, bool], dict[str, str]]
    tensor_splits: Callable[[str], Mapping[str, Any]] | None = None
    config_problems: Callable[[Any, Any, list[str]], list[Any]] | None = None

    def actor_class(self) -> type:
        module, _, name = self.replica_class.partition(":")
        return getattr(importlib.import_module(module), name)

    def traits(self) -> dict[str, Any]:
        return ROLLOUT_BACKENDS.traits(self.name)


def register_rollout_backend(backend: RolloutBackend, **traits: Any) -> RolloutBackend:
    ROLLOUT_BACKENDS.register(backend.name, **traits)(backend)
    return backend


def rollout_backend(name: str) -> RolloutBackend:
    """The backend registered as ``name`` (the built-in ones register on first use)."""
    _register_builtins()
    if name in REFUSED_BACKENDS and name not in ROLLOUT_BACKENDS:
        feature, instead = REFUSED_BACKENDS[name]
        raise ValueError(f"actor_rollout_ref.rollout.name={name}: {feature} is not supported: {instead}")
    return ROLLOUT_BACKENDS[name]


def backend_names() -> list[str]:
    _register_builtins()
    return sorted(ROLLOUT_BACKENDS)


def _register_builtins() -> None:
    # The built-in backends' registration modules import no engine (vLLM, transformers) themselves.
    import megarl.rollout.hf.registration  # noqa: F401
    import megarl.rollout.vllm.registration  # noqa: F401
