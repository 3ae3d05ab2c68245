"""One engine replica: a Ray actor that owns one ``vllm.LLM`` (with its own TP size).

The fleet creates it with ``ray.remote(EngineReplica).options(...)`` inside the replica's
placement-group bundle and with the environment from ``engine_config.replica_env``. Every method
is a plain synchronous call: the fleet sends one batch per replica and waits for all of them.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

from megarl.rollout.engine_config import ReplicaSpec, llm_kwargs
from megarl.rollout.sample import RolloutSample

logger = logging.getLogger(__name__)


class EngineReplica:
    """Hosts one vLLM engine; ``index`` is the replica's position in the fleet.

    ``device_ids`` (GPU, from the trainer's placement) are the GPUs of the replica's device slots:
    they become ``CUDA_VISIBLE_DEVICES`` before anything asks CUDA for its devices, so vLLM's TP
    workers run on exactly those GPUs even though Ray gave this actor a share of only the first.
    """

    def __init__(self, index: int, spec: ReplicaSpec, device_ids: Sequence[str] = ()):
        start = time.perf_counter()
        if device_ids:
            if len(device_ids) != spec.tensor_parallel_size:
                raise ValueError(f"replica {index}: {len(device_ids)} GPUs {list(device_ids)} for "
                                 f"TP={spec.tensor_parallel_size}")
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, device_ids))
        from megarl.platform import has_cuda
        from vllm import LLM

        self.index = index
        self.on_gpu = has_cuda()
        self.import_seconds = time.perf_counter() - start
        self.llm = LLM(**llm_kwargs(spec, self.on_gpu))
        self.checkpoint_shapes = checkpoint_shapes(spec.model_path)
        self.start_seconds = time.perf_counter() - start - self.import_seconds
        self.stale: str | None = None  # set while a weight sync runs or after one failed
        logger.info("replica %d: vLLM imported in %.1f s, engine started in %.1f s (pid %d)", index,
                    self.import_seconds, self.start_seconds, os.getpid())

    def info(self) -> dict[str, Any]:
        """Facts the fleet checks requests against, plus the engine start time."""
        model_config = self.llm.llm_engine.model_config
        return dict(
            index=self.index,
            pid=os.getpid(),
            on_gpu=self.on_gpu,
            max_model_len=model_config.max_model_len,
            vocab_size=model_config.get_vocab_size(),
            dtype=str(model_config.dtype),
            import_seconds=self.import_seconds,
            start_seconds=self.start_seconds,
        )

    def generate(self, requests: Sequence[tuple[int, list[int], int]], sampling_kwargs: dict[str, Any]) -> list[RolloutSample]:
        """Generate for ``(prompt_index, prompt_ids, request_seed)`` requests; n samples per prompt."""
        self._check_fresh()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for _, ids, _ in requests]
        params = [SamplingParams(**sampling_kwargs, seed=seed) for _, _, seed in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = []
        for (prompt_index, prompt_ids, _), output in zip(requests, outputs):
            for completion in sorted(output.outputs, key=lambda c: c.index):
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"replica {self.index}: prompt {prompt_index} sample {completion.index} "
                                       f"ended with finish_reason={completion.finish_reason!r}")
                token_ids = list(completion.token_ids)
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids)]
                stop_reason = completion.stop_reason
                samples.append(RolloutSample(
                    prompt_index=prompt_index,
                    sample_index=completion.index,
                    prompt_ids=list(prompt_ids),
                    response_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_string=stop_reason if isinstance(stop_reason, str) else None,
                    response_text=completion.text,
                    replica=self.index,
                ))
        return samples

    def score(self, sequences: Sequence[list[int]], skip: Sequence[int]) -> list[list[float]]:
        """Log-probs of each sequence's own tokens after its first ``skip`` tokens.

        The sequence minus its last token is the prompt: ``prompt_logprobs=0`` scores its tokens
        (entry t scores token t given tokens < t), and the one decode step scores the last token
        through ``logprob_token_ids``. So a sequence may be as long as ``max_model_len``.
        """
        self._check_fresh()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(s[:-1])) for s in sequences]
        params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=1,
                                 logprob_token_ids=[s[-1]], detokenize=False) for s in sequences]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for sequence, start, output in zip(sequences, skip, outputs):
            entries = output.prompt_logprobs  # entries[0] is None: nothing predicts the first token
            row = [entries[t][sequence[t]].logprob for t in range(start, len(sequence) - 1)]
            row.append(output.outputs[0].logprobs[0][sequence[-1]].logprob)
            result.append(row)
        return result

    def load_weights(self, named_tensors: list, version: int) -> int:
        """Load HF-named full tensors into every TP worker; return the version they all report.

        Names and shapes are checked against the checkpoint the engine started from first: a
        failure inside vLLM's reload would leave the model half loaded.
        """
        check_against_checkpoint(named_tensors, self.checkpoint_shapes)
        start = time.perf_counter()
        versions = self.llm.collective_rpc("megarl_load_weights", args=(named_tensors, version))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        logger.info("replica %d: loaded %d tensors (version %d) in %.2f s", self.index, len(named_tensors),
                    version, time.perf_counter() - start)
        return self._agreed(versions, "weights version")

    def sync_connect(self, plan, first_rank: int, world_size: int, master_addr: str, master_port: int,
                     transport: str, timeout_s: float) -> list[int]:
        """Join the weight-sync world with every TP worker; return their sync ranks."""
        return self.llm.collective_rpc("megarl_sync_connect", args=(plan, first_rank, self.index, world_size,
                                                                    master_addr, master_port, transport, timeout_s))

    def sync_receive(self, version: int) -> dict[str, float]:
        """Receive one sharded weight sync into every TP worker (see the worker extension)."""
        self.stale = f"weight sync to version {version} in progress"
        try:
            results = self.llm.collective_rpc("megarl_sync_receive", args=(version,))
        except BaseException as exc:
            self.stale = f"weight sync to version {version} failed: {exc}"
            raise
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.stale = None
        return {"seconds": max(r["seconds"] for r in results), "bytes": sum(r["bytes"] for r in results),
                "version": self._agreed([r["version"] for r in results], "weights version")}

    def sync_close(self) -> None:
        if self.llm is not None:
            self.llm.collective_rpc("megarl_sync_close")

    def _check_fresh(self) -> None:
        if self.stale:
            raise RuntimeError(f"replica {self.index} refuses to generate: {self.stale}. The fleet never serves "
                               "stale weights; a successful sync clears this.")

    def weights_version(self) -> int:
        return self._agreed(self.llm.collective_rpc("megarl_weights_version"), "weights version")

    def weight_checksum(self) -> float:
        """Sum of the TP workers' parameter sums (each holds its shard): equal across replicas with equal weights."""
        return float(sum(self.llm.collective_rpc("megarl_weight_checksum")))

    def sleep(self, level: int) -> None:
        """Free the KV cache and offload (level 1) or drop (level 2) the weights; GPU only."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def close(self) -> None:
        """Stop the engine (and its TP worker processes) before the actor is killed."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

    def _agreed(self, values: list, what: str):
        if any(v != values[0] for v in values):
            raise RuntimeError(f"replica {self.index}: TP workers disagree on the {what}: {values}")
        return values[0]


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a local safetensors checkpoint (empty for anything else).

    A tied ``lm_head.weight`` is listed with the embedding's shape: trainers send it, vLLM ignores it.
    """
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    config_file = Path(model_path) / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()).get("tie_word_embeddings"):
        embedding = shapes.get("model.embed_tokens.weight")
        if embedding is not None:
            shapes.setdefault("lm_head.weight", embedding)
    return shapes


def check_against_checkpoint(named_tensors: Sequence[tuple[str, Any]], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError naming every tensor whose HF name or shape the checkpoint does not have."""
    if not shapes:
        return
    unknown = [name for name, _ in named_tensors if name not in shapes]
    wrong = [f"{name}: got {tuple(t.shape)}, checkpoint has {shapes[name]}"
             for name, t in named_tensors if name in shapes and tuple(t.shape) != shapes[name]]
    problems = []
    if unknown:
        problems.append(f"{len(unknown)} names the checkpoint does not have, e.g. {unknown[:3]} "
                        f"(expected HF names like {sorted(shapes)[:2]})")
    if wrong:
        problems.append(f"{len(wrong)} shape mismatches: {'; '.join(wrong[:3])}")
    if problems:
        raise ValueError("update_weights: " + " and ".join(problems) + "; nothing was loaded")
