"""The main job: ``python -m megarl.trainer.main_ppo`` (verl's entry point), ``megarl train`` or
``python -m megarl.train``, all with verl's command line (``megarl.config.command_line``).

Order of events, each step logged:
  1. load and check the config and the files it names, reporting every problem at once (no
     process starts before all of it is valid);
  2. join the Ray cluster ($RAY_ADDRESS / trainer.ray_address) or start a local one on 127.0.0.1;
  3. reserve the devices (one placement group per node, ``trainer/placement.py``), then start the
     Megatron workers (one Ray actor per rank) and the vLLM rollout fleet in them side by side
     (``trainer/startup.py``), and the agent loops' rollout seam on the fleet (tools are loaded and
     checked before any of it starts);
  4. connect the weight sync between them;
  5. run the RL loop (resume, validate, train, checkpoint), then shut everything down.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("megarl.train")


def load_tokenizer(cfg):
    """The driver's tokenizer (verl: ``data.trust_remote_code``), with ``model.custom_chat_template``."""
    from transformers import AutoTokenizer

    model = cfg.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path or model.path,
                                              trust_remote_code=cfg.data.trust_remote_code)
    if model.custom_chat_template:
        tokenizer.chat_template = model.custom_chat_template
    return tokenizer


def local_model_paths(cfg) -> None:
    """Replace hub ids of model.path / tokenizer_path / critic.model.path by their HF-cache snapshot dirs."""
    from megarl.config.preflight import resolve_model_path

    for node, key in ((cfg.actor_rollout_ref.model, "path"), (cfg.actor_rollout_ref.model, "tokenizer_path"),
                      (cfg.critic.model, "path")):
        value = node[key]
        if value and not Path(str(value)).expanduser().is_dir():
            local = resolve_model_path(str(value))
            if local is not None:
                logger.info("%s: using the Hugging Face cache's snapshot %s", value, local)
                node[key] = local


def check_model(cfg) -> None:
    """Before any process starts: ``actor_rollout_ref.model.path`` is an unquantised HF checkpoint (the
    fleet loads it itself) that the actor's megatron layout can split."""
    from megarl.models import check_layout, load_hf_config, model_dims
    from megarl.models.fp8 import block_fp8
    from megarl.trainer.megatron_worker import layout_from_config

    model_path = cfg.actor_rollout_ref.model.path
    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"actor_rollout_ref.model.path={model_path} has no config.json: give a Hugging "
                                "Face checkpoint directory (megarl make-tiny-model writes one)")
    if block_fp8(load_hf_config(model_path)) is not None:  # other quantisations are refused inside
        raise ValueError(
            f"actor_rollout_ref.model.path={model_path} is FP8 block-quantised: the trainer would dequantise it, but "
            "the vLLM fleet would serve it in FP8 while the weight sync sends it full-precision weights. Make a bf16 "
            f"copy once and train from that: python -m conversion hf-to-megatron --hf {model_path} --out MCORE "
            f"--dtype bf16 (under torchrun for a large model), then python -m conversion megatron-to-hf --checkpoint "
            f"MCORE --hf-config {model_path} --out BF16_DIR, and set actor_rollout_ref.model.path=BF16_DIR "
            "(actor_rollout_ref.actor.megatron.dist_checkpointing_path=MCORE starts the trainer from the conversion)"
        )
    try:
        dims = model_dims(model_path)
        check_layout(dims, layout_from_config(cfg.actor_rollout_ref.actor.megatron, dims.num_layers))
    except ValueError as exc:
        raise ValueError(f"actor_rollout_ref.actor.megatron.* for actor_rollout_ref.model.path={model_path}: {exc}; "
                         "pick parallel sizes that divide these counts") from None


