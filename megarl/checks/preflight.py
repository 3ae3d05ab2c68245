"""What a run will read, checked before anything starts: models, checkpoints, data files, reward.

``preflight_problems(cfg)`` only reads: a model's ``config.json`` (a local directory, or a hub id
found in the Hugging Face cache), the schema and row count of each parquet file (and its data
source column, to check that a rule reward exists for every source), the checkpoints a run
starts or resumes from (complete, every file of the size its manifest records: a stat per file;
the checksums are read at load), and the reward file, which it imports to check the function's signature. On a machine
with a GPU it also plans the run's memory on that GPU (``megarl.plan.check``) and refuses a run
that cannot fit (``trainer.plan_check``). No model is built, no process or Ray cluster starts.
Each problem is one line naming the key and the fix.
"""
from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig

from megarl.settings.derived import critic_enabled
from megarl.config.errors import Problem, refusal
from megarl.models.locate import model_problems, resolve_model_path


def preflight_problems(cfg: DictConfig) -> list[Problem]:
    problems: list[Problem] = []
    arr = cfg.actor_rollout_ref
    model = model_problems("actor_rollout_ref.model.path", arr.model.path)
    problems += model
    if arr.model.tokenizer_path:
        problems += model_problems("actor_rollout_ref.model.tokenizer_path", arr.model.tokenizer_path, needs_family=False)
    if critic_enabled(cfg) and cfg.critic.model.path != arr.model.path:
        problems += model_problems("critic.model.path", cfg.critic.model.path)
    problems += _checkpoint_problems(cfg)
    from megarl.checks.lora import lora_preflight_problems

    problems += lora_preflight_problems(cfg)
    problems += _data_problems(cfg)
    problems += _tool_problems(cfg)
    problems += _reward_problems(cfg)
    problems += _logger_problems(cfg)
    if not model:
        model = _quantization_problems(arr.model.path)
        problems += model
    if not model:  # the layouts and the memory plan read the model's config.json (megarl.plan; trainer.plan_check)
        from megarl.plan.check import plan_problems

        problems += _override_problems(cfg)
        problems += _layout_problems(cfg)
        problems += plan_problems(cfg)
    problems += _resume_problems(cfg)
    return problems


def _quantization_problems(path) -> list[Problem]:
    """The actor's checkpoint is what the fleet serves: an FP8 or MXFP4 one would be served quantised and synced
    in full precision (``fp8_rollout_problem``), and other quantisations are not read at all
    (``checkpoint_quantization``)."""
    from megarl.models import load_hf_config
    from megarl.models.fp8 import checkpoint_quantization, fp8_rollout_problem

    key = "actor_rollout_ref.model.path"
    try:
        quantization = checkpoint_quantization(load_hf_config(resolve_model_path(str(path)) or path))
    except ValueError as exc:  # another quantisation, named by its field
        return [Problem(f"{key}={path}: {exc}", key=key)]
    except (OSError, TypeError, AttributeError):
        return []  # a config that transformers cannot read: the layout checks report it
    return [Problem(fp8_rollout_problem(key, path, quantization), key=key)] if quantization else []


def _override_problems(cfg: DictConfig) -> list[Problem]:
    """verl's ``override_config.model_config`` of the actor's (and the critic's) model: fields its config has,
    none that would change its tensors (``megarl.models.config_overrides``)."""
    from megarl.models import override_problems
    from megarl.settings.engine import hf_config_overrides

    sections = [("actor", "actor_rollout_ref.model", cfg.actor_rollout_ref.model.path)]
    if critic_enabled(cfg):
        sections.append(("critic", "critic.model", cfg.critic.model.path))
    problems = []
    for role, section, path in sections:
        key = f"{section}.override_config.model_config"
        try:
            found = override_problems(key, resolve_model_path(str(path)) or str(path), hf_config_overrides(cfg, role),
                                      role)
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # a config the bridge cannot read: reported by the model checks
        problems += [Problem(message, key=key) for message in found]
    return problems


