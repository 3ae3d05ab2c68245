"""One hf rollout replica: a Ray actor that generates with a Hugging Face transformers model.

The counterpart of ``megarl.rollout.vllm.replica.EngineReplica`` with the same methods, messages
and guarantees (see ``megarl.rollout.backend`` for the seam): the fleet cannot tell them apart
but by speed and by the random numbers of sampled tokens. The model runs in this process
(``engine.HFEngine``: a KV-cache decoding loop over ``AutoModelForCausalLM``), on one device, no
tensor parallelism; ``scheduler.Scheduler`` batches the requests in flight continuously (the batch
``generate`` of the fleet, and the per-request ``generate_tokens`` and ``generate_group`` of agent
loops alike).

Weights: ``self.weights`` (``ReceiverEndpoint``) records the version served and whether the weights
are stale; the sync's tensors go straight into the model's parameters (``weights.SyncReceiver``),
on the engine thread, while the generation gate (``gate.py``) is closed: running requests finish
first (``in_flight="wait"``) or are aborted and continued on the new weights afterwards
(``"abort"``), every token stamped with its version. A replica whose last sync failed, or is
running, refuses to generate. It has no sleep mode and serves no LoRA adapters (merged updates
only); the config check refuses both before anything starts.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any, Sequence

from megarl.rollout.gate import Segment, generate_group_resumable, generate_resumable
from megarl.rollout.hf.registration import HFReplicaSpec
from megarl.rollout.replica_base import GatedReplica, batch_samples, check_finish, require_one_sample
from megarl.rollout.sample import Generation, RolloutSample

logger = logging.getLogger(__name__)


class HFReplica(GatedReplica):
    """Hosts one transformers model; ``index`` is the replica's position in the fleet.

    ``device_ids`` (GPU, from the trainer's placement): the one GPU of the replica's slot, made
    ``CUDA_VISIBLE_DEVICES`` before torch looks for devices.
    """

    def __init__(self, index: int, spec: HFReplicaSpec, device_ids: Sequence[str] = ()):
        from megarl.logging.worker_logs import capture_worker_output

        capture_worker_output(f"rollout_replica{index}")
        start = time.perf_counter()
        if device_ids:
            if len(device_ids) != 1:
                raise ValueError(f"replica {index}: {len(device_ids)} GPUs {list(device_ids)} for one hf replica "
                                 "(it has no tensor parallelism)")
            os.environ["CUDA_VISIBLE_DEVICES"] = str(device_ids[0])
        import torch
        import transformers  # noqa: F401  (the import time is reported)

        from megarl.platform import has_cuda

        self._init_gate(index, self._rpc)
        self.spec = spec
        self.on_gpu = has_cuda()
        self.import_seconds = time.perf_counter() - start
        self.device = torch.device("cuda", 0) if self.on_gpu else torch.device("cpu")
        self.model, self.tokenizer = self._load(spec)
        self._start_engine(spec)
        self.start_seconds = time.perf_counter() - start - self.import_seconds
        logger.info("replica %d: transformers imported in %.1f s, %s loaded in %.1f s (pid %d, %s, %s)", index,
                    self.import_seconds, spec.model_path, self.start_seconds, os.getpid(), self.device,
                    self.model.dtype)

    def _load(self, spec: HFReplicaSpec):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from megarl.platform.hardware import limit_memory_fraction
        from megarl.rollout.hf.engine import resolve_dtype

        if self.on_gpu:
            limit_memory_fraction(spec.gpu_memory_utilization, self.device)
        else:
            torch.set_num_threads(spec.cpu_threads)
        from megarl.models.families import register_checkpoint_classes

        register_checkpoint_classes(spec.model_path)  # a family's own transformers classes (Kimi-K2's kimi_k2)
        extra = {}
        if spec.hf_overrides:  # the trainer's models are built with these fields too (override_config.model_config)
            from transformers import AutoConfig

            from megarl.models import apply_overrides

            config = AutoConfig.from_pretrained(spec.model_path, trust_remote_code=spec.trust_remote_code)
            extra["config"] = apply_overrides(config, dict(spec.hf_overrides))
        model = AutoModelForCausalLM.from_pretrained(
            spec.model_path, dtype=resolve_dtype(spec.dtype, self.on_gpu), trust_remote_code=spec.trust_remote_code,
            attn_implementation="sdpa" if self.on_gpu else "eager", **extra).to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path or spec.model_path,
                                                  trust_remote_code=spec.trust_remote_code)
        longest = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if longest is not None and spec.max_model_len > longest:
            raise ValueError(f"actor_rollout_ref.rollout.max_model_len={spec.max_model_len} (or prompt_length + "
                             f"response_length) exceeds the model's max_position_embeddings={longest}; lower it")
        return model, tokenizer

    def _start_engine(self, spec: HFReplicaSpec) -> None:
        from megarl.rollout.hf.engine import HFEngine
        from megarl.rollout.hf.scheduler import Scheduler
        from megarl.rollout.hf.weights import SyncReceiver

        eos = self.tokenizer.eos_token_id
        configured = self.model.generation_config.eos_token_id
        extra = {configured} if isinstance(configured, int) else set(configured or ())
        pad = next(t for t in (self.tokenizer.pad_token_id, eos, 0) if t is not None)
        self.engine = HFEngine(self.model, self.device, pad, spec.logprobs_mode)
        self.scheduler = Scheduler(self.engine, self.tokenizer, max_model_len=spec.max_model_len,
                                   max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                                   eos_token_id=eos, extra_eos_ids=frozenset(extra - {eos}),
                                   log_stats=not spec.disable_log_stats)
        self.sync = SyncReceiver(self.model, self.device)

    async def info(self) -> dict[str, Any]:
        """Facts the fleet checks requests against, plus the engine start time."""
        return dict(index=self.index, pid=os.getpid(), on_gpu=self.on_gpu, max_model_len=self.spec.max_model_len,
                    vocab_size=int(self.model.config.get_text_config().vocab_size), dtype=str(self.model.dtype),
                    import_seconds=self.import_seconds, start_seconds=self.start_seconds)

    # ------------------------------------------------------------------ generation
    def _settings(self, sampling_kwargs: dict[str, Any]):
        from megarl.rollout.hf.sampler import RowSampling

        return RowSampling.from_kwargs(sampling_kwargs)

    def _segment(self, sequence, what: str, allow_abort: bool = False) -> Segment:
        check_finish(self.index, sequence.finish_reason, what, allow_abort)
        stop = sequence.stop_reason
        return Segment(token_ids=list(sequence.token_ids), logprobs=list(sequence.logprobs),
                       finish_reason=sequence.finish_reason, stop_string=stop if isinstance(stop, str) else None,
                       text=sequence.text)

    def _text_only(self, images) -> None:
        if images:
            raise ValueError(f"replica {self.index}: the hf rollout backend serves text prompts only; image prompts "
                             "need actor_rollout_ref.rollout.name=vllm")

    async def generate(self, requests: Sequence[tuple[int, list[int], int]],
                       sampling_kwargs: dict[str, Any], images: dict[int, list] | None = None) -> list[RolloutSample]:
        """Generate for ``(prompt_index, prompt_ids, request_seed)`` requests; n samples per prompt.

        All requests are in flight at once; the k-th of a prompt's n samples is seeded with
        ``request_seed + k`` (as vLLM does). A weight sync waits for them (an abort would be an
        error: batch requests are not resumed). ``images``: this backend serves text prompts only (no
        ``images`` trait; the fleet refuses image prompts before they reach it).
        """
        import asyncio

        self._text_only(images)

        settings = self._settings(sampling_kwargs)

        def one(ids, seed):
            return self._gated(lambda rid: self.scheduler.generate(rid, list(ids), settings, seed), "batch")

        outputs = await asyncio.gather(*[one(ids, seed) for _, ids, seed in requests])
        samples = []
        for (prompt_index, prompt_ids, _), sequences in zip(requests, outputs):
            samples += batch_samples(self.index, prompt_index, prompt_ids, [
                (s.sample_index, self._segment(s, f"prompt {prompt_index} sample {s.sample_index}")) for s in sequences])
        return samples

    def _segment_runner(self, sampling_kwargs: dict[str, Any], what: str):
        """``run_segment`` of ``generate_resumable``: one sample of ``prompt + tokens so far`` on the
        current weights, ``max_tokens`` at most, seeded ``segment_seed``; it may end aborted."""
        async def run_segment(request_id: str, ids: list[int], max_tokens: int, segment_seed: int) -> Segment:
            self.weights.check_fresh()
            settings = self._settings({**sampling_kwargs, "n": 1, "max_tokens": max_tokens})
            [sequence] = await self.scheduler.generate(request_id, ids, settings, segment_seed)
            return self._segment(sequence, what, allow_abort=True)

        return run_segment

    def _detokenize(self, ids: list[int]) -> str:
        """The text of a completion that ran in several segments (as vLLM's detokenizer: no special tokens)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def generate_tokens(self, prompt_ids: list[int], sampling_kwargs: dict[str, Any], seed: int,
                              images: Sequence = ()) -> Generation:
        """One completion (``n=1``), resumed on the new weights after a sync that aborts it: the contract of
        ``EngineReplica.generate_tokens``, on the scheduler's rows (text prompts only: ``images`` refused)."""
        self._text_only(images)
        require_one_sample(sampling_kwargs)
        self._settings(sampling_kwargs)  # bad settings fail before the request enters the gate
        run_segment = self._segment_runner(sampling_kwargs, f"a request of {len(prompt_ids)} tokens")
        return await generate_resumable(self.gate, run_segment, prompt_ids, int(sampling_kwargs["max_tokens"]), seed,
                                        lambda: self.weights.version, f"turn-{self.index}", self._detokenize)

    async def generate_group(self, prompt_ids: list[int], sampling_kwargs: dict[str, Any], seed: int,
                             images: Sequence = ()) -> list[Generation]:
        """The ``n`` completions of one prompt as one request (single-turn agent loops): the k-th is
        what ``generate_tokens`` gives with seed ``seed + k`` (its own ``torch.Generator``, as in
        ``generate``). A sync that aborts them continues each alone, as ``generate_tokens`` would."""
        self._text_only(images)
        what = f"a group request of {len(prompt_ids)} tokens"
        self._settings(sampling_kwargs)  # bad settings fail before the request enters the gate

        async def run_group(request_id: str, ids: list[int], max_tokens: int, group_seed: int) -> list[Segment]:
            self.weights.check_fresh()
            settings = self._settings({**sampling_kwargs, "max_tokens": max_tokens})
            sequences = await self.scheduler.generate(request_id, ids, settings, group_seed)
            return [self._segment(s, what, allow_abort=True) for s in sequences]

        return await generate_group_resumable(
            self.gate, run_group, self._segment_runner(sampling_kwargs, what), prompt_ids,
            int(sampling_kwargs["max_tokens"]), seed, lambda: self.weights.version, f"group-{self.index}",
            self._detokenize)

    async def score(self, sequences: Sequence[list[int]], skip: Sequence[int], topk: int = 0) -> list:
        """Log-probs (``log_softmax(logits)``, as vLLM's prompt log-probs) of each sequence's own tokens
        after its first ``skip`` tokens (with ``topk``, ``TopkScores``: also the top-k at each position); a
        sequence may be as long as ``max_model_len``."""
        too_long = [len(s) for s in sequences if len(s) > self.spec.max_model_len]
        if too_long:
            raise ValueError(f"replica {self.index}: a sequence of {too_long[0]} tokens is longer than "
                             f"max_model_len={self.spec.max_model_len}")
        return await self._gated(lambda rid: self.scheduler.on_engine(self.engine.score, list(sequences), list(skip),
                                                                       topk), "score")

    # ------------------------------------------------------------------ weights
    async def load_adapter(self, adapter: dict, version: int) -> dict[str, float]:
        raise RuntimeError("the hf rollout backend serves merged weights only: adapter-only LoRA updates "
                           "(actor_rollout_ref.model.lora.merge=False) need rollout.name=vllm, or set lora.merge=True")

    def _abort_running(self):
        return self.scheduler.abort

    async def sync_close(self) -> None:
        if self.scheduler is not None:
            await self.weights.close()

    async def _rpc(self, method: str, *args) -> list:
        """The ``ReceiverEndpoint``'s calls, run on the engine thread; one result (one rank)."""
        calls = {"megarl_sync_connect": self.sync.connect, "megarl_sync_receive": self.sync.receive,
                 "megarl_sync_close": self.sync.close}
        if method not in calls:
            raise ValueError(f"hf replica: unknown sync call {method!r}")
        return [await self.scheduler.on_engine(calls[method], *args)]

    async def sleep(self, level: int) -> None:
        raise RuntimeError("the hf rollout backend has no sleep mode (its model stays in memory); run it with "
                           "actor_rollout_ref.rollout.free_cache_engine=False, or use rollout.name=vllm")

    async def wake_up(self, tags: list[str]) -> None:
        raise RuntimeError("the hf rollout backend has no sleep mode, so nothing to wake up")

    async def close(self) -> None:
        """Stop the scheduler and free the model before the actor is killed."""
        scheduler, self.scheduler = getattr(self, "scheduler", None), None
        if scheduler is not None:
            await scheduler.close()
        if getattr(self, "sync", None) is not None:
            self.sync.close()
        self.model = self.engine = None
        gc.collect()
