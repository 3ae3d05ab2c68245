"""Training can start from a megatron dist checkpoint (``megatron.dist_checkpointing_path``).

Model A is ``model.path`` (config, tokenizer, and the fleet's starting weights); model B has the
same architecture and other weights, converted to megatron at TP=1 by ``conversion``. The trainer,
at TP=2, must compute B's log-probs (checked against a Hugging Face forward of B), and the
loop's start-up sync must make the fleet (started from A) serve B.
"""
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.checks import load_config
from megarl.trainer.megatron_worker import check_same_architecture
from megarl.settings.engine import initial_checkpoints

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 42, 9], [7, 7, 3, 100, 12]]


def config(model, checkpoint, *extra):
    return load_config(None, [
        "data.train_files=unused.parquet", f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=2",
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        f"actor_rollout_ref.actor.megatron.dist_checkpointing_path={checkpoint}",
        "actor_rollout_ref.rollout.num_replicas=1", "actor_rollout_ref.rollout.max_num_batched_tokens=512",
        "actor_rollout_ref.rollout.max_num_seqs=16", "data.max_prompt_length=16", "data.max_response_length=8",
        "actor_rollout_ref.rollout.weight_sync.timeout_s=120", *extra])


def test_start_checkpoints_follow_the_verl_keys():
    cfg = config("m", "/ckpt/actor")
    assert initial_checkpoints(cfg) == {"actor": "/ckpt/actor", "ref": "/ckpt/actor", "critic": None}
    cfg = config("m", "/ckpt/actor", "actor_rollout_ref.ref.megatron.dist_checkpointing_path=/ckpt/ref",
                 "critic.megatron.dist_checkpointing_path=/ckpt/critic")
    assert initial_checkpoints(cfg) == {"actor": "/ckpt/actor", "ref": "/ckpt/ref", "critic": "/ckpt/critic"}
    cfg = config("m", "/ckpt/actor", "actor_rollout_ref.actor.megatron.use_dist_checkpointing=false")
    assert initial_checkpoints(cfg)["actor"] is None


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    from megarl.devtools.tiny_model import make_tiny_model

    llama = make_tiny_model("llama", "tiny", tmp_path / "llama", seed=0)
    saved = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="converted from a different model .* \\(model_type: qwen2 vs llama; hidden_size: 64 vs 128"):
        check_same_architecture("/ckpt", saved, str(llama))
    check_same_architecture("/ckpt", None, str(llama))  # a trainer checkpoint records no HF config


def test_a_missing_start_checkpoint_fails_before_any_process_starts(tmp_path):
    from megarl.engine import resolve_checkpoint

    with pytest.raises(FileNotFoundError, match="is not a complete megarl checkpoint"):
        resolve_checkpoint(tmp_path / "nothing")


def test_the_loop_syncs_the_fleet_to_a_megatron_start_checkpoint(tmp_path):
    from megarl.run.loop import TrainingLoop

    from megarl.trainer.rollout_memory import RolloutMemory

    synced = []
    finite = SimpleNamespace(call=lambda method, roles: [{role: {"count": 0, "first": None} for role in roles}])
    from megarl.settings.trainer import trainer_settings

    settings = trainer_settings(config("m", "/ckpt/actor", f"trainer.default_local_dir={tmp_path}"))
    trainer = SimpleNamespace(settings=settings, total_steps=1,
                              weight_sync=SimpleNamespace(sync=lambda: synced.append("sync")),
                              rollout_memory=RolloutMemory(None, False), workers=finite, coords=[{}])
    assert TrainingLoop(trainer, None, str(tmp_path)).resume() == 0
    assert synced == ["sync"]


def hf_logprobs(model_dir, prompt, response):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].float(), dim=-1)
    return torch.tensor([logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)])


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_starts_from_a_converted_checkpoint_and_the_fleet_follows(ray_address, tmp_path):
    from megarl.settings.worker import worker_settings
    import ray

    from megarl.engine import RLBatch
    from megarl.rollout import RolloutFleet
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.trainer.megatron_worker import MegatronWorker
    from megarl.cluster.ray_cluster import init_ray, shutdown_ray
    from megarl.cluster.worker_group import WorkerGroup
    from megarl.settings.sync import weight_updates
    from megarl.trainer.sync_verify import verify_sync

    model_a = make_tiny_model("llama", "tiny", tmp_path / "a", seed=0)
    model_b = make_tiny_model("llama", "tiny", tmp_path / "b", seed=5)
    converted = subprocess.run([sys.executable, "-m", "conversion", "hf-to-megatron", "--hf", str(model_b),
                                "--out", str(tmp_path / "b_mcore")], cwd=REPO, capture_output=True, text=True,
                               timeout=300)
    assert converted.returncode == 0, converted.stderr[-3000:]
    cfg = config(model_a, tmp_path / "b_mcore")

    init_ray(address=ray_address)
    workers = fleet = session = None
    try:
        workers = WorkerGroup(MegatronWorker, 2, init_args=(worker_settings(cfg, 2),))
        response = [11, 12, 13, 14]
        batch = RLBatch.from_parts(torch.tensor([PROMPTS[0]]), torch.ones(1, 4, dtype=torch.long),
                                   torch.tensor([response]), torch.ones(1, 4, dtype=torch.long))
        trainer_logp = workers.call("compute_log_prob", ray.put(batch), False)[0][0][0]
        assert torch.allclose(trainer_logp, hf_logprobs(model_b, PROMPTS[0], response), atol=1e-4)
        assert not torch.allclose(trainer_logp, hf_logprobs(model_a, PROMPTS[0], response), atol=1e-2)

        fleet = RolloutFleet(cfg.actor_rollout_ref.rollout, str(model_a), cpu_kv_cache_gib=0.25)
        session = weight_updates(cfg, workers, fleet)
        assert verify_sync(fleet, workers, PROMPTS)["rollout/logprob_diff"] > 1e-2  # the fleet serves A
        session.sync()  # what TrainingLoop.resume does at step 0
        assert verify_sync(fleet, workers, PROMPTS)["rollout/logprob_diff_max"] < 1e-4
    finally:
        for closer in (session, fleet, workers):
            if closer is not None:
                (getattr(closer, "close", None) or closer.shutdown)()
        shutdown_ray()
