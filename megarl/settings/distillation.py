"""On-policy distillation from the config: verl's ``distillation.*`` read into typed settings, with its rules.

verl's semantics, kept: one teacher is ``teacher_models.teacher_model`` and fills the teachers' pool
(``nnodes x n_gpus_per_node`` devices: ``num_replicas`` = pool / its TP), scoring every sample;
several teachers are named entries besides it (``+distillation.teacher_models.<name>.key=...``;
the default entry is then dropped, as in verl), each with its ``key``, ``model_path`` and
``num_replicas``, and a sample goes to the teacher whose ``key`` is its ``teacher_key`` field
(``data_source`` by default). Their replicas must fill the pool exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megarl.algorithms.distillation import DistillationLossSettings
from megarl.config.errors import Problem, refusal

KEY = "distillation"
DEFAULT_TEACHER = "teacher_model"  # verl's entry for a single teacher


@dataclass(frozen=True)
class Teacher:
    key: str  # the teacher_key value it scores ("default" for a single teacher: every sample)
    model_path: str
    num_replicas: int
    engine: Any  # the typed inference section its fleet starts from


@dataclass(frozen=True)
class DistillationSettings:
    teachers: tuple[Teacher, ...]
    teacher_key: str  # the sample field that picks the teacher (several teachers)
    loss: DistillationLossSettings
    nnodes: int
    per_node: int

    @property
    def single(self) -> bool:
        return len(self.teachers) == 1 and self.teachers[0].key == "default"


def loss_settings(section: Any) -> DistillationLossSettings:
    return DistillationLossSettings(
        loss_mode=str(section.loss_mode), use_task_rewards=bool(section.use_task_rewards),
        distillation_loss_coef=float(section.distillation_loss_coef),
        loss_max_clamp=None if section.loss_max_clamp is None else float(section.loss_max_clamp),
        log_prob_min_clamp=None if section.log_prob_min_clamp is None else float(section.log_prob_min_clamp),
        topk=int(section.topk), use_policy_gradient=bool(section.use_policy_gradient),
        clip_ratio_low=float(section.clip_ratio if section.clip_ratio_low is None else section.clip_ratio_low),
        clip_ratio_high=float(section.clip_ratio if section.clip_ratio_high is None else section.clip_ratio_high))


def _teacher_names(d: Any) -> list[str]:
    names = [str(name) for name in d.teacher_models]
    return [n for n in names if n != DEFAULT_TEACHER] if len(names) > 1 else names  # verl: named ones replace it


def _teachers(cfg: Any) -> tuple[dict[str, Any], list[Problem]]:
    """Each teacher entry as a typed ``TeacherModelConfig``, and the problems of the entries' keys: a key of
    the schema is typed; one of verl's own is decided by its rule (``verl_keys``: refused at a value that asks
    for something megarl lacks, or noted); any other key is unknown."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megarl.config.schema import TeacherModelConfig
    from megarl.config.screen import FREE, SECTION, schema_fields
    from megarl.config.verl_keys import Refused, rule_for

    fields, rollout = schema_fields(TeacherModelConfig), cfg.actor_rollout_ref.rollout
    get = lambda key: OmegaConf.select(cfg, key)  # noqa: E731
    teachers, problems = {}, []
    for name in _teacher_names(cfg.distillation):
        where = f"{KEY}.teacher_models.{name}"
        try:
            entry = OmegaConf.to_container(cfg.distillation.teacher_models[name], resolve=True)
        except OmegaConfBaseException as exc:
            problems.append(Problem(f"{where}: {exc}", key=where))
            continue
        if not isinstance(entry, dict):
            problems.append(Problem(f"{where}={entry!r}: a teacher is a section (key, model_path, num_replicas, "
                                    "inference.*)", key=where))
            continue
        typed = OmegaConf.structured(TeacherModelConfig)
        typed.inference.name, typed.inference.dtype = rollout.name, rollout.dtype  # verl: the student's engine's
        typed.inference.prompt_length, typed.inference.response_length = rollout.prompt_length, rollout.response_length

        def walk(node: dict, prefix: str) -> None:
            for key, value in node.items():
                path = f"{prefix}{key}"
                kind = fields.get(path)
                if kind == SECTION and isinstance(value, dict):
                    walk(value, path + ".")
                elif kind is not None and kind != SECTION:
                    try:
                        OmegaConf.update(typed, path, value, merge=kind == FREE)
                    except OmegaConfBaseException as exc:
                        problems.append(Problem(f"{where}.{path}={value!r}: {exc}".split("\n")[0], key=f"{where}.{path}"))
                else:
                    rule = rule_for(f"{where}.{path}")
                    if rule is None:
                        if isinstance(value, dict):
                            walk(value, path + ".")  # verl's keys inside a section of its own
                            continue
                        problems.append(Problem(f"unknown config key '{where}.{path}': a teacher takes "
                                                f"{', '.join(k for k in fields if fields[k] != SECTION)}",
                                                key=f"{where}.{path}"))
                    elif isinstance(rule, Refused) and rule.asks(value, get):
                        problems.append(refusal(f"{where}.{path}={value}", rule.feature, rule.instead))
        walk(entry, "")
        teachers[name] = OmegaConf.to_object(typed)
    return teachers, problems


