"""The asynchronous producer on a real Ray cluster with fake engines of random latency.

The real pieces: ``AsyncBatches`` (producer thread, sample buffer, staleness rules), the agent seam
(``AgentRollout`` with the single-turn loop and ``GenerateClient``s) and the replicas' generation
gate with resumable requests (``megarl.rollout.gate``). The fake: an async Ray actor per replica
that emits tokens one by one after random, heavy-tailed delays, encodes the weight version that
sampled each token in the token id, and takes a "weight sync" the way a replica does (the gate
closes; running requests are aborted and resumed, or awaited). A fake trainer takes the batches.

Checked: no group trains more than ceil(K) versions after its first token; every token's recorded
version is the version that sampled it, and resumed requests continue their tokens; every prompt
trains exactly once across a checkpoint and resume; after the resume no more groups run than the
bound allows (no burst).
"""
from __future__ import annotations

import asyncio
import math
import random
import time

import pytest
import ray

from megarl.rollout.client import GenerateClient
from megarl.rollout.fleet import split_evenly
from megarl.rollout.gate import GenerationGate, Segment, generate_group_resumable, generate_resumable

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
TOKEN_BASE = 400  # a sampled token is TOKEN_BASE + the version that sampled it


class FakeReplica:
    def __init__(self, seed: int):
        self.gate, self.version, self.rng = GenerationGate(), 0, random.Random(seed)
        self.aborted: set[str] = set()
        self.bad: list[str] = []

    async def _segment(self, original, request_id, ids, max_tokens):
        if ids[:len(original)] != original:
            self.bad.append(f"{request_id}: a resumed segment lost its prompt")
        tokens = []
        for _ in range(min(max_tokens, 1 + self.rng.randrange(6))):
            await asyncio.sleep(0.004 * self.rng.paretovariate(1.3))
            if request_id in self.aborted:
                return Segment(tokens, [-0.5] * len(tokens), "abort", None, "")
            tokens.append(TOKEN_BASE + self.version)
        return Segment(tokens, [-0.5] * len(tokens), "length" if len(tokens) == max_tokens else "stop", None, "x")

    async def generate_tokens(self, prompt_ids, sampling_kwargs, seed, images=()):
        original = list(prompt_ids)

        async def run_segment(request_id, ids, max_tokens, segment_seed):
            return await self._segment(original, request_id, ids, max_tokens)

        return await generate_resumable(self.gate, run_segment, prompt_ids, int(sampling_kwargs["max_tokens"]), seed,
                                        lambda: self.version, "fake")

    async def generate_group(self, prompt_ids, sampling_kwargs, seed, images=()):
        original = list(prompt_ids)

        async def run_group(request_id, ids, max_tokens, group_seed):
            return list(await asyncio.gather(*[self._segment(original, request_id, ids, max_tokens)
                                               for _ in range(sampling_kwargs["n"])]))

        async def run_segment(request_id, ids, max_tokens, segment_seed):
            return await self._segment(original, request_id, ids, max_tokens)

        return await generate_group_resumable(self.gate, run_group, run_segment, prompt_ids,
                                              int(sampling_kwargs["max_tokens"]), seed, lambda: self.version, "fake")

    async def sync_receive(self, version, in_flight):
        async def abort(ids):
            self.aborted.update(ids)

        await self.gate.close(abort if in_flight == "abort" else None)
        await asyncio.sleep(0.01)  # the weights change while nothing runs
        self.version = version
        self.gate.open()

    def report(self):
        return self.bad


class FakeFleet:
    def __init__(self, count: int):
        actor = ray.remote(FakeReplica)
        self.handles = [actor.options(num_cpus=0).remote(seed) for seed in range(count)]
        self.num_replicas = count

    def client(self, replica: int) -> GenerateClient:
        return GenerateClient([(replica, self.handles[replica])], 0, max_model_len=4096, vocab_size=1 << 20)

    def replica_for(self, prompt_index: int, num_prompts: int) -> int:
        return next(r for r, chunk in enumerate(split_evenly(num_prompts, self.num_replicas)) if prompt_index in chunk)

    def sync(self, version: int, in_flight: str) -> None:
        ray.get([h.sync_receive.remote(version, in_flight) for h in self.handles])


class FakeSession:
    version = 0


@pytest.fixture(scope="module")
def cluster(ray_address):
    from megarl.cluster.ray_cluster import init_ray, shutdown_ray

    init_ray(address=ray_address)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megarl.devtools.tiny_tokenizer import build_tokenizer
    from tests.config._fixtures import write_prompts

    data = write_prompts(tmp_path_factory.mktemp("prompts") / "train.parquet", rows=200)
    return build_tokenizer("llama"), data


