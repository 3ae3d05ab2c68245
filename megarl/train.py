"""The main job: ``python -m megarl.train --config-name <yaml> [key=value ...]`` (or ``megarl train``).

Order of events, each step logged:
  1. load and validate the config (no process starts before it is valid);
  2. join the Ray cluster ($RAY_ADDRESS / trainer.ray_address) or start a local one on 127.0.0.1;
  3. reserve the devices (one placement group per node, ``trainer/placement.py``), then start the
     Megatron workers (one Ray actor per rank) and the vLLM rollout fleet in them, and the agent
     loops' rollout seam on the fleet (tools are loaded and checked before any of it starts);
  4. connect the weight sync between them;
  5. run the RL loop (resume, validate, train, checkpoint), then shut everything down.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("megarl.train")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "--config", dest="config", required=True,
                        help="a YAML path or the name of a file in configs/ (e.g. quickstart)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor_rollout_ref.rollout.n=8")
    return parser.parse_args(argv)


def run(cfg) -> dict[str, float]:
    """Run training for a validated config; return the last step's metrics."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from megarl.agent import AgentRollout, build_agent_context
    from megarl.agent.rollout import LoopSet, default_loop_name, tool_schemas_for
    from megarl.agent.workers import start_workers
    from megarl.data import build_dataset, build_train_loader
    from megarl.logging import MetricsLogger
    from megarl.rollout import RolloutFleet
    from megarl.trainer.controller import RLTrainer, TrainingLoop
    from megarl.engine import resolve_checkpoint
    from megarl.trainer.megatron_worker import MegatronWorker, initial_checkpoints
    from megarl.trainer.placement import ClusterPlacement, plan_from_config
    from megarl.trainer.ray_cluster import init_ray, shutdown_ray
    from megarl.trainer.worker_group import WorkerGroup
    from megarl.weight_sync.session import WeightSyncSession

    torch.set_num_threads(1)
    model_path = cfg.actor_rollout_ref.model.path
    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"actor_rollout_ref.model.path={model_path} has no config.json: give a Hugging "
                                "Face checkpoint directory (megarl make-tiny-model writes one)")
    for role, checkpoint in initial_checkpoints(cfg).items():
        if checkpoint is not None:
            resolve_checkpoint(checkpoint)  # a missing or incomplete one fails here, before any process starts
            logger.info("%s starts from the megatron checkpoint %s", role, checkpoint)
    tokenizer_path = cfg.actor_rollout_ref.model.tokenizer_path or model_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    # tools, agent loops and data: their errors surface before any process starts
    agent_context = build_agent_context(cfg, tokenizer)
    loops = LoopSet(agent_context)
    chat_tools = tool_schemas_for(loops, default_loop_name(cfg.actor_rollout_ref.rollout))
    train_loader = build_train_loader(cfg.data, tokenizer, chat_tools)
    val_dataset = build_dataset(cfg.data, tokenizer, "val", chat_tools) if cfg.data.val_files else None

    plan = plan_from_config(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    resources = init_ray(address=cfg.trainer.ray_address,
                         num_cpus=max(os.cpu_count() or 1, plan.nnodes * plan.per_node))
    use_gpu = resources.get("GPU", 0) > 0
    logger.info("Ray cluster: %d node(s), resources %s; placement %s: %d trainer ranks, %d rollout replica(s) "
                "x TP=%d", len(__import__("ray").nodes()), resources, plan.mode, plan.trainer_world,
                len(plan.replicas), rollout.tensor_model_parallel_size)
    log_dir = Path(cfg.trainer.default_local_dir)
    metrics_logger = workers = fleet = sync = placement = agent_rollout = None
    try:
        placement = ClusterPlacement(plan, use_gpu)
        workers = WorkerGroup(MegatronWorker, plan.trainer_world, init_args=(OmegaConf.to_container(cfg, resolve=True),),
                              slots=placement.trainer_slots(),
                              env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        fleet = RolloutFleet(rollout, model_path, tokenizer_path=cfg.actor_rollout_ref.model.tokenizer_path,
                             slots=placement.replica_slots(),
                             sleep_mode=plan.mode == "colocated" and rollout.free_cache_engine)
        sync = WeightSyncSession(cfg, workers, fleet)
        agent_rollout = AgentRollout(agent_context, fleet, rollout, loops=loops,
                                     worker_factory=lambda count: start_workers(cfg, tokenizer_path, count))
        metrics_logger = MetricsLogger(cfg.trainer.logger, log_dir, cfg.trainer.project_name,
                                       cfg.trainer.experiment_name, OmegaConf.to_container(cfg, resolve=True))
        trainer = RLTrainer(cfg, workers, fleet, sync, tokenizer, train_loader, val_dataset, rollout=agent_rollout)
        loop = TrainingLoop(trainer, metrics_logger, str(log_dir))
        last = loop.run()
        from megarl.trainer.plots import plot_reward_curve

        plot = plot_reward_curve(trainer.history, log_dir / "reward_curve.png")
        logger.info("reward curve written to %s", plot)
        last["_history"] = trainer.history
        return last
    finally:
        for closer in (agent_rollout, sync, fleet, workers, metrics_logger, placement):
            if closer is not None:
                try:
                    (getattr(closer, "close", None) or closer.shutdown)()
                except Exception as exc:  # keep tearing down the rest
                    logger.warning("shutdown of %s failed: %s", type(closer).__name__, exc)
        shutdown_ray()


def main(argv: list[str] | None = None) -> int:
    from megarl.config import ConfigError, load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