def run(cfg) -> dict[str, float]:
    """Run training for a validated config; return the last step's metrics."""
    import torch
    from omegaconf import OmegaConf

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
    from megarl.trainer.startup import start_together
    from megarl.trainer.worker_group import WorkerGroup
    from megarl.weight_sync.session import WeightSyncSession

    torch.set_num_threads(1)
    local_model_paths(cfg)
    model_path = cfg.actor_rollout_ref.model.path
    check_model(cfg)
    from megarl.models.loading import describe_skipped

    skipped = describe_skipped(model_path)  # e.g. DeepSeek-V3's MTP layers: named, never silently dropped
    if skipped:
        logger.info(skipped)
    for role, checkpoint in initial_checkpoints(cfg).items():
        if checkpoint is not None:
            resolve_checkpoint(checkpoint)  # a missing or incomplete one fails here, before any process starts
            logger.info("%s starts from the megatron checkpoint %s", role, checkpoint)
    tokenizer = load_tokenizer(cfg)
    tokenizer_path = cfg.actor_rollout_ref.model.tokenizer_path or model_path
    need_source = not cfg.custom_reward_function.path  # rule rewards are picked by data_source
    # tools, agent loops and data: their errors surface before any process starts
    agent_context = build_agent_context(cfg, tokenizer)
    loops = LoopSet(agent_context)
    chat_tools = tool_schemas_for(loops, default_loop_name(cfg.actor_rollout_ref.rollout))
    train_loader = build_train_loader(cfg.data, tokenizer, need_source, chat_tools)
    val_dataset = build_dataset(cfg.data, tokenizer, "val", need_source, chat_tools) if cfg.data.val_files else None

    plan = plan_from_config(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    num_cpus = cfg.ray_kwargs.ray_init.num_cpus or max(os.cpu_count() or 1, plan.nnodes * plan.per_node)
    resources = init_ray(address=cfg.trainer.ray_address, num_cpus=num_cpus)
    use_gpu = resources.get("GPU", 0) > 0
    logger.info("Ray cluster: %d node(s), resources %s; placement %s: %d trainer ranks, %d rollout replica(s) "
                "x TP=%d", len(__import__("ray").nodes()), resources, plan.mode, plan.trainer_world,
                len(plan.replicas), rollout.tensor_model_parallel_size)
    log_dir = Path(cfg.trainer.default_local_dir)
    metrics_logger = workers = fleet = sync = placement = agent_rollout = None
    try:
        placement = ClusterPlacement(plan, use_gpu)
        started = start_together(  # neither needs the other before the weight sync connects them
            workers=lambda: WorkerGroup(
                MegatronWorker, plan.trainer_world, init_args=(OmegaConf.to_container(cfg, resolve=True),),
                slots=placement.trainer_slots(), env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                dist_timeout_s=cfg.actor_rollout_ref.nccl_timeout),
            fleet=lambda: RolloutFleet(
                rollout, model_path, tokenizer_path=cfg.actor_rollout_ref.model.tokenizer_path,
                slots=placement.replica_slots(), trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
                sleep_mode=plan.mode == "colocated" and rollout.free_cache_engine))
        workers, fleet = started["workers"], started["fleet"]
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
        if cfg.ray_kwargs.timeline_json_file:
            try:
                __import__("ray").timeline(filename=cfg.ray_kwargs.timeline_json_file)
                logger.info("Ray timeline written to %s", cfg.ray_kwargs.timeline_json_file)
            except Exception as exc:  # keep tearing down
                logger.warning("writing the Ray timeline failed: %s", exc)
        for closer in (agent_rollout, sync, fleet, workers, metrics_logger, placement):
            if closer is not None:
                try:
                    (getattr(closer, "close", None) or closer.shutdown)()
                except Exception as exc:  # keep tearing down the rest
                    logger.warning("shutdown of %s failed: %s", type(closer).__name__, exc)
        shutdown_ray()


def main(argv: list[str] | None = None) -> int:
    from megarl.config import ConfigError, load_config, to_yaml
    from megarl.config.command_line import USAGE, CommandLineError, parse_command_line

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cmd = parse_command_line(list(sys.argv[1:] if argv is None else argv))
    except CommandLineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cmd.help:
        print(__doc__ + "\n" + USAGE)
        return 0
    notes: list[str] = []
    try:
        cfg = load_config(cmd.name, cmd.overrides, config_path=cmd.config_path, preflight=True, notes=notes)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        logger.info("config: %s", note)
    if cmd.print_config:
        print(to_yaml(cfg), end="")
        return 0
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
