"""The main job: ``python -m megarl.trainer.main_ppo`` (verl's entry point), ``megarl train`` or
``python -m megarl.run.train``, all with verl's command line (``megarl.config.command_line``).

Order of events, each step logged:
  1. load and check the config and the files it names, reporting every problem at once (no
     process starts before all of it is valid);
  2. join the Ray cluster ($RAY_ADDRESS / trainer.ray_address) or start a local one on 127.0.0.1;
  3. reserve the devices (one placement group per node, ``trainer/placement.py``), then start the
     Megatron workers (one Ray actor per rank) and the vLLM rollout fleet in them side by side
     (``trainer/startup.py``), the reward model or judge when one is configured
     (``megarl.rewards.reward_models``, on the trainer's devices or its own pool), and the agent loops'
     rollout seam on the fleet (tools are loaded and checked before any of it starts);
  4. connect the weight sync between them;
  5. run the RL loop (resume, validate, train, checkpoint), then shut everything down.

Which checkpoint a run resumes from is decided in step 1 (``megarl.trainer.resume``): checkpoints it
passes over are named there, and a directory whose checkpoints cannot be resumed is refused rather
than overwritten. The console shows a few start-up lines, one line per step, validation and checkpoint, and a
summary (``megarl.logging.console``; ``--verbose`` shows everything); the workers' output goes
to ``<trainer.default_local_dir>/logs/`` (``megarl.logging.worker_logs``). A run whose last
step is checkpointed already says so before any process starts. Ctrl-C or SIGTERM stops the
engines and workers and says how to resume (``megarl.run.interrupts``); SIGTERM or SIGUSR1 during
the training steps first saves the step in progress (``megarl.run.preemption``). A worker process
that dies stops the run naming it, or restarts the run from its last checkpoint
(``trainer.max_restarts``, ``megarl.run.restarts``). A run whose gradients or weights turn
non-finite stops with status 1 and says why (``megarl.trainer.training_safety``).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("megarl.run.train")


def tool_template_warning(cfg, tokenizer, tools) -> None:
    """Before start: a chat template that renders no schema of the run's tools (SmolLM2's ignores ``tools``)
    means the model never learns what it may call; said once, as a warning."""
    from megarl.agent.chat import dropped_tool_schemas

    if not tools or not tools.schemas:
        return
    dropped = dropped_tool_schemas(tokenizer, tools.schemas, dict(cfg.data.apply_chat_template_kwargs or {}))
    if dropped:
        model = cfg.actor_rollout_ref.model
        logger.warning("the chat template of %s renders no schema of the tools %s (apply_chat_template(tools=...) "
                       "leaves them out of the prompt): the model never sees what it may call. Use a model whose "
                       "template renders tools (Qwen2.5 / Qwen3 instruct), set actor_rollout_ref.model."
                       "custom_chat_template, or put the schemas into the prompt text yourself",
                       model.tokenizer_path or model.path, ", ".join(dropped))


def local_model_paths(cfg) -> None:
    """Replace hub ids of model.path / tokenizer_path / critic.model.path by their HF-cache snapshot dirs."""
    from megarl.models.locate import resolve_model_path

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
    from megarl.models.fp8 import checkpoint_quantization, fp8_rollout_problem
    from megarl.settings.engine import layout_from_config

    model_path = cfg.actor_rollout_ref.model.path
    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(f"actor_rollout_ref.model.path={model_path} has no config.json: give a Hugging "
                                "Face checkpoint directory (megarl make-tiny-model writes one)")
    quantization = checkpoint_quantization(load_hf_config(model_path))  # others are refused inside
    if quantization is not None:
        raise ValueError(fp8_rollout_problem("actor_rollout_ref.model.path", model_path, quantization))
    try:
        dims = model_dims(model_path)
        check_layout(dims, layout_from_config(cfg.actor_rollout_ref.actor.megatron, dims.num_layers))
    except ValueError as exc:
        raise ValueError(f"actor_rollout_ref.actor.megatron.* for actor_rollout_ref.model.path={model_path}: {exc}; "
                         "pick parallel sizes that divide these counts") from None


def run(cfg, guard=None) -> dict[str, float]:
    """Run training for a validated config; return the last step's metrics (``_history``: the
    step history; ``_finished``: the checkpoint already held the last step, nothing ran).

    ``guard`` (an installed ``InterruptGuard``; one is made otherwise) turns Ctrl-C and SIGTERM into
    ``Interrupted``, raised after everything is shut down, with the step in progress. A worker process
    that dies raises ``WorkerDied`` after the same teardown, or, ``trainer.max_restarts`` times, starts
    the run again (``megarl.run.restarts``). The driver's log goes to
    ``<trainer.default_local_dir>/logs/driver.log``."""
    import time

    import torch

    from megarl.logging.console import attach_log_file, detach_log_file, say
    from megarl.logging.worker_logs import DRIVER_LOG
    from megarl.run.interrupts import InterruptGuard
    from megarl.run.restarts import log_tail, prepare_restart, restart_line, run_with_restarts

    torch.set_num_threads(1)
    log_dir = Path(cfg.trainer.default_local_dir)
    worker_logs = log_dir / "logs"
    attach_log_file(worker_logs / DRIVER_LOG)
    started, max_restarts = time.time(), cfg.trainer.max_restarts
    guard = guard or InterruptGuard().install()

    def before_restart(restarts: int, exc) -> None:
        logger.info("%s\n%s", exc, log_tail(exc, worker_logs))
        say("%s", restart_line(restarts, max_restarts, exc, prepare_restart(cfg.trainer, log_dir, started)))

    try:
        return run_with_restarts(lambda restarts: _run(cfg, guard, log_dir, worker_logs, restarts), max_restarts,
                                 before_restart, stop_requested=lambda: guard.received is not None)
    finally:
        detach_log_file()


def _run(cfg, guard, log_dir: Path, worker_logs: Path, restarts: int = 0) -> dict[str, float]:
    from megarl.cluster.ray_cluster import init_ray, remove_local_temp_dir, shutdown_ray
    from megarl.engine import resolve_checkpoint
    from megarl.logging.console import adopt_library_loggers, console_state, say
    from megarl.logging.worker_logs import WorkerLogFollower, worker_log_env
    from megarl.models.loading import describe_skipped
    from megarl.run import startup_lines
    from megarl.run.build import prepare, start
    from megarl.cluster.process_watch import WorkerDied
    from megarl.run.preemption import Preemption
    from megarl.run.summary import RunSummary, places
    from megarl.settings.cluster import plan_from_config, ray_settings, reward_pool_from_config
    from megarl.settings.data import load_tokenizer
    from megarl.settings.engine import initial_checkpoints
    from megarl.trainer.checkpointing import latest_checkpoint_step
    from megarl.trainer.training_safety import TrainingHalted

    adopt_library_loggers()  # Ray and transformers are imported by now
    guard.on_kill = remove_local_temp_dir
    guard.preemption = Preemption(enabled=cfg.trainer.save_on_preempt)  # armed by the loop around its steps
    local_model_paths(cfg)
    check_model(cfg)
    skipped = describe_skipped(cfg.actor_rollout_ref.model.path)  # e.g. MTP layers: named, never silently dropped
    if skipped:
        say("%s", skipped)
    for role, checkpoint in initial_checkpoints(cfg).items():
        if checkpoint is not None:
            resolve_checkpoint(checkpoint)  # a missing or incomplete one fails here, before any process starts
            logger.info("%s starts from the megatron checkpoint %s", role, checkpoint)
    prepared = prepare(cfg, log_dir, load_tokenizer)  # tools, agent loops, data, resume: errors before any process
    total = prepared.total_steps
    tool_template_warning(cfg, prepared.tokenizer, prepared.loops.context.tools)
    if prepared.finished is not None:  # before Ray: nothing would run
        step, checkpoint = prepared.finished
        say("%s has finished already: its checkpoint %s holds step %d of %d. Nothing to train: raise "
            "trainer.total_training_steps to continue it, or set trainer.resume_mode=disable (or another "
            "trainer.default_local_dir) to start over", log_dir, checkpoint, step, total)
        return {"_history": checkpoint_history(checkpoint), "_finished": True}
    for note in prepared.resume.notes:  # checkpoints passed over (which file, which step instead), or started over
        say("%s", note)
    say("%s", startup_lines.data_line(prepared.train_loader, prepared.val_dataset, prepared.start_step, total,
                                      cfg.data.train_batch_size))

    plan = plan_from_config(cfg)
    reward_pool = reward_pool_from_config(cfg)  # a reward model's own devices, if it has them
    slots = plan.nnodes * plan.per_node + (reward_pool.nnodes * reward_pool.per_node if reward_pool else 0)
    if cfg.distillation.enabled:  # the teachers' own pool
        slots += cfg.distillation.nnodes * cfg.distillation.n_gpus_per_node
    ray_cfg = ray_settings(cfg)
    num_cpus = ray_cfg.num_cpus or max(os.cpu_count() or 1, slots)
    resources = init_ray(address=ray_cfg.address, num_cpus=num_cpus, worker_env=worker_log_env(worker_logs),
                         private_tmp=True)
    guard.install()  # ray.init sets a SIGTERM handler of its own
    adopt_library_loggers()
    use_gpu = resources.get("GPU", 0) > 0
    import ray

    ray_nodes = sum(1 for node in ray.nodes() if node["Alive"])
    logger.info("Ray cluster: %d node(s), resources %s", ray_nodes, resources)
    say("%s", startup_lines.layout_line(cfg, plan, use_gpu, ray_nodes))
    say("%s", startup_lines.memory_line(cfg))
    follower = WorkerLogFollower(worker_logs).start()
    summary = RunSummary(total)
    run = None
    try:
        with summary.timed("start-up"):
            run = start(prepared, plan, use_gpu, summary, say)
        run.loop.preemption, run.loop.restarts = guard.preemption, restarts
        follower.poll()
        held_back = console_state().suppressed_line()
        say("%s", (held_back + "; " if held_back else "") + f"worker logs: {worker_logs}/")
        last = run.loop.run()
        from megarl.run.plots import plot_reward_curve

        plot = plot_reward_curve(run.trainer.history, log_dir / "reward_curve.png")
        follower.poll()
        latest = latest_checkpoint_step(log_dir)
        for line in summary.lines(places(log_dir, cfg.trainer.logger, latest and latest[1], run.samples.files, plot,
                                         worker_logs)):
            say("%s", line)
        held_back = console_state().suppressed_line(since_last=True)
        if held_back:
            say("  %s", held_back)
        last["_history"] = run.trainer.history
        return last
    except KeyboardInterrupt as exc:  # the guard's Interrupted, or Ray's KeyboardInterrupt standing for it
        interrupted = guard.interrupted(exc)
        interrupted.step = run.loop.step if run is not None and run.loop is not None else 0
        interrupted.total_steps = total
        raise interrupted from None
    except (TrainingHalted, WorkerDied):  # the run stopped itself or lost a worker; main prints why, or it restarts
        raise
    except Exception:
        logging.getLogger("megarl.console").error("the run failed (worker logs: %s/)", worker_logs)
        raise
    finally:
        if ray_cfg.timeline_json_file:
            try:
                ray.timeline(filename=ray_cfg.timeline_json_file)
                logger.info("Ray timeline written to %s", ray_cfg.timeline_json_file)
            except Exception as exc:  # keep tearing down
                logger.warning("writing the Ray timeline failed: %s", exc)
        if run is not None:
            run.close()
        follower.stop()
        shutdown_ray()


def checkpoint_history(path) -> list[dict]:
    """The step history a checkpoint's controller state holds (empty if it cannot be read)."""
    try:
        from megarl.engine.checkpoint import checkpoint_extra

        return list((checkpoint_extra(path) or {}).get("history", []))
    except Exception as exc:  # the history only decorates the message
        logger.info("could not read the history of %s: %s", path, exc)
        return []


