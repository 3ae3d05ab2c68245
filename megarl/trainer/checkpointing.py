"""Where checkpoints live, what they hold, how many are kept, and which one a run resumes from.

Layout under ``trainer.default_local_dir``::

    actor/step_<N>/    megatron dist checkpoint of the actor (what ``actor.checkpoint.save_contents``
                       asks for) plus the controller state (step, data-loader position, KL
                       controller, weight version, config), which is always saved
      huggingface/     with ``hf_model`` in save_contents: an HF safetensors export (config, tokenizer)
    actor/latest       the name of the newest complete step directory (written last, atomically)
    critic/step_<N>/   the critic, when there is one (``critic.checkpoint.*``); saved before the
                       actor's step, so ``actor/latest`` moves only when both are complete

Each step directory holds ``megarl_manifest.json`` (every file's size and SHA-256), checked at load.

Contents (verl's names): ``model`` (the megatron weights, required: resume needs them),
``optimizer`` (the distributed optimizer's fp32 master weights, Adam moments and step counts),
``extra`` (the LR schedule and RNG states), ``hf_model`` (the export; never loaded).
``load_contents`` (default: the same as ``save_contents``) picks what a resume loads; asking for
a part the checkpoint lacks is an error naming the key. ``hf_model`` there loads nothing (as in
verl: the export is for other tools; a resume reads the megatron weights). Resuming without ``optimizer`` restarts
Adam from zero moments with master weights taken from the loaded model; without ``extra`` the LR
schedule restarts (warmup again) and the RNG states are fresh. Both are logged.

Retention: after each successful save, ``trainer.max_actor_ckpt_to_keep`` /
``max_critic_ckpt_to_keep`` (None or 0: keep all) delete the oldest ``step_<N>`` directories;
never the one ``latest`` names, never a ``.tmp`` directory (an interrupted save, which the next
save of that step replaces).

Which checkpoint a run resumes from (``trainer.resume_mode``) is ``megarl.trainer.resume``.
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

CONTENTS = ("model", "optimizer", "extra", "hf_model")
HF_EXPORT_DIR = "huggingface"
_STEP_DIR = re.compile(r"step_(\d+)")


def contents_problems(section: str, checkpoint_cfg) -> list[str]:
    """Config problems of one ``<section>.checkpoint`` (save_contents / load_contents)."""
    problems = []
    keys = ["save_contents"] + (["load_contents"] if list(checkpoint_cfg.load_contents) != list(checkpoint_cfg.save_contents) else [])
    for key in keys:
        values = list(checkpoint_cfg[key])
        unknown = sorted(set(values) - set(CONTENTS))
        if unknown:
            problems.append(f"{section}.checkpoint.{key} has unknown entries {unknown}; use {list(CONTENTS)}.")
        if "model" not in values:
            problems.append(f"{section}.checkpoint.{key}={values} lacks 'model': a megarl checkpoint is resumed from "
                            "its megatron weights; keep 'model' (add 'hf_model' for an HF export).")
    return problems


def retention_problems(trainer_cfg) -> list[str]:
    return [f"trainer.{key}={trainer_cfg[key]}: use null (keep all) or a count >= 1."
            for key in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep")
            if trainer_cfg[key] is not None and trainer_cfg[key] < 0]


def engine_parts(contents) -> dict[str, bool]:
    """``save_checkpoint`` / ``load_checkpoint`` arguments for verl's content names."""
    contents = set(contents)
    return {"optimizer": "optimizer" in contents, "scheduler": "extra" in contents, "rng": "extra" in contents,
            "hf_model": "hf_model" in contents}


def check_loadable(path: str | Path, load_contents, key: str) -> None:
    """Raise naming ``key`` when the checkpoint at ``path`` lacks a part ``load_contents`` asks for."""
    from megarl.engine import checkpoint_contents

    held = set(checkpoint_contents(path))
    parts = engine_parts(load_contents)
    missing = [name for name, engine in (("optimizer", ["optimizer"]), ("extra", ["scheduler", "rng"]))
               if parts[engine[0]] and not set(engine) <= held]
    if missing:
        raise ValueError(f"{path} was saved without {missing} (it holds {sorted(held)}), but {key}="
                         f"{list(load_contents)} asks for it; drop {missing} from {key} to resume without them")
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    for name, effect in (("optimizer", "Adam restarts from zero moments (master weights from the loaded model)"),
                         ("extra", "the LR schedule restarts and the RNG states are fresh")):
        if name not in load_contents:
            logger.warning("%s has no '%s': %s", key, name, effect)


