"""The run's reward model or LLM judge: vLLM replicas in their device slots, served over HTTP.

    service, pool = start_reward_model(cfg, placement, use_gpu)  # megarl.run.build, before training
    manager = reward_manager(cfg, model_reward=service)
    with service.awake():                                        # the manager does this for a pass
        scores = service.score(ResponsesToScore(...))            # a discriminative model's scores
    service.close()

The replicas are a ``RolloutFleet`` of their own (no weight sync: the reward model is frozen), on
the trainer's slots (colocated, verl's default: with ``reward_model.rollout.free_cache_engine`` on
GPU the engines sleep, level 1, outside the reward pass and wake when it starts, after
generation) or on a pool of their own (``reward_model.enable_resource_pool``: whole devices, always
awake). A sequence classifier runs vLLM's pooling runner; scores go over Ray (token ids in, one
float out per sequence, the batch split evenly over the replicas). Every replica also serves vLLM's
OpenAI-compatible HTTP API on its engine, behind one address (a ``router.ReplicaRouter`` when
there are several): the ``reward_router_address`` verl's reward functions POST to
(``/classify``, ``/v1/chat/completions``), which ``judge.JudgeClient`` uses as well.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from megarl.rewards.reward_models.inputs import ResponsesToScore, model_sequences
from megarl.rewards.reward_models.judge import JudgeClient
from megarl.rewards.reward_models.settings import DISCRIMINATIVE, GENERATIVE, RewardModelSettings

logger = logging.getLogger(__name__)


@dataclass
class ModelScores:
    scores: list[float]
    metrics: dict[str, float] = field(default_factory=dict)


class RewardModelService:
    """``slots``: one ``placement.ActorSlot`` per replica; ``sleep_mode``: the engines sleep between passes (GPU)."""

    def __init__(self, settings: RewardModelSettings, engine: Any, slots: Sequence[Any], *, use_gpu: bool | None = None,
                 sleep_mode: bool = False):
        """``engine``: the typed ``reward_model.rollout`` section its fleet starts from (``max_model_len``
        set to the reward model's max length: ``megarl.settings.reward_models.reward_engine``)."""
        import ray
        from transformers import AutoTokenizer

        from megarl.rollout import RolloutFleet

        self.settings, self.kind = settings, settings.kind
        self.default_sampling = {"temperature": 0.0, "max_tokens": int(engine.response_length)}
        self.tokenizer = AutoTokenizer.from_pretrained(settings.path, trust_remote_code=settings.trust_remote_code)
        self.fleet = self.router = None
        start = time.perf_counter()
        try:
            self.fleet = RolloutFleet(engine, settings.path, slots=slots, use_gpu=use_gpu,
                                      trust_remote_code=settings.trust_remote_code, sleep_mode=sleep_mode)
            backends = ray.get(self.fleet.call_async("serve_http"))
            self.address = backends[0]
            if len(backends) > 1:
                from megarl.rewards.reward_models.router import ReplicaRouter

                self.router = ray.remote(ReplicaRouter).options(num_cpus=0).remote(backends)
                self.address = ray.get(self.router.start.remote(backends[0].rsplit(":", 1)[0]))
            if self.fleet.sleep_mode:
                self.fleet.sleep(1)  # weights to host memory until the first reward pass
        except BaseException:
            self.close()
            raise
        self.judge = JudgeClient(self.address, settings.path, settings.judge, self.default_sampling) \
            if self.kind == GENERATIVE else None
        self._reported: dict[str, int] = {}
        logger.info("reward model (%s) %s: %d replica(s) ready in %.1f s, HTTP at %s", self.kind, settings.path,
                    self.fleet.num_replicas, time.perf_counter() - start, self.address)

    @property
    def scores_responses(self) -> bool:
        """A discriminative reward model: it scores responses itself (``score``)."""
        return self.kind == DISCRIMINATIVE

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """The engines awake for one reward pass (sleeping again after it, with sleep mode)."""
        if not self.fleet.sleep_mode:
            yield
            return
        self.fleet.wake_up()
        try:
            yield
        finally:
            self.fleet.sleep(1)

    def score(self, batch: ResponsesToScore) -> ModelScores:
        """A discriminative reward model's score of every response (its output at the last token)."""
        if self.kind != DISCRIMINATIVE:
            raise RuntimeError(f"{self.settings.path} is a judge (a causal LM): it does not score responses itself; "
                               "the reward function asks it (judge, reward_router_address)")
        start = time.perf_counter()
        tokenizer = self.tokenizer if self.settings.retemplate else None
        sequences, cut = model_sequences(batch, tokenizer, self.settings.max_length)
        parts = self.fleet.spread("classify", len(sequences), lambda chunk: ([sequences[i] for i in chunk],))
        scores = [s for part in parts for s in part]
        seconds = time.perf_counter() - start
        tokens = sum(len(s) for s in sequences)
        metrics = {"reward_model/score/mean": sum(scores) / max(len(scores), 1), "reward_model/truncated": cut,
                   "reward_model/input_tokens": tokens, "reward_model/tokens_per_s": tokens / max(seconds, 1e-9)}
        if cut:
            logger.warning("reward model: %d of %d inputs were longer than reward_model.max_length=%d tokens and "
                           "were cut on the right", cut, len(sequences), self.settings.max_length)
        return ModelScores(scores, metrics)

    def context(self, names: frozenset[str]) -> dict[str, Any]:
        """The reward-model arguments named in ``names`` that a reward function gets with every call."""
        offered = {"reward_router_address": self.address, "reward_model_tokenizer": self.tokenizer}
        if self.judge is not None:
            offered["judge"] = self.judge
        unknown = {"judge"} & (names - set(offered))
        if unknown:
            raise ValueError(f"the reward function takes judge, but {self.settings.path} is a discriminative reward "
                             "model (a judge is a causal LM); take rm_score instead")
        return {k: v for k, v in offered.items() if k in names}

    def client_metrics(self) -> dict[str, float]:
        """The judge client's requests and retries in this process since the last call."""
        if self.judge is None:
            return {}
        metrics = {}
        for name in ("requests", "retries"):
            total = self.judge.stats[name]
            metrics[f"reward/judge_{name}"] = total - self._reported.get(name, 0)
            self._reported[name] = total
        return metrics

    def close(self) -> None:
        import ray

        if self.router is not None:
            try:
                ray.get(self.router.stop.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - keep tearing down
                logger.warning("reward-model router did not stop cleanly: %s", exc)
            ray.kill(self.router)
            self.router = None
        if self.fleet is not None:
            self.fleet.shutdown()
            self.fleet = None
