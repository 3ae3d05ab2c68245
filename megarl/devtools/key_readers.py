"""Which code reads each schema key: recorded, not kept by hand.

``readers()`` runs what a launch runs on a config before it starts processes (the checks, ``prepare``,
Ray's settings and every settings constructor: ``read_by_the_door``) on a few configs that turn the
optional parts on, and records each value read from the DictConfig with the megarl module that read it.
A section handed to a component whole, typed (``typed_config``: the trainer's ``trainer`` and
``algorithm`` sections, the agent seam's ``rollout``), is read by that component: its keys count when
the field is used somewhere in the package (an attribute access of its name outside ``megarl/config``),
and the configuration reference names the module that hands the section on.

``tests/config/test_key_readers.py`` fails when a key has no reader; ``megarl.devtools.docs_pages``
writes the readers into the configuration reference (docs/reference/config-keys.md).
"""
from __future__ import annotations

import ast
import contextlib
import sys
import tempfile
from collections import defaultdict
from functools import lru_cache
from pathlib import Path
from unittest import mock

from omegaconf import DictConfig, OmegaConf

from megarl.config.screen import SECTION, schema_fields
from megarl.devtools.config_files import write_model_config, write_prompts

PACKAGE = Path(__file__).resolve().parents[1]

# Keys that have no effect by nature, with the reason: the only hand-kept list.
INERT = {
    "actor_rollout_ref.ref.megatron.use_distributed_optimizer": "the reference model is frozen: it has no optimizer",
    "actor_rollout_ref.ref.megatron.seed": "the reference runs in the actor's parallel state (seeded by "
                                           "actor_rollout_ref.actor.megatron.seed) and has no dropout (eval mode)",
}

# Frames that pass a read on rather than make it: OmegaConf, the schema's own package, the typed
# view (megarl.settings.typed_config) and this recorder.
_PASSING = ("omegaconf", "megarl.config", "megarl.devtools")


def _reader() -> str:
    """The megarl module that made the read now in progress ('' when none did, e.g. a test)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("megarl.") and not name.startswith(_PASSING) and not (
                name == "megarl.settings" and frame.f_code.co_name == "typed_config"):
            return name
        frame = frame.f_back
    return ""


@contextlib.contextmanager
def recording():
    """Record the full key of every value read from a DictConfig (attribute, item, ``get``, iteration) in
    ``direct``, and of every leaf under a node turned into typed objects (``OmegaConf.to_object``) in
    ``handed``: key -> the set of megarl modules that read it (or handed it on)."""
    direct, handed = defaultdict(set), defaultdict(set)
    get_impl, to_object = DictConfig._get_impl, OmegaConf.to_object

    def read(self, key, default_value, validate_key=True):
        direct[self._get_full_key(key)].add(_reader())
        return get_impl(self, key, default_value, validate_key)

    def typed(cfg):
        if isinstance(cfg, DictConfig):
            prefix, reader = cfg._get_full_key(None), _reader()
            for k in _leaves(OmegaConf.to_container(cfg)):
                handed[f"{prefix}.{k}" if prefix else k].add(reader)
        return to_object(cfg)

    DictConfig._get_impl, OmegaConf.to_object = read, typed
    try:
        yield direct, handed
    finally:
        DictConfig._get_impl, OmegaConf.to_object = get_impl, to_object


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path


@lru_cache(maxsize=None)
def attributes_used() -> frozenset[str]:
    """Attribute names accessed in the package outside ``megarl/config`` (where the schema defines them)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "config":
            continue
        names.update(node.attr for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(node, ast.Attribute))
    return frozenset(names)


def leaf_keys() -> list[str]:
    return [key for key, kind in schema_fields().items() if kind != SECTION]


class _Recorded:
    """Stands in for a process-owning component (the weight sync needs started workers and a fleet)."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def read_by_the_door(cfg, run_dir: Path) -> None:
    """Run what a launch runs on ``cfg`` before and while it builds the components' settings: the checks,
    ``prepare`` (tokenizer, agent loops, data, resume plan), Ray's settings and every settings constructor."""
    import transformers

    import megarl.settings.profiling as profiling
    import megarl.settings.sync as sync
    from megarl.checks import launch_problems
    from megarl.devtools.tiny_tokenizer import build_tokenizer
    from megarl.run.build import prepare
    from megarl.settings.cluster import plan_from_config, ray_settings, reward_pool_from_config
    from megarl.settings.data import load_tokenizer
    from megarl.settings.distillation import distillation_settings
    from megarl.settings.reward_models import reward_engine, settings_from_config
    from megarl.settings.rewards import reward_manager
    from megarl.settings.rollout import fleet_arguments
    from megarl.settings.trainer import trainer_settings
    from megarl.settings.worker import worker_settings

    with mock.patch.object(sync, "WeightSyncSession", _Recorded), mock.patch.object(sync, "AdapterUpdates", _Recorded), \
            mock.patch.object(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: build_tokenizer("qwen3")), \
            mock.patch.object(profiling.shutil, "which", lambda name: f"/usr/bin/{name}"):  # nsys stands installed
        notes: list[str] = []
        problems = launch_problems(cfg, notes)
        assert problems == [], problems
        prepare(cfg, run_dir, load_tokenizer)
        ray_settings(cfg)
        trainer_settings(cfg)
        plan = plan_from_config(cfg)
        worker_settings(cfg, plan.trainer_world)
        fleet_arguments(cfg, plan)
        sync.weight_updates(cfg, None, None)
        model = settings_from_config(cfg)
        if model is not None:
            reward_engine(cfg, model)
        reward_pool_from_config(cfg)
        reward_manager(cfg)
        distillation_settings(cfg)