def save_engine(engine, save_contents, root: str, step: int, extra: dict | None,
                export_hf: Callable[[Path], None], model_part: str = "all", meta: dict | None = None,
                exports: dict[str, Callable[[Path], None]] | None = None) -> Path:
    """Save an actor or critic engine's parts under ``root`` (collective); ``export_hf(out_dir)`` writes
    the HF export when ``hf_model`` is asked for. ``model_part``, ``meta`` and further ``exports``
    (LoRA: the trained tensors only, the settings, the PEFT adapter) go to ``save_checkpoint``."""
    from megarl.engine import save_checkpoint

    parts = engine_parts(save_contents)
    exports = dict(exports or {})
    if parts["hf_model"]:
        exports["hf_model"] = lambda staging: export_hf(staging / HF_EXPORT_DIR)
    return save_checkpoint(root, step, engine.model, engine.optimizer if parts["optimizer"] else None,
                           engine.scheduler if parts["scheduler"] else None, extra=extra, rng=parts["rng"],
                           exports=exports or None, model_part=model_part, meta=meta)


def load_engine(engine, path: str, load_contents, key: str, load_rng: bool = True, verify: bool = True) -> dict | None:
    """Load what ``load_contents`` (the config ``key``) asks for into an engine; returns the caller state
    (``verify=False``: the caller has checked the files against the manifest)."""
    from megarl.engine import load_checkpoint

    check_loadable(path, load_contents, key)
    parts = engine_parts(load_contents)
    extra = load_checkpoint(path, engine.model, engine.optimizer if parts["optimizer"] else None,
                            engine.scheduler if parts["scheduler"] else None, load_rng=load_rng and parts["rng"],
                            verify=verify)
    if not parts["optimizer"]:
        engine.optimizer.reload_model_params()  # master weights (bf16 training) from the loaded weights
    return extra


def prune_checkpoints(root: str | Path, keep: int | None) -> list[Path]:
    """Delete the oldest ``step_<N>`` directories under ``root`` beyond the newest ``keep``; returns them.

    The directory ``root/latest`` names is always kept; ``.tmp`` directories are never touched.
    """
    root = Path(root)
    if not keep or not root.is_dir():
        return []
    marker = root / "latest"
    protected = marker.read_text().strip() if marker.is_file() else None
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name)))
    doomed = [p for _, p in steps[:-keep] if p.name != protected]
    for path in doomed:
        shutil.rmtree(path)
    if doomed:
        logger.info("checkpoint retention (keep %d): deleted %s", keep, ", ".join(p.name for p in doomed))
    return doomed


def checkpoint_step(path: Path) -> int | None:
    """The step of a ``step_<N>`` checkpoint directory."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def latest_checkpoint_step(root: str | Path) -> tuple[int, Path] | None:
    """(step, directory) of ``<root>/actor/latest`` (the newest whole step when ``latest`` names an
    interrupted save: what a resume would use), or None when the run has no checkpoint yet."""
    from megarl.engine import checkpoint_problems, latest_checkpoint, step_directories

    try:
        path = latest_checkpoint(Path(root) / "actor")
    except FileNotFoundError:
        path = next((p for p in step_directories(Path(root) / "actor") if not checkpoint_problems(p)), None)
    if path is None or checkpoint_step(path) is None:
        return None
    return checkpoint_step(path), path


def save_on_workers(workers, root: str, step: int, state: dict, trainer_cfg) -> str:
    """Every rank writes its part of ``<root>/*/step_<step>``; returns the actor's path. A rank that dies is
    named at once (``WorkerGroup.wait``); a save longer than ``trainer.save_timeout_s`` fails the run."""
    limit = trainer_cfg.save_timeout_s
    refs = workers.call_async("save_checkpoint", root, step, state)
    try:
        return workers.wait(refs, f"save_checkpoint (step {step})", timeout_s=limit)[0]
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}: the checkpoint is incomplete ({root}/actor/step_{step}.tmp, never loaded); if "
                           f"saves of this size take longer, raise trainer.save_timeout_s={limit:g}") from None
