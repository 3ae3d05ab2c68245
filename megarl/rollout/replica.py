"""One engine replica: a Ray actor that owns one vLLM ``AsyncLLM`` engine (with its own TP size).

The fleet creates it with ``ray.remote(EngineReplica).options(...)`` inside the replica's
placement-group bundle and with the environment from ``engine_config.replica_env``. Its methods
are coroutines, so Ray runs it as an async actor: many requests are in flight at once (the batch
``generate`` of the fleet, and the per-request ``generate_tokens`` of agent loops, every turn of
every trajectory a request of its own) and vLLM's scheduler batches them continuously. The engine
core runs in a child process of the actor (vLLM's ``AsyncLLM`` always does); the TP workers, with
megarl's worker extension, run in that process (TP=1) or in its children.

A reward model's replica (``megarl.rewards.models``) runs vLLM's pooling runner instead and scores
sequences (``classify``); reward-model and judge replicas also serve vLLM's OpenAI-compatible HTTP
API on their engine (``serve_http``), which reward functions call.

Weight updates and syncs go through ``collective_rpc`` to the worker extension; while one runs, or
after one failed, the replica refuses to generate (``stale``), so stale weights are never served.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any, Sequence

from megarl.rollout.engine_config import ReplicaSpec, llm_kwargs
from megarl.rollout.sample import Generation, RolloutSample

logger = logging.getLogger(__name__)


class EngineReplica:
    """Hosts one vLLM engine; ``index`` is the replica's position in the fleet.

    ``device_ids`` (GPU, from the trainer's placement) are the GPUs of the replica's device slots:
    they become ``CUDA_VISIBLE_DEVICES`` before anything asks CUDA for its devices, so vLLM's TP
    workers run on exactly those GPUs even though Ray gave this actor a share of only the first.
    """

    def __init__(self, index: int, spec: ReplicaSpec, device_ids: Sequence[str] = ()):
        from megarl.logging.worker_logs import capture_worker_output

        capture_worker_output(f"rollout_replica{index}")  # its engine core and TP workers write there too
        start = time.perf_counter()
        if device_ids:
            if len(device_ids) != spec.tensor_parallel_size:
                raise ValueError(f"replica {index}: {len(device_ids)} GPUs {list(device_ids)} for "
                                 f"TP={spec.tensor_parallel_size}")
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, device_ids))
        from megarl.platform import has_cuda
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.index = index
        self.on_gpu = has_cuda()
        self.import_seconds = time.perf_counter() - start
        args = AsyncEngineArgs(**llm_kwargs(spec, self.on_gpu))
        vllm_config = args.create_engine_config()
        if spec.ray_executor:  # the engine core process is not this actor: hand it the actor's placement group
            import ray

            vllm_config.parallel_config.placement_group = ray.util.get_current_placement_group()
        self.engine = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=spec.disable_log_stats)
        self.model_config = vllm_config.model_config
        self.checkpoint_shapes = checkpoint_shapes(spec.model_path)
        self.start_seconds = time.perf_counter() - start - self.import_seconds
        self.stale: str | None = None  # set while a weight sync runs or after one failed
        self._request_counter = 0
        self.model_path = spec.model_path
        self.http = None  # the OpenAI-compatible server, once serve_http started it
        self.lora_request = None  # adapter-only updates: every request is served with this adapter
        logger.info("replica %d: vLLM imported in %.1f s, engine started in %.1f s (pid %d)", index,
                    self.import_seconds, self.start_seconds, os.getpid())

    async def info(self) -> dict[str, Any]:
        """Facts the fleet checks requests against, plus the engine start time."""
        return dict(
            index=self.index,
            pid=os.getpid(),
            on_gpu=self.on_gpu,
            max_model_len=self.model_config.max_model_len,
            vocab_size=self.model_config.get_vocab_size(),
            dtype=str(self.model_config.dtype),
            import_seconds=self.import_seconds,
            start_seconds=self.start_seconds,
        )

    # ------------------------------------------------------------------ generation
    async def _final_output(self, prompt_ids: Sequence[int], params, tag: str):
        """Run one request to completion; its last ``RequestOutput``."""
        from vllm.inputs import TokensPrompt

        self._request_counter += 1
        request_id = f"{tag}-{self.index}-{self._request_counter}"
        final = None
        async for output in self.engine.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id,
                                                 lora_request=self.lora_request):
            final = output
        if final is None:
            raise RuntimeError(f"replica {self.index}: request {request_id} returned no output")
        return final

    def _params(self, sampling_kwargs: dict[str, Any], seed: int, **extra):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(**sampling_kwargs, **extra, seed=seed, output_kind=RequestOutputKind.FINAL_ONLY)

    def _completion(self, completion, what: str) -> Generation:
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"replica {self.index}: {what} ended with finish_reason={completion.finish_reason!r}")
        token_ids = list(completion.token_ids)
        stop_reason = completion.stop_reason
        return Generation(
            token_ids=token_ids,
            logprobs=[step[token].logprob for step, token in zip(completion.logprobs, token_ids)],
            finish_reason=completion.finish_reason,
            stop_string=stop_reason if isinstance(stop_reason, str) else None,
            text=completion.text,
        )

    async def generate(self, requests: Sequence[tuple[int, list[int], int]],
                       sampling_kwargs: dict[str, Any]) -> list[RolloutSample]:
        """Generate for ``(prompt_index, prompt_ids, request_seed)`` requests; n samples per prompt.

        All requests are in flight at once; vLLM gives the k-th of a prompt's n samples the seed
        ``request_seed + k``.
        """
        self._check_fresh()
        outputs = await asyncio.gather(*[self._final_output(ids, self._params(sampling_kwargs, seed), "batch")
                                         for _, ids, seed in requests])
        samples = []
        for (prompt_index, prompt_ids, _), output in zip(requests, outputs):
            for completion in sorted(output.outputs, key=lambda c: c.index):
                g = self._completion(completion, f"prompt {prompt_index} sample {completion.index}")
                samples.append(RolloutSample(
                    prompt_index=prompt_index, sample_index=completion.index, prompt_ids=list(prompt_ids),
                    response_ids=g.token_ids, logprobs=g.logprobs, finish_reason=g.finish_reason,
                    stop_string=g.stop_string, response_text=g.text, replica=self.index))
        return samples

    async def generate_tokens(self, prompt_ids: list[int], sampling_kwargs: dict[str, Any], seed: int) -> Generation:
        """One completion of ``prompt_ids`` (token in, token out): one turn of an agent loop.

        ``sampling_kwargs`` must ask for one sample (``n=1``); ``seed`` makes it reproducible.
        """
        self._check_fresh()
        if sampling_kwargs.get("n", 1) != 1:
            raise ValueError(f"generate_tokens returns one completion; got n={sampling_kwargs['n']}")
        output = await self._final_output(prompt_ids, self._params(sampling_kwargs, seed), "turn")
        return self._completion(output.outputs[0], f"a request of {len(prompt_ids)} tokens")

    async def score(self, sequences: Sequence[list[int]], skip: Sequence[int]) -> list[list[float]]:
        """Log-probs of each sequence's own tokens after its first ``skip`` tokens.

        The sequence minus its last token is the prompt: ``prompt_logprobs=0`` scores its tokens
        (entry t scores token t given tokens < t), and the one decode step scores the last token
        through ``logprob_token_ids``. So a sequence may be as long as ``max_model_len``.
        """
        self._check_fresh()
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=1,
                                 logprob_token_ids=[s[-1]], detokenize=False,
                                 output_kind=RequestOutputKind.FINAL_ONLY) for s in sequences]
        outputs = await asyncio.gather(*[self._final_output(s[:-1], p, "score") for s, p in zip(sequences, params)])
        result = []
        for sequence, start, output in zip(sequences, skip, outputs):
            entries = output.prompt_logprobs  # entries[0] is None: nothing predicts the first token
            row = [entries[t][sequence[t]].logprob for t in range(start, len(sequence) - 1)]
            row.append(output.outputs[0].logprobs[0][sequence[-1]].logprob)
            result.append(row)
        return result

    async def classify(self, sequences: Sequence[list[int]]) -> list[float]:
        """A one-label sequence classifier's raw output (no sigmoid) at the last token of each
        sequence: a reward model's scores (the engine runs vLLM's pooling runner)."""
        self._check_fresh()
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        async def one(ids: list[int]) -> float:
            self._request_counter += 1
            request_id = f"classify-{self.index}-{self._request_counter}"
            final = None
            params = PoolingParams(task="classify", use_activation=False)
            async for output in self.engine.encode(TokensPrompt(prompt_token_ids=list(ids)), params, request_id):
                final = output
            if final is None:
                raise RuntimeError(f"replica {self.index}: request {request_id} returned no output")
            data = final.outputs.data
            if data.numel() != 1:
                raise RuntimeError(f"replica {self.index}: the reward model returned {data.numel()} values per "
                                   "sequence; a reward model has one label (num_labels=1)")
            return float(data.reshape(-1)[0])

        return list(await asyncio.gather(*[one(ids) for ids in sequences]))

    async def serve_http(self, host: str | None = None) -> str:
        """Serve this engine over vLLM's OpenAI-compatible HTTP API on ``host`` (default: this node's
        address as Ray knows it); return ``host:port``."""
        import ray

        from megarl.rollout.http_server import serve_openai

        if self.http is None:
            self.http = await serve_openai(self.engine, self.model_path, host or ray.util.get_node_ip_address())
        return self.http.address

    # ------------------------------------------------------------------ weights
    async def load_weights(self, named_tensors: list, version: int) -> int:
        """Load HF-named full tensors into every TP worker; return the version they all report.

        Names and shapes are checked against the checkpoint the engine started from first: a
        failure inside vLLM's reload would leave the model half loaded.
        """
        check_against_checkpoint(named_tensors, self.checkpoint_shapes)
        start = time.perf_counter()
        versions = await self._rpc("megarl_load_weights", named_tensors, version)
        await self.engine.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        logger.info("replica %d: loaded %d tensors (version %d) in %.2f s", self.index, len(named_tensors),
                    version, time.perf_counter() - start)
        return self._agreed(versions, "weights version")

    async def load_adapter(self, adapter: dict, version: int) -> dict[str, float]:
        """Serve the base model with this LoRA adapter (PEFT ``{"tensors", "config"}``) from now on.

        The adapter is written to this replica's own directory and added to vLLM under a new id
        (version + 1), the previous one removed, and the prefix cache reset (its KV blocks were
        computed with the old adapter); until that is done the replica refuses to generate.
        """
        from megarl.rollout.adapters import AdapterStore

        start = time.perf_counter()
        self.stale = f"LoRA adapter update to version {version} in progress"
        try:
            if not hasattr(self, "adapter_store"):
                self.adapter_store = AdapterStore(self.index)
            request, nbytes = self.adapter_store.write(adapter, version)
            await self.engine.add_lora(request)
            if self.lora_request is not None and self.lora_request.lora_int_id != request.lora_int_id:
                await self.engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = request
            await self.engine.reset_prefix_cache()
        except BaseException as exc:
            self.stale = f"LoRA adapter update to version {version} failed: {exc}"
            raise
        self.stale = None
        self.adapter_version = int(version)
        return {"seconds": time.perf_counter() - start, "bytes": float(nbytes), "version": int(version)}

    async def sync_connect(self, plan, first_rank: int, world_size: int, master_addr: str, master_port: int,
                           transport: str, timeout_s: float) -> list[int]:
        """Join the weight-sync world with every TP worker; return their sync ranks."""
        return await self._rpc("megarl_sync_connect", plan, first_rank, self.index, world_size, master_addr,
                               master_port, transport, timeout_s)

    async def sync_receive(self, version: int) -> dict[str, float]:
        """Receive one sharded weight sync into every TP worker (see the worker extension)."""
        self.stale = f"weight sync to version {version} in progress"
        try:
            results = await self._rpc("megarl_sync_receive", version)
        except BaseException as exc:
            self.stale = f"weight sync to version {version} failed: {exc}"
            raise
        await self.engine.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.stale = None
        return {"seconds": max(r["seconds"] for r in results), "bytes": sum(r["bytes"] for r in results),
                "version": self._agreed([r["version"] for r in results], "weights version")}

    async def sync_close(self) -> None:
        if self.engine is not None:
            await self._rpc("megarl_sync_close")

    async def _rpc(self, method: str, *args) -> list:
        """Call a worker-extension method on every TP worker; one result per worker.

        The engine core runs in another process and encodes RPC arguments with msgpack, which turns
        tensors and dataclasses into plain lists; so the arguments travel pickled (between this
        actor and its own engine processes) and ``megarl_call`` unpickles them in the worker.
        """
        return await self.engine.collective_rpc("megarl_call", args=(method, pickle.dumps(args)))

    def _check_fresh(self) -> None:
        if self.stale:
            raise RuntimeError(f"replica {self.index} refuses to generate: {self.stale}. The fleet never serves "
                               "stale weights; a successful sync clears this.")

    async def weights_version(self) -> int:
        return self._agreed(await self._rpc("megarl_weights_version"), "weights version")

    async def weight_checksum(self) -> float:
        """Sum of the TP workers' parameter sums (each holds its shard): equal across replicas with equal weights."""
        return float(sum(await self._rpc("megarl_weight_checksum")))

    async def sleep(self, level: int) -> None:
        """Free the KV cache and offload (level 1) or drop (level 2) the weights; GPU only."""
        await self.engine.sleep(level=level)

    async def wake_up(self, tags: list[str]) -> None:
        await self.engine.wake_up(tags=tags)

    async def close(self) -> None:
        """Stop the engine (its core process and TP workers) before the actor is killed."""
        if self.http is not None:
            await self.http.close()
            self.http = None
        if hasattr(self, "adapter_store"):
            self.adapter_store.close()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
            del engine
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