def main(argv: list[str] | None = None) -> int:
    from megarl.platform.gc_tuning import tune_gc

    tune_gc()  # before the run loads torch and Ray (megarl/platform/gc_tuning.py)
    from megarl.checks import ConfigError, load_config
    from megarl.config import to_yaml
    from megarl.config.command_line import USAGE, CommandLineError, parse_command_line
    from megarl.logging.console import say, set_level, setup_console
    from megarl.run.interrupts import InterruptGuard, interrupt_report

    setup_console("INFO")
    try:
        cmd = parse_command_line(list(sys.argv[1:] if argv is None else argv))
    except CommandLineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cmd.help:
        print(__doc__ + "\n" + USAGE)
        return 0
    if cmd.verbose:
        set_level("DEBUG")
    notes: list[str] = []
    try:
        cfg = load_config(cmd.name, cmd.overrides, config_path=cmd.config_path, preflight=True, notes=notes)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not cmd.verbose:
        set_level(cfg.trainer.log_level)
    for note in notes:
        say("config: %s", note)
    if cmd.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from megarl.cluster.process_watch import WorkerDied
    from megarl.data import DataFormatError
    from megarl.rollout.replica_table import ReplicaFailuresExceeded
    from megarl.run.restarts import log_tail
    from megarl.trainer.training_safety import TrainingHalted

    guard = InterruptGuard().install()
    try:
        run(cfg, guard)
    except KeyboardInterrupt as exc:
        interrupted = guard.interrupted(exc)
        say("%s", interrupt_report(cfg.trainer, interrupted))
        return interrupted.exit_code
    except TrainingHalted as exc:  # non-finite gradients or weights: the cause, where to look, the last checkpoint
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except WorkerDied as exc:  # which rank, what it ran, its last log lines (after trainer.max_restarts restarts)
        tail = log_tail(exc, Path(cfg.trainer.default_local_dir) / "logs")
        limit = cfg.trainer.max_restarts
        restarted = f" (after {limit} restart(s), trainer.max_restarts)" if limit else ""
        print(f"error: {exc}{restarted}" + (f"\n{tail}" if tail else ""), file=sys.stderr)
        return 1
    except ReplicaFailuresExceeded as exc:  # trainer.max_replica_failures: which replica, why, its last log lines
        tail = log_tail(exc, Path(cfg.trainer.default_local_dir) / "logs")
        print(f"error: {exc}" + (f"\n{tail}" if tail else ""), file=sys.stderr)
        return 1
    except DataFormatError as exc:  # a data file or row, found while the prompts load (before any process starts)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        guard.restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
