"""A run's parts, built in two halves: what needs no process (``prepare``), then the processes (``start``).

``prepare(cfg)`` reads the tokenizer, the agent loops and their tools, the data and the resume
plan, so that every problem they have surfaces before Ray starts. ``start(prepared)`` joins or
starts the Ray cluster, places the trainer ranks and the rollout fleet (side by side), connects the
weight sync, starts a reward model when one is configured, and builds the controller and its loop.
The returned ``Run`` closes everything in order (``with start(...) as run: run.loop.run()``).

Every component gets settings built here from the checked config by ``megarl.settings``; none of
them reads the config itself.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """What a run needs before any process starts."""

    cfg: Any
    log_dir: Path
    tokenizer: Any
    agent: Any  # AgentSettings
    loops: Any  # LoopSet
    train_loader: Any
    val_dataset: Any
    total_steps: int
    resume: Any  # ResumePlan
    finished: tuple | None  # (step, checkpoint) when the last step is checkpointed already
    processor: Any = None  # a vision-language model's AutoProcessor (its images' pixel values), else None

    @property
    def start_step(self) -> int:
        from megarl.trainer.checkpointing import checkpoint_step

        return (checkpoint_step(self.resume.first[0]) or 0) if self.resume.first is not None else 0


def prepare(cfg, log_dir: Path, load_tokenizer) -> Prepared:
    """Tokenizer, agent loops (tools checked), data and the resume plan: their errors before any process."""
    from megarl.agent import build_agent_context
    from megarl.agent.rollout import LoopSet, tool_schemas_for
    from megarl.run.interrupts import finished_run
    from megarl.settings import typed_config
    from megarl.settings.agent import agent_settings
    from megarl.settings.data import build_dataset, build_train_loader, load_processor
    from megarl.data import DataFormatError
    from megarl.settings.derived import critic_enabled
    from megarl.settings.distillation import distillation_settings, routing_problem
    from megarl.trainer.controller import total_training_steps
    from megarl.trainer.resume import resume_plan

    tokenizer = load_tokenizer(cfg)
    # rule rewards are picked by data_source (a custom function or a reward model scores without one)
    need_source = not (cfg.custom_reward_function.path or cfg.reward_model.enable)
    agent = agent_settings(cfg)
    loops = LoopSet(build_agent_context(agent, tokenizer))
    chat_tools = tool_schemas_for(loops, agent.default_loop)
    processor = load_processor(cfg)  # a vision-language model's: its datasets' images
    train_loader = build_train_loader(cfg.data, tokenizer, need_source, chat_tools, processor)
    val_dataset = build_dataset(cfg.data, tokenizer, "val", need_source, chat_tools, processor) \
        if cfg.data.val_files else None
    routing = routing_problem(distillation_settings(cfg), {"train": train_loader.dataset})  # several teachers
    if routing:
        raise DataFormatError(routing)
    trainer = typed_config(cfg.trainer)
    total = total_training_steps(trainer, len(train_loader))
    resume = resume_plan(trainer, log_dir, critic_enabled(cfg))  # refuses here, before any process starts
    finished = finished_run(trainer, log_dir, total, critic_enabled(cfg))
    return Prepared(cfg, log_dir, tokenizer, agent, loops, train_loader, val_dataset, total, resume, finished,
                    processor)


@dataclass
class Run:
    """The started processes of a run and its loop; ``close`` stops them in order (the trainer first)."""

    placement: Any = None
    workers: Any = None
    fleet: Any = None
    sync: Any = None
    reward_model: Any = None
    reward_placement: Any = None
    teachers: Any = None  # distillation teachers (megarl.trainer.teachers), with their pool
    agent_rollout: Any = None
    metrics_logger: Any = None
    trainer: Any = None
    samples: Any = None
    loop: Any = None
    seconds: dict = field(default_factory=dict)

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for closer in (self.trainer, self.agent_rollout, self.sync, self.fleet, self.reward_model, self.teachers,
                       self.workers, self.metrics_logger, self.placement, self.reward_placement):  # the trainer (its producer) first
            if closer is not None:
                try:
                    (getattr(closer, "close", None) or closer.shutdown)()
                except Exception as exc:  # keep tearing down the rest
                    logger.warning("shutdown of %s failed: %s", type(closer).__name__, exc)
        self.__init__()


def start(prepared: Prepared, plan, use_gpu: bool, summary, say) -> Run:
    """The processes of a run on the Ray cluster already joined (``plan``: the placement plan). A failure
    closes whatever had started."""
    run = Run()
    try:
        _start(run, prepared, plan, use_gpu, summary, say)
    except BaseException:
        run.close()
        raise
    return run


def _start(run: Run, prepared: Prepared, plan, use_gpu: bool, summary, say) -> None:
    from megarl.agent import AgentRollout
    from megarl.agent.workers import start_workers
    from megarl.cluster.placement import ClusterPlacement
    from megarl.cluster.startup import start_reward_model, start_together
    from megarl.cluster.worker_group import WorkerGroup
    from megarl.logging import MetricsLogger
    from megarl.logging.progress import Progress
    from megarl.rollout import RolloutFleet
    from megarl.run import startup_lines
    from megarl.run.loop import TrainingLoop
    from megarl.run.samples import SampleReporter
    from megarl.settings import typed_config
    from megarl.settings.cluster import reward_pool_from_config
    from megarl.settings.distillation import distillation_settings
    from megarl.settings.worker import worker_settings
    from megarl.settings.profiling import profiler_settings
    from megarl.trainer.teachers import Teachers
    from megarl.settings.reward_models import reward_engine, settings_from_config
    from megarl.settings.rewards import reward_manager
    from megarl.settings.rollout import fleet_arguments
    from megarl.settings.sync import weight_updates
    from megarl.settings.trainer import trainer_settings
    from megarl.trainer.controller import RLTrainer
    from megarl.trainer.megatron_worker import MegatronWorker

    cfg = prepared.cfg
    run.placement = ClusterPlacement(plan, use_gpu)
    seconds = run.seconds
    profiler = profiler_settings(cfg)  # nsys: the ranks it selects start under Ray's nsight plugin
    with Progress(f"starting {plan.trainer_world} trainer rank(s) and {len(plan.replicas)} rollout replica(s)"):
        started = start_together(  # neither needs the other before the weight sync connects them
            seconds,
            workers=lambda: WorkerGroup(
                MegatronWorker, plan.trainer_world, init_args=(worker_settings(cfg, plan.trainer_world),),
                slots=run.placement.trainer_slots(), env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                dist_timeout_s=cfg.actor_rollout_ref.nccl_timeout,
                runtime_env=profiler.runtime_env if profiler is not None else None),
            fleet=lambda: RolloutFleet(**fleet_arguments(cfg, plan), slots=run.placement.replica_slots()))
    run.workers, run.fleet = started["workers"], started["fleet"]
    began = time.perf_counter()
    run.sync = weight_updates(cfg, run.workers, run.fleet)  # merged weights, sharded; or the LoRA adapter alone
    say("%s", startup_lines.ready_line(seconds["workers"], seconds["fleet"], time.perf_counter() - began, run.fleet,
                                       run.sync))
    model = settings_from_config(cfg)
    run.reward_model, run.reward_placement = start_reward_model(
        model, reward_engine(cfg, model) if model is not None else None, reward_pool_from_config(cfg), run.placement,
        use_gpu)
    distillation = distillation_settings(cfg)
    if distillation is not None:
        run.teachers = Teachers.start(distillation, use_gpu)
    tokenizer_path = cfg.actor_rollout_ref.model.tokenizer_path or cfg.actor_rollout_ref.model.path
    run.agent_rollout = AgentRollout(
        prepared.loops.context, run.fleet, typed_config(cfg.actor_rollout_ref.rollout), loops=prepared.loops,
        worker_factory=lambda count: start_workers(prepared.agent, tokenizer_path, count))
    settings = trainer_settings(cfg)
    run.metrics_logger = MetricsLogger(cfg.trainer.logger, prepared.log_dir, cfg.trainer.project_name,
                                       cfg.trainer.experiment_name, settings.config_record)
    run.trainer = RLTrainer(settings, run.workers, run.fleet, run.sync, prepared.tokenizer,
                            prepared.train_loader, reward_manager(cfg, model_reward=run.reward_model), run.agent_rollout,
                            prepared.val_dataset, teachers=run.teachers, processor=prepared.processor)
    run.samples = SampleReporter(cfg, run.metrics_logger, run.trainer.reward)
    run.loop = TrainingLoop(run.trainer, run.metrics_logger, str(prepared.log_dir), summary, run.samples,
                            prepared.resume)