def run_steps(batches, fleet, session, first: int, last: int, rng, bound, seen: dict):
    for step in range(first, last + 1):
        data, _ = batches.take(step)
        window = batches.window(step)
        lag = window - data["first_version"]
        assert int(lag.max()) <= math.ceil(bound.threshold), (step, lag.tolist())
        mask = data.batch.response_mask.bool()
        versions, responses = data["versions"], data.batch.responses
        assert bool(((responses - TOKEN_BASE == versions) | ~mask).all())  # each token's version is its sampler's
        for row in range(len(data)):
            sampled = versions[row][mask[row]].tolist()
            assert sampled == sorted(sampled)  # a resumed request continues on newer weights
        for uid in set(data["uid"]):
            assert uid not in seen, f"prompt {uid} trained twice (steps {seen[uid]} and {step})"
            seen[uid] = step
        time.sleep(rng.uniform(0.0, 0.05))  # the update
        if batches.sync_due(step):
            session.version += 1
            fleet.sync(session.version, batches.in_flight)
            batches.published(session.version)


@pytest.mark.parametrize("threshold, sync_every, partial", [(2.0, 1, True), (1.0, 2, False), (0.5, 1, True)])
def test_admission_bounds_staleness_and_resume_neither_replays_nor_bursts(cluster, setup, threshold, sync_every, partial):
    from megarl.settings.trainer import async_settings
    from megarl.agent import AgentContext, AgentRollout, MultiTurnSettings
    from megarl.checks import load_config
    from megarl.settings.data import build_train_loader
    from megarl.trainer.asynchronous.batches import AsyncBatches

    tokenizer, data_file = setup
    cfg = load_config(None, [
        f"data.train_files={data_file}", "actor_rollout_ref.model.path=/m", "data.train_batch_size=3",
        "actor_rollout_ref.rollout.n=2", "data.max_response_length=6", "async_training.mode=fully_async",
        f"async_training.staleness_threshold={threshold}", f"async_training.trigger_parameter_sync_step={sync_every}",
        f"async_training.partial_rollout={str(partial).lower()}", "async_training.wait_timeout_s=60",
        "algorithm.rollout_correction.rollout_is=token"], validate=False)
    settings = async_settings(cfg)
    fleet, session, rng = FakeFleet(2), FakeSession(), random.Random(0)
    context = AgentContext(tokenizer=tokenizer, response_length=6, multi_turn=MultiTurnSettings())
    rollout = AgentRollout(context, fleet, cfg.actor_rollout_ref.rollout)

    def start(state=None):
        loader = build_train_loader(cfg.data, tokenizer)
        batches = AsyncBatches(settings, rollout, loader, session, n=2, pad_id=0, response_length=6)
        if state is not None:
            batches.load_state_dict(state)
        return batches

    seen: dict[str, int] = {}
    batches = start()
    try:
        run_steps(batches, fleet, session, 1, 8, rng, settings.bound, seen)
        state = batches.state_dict()
    finally:
        batches.close()
    assert state["untrained"], "the producer had nothing drawn ahead: the test would not test a resume"
    # resume: the fleet is synced once more (TrainingLoop.resume), the drawn prompts start again first
    session.version += 1
    fleet.sync(session.version, "wait")
    batches = start(state)
    try:
        time.sleep(0.3)  # let the producer fill up before the first take
        run_steps(batches, fleet, session, 9, 16, rng, settings.bound, seen)
        most_ahead = batches.buffer.counts()["most_ahead"]  # since the resume
        final = batches.state_dict()
    finally:
        batches.close()
    assert not [b for r in ray.get([h.report.remote() for h in fleet.handles]) for b in r]
    assert 0 < most_ahead <= math.floor((threshold + 1) * settings.bound.window_groups + 1e-9), most_ahead
    steps_of = {}
    for uid, step in seen.items():
        steps_of.setdefault(step, []).append(uid)
    assert sorted(steps_of) == list(range(1, 17)) and all(len(v) == 3 for v in steps_of.values())
    trained = {(int(u.split(":")[0]) - 1) * 3 + int(u.split(":")[1]) for u in seen}
    left = {key for key, _ in final["untrained"]}
    assert not trained & left and sorted(trained | left) == list(range(final["next_key"]))  # none skipped or replayed
