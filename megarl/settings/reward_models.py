"""A reward model or LLM judge from the config: ``reward_model.*`` (``enable``, ``model.path``,
``model.input_tokenizer``, ``model.trust_remote_code``, ``max_length``, ``enable_resource_pool``,
``judge.*``, ``rollout.*`` for its engines), with the cross-key rules and file checks the config
check reports (``megarl.rewards.reward_models`` serves it).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from megarl.config.errors import Problem, refusal
from megarl.rewards.reward_models.settings import (DISCRIMINATIVE, GENERATIVE, KEY, JudgeSettings, RewardModelSettings,
                                                    model_kind, num_labels, read_hf_config)


def judge_settings(section: Any) -> JudgeSettings:
    return JudgeSettings(timeout_s=float(section.timeout_s), max_retries=int(section.max_retries),
                         retry_backoff_s=float(section.retry_backoff_s), max_concurrent=int(section.max_concurrent),
                         fallback_score=float(section.fallback_score))


def reward_engine(cfg: Any, settings: RewardModelSettings):
    """The typed ``reward_model.rollout`` section its fleet starts from, with the reward model's max length."""
    from megarl.settings import typed_config

    return dataclasses.replace(typed_config(cfg.reward_model.rollout), max_model_len=settings.max_length)


def settings_from_config(cfg: Any) -> RewardModelSettings | None:
    """The reward model of a checked config (None: ``reward_model.enable`` is off)."""
    rm = cfg.reward_model
    if not rm.enable:
        return None
    from megarl.models.locate import resolve_model_path

    path = resolve_model_path(str(rm.model.path)) or str(rm.model.path)
    engine = rm.rollout
    return RewardModelSettings(
        path=path, kind=model_kind(read_hf_config(path)) or DISCRIMINATIVE,
        retemplate=rm.model.input_tokenizer is not None,
        max_length=int(rm.max_length or engine.max_model_len or engine.prompt_length + engine.response_length),
        pool=bool(rm.enable_resource_pool), trust_remote_code=bool(rm.model.trust_remote_code),
        judge=judge_settings(rm.judge))


def policy_tokenizers(cfg: Any) -> tuple[str, ...]:
    """Paths that name the policy's tokenizer (what ``input_tokenizer`` may be)."""
    model = cfg.actor_rollout_ref.model
    return tuple(str(p) for p in (model.tokenizer_path, model.path) if p)


def reward_model_problems(cfg: Any) -> list[Problem]:
    """The cross-key rules of ``reward_model.*`` (files are checked in ``preflight_problems``)."""
    rm, problems = cfg.reward_model, []
    if not rm.enable:
        return problems
    engine = rm.rollout
    if not rm.model.path:
        problems.append(Problem("reward_model.enable=True needs reward_model.model.path (a "
                                "...ForSequenceClassification reward model or a causal-LM judge)", key=KEY))
    if engine.name != "vllm":
        why = (" (the hf rollout backend has no classifier head runner and no OpenAI-compatible server, which reward "
               "models and judges are served through)" if engine.name == "hf" else "")
        problems.append(refusal(f"reward_model.rollout.name={engine.name}", f"{engine.name} as the reward model's "
                                f"engine", f"megarl serves reward models with vLLM{why}: set reward_model.rollout.name=vllm"))
    tokenizer = rm.model.input_tokenizer
    if tokenizer is not None and str(tokenizer) not in policy_tokenizers(cfg):
        problems.append(refusal(f"reward_model.model.input_tokenizer={tokenizer}", "decoding the responses with a "
                                "tokenizer other than the policy's", "megarl decodes them with the policy's "
                                f"({' or '.join(policy_tokenizers(cfg))}) and applies the reward model's chat "
                                "template; set input_tokenizer to it, or null to feed the policy's token ids as they are"))
    if engine.tensor_model_parallel_size < 1:
        problems.append(Problem(f"reward_model.rollout.tensor_model_parallel_size={engine.tensor_model_parallel_size}: "
                                "must be >= 1"))
    if not 0 < engine.gpu_memory_utilization <= 1:
        problems.append(Problem(f"reward_model.rollout.gpu_memory_utilization={engine.gpu_memory_utilization}: "
                                "must be in (0, 1]"))
    elif not rm.enable_resource_pool and cfg.trainer.placement == "colocated" and \
            engine.gpu_memory_utilization + cfg.actor_rollout_ref.rollout.gpu_memory_utilization > 1:
        problems.append(Problem(
            f"reward_model.rollout.gpu_memory_utilization={engine.gpu_memory_utilization} + actor_rollout_ref.rollout."
            f"gpu_memory_utilization={cfg.actor_rollout_ref.rollout.gpu_memory_utilization} > 1: a colocated reward "
            "model scores while the rollout engines are awake, on the same GPUs; lower them, or give the reward "
            "model its own devices (reward_model.enable_resource_pool=True, nnodes, n_gpus_per_node)"))
    if rm.max_length is not None and rm.max_length < 2:
        problems.append(Problem(f"reward_model.max_length={rm.max_length}: must be >= 2 tokens"))
    if rm.max_length is not None and engine.max_model_len is not None and rm.max_length > engine.max_model_len:
        problems.append(Problem(f"reward_model.max_length={rm.max_length} exceeds reward_model.rollout.max_model_len="
                                f"{engine.max_model_len}; give one of them"))
    judge = rm.judge
    for key, value, low in (("timeout_s", judge.timeout_s, 0), ("retry_backoff_s", judge.retry_backoff_s, -1e-9)):
        if not value > low:
            problems.append(Problem(f"reward_model.judge.{key}={value}: must be > {max(low, 0):g}"))
    if judge.max_retries < 0 or judge.max_concurrent < 1:
        problems.append(Problem(f"reward_model.judge.max_retries={judge.max_retries} must be >= 0 and "
                                f"max_concurrent={judge.max_concurrent} >= 1"))
    return problems  # where its replicas go is the placement's check (megarl.checks.rules._check_rewards)