def _layout_problems(cfg: DictConfig) -> list[Problem]:
    """The parallel sizes against the model's config.json: the trainer's megatron layout, and the TP of the
    vLLM engines (the fleet's; a reward model's), which would otherwise fail 90 s into a launch with
    vLLM's or megatron's raw error."""
    from megarl.models import check_layout, model_dims, vllm_tp_problems
    from megarl.settings.engine import layout_from_config

    arr = cfg.actor_rollout_ref
    engines = [("actor_rollout_ref.rollout.tensor_model_parallel_size", arr.rollout.tensor_model_parallel_size,
                "actor_rollout_ref.model.path", arr.model.path)]
    if cfg.reward_model.enable:
        engines.append(("reward_model.rollout.tensor_model_parallel_size",
                        cfg.reward_model.rollout.tensor_model_parallel_size, "reward_model.model.path",
                        resolve_model_path(str(cfg.reward_model.model.path)) or cfg.reward_model.model.path))
    problems: list[Problem] = []
    try:
        dims = model_dims(resolve_model_path(str(arr.model.path)) or arr.model.path)
    except (OSError, ValueError, TypeError, AttributeError):
        return []  # a config the bridge cannot read: reported by the model checks
    from megarl.checks import router_replay

    problems += router_replay.model_problems(cfg, dims)
    key = "actor_rollout_ref.actor.megatron"
    cp = arr.actor.megatron.context_parallel_size
    if dims.mrope is not None and cp > 1:  # a feature megarl lacks, not a layout that cannot split
        problems.append(refusal(f"{key}.context_parallel_size={cp}", "context parallelism for vision-language "
                                "models (M-RoPE positions)", "set context_parallel_size=1; a long image prompt "
                                "fits with more tensor or pipeline parallelism", issue=28))
    else:
        layout = layout_from_config(arr.actor.megatron, dims.num_layers)
        try:
            check_layout(dims, layout)
        except ValueError as exc:
            problems.append(Problem(f"{key}.* for actor_rollout_ref.model.path={arr.model.path}: {exc}; pick "
                                    "parallel sizes that divide these counts", key=f"{key}.tensor_model_parallel_size"))
        if dims.is_moe and layout.tp > 1 and layout.ep == 1 and layout.etp == 1:
            problems.append(Problem(
                f"{key}.tensor_model_parallel_size={layout.tp} with expert_model_parallel_size=1 and "
                "expert_tensor_parallel_size=1 for a MoE model: each TP rank would train whole experts on its own "
                "share of the tokens (sequence parallelism, which megatron needs for MoE under TP) and megatron "
                "would not sum those gradients over the TP ranks, so the ranks' experts drift apart from the first "
                f"step; split the experts: expert_tensor_parallel_size={layout.tp} (each expert over the TP ranks) or "
                "expert_model_parallel_size > 1", key=f"{key}.expert_tensor_parallel_size"))
    if dims.vision is not None and dims.vision.deepstack_layers:  # build_model refuses it at the start otherwise
        from megarl.settings.engine import model_overrides, needs_reference

        for role in ("actor", "ref") if needs_reference(cfg) else ("actor",):
            if model_overrides(cfg, role, typed=False).get("recompute_granularity") == "full":
                problems.append(refusal(f"actor_rollout_ref.{role}.megatron.override_transformer_config."
                                        "recompute_granularity=full (or model.enable_gradient_checkpointing=True)",
                                        "full activation recomputation with DeepStack features (Qwen3-VL)",
                                        "use recompute_granularity=selective: under full recomputation a pipeline "
                                        "schedule would recompute a layer with another micro-batch's image features",
                                        issue=28))
    if dims.vision is not None:  # what does not read images yet (each would score the image tokens without pixels)
        for on, key, feature in ((cfg.distillation.enabled, "distillation.enabled=True", "distillation teachers that "
                                  "read images"), (cfg.reward_model.enable, "reward_model.enable=True",
                                                   "reward models that read images")):
            if on:
                problems.append(refusal(key, f"{feature} (for the vision-language actor {arr.model.path})",
                                        "score with a rule reward or a custom reward function (verl's signature), "
                                        "which see the response text and the row's ground truth", issue=28))
    if arr.actor.freeze_vision_tower and dims.vision is None:
        problems.append(Problem(f"actor_rollout_ref.actor.freeze_vision_tower=True: actor_rollout_ref.model.path="
                                f"{arr.model.path} has no vision tower (a text model); leave it False",
                                key="actor_rollout_ref.actor.freeze_vision_tower"))
    ep = arr.rollout.expert_parallel_size
    if ep > 1 and (dims.moe is None or ep > dims.moe.num_experts):
        what = "has no routed experts" if dims.moe is None else f"has {dims.moe.num_experts} routed experts"
        problems.append(Problem(f"actor_rollout_ref.rollout.expert_parallel_size={ep}: actor_rollout_ref.model.path="
                                f"{arr.model.path} {what}, so its engines cannot place one or more on each of {ep} "
                                "ranks; leave it at 1", key="actor_rollout_ref.rollout.expert_parallel_size"))
    if arr.rollout.name == "vllm":  # the fleet's engines would start, then generate other than the trainer computes
        from megarl.models import vllm_refusal

        why = vllm_refusal(resolve_model_path(str(arr.model.path)) or arr.model.path)
        if why:
            problems.append(Problem(f"actor_rollout_ref.rollout.name=vllm for actor_rollout_ref.model.path="
                                    f"{arr.model.path}: {why}", key="actor_rollout_ref.rollout.name"))
    for tp_key, tp, path_key, path in engines:
        try:
            found = vllm_tp_problems(dims if path_key.startswith("actor") else model_dims(path), tp) if tp >= 1 else []
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # the reward model's own checks report it
        if found:
            problems.append(Problem(f"{tp_key}={tp}: vLLM cannot split {path_key}={path} over {tp} ranks: "
                                    f"{'; '.join(found)}; pick a TP that divides these counts", key=tp_key))
    return problems


