"""The distillation teachers: frozen models on a pool of their own that score the student's samples.

Each teacher is a ``RolloutFleet`` (vLLM, or the hf backend) on its share of the teachers' pool
(``plan_teacher_pool``); it is never synced. ``log_probs`` hands every sample's prompt and whole
response (model and tool tokens: the teacher reads what the student read) to its teacher, which
scores the response tokens teacher-forced (``RolloutFleet.compute_log_probs``, vLLM's prompt
log-probs), and returns them as a ``[B, R]`` tensor aligned with the batch's responses. Only the
response mask's tokens enter the loss. With several teachers a sample goes to the one whose key is
its ``teacher_key`` field (``data_source`` by default); a sample whose value names no teacher is an
error that names the value and the teachers' keys.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from megarl.settings.distillation import DistillationSettings, scoring_engine

logger = logging.getLogger(__name__)


class Teachers:
    def __init__(self, settings: DistillationSettings, fleets: dict[str, Any], placement: Any = None):
        self.settings, self.fleets, self.placement = settings, fleets, placement

    @classmethod
    def start(cls, settings: DistillationSettings, use_gpu: bool) -> "Teachers":
        """Reserve the teachers' pool and start every teacher's replicas on it."""
        from megarl.cluster.placement import ClusterPlacement, plan_teacher_pool
        from megarl.rollout import RolloutFleet

        plan = plan_teacher_pool(settings.nnodes, settings.per_node,
                                 [(t.num_replicas, int(t.engine.tensor_model_parallel_size)) for t in settings.teachers])
        placement = ClusterPlacement(plan, use_gpu)
        teachers = cls(settings, {}, placement)
        try:
            slots, began = placement.pool_slots(), time.perf_counter()
            for teacher in settings.teachers:
                mine, slots = slots[:teacher.num_replicas], slots[teacher.num_replicas:]
                engine = scoring_engine(teacher.engine, settings.loss.topk if settings.loss.uses_topk else 0)
                teachers.fleets[teacher.key] = RolloutFleet(engine, teacher.model_path,
                                                            slots=mine, use_gpu=use_gpu, sleep_mode=False)
            logger.info("distillation: %s ready in %.1f s", ", ".join(
                f"teacher {t.model_path} ({t.num_replicas} replica(s) x TP{t.engine.tensor_model_parallel_size}"
                f"{'' if settings.single else f', key {t.key!r}'})" for t in settings.teachers),
                time.perf_counter() - began)
        except BaseException:
            teachers.close()
            raise
        return teachers

    def log_probs(self, batch: Any, fields: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The batch fields the loss reads: ``teacher_log_probs [B, R]`` of the batch's response tokens (0 at
        padding) and, for a top-k loss, ``teacher_topk_ids`` / ``teacher_topk_log_probs [B, R, k]`` (the
        teacher's k most likely tokens at each response position). ``fields`` are the step's per-sample fields
        (the teacher key's values)."""
        prompt_len = batch.prompt_length
        ids, mask = batch.input_ids, batch.attention_mask.bool()
        prompts = [ids[i, :prompt_len][mask[i, :prompt_len]].tolist() for i in range(len(ids))]
        responses = [ids[i, prompt_len:][mask[i, prompt_len:]].tolist() for i in range(len(ids))]
        rows_of = self._route(fields, len(ids))
        topk = self.settings.loss.topk if self.settings.loss.uses_topk else 0
        shape = batch.response_mask.shape
        result = {"teacher_log_probs": torch.zeros(shape, dtype=torch.float32)}
        if topk:
            result["teacher_topk_ids"] = torch.zeros(*shape, topk, dtype=torch.long)
            result["teacher_topk_log_probs"] = torch.zeros(*shape, topk, dtype=torch.float32)
        for key, rows in rows_of.items():
            scored = self.fleets[key].compute_log_probs([prompts[i] for i in rows], [responses[i] for i in rows], topk)
            for i, row in zip(rows, scored):
                if not topk:
                    result["teacher_log_probs"][i, :len(row)] = torch.tensor(row, dtype=torch.float32)
                    continue
                length = len(row.log_probs)
                result["teacher_log_probs"][i, :length] = torch.tensor(row.log_probs, dtype=torch.float32)
                if length:
                    result["teacher_topk_ids"][i, :length] = torch.tensor(row.topk_ids, dtype=torch.long)
                    result["teacher_topk_log_probs"][i, :length] = torch.tensor(row.topk_log_probs, dtype=torch.float32)
        return result

    def _route(self, fields: dict[str, Any], count: int) -> dict[str, list[int]]:
        if self.settings.single:
            return {"default": list(range(count))}
        name = self.settings.teacher_key
        if name not in fields:
            raise KeyError(f"distillation.teacher_key={name!r} is not a field of the samples; they have "
                           f"{sorted(fields)}")
        rows_of: dict[str, list[int]] = {}
        for i, value in enumerate(fields[name]):
            if str(value) not in self.fleets:
                raise KeyError(f"sample {i} has {name}={value!r}, which no teacher's key names (the teachers' keys: "
                               f"{sorted(self.fleets)}); add a teacher for it (distillation.teacher_models.<name>.key)")
            rows_of.setdefault(str(value), []).append(i)
        return rows_of

    def close(self) -> None:
        for fleet in self.fleets.values():
            fleet.shutdown()
        self.fleets = {}
        if self.placement is not None:
            self.placement.close()
            self.placement = None
