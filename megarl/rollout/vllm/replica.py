"""One engine replica: a Ray actor that owns one vLLM ``AsyncLLM`` engine (with its own TP size).

The fleet creates it with ``ray.remote(EngineReplica).options(...)`` inside the replica's
placement-group bundle and with the environment from ``engine_config.replica_env``. Its methods
are coroutines, so Ray runs it as an async actor: many requests are in flight at once (the batch
``generate`` of the fleet, and the per-request ``generate_tokens`` of agent loops, every turn of
every trajectory a request of its own) and vLLM's scheduler batches them continuously. The engine
core runs in a child process of the actor (as vLLM's ``AsyncLLM`` does), its TP workers, with megarl's
worker extension, in children of that; a TP=1 replica on CPU runs engine core and worker in the actor's
own process (``inproc_core.py``: it spares a process that imports vLLM again on every engine start).

A reward model's replica (``megarl.rewards.reward_models``) runs vLLM's pooling runner instead and scores
sequences (``classify``); reward-model and judge replicas also serve vLLM's OpenAI-compatible HTTP
API on their engine (``serve_http``), which reward functions call.

Weights: ``self.weights`` (``ReceiverEndpoint``) is the replica's end of the weight sync and the one
record of the version it serves; while a sync runs, or after one failed, it is stale and the
replica refuses to generate, so stale weights are never served. Around a sync the generation gate
(``gate.py``) closes: running requests finish first, or are aborted and continued on the new
weights afterwards (``in_flight="abort"``: partial rollouts), every token stamped with its version.
With adapter-only LoRA updates (``load_adapter``) the same gate and version record apply.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import pickle
import time
from typing import Any, Sequence

from megarl.rollout.images import check_expanded, collapse_image_tokens
from megarl.rollout.vllm.engine_config import ReplicaSpec, llm_kwargs
from megarl.rollout.gate import Segment, generate_group_resumable, generate_resumable
from megarl.rollout.replica_base import GatedReplica, ReplicaLost, batch_samples, check_finish, require_one_sample
from megarl.rollout.sample import Generation, RolloutSample

logger = logging.getLogger(__name__)

# How long a CPU engine's core process (with its TP workers) gets to exit after vLLM's SIGTERM before vLLM
# kills it. Exiting takes it 2-5 s on 2 cores (gloo groups torn down, gc, interpreter exit; measured), on
# every run's teardown, and holds nothing a kill loses: host memory and sockets go with the process, and
# the replica's multiprocessing resource tracker unlinks the semaphore it leaves. GPUs keep vLLM's 5 s.
CPU_STOP_GRACE_S = 0.5


class EngineReplica(GatedReplica):
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
        import ray

        from megarl.platform import has_cuda
        from megarl.platform.network import pin_socket_interfaces

        # vLLM's gloo groups (TP on CPU), NCCL and the weight-sync receivers listen on this node's cluster
        # interface only (lo on one node); its TP workers inherit the environment
        pin_socket_interfaces(ray.util.get_node_ip_address())
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from megarl.rollout.vllm.inproc_core import engine_core_in_process

        self._init_gate(index, self._rpc)
        self.on_gpu = has_cuda()
        self.import_seconds = time.perf_counter() - start
        args = AsyncEngineArgs(**llm_kwargs(spec, self.on_gpu))
        vllm_config = args.create_engine_config()
        if spec.ray_executor:  # the engine core process is not this actor: hand it the actor's placement group
            vllm_config.parallel_config.placement_group = ray.util.get_current_placement_group()
        # On CPU with VLLM_ENABLE_V1_MULTIPROCESSING=0 (replica_env) the engine core runs in this process
        self.core_in_process = not self.on_gpu and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        with engine_core_in_process() if self.core_in_process else contextlib.nullcontext():
            self.engine = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=spec.disable_log_stats)
        self.model_config = vllm_config.model_config
        self.image_token_id = getattr(self.model_config.hf_config, "image_token_id", None)
        self.start_seconds = time.perf_counter() - start - self.import_seconds
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
            image_token_id=self.image_token_id,
            import_seconds=self.import_seconds,
            start_seconds=self.start_seconds,
        )

    # ------------------------------------------------------------------ generation
    async def _final_output(self, prompt_ids: Sequence[int], params, tag: str, request_id: str | None = None,
                            images: Sequence | None = None):
        """Run one request to completion; its last ``RequestOutput``. With ``images``, ``prompt_ids`` repeat
        each image's placeholder once per image token, and vLLM's processor must make the same ids."""
        from vllm.inputs import TokensPrompt

        if images:
            prompt = TokensPrompt(prompt_token_ids=collapse_image_tokens(prompt_ids, self.image_token_id, len(images)),
                                  multi_modal_data={"image": list(images)})
        else:
            prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        if request_id is None:
            request_id = self._request_id(tag)
        from vllm.v1.engine.exceptions import EngineDeadError

        final = None
        try:
            async for output in self.engine.generate(prompt, params, request_id, lora_request=self.lora_request):
                final = output
        except EngineDeadError as exc:  # its engine core process is gone: the fleet replaces this replica
            raise ReplicaLost(f"replica {self.index}: its vLLM engine died ({exc})") from exc
        if final is None:
            raise RuntimeError(f"replica {self.index}: request {request_id} returned no output")
        if images:
            check_expanded(f"request {request_id}", prompt_ids, final.prompt_token_ids, self.index)
        return final

    def _params(self, sampling_kwargs: dict[str, Any], seed: int, **extra):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(**sampling_kwargs, **extra, seed=seed, output_kind=RequestOutputKind.FINAL_ONLY)

    def _segment(self, completion, what: str, allow_abort: bool = False) -> Segment:
        check_finish(self.index, completion.finish_reason, what, allow_abort)
        token_ids = list(completion.token_ids)
        stop_reason = completion.stop_reason
        return Segment(token_ids=token_ids,
                       logprobs=[step[token].logprob for step, token in zip(completion.logprobs or [], token_ids)],
                       finish_reason=completion.finish_reason,
                       stop_string=stop_reason if isinstance(stop_reason, str) else None, text=completion.text)

    async def generate(self, requests: Sequence[tuple[int, list[int], int]],
                       sampling_kwargs: dict[str, Any], images: dict[int, list] | None = None) -> list[RolloutSample]:
        """Generate for ``(prompt_index, prompt_ids, request_seed)`` requests; n samples per prompt.

        All requests are in flight at once; vLLM gives the k-th of a prompt's n samples the seed
        ``request_seed + k``. A weight sync waits for them (an abort would be an error: batch
        requests are not resumed). ``images``: the PIL images of the prompts that have any, by prompt index.
        """
        images = images or {}

        def one(index, ids, seed):
            return self._gated(lambda rid: self._final_output(ids, self._params(sampling_kwargs, seed), "batch", rid,
                                                              images.get(index)), "batch")

        outputs = await asyncio.gather(*[one(index, ids, seed) for index, ids, seed in requests])
        samples = []
        for (prompt_index, prompt_ids, _), output in zip(requests, outputs):
            samples += batch_samples(self.index, prompt_index, prompt_ids, [
                (c.index, self._segment(c, f"prompt {prompt_index} sample {c.index}"))
                for c in sorted(output.outputs, key=lambda c: c.index)])
        return samples

    async def generate_tokens(self, prompt_ids: list[int], sampling_kwargs: dict[str, Any], seed: int,
                              images: Sequence = ()) -> Generation:
        """One completion of ``prompt_ids`` (token in, token out): one turn of an agent loop.

        ``sampling_kwargs`` must ask for one sample (``n=1``); ``seed`` makes it reproducible. A
        weight sync that aborts it (partial rollouts) does not end it: it continues on the new
        weights, and ``Generation.versions`` records the version of each token. ``images``: the prompt's
        (a vision-language model's), with each segment: the continuation keeps them in its prefix.
        """
        require_one_sample(sampling_kwargs)
        what = f"a request of {len(prompt_ids)} tokens"

        async def run_segment(request_id: str, ids: list[int], max_tokens: int, segment_seed: int) -> Segment:
            self.weights.check_fresh()
            params = self._params({**sampling_kwargs, "max_tokens": max_tokens}, segment_seed)
            output = await self._final_output(ids, params, "turn", request_id, images)
            return self._segment(output.outputs[0], what, allow_abort=True)

        tokenizer = self.engine.tokenizer
        return await generate_resumable(
            self.gate, run_segment, prompt_ids, int(sampling_kwargs["max_tokens"]), seed,
            lambda: self.weights.version, f"turn-{self.index}",
            detokenize=(lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else None)

    async def generate_group(self, prompt_ids: list[int], sampling_kwargs: dict[str, Any], seed: int,
                             images: Sequence = ()) -> list[Generation]:
        """The ``n`` completions of one prompt as one engine request (single-turn agent loops): the
        k-th is what ``generate_tokens`` gives with seed ``seed + k``, sampled once for all with the
        prompt's prefix computed once. A sync that aborts them continues each alone."""
        what = f"a group request of {len(prompt_ids)} tokens"

        async def run_group(request_id: str, ids: list[int], max_tokens: int, group_seed: int) -> list[Segment]:
            self.weights.check_fresh()
            params = self._params({**sampling_kwargs, "max_tokens": max_tokens}, group_seed)
            output = await self._final_output(ids, params, "group", request_id, images)
            return [self._segment(c, what, allow_abort=True) for c in sorted(output.outputs, key=lambda c: c.index)]

        async def run_segment(request_id: str, ids: list[int], max_tokens: int, segment_seed: int) -> Segment:
            self.weights.check_fresh()
            params = self._params({**sampling_kwargs, "n": 1, "max_tokens": max_tokens}, segment_seed)
            output = await self._final_output(ids, params, "turn", request_id, images)
            return self._segment(output.outputs[0], what, allow_abort=True)

        tokenizer = self.engine.tokenizer
        return await generate_group_resumable(
            self.gate, run_group, run_segment, prompt_ids, int(sampling_kwargs["max_tokens"]), seed,
            lambda: self.weights.version, f"group-{self.index}",
            detokenize=(lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else None)

    async def score(self, sequences: Sequence[list[int]], skip: Sequence[int], topk: int = 0) -> list:
        """Log-probs of each sequence's own tokens after its first ``skip`` tokens; with ``topk`` also the
        engine's ``topk`` most likely tokens at each of those positions (``TopkScores`` per sequence).

        The sequence minus its last token is the prompt: ``prompt_logprobs=0`` scores its tokens
        (entry t scores token t given tokens < t), and the one decode step scores the last token
        through ``logprob_token_ids``. So a sequence may be as long as ``max_model_len``. With
        ``topk`` the whole sequence is the prompt (``prompt_logprobs=topk``: each entry holds the top-k
        and the sequence's own token), so a sequence may be one token shorter.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if topk:
            return await self._score_topk(sequences, skip, topk)

        params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=1,
                                 logprob_token_ids=[s[-1]], detokenize=False,
                                 output_kind=RequestOutputKind.FINAL_ONLY) for s in sequences]
        outputs = await asyncio.gather(*[
            self._gated(lambda rid, s=s, p=p: self._final_output(s[:-1], p, "score", rid), "score")
            for s, p in zip(sequences, params)])
        result = []
        for sequence, start, output in zip(sequences, skip, outputs):
            entries = output.prompt_logprobs  # entries[0] is None: nothing predicts the first token
            row = [entries[t][sequence[t]].logprob for t in range(start, len(sequence) - 1)]
            row.append(output.outputs[0].logprobs[0][sequence[-1]].logprob)
            result.append(row)
        return result

    async def _score_topk(self, sequences: Sequence[list[int]], skip: Sequence[int], topk: int) -> list:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from megarl.rollout.sample import TopkScores

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=topk, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        outputs = await asyncio.gather(*[
            self._gated(lambda rid, s=s: self._final_output(list(s), params, "score", rid), "score") for s in sequences])
        result = []
        for sequence, start, output in zip(sequences, skip, outputs):
            entries = output.prompt_logprobs  # entries[t]: the top-k at t and token t itself, given tokens < t
            scores = TopkScores([], [], [])
            for t in range(start, len(sequence)):
                best = sorted(entries[t].items(), key=lambda item: (item[1].rank, -item[1].logprob))[:topk]
                scores.log_probs.append(entries[t][sequence[t]].logprob)
                scores.topk_ids.append([token for token, _ in best])
                scores.topk_log_probs.append([entry.logprob for _, entry in best])
            result.append(scores)
        return result

    async def classify(self, sequences: Sequence[list[int]]) -> list[float]:
        """A one-label sequence classifier's raw output (no sigmoid) at the last token of each
        sequence: a reward model's scores (the engine runs vLLM's pooling runner)."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        async def one(ids: list[int], request_id: str) -> float:
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

        return list(await asyncio.gather(*[self._gated(lambda rid, ids=ids: one(ids, rid), "classify")
                                           for ids in sequences]))

    async def serve_http(self, host: str | None = None) -> str:
        """Serve this engine over vLLM's OpenAI-compatible HTTP API on ``host`` (default: this node's
        address as Ray knows it); return ``host:port``."""
        import ray

        from megarl.rollout.vllm.http_server import serve_openai

        if self.http is None:
            self.http = await serve_openai(self.engine, self.model_path, host or ray.util.get_node_ip_address())
        return self.http.address

    # ------------------------------------------------------------------ weights
    async def load_adapter(self, adapter: dict, version: int) -> dict[str, float]:
        """Serve the base model with this LoRA adapter (PEFT ``{"tensors", "config"}``) from now on.

        The gate closes first (running requests finish on the old adapter; new ones wait). The
        adapter is written to this replica's own directory and added to vLLM under a new id, the
        previous one removed, and the prefix cache reset (its KV blocks were computed with the old
        adapter); the weights record is stale until that is done and names the failure if it fails.
        """
        from megarl.rollout.vllm.adapters import AdapterStore

        if version <= self.weights.version:
            raise ValueError(f"replica {self.index}: adapter version {version} is not newer than the version it "
                             f"serves ({self.weights.version})")
        start = time.perf_counter()
        await self.gate.close(None)
        try:
            self.weights.stale = f"LoRA adapter update to version {version} in progress"
            if not hasattr(self, "adapter_store"):
                self.adapter_store = AdapterStore(self.index)
            request, nbytes = self.adapter_store.write(adapter, version)
            await self.engine.add_lora(request)
            if self.lora_request is not None and self.lora_request.lora_int_id != request.lora_int_id:
                await self.engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = request
            await self._drop_stale_caches()
            self.weights.version, self.weights.stale = int(version), None
        except BaseException as exc:
            self.weights.stale = f"LoRA adapter update to version {version} failed: {exc}"
            raise
        finally:
            self.gate.open()
        return {"seconds": time.perf_counter() - start, "bytes": float(nbytes), "version": int(version)}

    def _abort_running(self):
        return self.engine.abort

    def _engine_failure(self) -> str | None:
        if self.engine is None:
            return "its vLLM engine was shut down"
        if self.engine.errored:
            return "its vLLM engine core failed" if self.core_in_process else "its vLLM engine core process died"
        return None

    async def _after_receive(self) -> None:
        await self._drop_stale_caches()

    async def _drop_stale_caches(self) -> None:
        """After new weights: cached KV blocks were computed with the old ones, and so were a vision-language
        model's cached vision-tower outputs (an image sent again would reuse them; after vLLM's reload its runner
        has dropped them while the scheduler still counts them: "Encoder cache miss")."""
        await self.engine.reset_prefix_cache()
        if self.image_token_id is not None:
            await self.engine.reset_encoder_cache()

    async def sync_close(self) -> None:
        if self.engine is not None:
            await self.weights.close()

    async def _rpc(self, method: str, *args) -> list:
        """Call a worker-extension method on every TP worker; one result per worker.

        The engine core (in another process, except a TP=1 CPU replica's) encodes RPC arguments with
        msgpack, which turns tensors and dataclasses into plain lists; so the arguments travel pickled
        (between this actor and its own engine processes) and ``megarl_call`` unpickles them in the worker.
        """
        return await self.engine.collective_rpc("megarl_call", args=(method, pickle.dumps(args)))

    async def sleep(self, level: int) -> None:
        """Free the KV cache and offload (level 1) or drop (level 2) the weights; GPU only."""
        await self.engine.sleep(level=level)

    async def wake_up(self, tags: list[str]) -> None:
        await self.engine.wake_up(tags=tags)

    async def close(self) -> None:
        """Stop the engine (its core, in its process or this one, and its TP workers) before the actor is killed."""
        if self.http is not None:
            await self.http.close()
            self.http = None
        if hasattr(self, "adapter_store"):
            self.adapter_store.close()
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown(timeout=None if self.on_gpu else CPU_STOP_GRACE_S)
            del engine
            gc.collect()