def _resume_problems(cfg: DictConfig) -> list[Problem]:
    """The checkpoint a resume would load: present, complete and of the recorded sizes (``resume_plan``)."""
    from megarl.trainer.resume import ResumeError, resume_plan

    if not cfg.trainer.default_local_dir or (cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path):
        return []  # the second is the config rules' problem
    try:
        plan = resume_plan(cfg.trainer, cfg.trainer.default_local_dir, critic_enabled(cfg))
    except (ResumeError, FileNotFoundError) as exc:
        return [Problem(str(exc), key="trainer.resume_mode")]
    if plan.first is None:
        return []
    return [p for role, path in zip(("actor", "critic"), plan.first) if path is not None
            for p in _lora_resume_problems(cfg, role, path)]


LORA_SHAPING = ("rank", "alpha", "type", "target_modules", "exclude_modules")  # what a resumed adapter must keep


def _lora_resume_problems(cfg: DictConfig, role: str, checkpoint) -> list[Problem]:
    """A resumed checkpoint's LoRA settings (its meta) against the run's: the adapters' shapes and scale."""
    from megarl.engine.checkpoint import checkpoint_meta
    from megarl.settings.engine import lora_settings

    prefix = "actor_rollout_ref.model.lora" if role == "actor" else "critic.model.lora"
    try:
        now = lora_settings(cfg, role)
    except ValueError:
        return []  # the LoRA checks name it
    saved = checkpoint_meta(checkpoint).get("lora")
    if saved is None and now is None:
        return []
    if saved is None or now is None:
        held = "a LoRA run's adapters" if saved is not None else "a whole model (no LoRA)"
        wanted = f"{prefix}.rank={now.rank}" if now is not None else f"{prefix}.rank=0"
        return [Problem(f"resuming {checkpoint}: it holds {held}, and this config has {wanted}; resume with the "
                        "settings it was trained with, or set trainer.resume_mode=disable (or another "
                        "trainer.default_local_dir) to start over", key=f"{prefix}.rank")]
    current, saved = now.to_dict(), {"type": "lora", **saved}  # checkpoints older than lora.type were all "lora"
    differ = [f"{k}: {saved.get(k)!r} there, {current[k]!r} here" for k in LORA_SHAPING if saved.get(k) != current[k]]
    if not differ:
        return []
    return [Problem(f"resuming {checkpoint}: it was trained with other LoRA settings ({'; '.join(differ)}); set "
                    f"{prefix}.* to the checkpoint's, or trainer.resume_mode=disable to start over", key=prefix)]


