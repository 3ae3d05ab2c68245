"""A CPU run whose trainer ranks and vLLM engines would not fit in this host's RAM is refused before start."""
from __future__ import annotations

import logging

import pytest

from megarl.checks import ConfigError, load_config
from megarl.plan import cpu_host
from megarl.plan.cpu_host import (CPU_KV_CACHE_BYTES, ENGINE_INPROC_BYTES, ENGINE_PROCESS_BYTES, ENGINE_WORKER_BYTES,
                                  GIB, TRAINER_PROCESS_BYTES, cpu_host_problems)
from tests.config._fixtures import write_model_config, write_prompts

PARAMS = 135_000_000  # SmolLM2-135M


def quickstart(*overrides: str):
    return load_config("quickstart", ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/m", *overrides])


def test_the_seeds_eight_rank_quick_start_on_a_small_host_is_refused_naming_what_fits(caplog):
    cfg = quickstart("trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    with caplog.at_level(logging.WARNING, logger="megarl.plan.cpu_host"):
        (problem,) = cpu_host_problems(cfg, PARAMS, available=18 * GIB, cpus=2)
    assert problem.key == "trainer.n_gpus_per_node"
    assert problem.message.startswith("this CPU host has 18.0 GiB of RAM available, but the run's processes would need")
    assert "8 trainer rank(s) x " in problem.message and "on CPU every rank and engine runs on this one host" in problem.message
    fits = int(problem.message.split("trainer.n_gpus_per_node=")[1].split()[0])
    smaller = quickstart(f"trainer.n_gpus_per_node={fits}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    assert 1 <= fits < 8 and not cpu_host_problems(smaller, PARAMS, 18 * GIB, 2)
    assert "will share this host's 2 core(s)" in caplog.text
    assert cpu_host_problems(quickstart(), PARAMS, available=18 * GIB, cpus=2) == []  # one rank, one replica: fits


def test_the_arithmetic_of_one_rank_and_one_replica(monkeypatch):
    """fp32: weights + gradients + Adam's two moments (one DP rank) and the process; the engine's weights,
    KV cache and process(es); the quickstart's KL-free GRPO has no reference."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    cfg = quickstart("actor_rollout_ref.actor.use_kl_loss=False")
    found = cpu_host.estimate(cfg, PARAMS)
    assert (found.trainer_ranks, found.replicas) == (1, 1)
    assert found.per_rank == TRAINER_PROCESS_BYTES + (4 + 4 + 8) * PARAMS
    assert found.per_replica == ENGINE_INPROC_BYTES + 4 * PARAMS + CPU_KV_CACHE_BYTES  # TP 1: one process
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's own engine-core and worker processes
    separate = cpu_host.estimate(cfg, PARAMS)
    assert separate.per_replica == ENGINE_PROCESS_BYTES + ENGINE_WORKER_BYTES + 4 * PARAMS + CPU_KV_CACHE_BYTES
    lora = cpu_host.estimate(quickstart("actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.model.lora.rank=8"),
                             PARAMS)
    assert lora.per_rank == TRAINER_PROCESS_BYTES + 4 * PARAMS  # the frozen base; the adapters are small


def test_the_config_check_runs_it_on_a_cpu_host(tmp_path, monkeypatch):
    model = write_model_config(tmp_path / "model")
    data = write_prompts(tmp_path / "train.parquet", rows=8)
    run = ["algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=1", "data.train_batch_size=4",
           "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
           f"actor_rollout_ref.model.path={model}", f"data.train_files={data}"]
    monkeypatch.setattr(cpu_host, "host_resources", lambda: (0.5 * GIB, 2))
    with pytest.raises(ConfigError) as info:
        load_config(None, run, preflight=True)
    (problem,) = info.value.problems
    assert problem.key == "trainer.n_gpus_per_node" and "not even one trainer rank and one replica fit" in problem.message
    load_config(None, [*run, "trainer.plan_check=False"], preflight=True)
    monkeypatch.setattr(cpu_host, "host_resources", lambda: (64 * GIB, 2))
    load_config(None, run, preflight=True)


def test_a_placement_that_cannot_be_made_is_left_to_the_placement_check():
    """A reward model's TP that does not divide the trainer's devices makes no plan: no estimate, no exception."""
    cfg = quickstart("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    cfg.reward_model.enable = True
    cfg.reward_model.rollout.tensor_model_parallel_size = 4
    assert cpu_host_problems(cfg, PARAMS, available=1 * GIB, cpus=2) == []