def reward_model_file_problems(cfg: Any) -> list[Problem]:
    """The checkpoint at ``reward_model.model.path``: a one-label sequence classifier or a causal LM,
    and (without ``input_tokenizer``) the policy's vocabulary."""
    from megarl.models.locate import model_problems, resolve_model_path

    rm = cfg.reward_model
    if not (rm.enable and rm.model.path):
        return []
    problems = model_problems(KEY, rm.model.path, needs_family=False)
    if problems:
        return problems
    local = resolve_model_path(str(rm.model.path))
    try:
        hf_config = read_hf_config(local)
    except (OSError, json.JSONDecodeError) as exc:
        return [Problem(f"{KEY}={rm.model.path}: cannot read its config.json: {exc}", key=KEY)]
    kind = model_kind(hf_config)
    architectures = hf_config.get("architectures")
    if kind is None:
        return [refusal(f"{KEY}={rm.model.path}", f"reward models of architecture {architectures}",
                        "a reward model is a ...ForSequenceClassification with one label (scored at the last "
                        "token) or a causal LM used as a judge by your reward function")]
    if kind == DISCRIMINATIVE and num_labels(hf_config) != 1:
        return [Problem(f"{KEY}={rm.model.path}: {architectures[0]} has {num_labels(hf_config)} labels; a reward "
                        "model has one (num_labels=1 in config.json): its output is the score", key=KEY)]
    if kind == GENERATIVE and not cfg.custom_reward_function.path:
        problems.append(Problem(f"{KEY}={rm.model.path} is a causal LM, a judge: a custom reward function must "
                                "build the judge's prompt and parse its answer (custom_reward_function.path; it "
                                "receives judge and reward_router_address; docs/rewards.md, Reward models)", key=KEY))
    if rm.model.input_tokenizer is None:
        problems += _same_vocabulary(cfg, local, kind)
    return problems


def _same_vocabulary(cfg: Any, rm_path: str, kind: str) -> list[Problem]:
    """``input_tokenizer=null``: the reward model reads the policy's token ids, so both must tokenize alike."""
    from transformers import AutoTokenizer

    model = cfg.actor_rollout_ref.model
    try:
        policy = AutoTokenizer.from_pretrained(model.tokenizer_path or model.path, trust_remote_code=cfg.data.trust_remote_code)
        reward = AutoTokenizer.from_pretrained(rm_path, trust_remote_code=cfg.reward_model.model.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - reported as a problem, with the reason
        return [Problem(f"reward_model.model.input_tokenizer=null: cannot load the tokenizers to compare them: {exc}")]
    if policy.get_vocab() != reward.get_vocab():
        return [Problem("reward_model.model.input_tokenizer=null feeds the policy's token ids to the reward model, but "
                        f"its tokenizer ({rm_path}) differs from the policy's; set reward_model.model.input_tokenizer="
                        f"{model.tokenizer_path or model.path} (the responses are decoded and the reward model's chat "
                        "template is applied)", key="reward_model.model.input_tokenizer")]
    return []