def configs(tmp_path: Path) -> dict[str, list[str]]:
    model = write_model_config(tmp_path / "model", architecture="LlamaForCausalLM", model_type="llama")
    data = write_prompts(tmp_path / "train.parquet", rows=8)
    base = [f"data.train_files={data}", f"data.val_files={data}", f"actor_rollout_ref.model.path={model}",
            "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=4", f"trainer.default_local_dir={tmp_path / 'run'}"]
    return {
        "grpo": base,
        "ppo with a critic and a KL loss": [*base, "algorithm.adv_estimator=gae", f"critic.model.path={model}",
                                            "actor_rollout_ref.actor.use_kl_loss=True"],
        "fully async": [*base, "async_training.mode=fully_async", "async_training.staleness_threshold=1",
                        "async_training.partial_rollout=True", "algorithm.rollout_correction.rollout_is=token",
                        "trainer.placement=split", "trainer.rollout_gpus=1",
                        "actor_rollout_ref.rollout.tensor_model_parallel_size=1"],
        "lora, for the critic too": [*base, "actor_rollout_ref.model.lora.rank=8", "algorithm.adv_estimator=gae",
                                     f"critic.model.path={model}", "critic.model.lora.rank=8",
                                     *[f"{role}.optim.{k}" for role in ("actor_rollout_ref.actor", "critic")
                                       for k in ("lr_warmup_steps=-1", "total_training_steps=10")]],
        "reward model on its own devices": [*base, "reward_model.enable=True", f"reward_model.model.path={model}",
                                            "reward_model.enable_resource_pool=True", "reward_model.nnodes=1",
                                            "reward_model.n_gpus_per_node=2"],
        "verl's rollout pool and global micro-batch size": [
            *[o for o in base if "actor.ppo_micro_batch_size_per_gpu" not in o],
            "actor_rollout_ref.actor.ppo_micro_batch_size=4", "async_training.mode=one_step_off",
            "rollout.nnodes=1", "rollout.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "algorithm.rollout_correction.rollout_is=token"],
        "distillation, as a reward": [*base, "distillation.enabled=True", "distillation.nnodes=1",
                                      "distillation.n_gpus_per_node=1",
                                      f"distillation.teacher_models.teacher_model.model_path={model}",
                                      "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
                                      "distillation.distillation_loss.loss_mode=k1",
                                      "distillation.distillation_loss.use_policy_gradient=True",
                                      "distillation.distillation_loss.clip_ratio_low=null"],
        "profiled, every role (torch)": [*base, "algorithm.adv_estimator=gae", f"critic.model.path={model}",
                                         "actor_rollout_ref.actor.use_kl_loss=True", "global_profiler.tool=torch",
                                         "global_profiler.steps=[2,3]", "global_profiler.profile_continuous_steps=True",
                                         *[f"{role}.profiler.enable=True" for role in (
                                             "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")]],
        "profiled under nsys, one stage each": [*base, "algorithm.adv_estimator=gae", f"critic.model.path={model}",
                                                "actor_rollout_ref.actor.use_kl_loss=True", "global_profiler.tool=nsys",
                                                "global_profiler.steps=[1]",
                                                "global_profiler.global_tool_config.nsys.discrete=True",
                                                *[f"{role}.profiler.enable=True" for role in (
                                                    "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")]],
        "overlong penalty, adaptive KL": [*base, "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=True",
                                          "reward_model.overlong_buffer.len=4",
                                          "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive"],
    }


def recorded_reads(tmp_path: Path | None = None) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(direct, handed) as ``recording`` gives them, over every config of ``configs``."""
    from megarl.config import compose_config

    with contextlib.ExitStack() as stack:
        if tmp_path is None:
            tmp_path = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        direct, handed = defaultdict(set), defaultdict(set)
        for index, overrides in enumerate(configs(tmp_path).values()):
            cfg = compose_config(None, overrides)  # composed and typed; the checks run under the recorder
            with recording() as (reads, typed):
                read_by_the_door(cfg, tmp_path / f"run{index}")
            for into, found in ((direct, reads), (handed, typed)):
                for key, modules in found.items():
                    into[key] |= modules
        return dict(direct), dict(handed)


def unread(keys, direct, handed, inert=INERT) -> list[str]:
    problems = []
    for key in keys:
        read = key in direct or (key in handed and key.rsplit(".", 1)[-1] in attributes_used())
        if not read and key not in inert:
            problems.append(f"{key}: no check and no settings constructor reads it")
    return problems


def readers(direct=None, handed=None) -> dict[str, tuple[list[str], list[str]]]:
    """Schema key -> (the megarl modules that read it from the config, those that hand its section on
    typed to a component), each sorted. Module names lose their ``megarl.`` prefix."""
    if direct is None:
        direct, handed = recorded_reads()
    short = lambda modules: sorted(m.removeprefix("megarl.") for m in modules if m)  # noqa: E731
    return {key: (short(direct.get(key, ())), short(handed.get(key, ())))
            for key in leaf_keys()}