def distillation_problems(cfg: Any) -> list[Problem]:
    """The cross-key rules of ``distillation.*`` (none when it is off)."""
    d, problems = cfg.distillation, []
    if not d.enabled:
        return problems
    loss = d.distillation_loss
    try:
        loss_settings(loss)  # the loss's own rules (megarl.algorithms.distillation)
    except ValueError as exc:
        problems.append(Problem(str(exc), key=f"{KEY}.distillation_loss.loss_mode"))
    if loss.policy_loss_mode != "vanilla":
        problems.append(refusal(f"{KEY}.distillation_loss.policy_loss_mode={loss.policy_loss_mode}",
                                "another policy loss for the distillation reward", "as in verl, the distillation "
                                "reward trains with the vanilla PPO-clip loss: set policy_loss_mode=vanilla"))
    actor = cfg.actor_rollout_ref.actor
    if not loss.use_task_rewards:
        for key, value, off in (("actor_rollout_ref.actor.use_kl_loss", actor.use_kl_loss, False),
                                ("actor_rollout_ref.actor.entropy_coeff", actor.entropy_coeff, 0)):
            if value != off:
                problems.append(Problem(f"{key}={value} with {KEY}.distillation_loss.use_task_rewards=False: the "
                                        "distillation loss is then the whole loss (as in verl), so this term would "
                                        f"be dropped; set {key}={off}, or use_task_rewards=True", key=key))
    entries, entry_problems = _teachers(cfg)
    problems += entry_problems
    several = len(entries) > 1 or DEFAULT_TEACHER not in entries
    pool = int(d.nnodes) * int(d.n_gpus_per_node)
    if pool < 1:
        problems.append(Problem(f"{KEY}.nnodes={d.nnodes} x {KEY}.n_gpus_per_node={d.n_gpus_per_node}: the teachers "
                                "need a pool of their own (at least 1 device; on CPU, worker processes)", key=f"{KEY}.nnodes"))
    keys, used = set(), 0
    for name, teacher in entries.items():
        where = f"{KEY}.teacher_models.{name}"
        if not teacher.model_path:
            problems.append(Problem(f"{where}.model_path is not set: the teacher model to score the samples with",
                                    key=f"{where}.model_path"))
        engine = teacher.inference
        if str(engine.name) not in ("vllm", "hf"):
            problems.append(Problem(f"{where}.inference.name={engine.name}: teachers run on vllm or hf"))
        tp = int(engine.tensor_model_parallel_size)
        if tp < 1:
            problems.append(Problem(f"{where}.inference.tensor_model_parallel_size={tp}: must be >= 1"))
            continue
        if several:
            if not teacher.key:
                problems.append(Problem(f"{where}.key is not set: with several teachers each names the "
                                        f"{KEY}.teacher_key value ({d.teacher_key}) of the samples it scores",
                                        key=f"{where}.key"))
            elif teacher.key in keys:
                problems.append(Problem(f"{where}.key={teacher.key}: another teacher has this key", key=f"{where}.key"))
            keys.add(teacher.key)
            if int(teacher.num_replicas) < 1:
                problems.append(Problem(f"{where}.num_replicas={teacher.num_replicas}: with several teachers each "
                                        "needs >= 1 replica", key=f"{where}.num_replicas"))
            used += int(teacher.num_replicas) * tp
        elif pool >= 1 and pool % tp:
            problems.append(Problem(f"{where}.inference.tensor_model_parallel_size={tp} must divide the teachers' "
                                    f"pool of {pool} devices ({KEY}.nnodes x n_gpus_per_node)"))
        elif pool >= 1 and int(teacher.num_replicas) not in (0, pool // tp):
            problems.append(Problem(f"{where}.num_replicas={teacher.num_replicas}: one teacher fills its pool, so it "
                                    f"has {pool // tp} replica(s) of TP{tp} ({KEY}.nnodes x n_gpus_per_node = {pool}); "
                                    f"leave it 0, or change the pool", key=f"{where}.num_replicas"))
    if several and pool >= 1 and used != pool:
        problems.append(Problem(f"the teachers' replicas take {used} devices (num_replicas x TP each) but their pool "
                                f"has {pool} ({KEY}.nnodes={d.nnodes} x n_gpus_per_node={d.n_gpus_per_node}); make "
                                "them equal", key=f"{KEY}.nnodes"))
    return problems


def distillation_settings(cfg: Any) -> DistillationSettings | None:
    """The distillation of a checked config (None: ``distillation.enabled`` is off)."""
    from megarl.models.locate import resolve_model_path

    d = cfg.distillation
    if not d.enabled:
        return None
    pool = int(d.nnodes) * int(d.n_gpus_per_node)
    entries, _ = _teachers(cfg)  # checked: distillation_problems
    teachers = []
    for name, teacher in entries.items():
        engine = teacher.inference
        path = str(teacher.model_path)
        path = resolve_model_path(path) or path
        if name == DEFAULT_TEACHER and len(entries) == 1:
            teachers.append(Teacher("default", path, pool // int(engine.tensor_model_parallel_size), engine))
        else:
            teachers.append(Teacher(str(teacher.key), path, int(teacher.num_replicas), engine))
    return DistillationSettings(tuple(teachers), str(d.teacher_key), loss_settings(d.distillation_loss),
                                int(d.nnodes), int(d.n_gpus_per_node))


VLLM_MAX_LOGPROBS = 20  # vLLM's default cap on the log-probs a request may ask for (EngineArgs.max_logprobs)


def scoring_engine(engine: Any, topk: int = 0) -> Any:
    """A teacher engine section that can score a whole sample: ``max_model_len`` holds prompt + response
    (one more with ``topk``: the whole sample is then the prompt), and vLLM may return ``topk`` log-probs
    per position."""
    if engine.max_model_len is None:
        engine = replace(engine, max_model_len=int(engine.prompt_length) + int(engine.response_length) + (1 if topk else 0))
    vllm_kwargs = dict(engine.engine_kwargs.vllm)
    if topk > int(vllm_kwargs.get("max_logprobs", VLLM_MAX_LOGPROBS)):
        engine = replace(engine, engine_kwargs=replace(engine.engine_kwargs, vllm={**vllm_kwargs, "max_logprobs": topk}))
    return engine


def distillation_file_problems(cfg: Any) -> list[Problem]:
    """Each teacher's checkpoint exists, and tokenizes as the student does (it scores the student's token ids;
    verl's teachers share the student's tokenizer too)."""
    from transformers import AutoTokenizer

    from megarl.models.locate import model_problems, resolve_model_path

    d = cfg.distillation
    if not d.enabled:
        return []
    model, problems = cfg.actor_rollout_ref.model, []
    student = None
    for name, teacher in _teachers(cfg)[0].items():
        key = f"{KEY}.teacher_models.{name}.model_path"
        if not teacher.model_path:
            continue  # distillation_problems names it
        found = model_problems(key, teacher.model_path, needs_family=False)
        problems += found
        if found:
            continue
        try:
            student = student or AutoTokenizer.from_pretrained(model.tokenizer_path or model.path,
                                                               trust_remote_code=cfg.data.trust_remote_code)
            theirs = AutoTokenizer.from_pretrained(resolve_model_path(str(teacher.model_path)) or teacher.model_path)
        except Exception as exc:  # noqa: BLE001 - reported as a problem, with the reason
            problems.append(Problem(f"{key}={teacher.model_path}: cannot load the tokenizers to compare them: {exc}",
                                    key=key))
            continue
        if theirs.get_vocab() != student.get_vocab():
            problems.append(refusal(f"{key}={teacher.model_path}", "a teacher with another tokenizer",
                                    "the teacher scores the student's token ids, so both must tokenize alike (as in "
                                    f"verl); pick a teacher of the student's family ({model.tokenizer_path or model.path})"))
    return problems


ROUTING_FIELDS = ("data_source", "agent_name")  # the samples' fields that can pick a teacher


def routing_problem(settings: DistillationSettings | None, datasets: dict[str, Any]) -> str | None:
    """With several teachers, every prompt of the data must name one (checked before any process starts)."""
    if settings is None or settings.single:
        return None
    name, keys = settings.teacher_key, sorted(t.key for t in settings.teachers)
    if name not in ROUTING_FIELDS:
        return (f"distillation.teacher_key={name!r}: a sample's teacher is picked by one of its fields "
                f"{list(ROUTING_FIELDS)}")
    for split, dataset in datasets.items():
        values = {str(getattr(item, name)) for item in dataset.items}
        unknown = sorted(values - set(keys))
        if unknown:
            return (f"{split} data: {name} values {unknown[:5]} name no teacher (the teachers' keys: {keys}); add a "
                    f"teacher for each (distillation.teacher_models.<name>.key) or filter the data")
    return None
