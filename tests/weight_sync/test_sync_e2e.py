"""Weight sync end to end: Megatron trainer layouts TP=2, PP=2 and EP=2 (MoE) -> 2 vLLM replicas,
and TP=2 / EP=2 -> 2 hf replicas (``rollout.name=hf``: the trainer's per-expert tensors land in
transformers' fused expert tensors).

After one training step (random advantages: the weights really change), the sync makes the
fleet's greedy log-probs equal the trainer's to 1e-4, and different from before the sync.
"""
from __future__ import annotations

import pytest
import torch

from megarl.checks import load_config

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.slow]

PROMPTS = [[5, 17, 42, 9], [7, 7, 3, 100, 12], [250, 11], [31, 64, 128, 5, 6, 7]]


def config(model, data, tp=1, pp=1, ep=1, rollout="vllm"):
    return load_config(None, [f"actor_rollout_ref.rollout.name={rollout}",
        f"data.train_files={data}", f"actor_rollout_ref.model.path={model}", "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}",
        f"actor_rollout_ref.actor.megatron.sequence_parallel={str(tp > 1).lower()}",
        "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.num_replicas=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.9", "actor_rollout_ref.rollout.max_num_batched_tokens=512",
        "actor_rollout_ref.rollout.max_num_seqs=64",
        "data.max_prompt_length=16", "data.max_response_length=8", "actor_rollout_ref.rollout.weight_sync.bucket_mb=1",
        "actor_rollout_ref.rollout.weight_sync.timeout_s=120",
    ])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("sync_models")
    return {"dense": make_tiny_model("qwen2", "tiny", root / "dense", seed=3),
            "moe": make_tiny_model("qwen3_moe", "tiny", root / "moe", seed=3), "data": root / "unused.parquet"}


@pytest.fixture(scope="module")
def ray_cluster(ray_address):
    from megarl.cluster.ray_cluster import init_ray, shutdown_ray

    init_ray(address=ray_address)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def fleets(ray_cluster):
    """One 2-replica fleet per model, shared by the layouts that use it (engine starts are slow)."""
    started = {}
    yield started
    for fleet in started.values():
        fleet.shutdown()


def train_one_step(workers, cfg):
    """One actor update with random advantages on a random batch: the weights move."""
    import ray

    from megarl.engine import RLBatch
    from megarl.trainer.megatron_worker import dp_leaders, gather_data_parallel

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (4, 5), generator=g)
    responses = torch.randint(3, 500, (4, 3), generator=g)
    batch = RLBatch.from_parts(prompts, torch.ones_like(prompts), responses, torch.ones_like(responses))
    leaders = dp_leaders(workers.call("coords"))  # EP=2 here means two data-parallel ranks
    old = gather_data_parallel(workers, leaders, "compute_log_prob", ray.put(batch), False)[0]
    batch = batch.with_fields(old_log_probs=old, advantages=torch.randn(4, 3, generator=g))
    workers.call("update_actor", ray.put(batch))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("layout", [
    dict(tp=2), dict(pp=2), dict(ep=2), dict(tp=2, rollout="hf"), dict(ep=2, rollout="hf"),
], ids=["tp2", "pp2", "ep2", "tp2-hf", "ep2-hf"])
def test_sync_makes_fleet_serve_trainer_weights(models, fleets, layout):
    from megarl.settings.worker import worker_settings
    from megarl.rollout import RolloutFleet
    from megarl.trainer.megatron_worker import MegatronWorker
    from megarl.cluster.worker_group import WorkerGroup
    from megarl.settings.sync import weight_updates
    from megarl.trainer.sync_verify import verify_sync

    model = models["moe"] if layout.get("ep") else models["dense"]
    cfg = config(model, models["data"], **layout)
    key = (str(model), layout.get("rollout", "vllm"))
    if key not in fleets:
        for other in list(fleets):  # the layouts are ordered by fleet: one fleet at a time fits the CPUs Ray has
            fleets.pop(other).shutdown()
        fleets[key] = RolloutFleet(cfg.actor_rollout_ref.rollout, str(model))
    fleet = fleets[key]
    workers = WorkerGroup(MegatronWorker, 2, init_args=(worker_settings(cfg, 2),))
    session = None
    try:
        session = weight_updates(cfg, workers, fleet)
        assert session.plan.bytes_sent * 2 == session.plan.bytes_needed()  # each byte once, 2 replicas
        session.sync()  # a fleet shared with an earlier layout holds that layout's trained weights
        before = verify_sync(fleet, workers, PROMPTS)
        assert before["rollout/logprob_diff_max"] < 1e-4
        train_one_step(workers, cfg)
        stale = verify_sync(fleet, workers, PROMPTS)
        assert stale["rollout/logprob_diff"] > 1e-3  # the trainer moved; the fleet has not yet
        metrics = session.sync()
        assert metrics["weight_sync/bytes_sent"] == session.plan.bytes_sent
        after = verify_sync(fleet, workers, PROMPTS)
        assert after["rollout/logprob_diff_max"] < 1e-4, after
        if fleet.backend.name == "hf":  # transformers' forward against megatron's, both fp32
            print(f"{layout}: rollout/logprob_diff after the sync {after['rollout/logprob_diff']:.2e}")
            assert after["rollout/logprob_diff"] < 1e-5, after
        assert fleet.version() == session.version == metrics["weight_sync/version"]
    finally:
        if session is not None:
            session.close()
        workers.shutdown()