def _checkpoint_problems(cfg: DictConfig) -> list[Problem]:
    from megarl.engine.checkpoint import checkpoint_problems, resolve_checkpoint
    from megarl.settings.engine import initial_checkpoints

    keys = {"actor": "actor_rollout_ref.actor.megatron.dist_checkpointing_path",
            "ref": "actor_rollout_ref.ref.megatron.dist_checkpointing_path",
            "critic": "critic.megatron.dist_checkpointing_path"}
    problems, seen = [], set()
    for role, path in initial_checkpoints(cfg).items():
        if path is None or (role == "critic" and not _critic_on(cfg)) or path in seen:
            continue  # the reference starts from the actor's checkpoint unless it names its own: said once
        seen.add(path)
        try:
            found = checkpoint_problems(resolve_checkpoint(path))
        except (FileNotFoundError, OSError) as exc:
            found = [str(exc)]
        if found:
            problems.append(Problem(f"{keys[role]}={path}: {'; '.join(found)}", key=keys[role]))
    return problems


def _critic_on(cfg) -> bool:
    return critic_enabled(cfg)


# ------------------------------------------------------------------ data
def _data_problems(cfg: DictConfig) -> list[Problem]:
    import pyarrow.parquet as pq

    from megarl.data import column_problems
    from megarl.data.utf8 import InvalidUtf8, to_python_column
    from megarl.rewards.registry import VERL_ONLY_REWARDS, UnknownDataSourceError, find_rule_reward

    d = cfg.data
    custom = bool(cfg.custom_reward_function.path) or bool(cfg.reward_model.enable)  # no rule reward needed
    problems: list[Problem] = []
    sources: set[str] = set()
    for split in ("train", "val"):
        files = d[f"{split}_files"]
        if files is None:
            continue
        files = [files] if isinstance(files, str) else list(files)
        if not files:
            problems.append(Problem(f"data.{split}_files is an empty list; give at least one parquet path"))
        rows = 0
        for path in files:
            path = os.path.expanduser(str(path))
            if not os.path.isfile(path):
                problems.append(Problem(f"data.{split}_files: {path!r} does not exist", key=f"data.{split}_files"))
                continue
            try:
                parquet = pq.ParquetFile(path)
            except Exception as exc:
                problems.append(Problem(f"data.{split}_files: {path} cannot be read as parquet: {exc}"))
                continue
            names = parquet.schema_arrow.names
            found = column_problems(path, names, d.prompt_key, d.reward_fn_key, need_reward_fn_key=not custom)
            problems += [Problem(message, key=f"data.{split}_files") for message in found]
            rows += parquet.metadata.num_rows
            if not custom and not found:
                try:
                    column = to_python_column(parquet.read(columns=[d.reward_fn_key]).column(0), path, d.reward_fn_key)
                except InvalidUtf8 as exc:
                    problems.append(Problem(str(exc), key=f"data.{split}_files"))
                    continue
                sources.update(str(s) for s in column)
        limit = d[f"{split}_max_samples"]
        rows = min(rows, limit) if limit > 0 else rows
        if split == "train" and rows and rows < d.train_batch_size:
            problems.append(Problem(f"data.train_files hold {rows} rows, fewer than data.train_batch_size="
                                    f"{d.train_batch_size}: no batch could be drawn; lower the batch size"))
    unknown = []
    instead = "write compute_score in a file and set custom_reward_function.path"
    for source in sorted(sources):
        try:
            find_rule_reward(source)
        except UnknownDataSourceError:
            if source in VERL_ONLY_REWARDS:
                problems.append(refusal(f"data source {source!r} (column {d.reward_fn_key!r})",
                                        f"verl's built-in reward for {source} ({VERL_ONLY_REWARDS[source]})", instead))
            else:
                unknown.append(source)
    if unknown:
        problems.append(Problem(f"no built-in reward for the data source(s) {unknown} (column {d.reward_fn_key!r}); "
                                "set custom_reward_function.path to a file with your compute_score"))
    return problems


# ------------------------------------------------------------------ tools
def _tool_problems(cfg: DictConfig) -> list[Problem]:
    """A multi-turn run's tools (verl's tool YAML, function tools), built as the run builds them: a class that
    does not import (a file copied from verl), a refused config key or a missing sandbox is a problem here."""
    from megarl.agent.rollout import build_tools
    from megarl.settings.agent import multi_turn_settings

    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    key = f"actor_rollout_ref.rollout.multi_turn.{'tool_config_path' if multi_turn.tool_config_path else 'function_tool_path'}"
    try:
        settings = multi_turn_settings(multi_turn)
        if settings.enable:
            build_tools(settings)
    except (ImportError, ValueError, TypeError, AttributeError, OSError, RuntimeError) as exc:  # the sandbox's too
        return [Problem(f"{key}: {exc}", key=key)]
    return []


# ------------------------------------------------------------------ reward function
def _reward_problems(cfg: DictConfig) -> list[Problem]:
    from megarl.rewards.custom import SAMPLE, RewardFunctionLoadError
    from megarl.settings.rewards import load_reward_function
    from megarl.settings.rewards import function_kwargs, manager_name

    from megarl.settings.reward_models import reward_model_file_problems

    key = "custom_reward_function.path"
    from megarl.settings.distillation import distillation_file_problems

    problems = reward_model_file_problems(cfg)  # reward_model.model.path, when a reward model is on
    problems += distillation_file_problems(cfg)  # the teachers' checkpoints and tokenizers
    if not cfg.custom_reward_function.path:
        return problems
    try:
        fn = load_reward_function(cfg.custom_reward_function, function_kwargs(cfg))
    except (FileNotFoundError, RewardFunctionLoadError) as exc:
        return problems + [Problem(f"{key}: {exc}", key=key)]
    problems += _context_problems(cfg, fn)
    if manager_name(cfg) == "batch" and fn.form == SAMPLE:
        problems.append(Problem(f"reward_model.reward_manager=batch calls the reward function once per batch, but "
                                f"{fn.describe()}; give a batch-form function or use the naive manager"))
    if fn.form != SAMPLE and cfg.reward.num_workers > 1:
        problems.append(Problem(f"reward.num_workers={cfg.reward.num_workers}: {fn.describe()} is called once per "
                                "batch in the controller; set reward.num_workers=1"))
    return problems


def _context_problems(cfg: DictConfig, fn: Any) -> list[Problem]:
    """The reward-model arguments the function names must be ones this run's reward model gives."""
    from megarl.rewards.reward_models.settings import DISCRIMINATIVE, GENERATIVE, model_kind, read_hf_config

    rm = cfg.reward_model
    if not rm.enable:
        if fn.required_context:
            return [Problem(f"custom_reward_function: {fn.describe()} takes {', '.join(sorted(fn.required_context))}, "
                            "which a reward model gives: set reward_model.enable=True and reward_model.model.path "
                            "(or give those parameters defaults)", key="custom_reward_function.path")]
        return []
    try:
        kind = model_kind(read_hf_config(resolve_model_path(str(rm.model.path)) or str(rm.model.path)))
    except (OSError, ValueError, TypeError):
        return []  # reported with the reward model's own checks
    wrong = {GENERATIVE: ("rm_score", "rm_scores"), DISCRIMINATIVE: ("judge",)}.get(kind, ())
    taken = sorted(set(wrong) & fn.context)
    if taken:
        what = "a judge (a causal LM): it gives judge, not scores" if kind == GENERATIVE else \
            "a discriminative reward model: it gives rm_score, not a judge"
        return [Problem(f"custom_reward_function: {fn.describe()} takes {', '.join(taken)}, but reward_model.model.path="
                        f"{rm.model.path} is {what}", key="custom_reward_function.path")]
    return []


def _logger_problems(cfg: DictConfig) -> list[Problem]:
    from megarl.logging import unavailable_sinks

    return [Problem(f"trainer.logger includes {name!r} but the {package} package is not installed: pip install "
                    f"{package}, or drop {name!r} from trainer.logger", key="trainer.logger")
            for name, package in unavailable_sinks(cfg.trainer.logger).items()]
