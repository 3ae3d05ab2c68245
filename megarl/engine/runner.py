"""Run megatron-core model chunks over an ``RLBatch``: micro-batching, packing, the pipeline
schedule, and per-token outputs returned in the original sample order on every rank.

The actor, critic and reference are thin layers over a ``ModelRunner``: they say what to
compute from the last stage's output (log-probs, values, a loss) and the runner does the rest.

Data parallelism: each rank passes the samples of its own data-parallel replica (the same
samples on all ranks of one model-parallel group, CP ranks included). All data-parallel ranks run
the same number of micro-batches (MoE expert parallelism exchanges tokens in every forward, so a
rank with fewer forwards would hang the others).

Context parallelism (CP > 1, packed micro-batches only): every CP rank runs its share of each
sample's tokens (``packing``); the per-token results are summed over the CP group, so each CP rank
computes the same losses and metrics from complete ``[B, R]`` tensors. The gradient that reaches a
rank is that of its own tokens; megatron's schedule multiplies each loss by CP and its DDP averages
gradients over DP x CP, which together give the gradient of the loss once. A token budget
(``use_dynamic_bsz``) is per device, so a CP group's micro-batch holds ``CP x`` it, as in verl.

Vision-language models (``megarl.models.VisionLanguageModel``): every micro-batch gets M-RoPE positions
``[3, rows, S]`` (on every pipeline stage), and, on the first stage, its samples' pixel inputs in the
layout's order and the mask of the prompts' image tokens (``packing.with_vision``). A text model's path is
unchanged; a batch with images for a text model is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megarl.engine.batch import RLBatch
from megarl.engine.batching import fixed_micro_batches, restore_order, token_budget_micro_batches
from megarl.engine.packing import (ModelInputs, gather_response, packed_lengths, packed_row, pad_to, padded_rows,
                                  scatter_response, with_vision)
from megarl.engine.schedule import run_micro_batches, share_from_last_stage
from megarl.engine.settings import BatchSettings
from megarl.engine.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs
from megarl.platform.distributed import collective_device


@dataclass
class MicroBatch:
    batch: RLBatch  # the micro-batch's samples, padded layout
    inputs: ModelInputs  # what the model sees
    count: int  # micro-batches in this schedule run (the schedule divides losses by it)
    rows: list[int] = field(default_factory=list)  # the samples' indices in the batch the run was given

    def response_targets(self) -> torch.Tensor:
        """``[n]`` the ids of this rank's real response tokens (``gather_response`` order)."""
        return self.inputs.targets[self.inputs.response_here]

    def to_response(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token results in ``gather_response`` order as complete ``[B, R]`` (0 at padding)."""
        return scatter_response(values, self.inputs)


class ModelRunner:
    """Model chunks (one per virtual pipeline stage) of one rank, and how to run batches through them."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module]):
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        if not model_chunks:
            raise ValueError("no model chunks given; build the model first (megarl.models.build_model)")
        self.chunks = list(model_chunks)
        self.config = get_model_config(self.chunks[0])
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.cp_group = parallel_state.get_context_parallel_group() if self.cp_size > 1 else None
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.vision = _vision_tower(self.chunks[0])  # the tower's dims for a vision-language model, else None
        self.replay = None  # a RoutingReplay when the model's MoE routers replay recorded choices (router_replay)

    # ------------------------------------------------------------------ micro-batches
    def split(self, batch: RLBatch, settings: BatchSettings) -> list[list[int]]:
        """Micro-batches (sample indices of ``batch``), as many on every data-parallel rank."""
        lengths = batch.sequence_lengths()
        packed, budget = settings.use_remove_padding, settings.max_token_len * self.cp_size
        if settings.use_dynamic_bsz:
            needed = len(token_budget_micro_batches(lengths, budget, packed=packed))
        else:
            needed = -(-len(batch) // settings.micro_batch_size)
        count = self.dp_max(needed)
        if len(self.chunks) > 1:  # the interleaved schedule runs micro-batches in groups of pp
            count = -(-count // self.pp_size) * self.pp_size
        if count > len(batch):
            raise ValueError(
                f"this rank has {len(batch)} samples but the step needs {count} micro-batches (the most of any "
                "data-parallel rank, rounded to a multiple of pp with a virtual pipeline); give every rank more samples"
            )
        if settings.use_dynamic_bsz:
            return token_budget_micro_batches(lengths, budget, count=count, packed=packed)
        return fixed_micro_batches(len(batch), settings.micro_batch_size, count=count)

    def dp_max(self, value: int) -> int:
        if self.dp_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.long, device=collective_device(self.dp_group))
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(tensor.item())

    def dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dp_size == 1:
            return tensor.clone()
        summed = tensor.to(collective_device(self.dp_group), copy=True)
        dist.all_reduce(summed, group=self.dp_group)
        return summed.to(tensor.device)

    def reduce(self, collected: list[dict[str, torch.Tensor]], names: list[str], token_means: Sequence[str] = ()) -> dict[str, float]:
        """Sum per-micro-batch values over micro-batches and data-parallel ranks, the same floats on
        every rank; names in ``token_means`` are then divided by the summed ``tokens``."""
        local = torch.zeros(len(names), dtype=torch.float64, device=collective_device(self.dp_group))
        for values in collected:  # empty except on the last pipeline stage
            local += torch.stack([values[name].double() for name in names]).to(local.device)
        totals = share_from_last_stage({"sums": self.dp_sum(local)}, {"sums": local})["sums"]
        result = dict(zip(names, totals.tolist()))
        tokens = max(result.pop("tokens", 1.0), 1.0)
        for name in token_means:
            result[name] /= tokens
        return result

    def reduce_max(self, collected: list[dict[str, torch.Tensor]], names: Sequence[str]) -> dict[str, float]:
        """The largest per-micro-batch value of each name over micro-batches and data-parallel ranks,
        the same floats on every rank."""
        if not names:
            return {}
        local = torch.full((len(names),), float("-inf"), dtype=torch.float64, device=collective_device(self.dp_group))
        for values in collected:  # empty except on the last pipeline stage
            local = torch.maximum(local, torch.stack([values[name].double() for name in names]).to(local.device))
        if self.dp_size > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.dp_group)
        return dict(zip(names, share_from_last_stage({"maxes": local}, {"maxes": local})["maxes"].tolist()))

    # ------------------------------------------------------------------ running
    def forward(self, model: torch.nn.Module, micro_batch: MicroBatch) -> torch.Tensor:
        """The model on one micro-batch: ``[rows, S, V/tp]`` logits (or values) on the last stage."""
        inputs = micro_batch.inputs
        extra = {} if inputs.packed_seq_params is None else {"packed_seq_params": inputs.packed_seq_params}
        if self.replay is not None:
            self.replay.before_forward(model, micro_batch)
        if inputs.image_mask is not None and _unwrap(model).pre_process:  # pixels go to the first stage only
            extra.update(pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                         image_mask=inputs.image_mask)
        output = model(input_ids=inputs.tokens, position_ids=inputs.position_ids, attention_mask=None, **extra)
        if self.replay is not None:
            self.replay.after_forward(model, micro_batch)
        return output

    def model_inputs(self, batch: RLBatch, parts: list[list[int]], packed: bool) -> list[MicroBatch]:
        """The micro-batches of ``parts``, packed or padded. With a virtual pipeline every micro-batch
        has one shape: megatron-core 0.16.1 exchanges the shapes of variable-size micro-batches with
        batched p2p, whose messages the interleaved schedule mixes up when the previous and next stage
        are the same rank (pp=2)."""
        multiple = self.tp_size if self.config.sequence_parallel else 1
        if self.cp_size > 1 and not packed:
            raise ValueError("context parallelism runs on packed micro-batches: set <role>.megatron.use_remove_padding=True")
        if batch.has_images() and self.vision is None:
            raise ValueError("the batch carries images (multi_modal_inputs) but the model is a text model; "
                             "train a vision-language checkpoint (Qwen2.5-VL / Qwen3-VL) or drop the images")
        pieces = [batch.select(part) for part in parts]
        if packed:
            total = None
            if len(self.chunks) > 1:
                total = max(sum(packed_lengths(piece, self.cp_size, multiple)) for piece in pieces)
            micro_batches = [MicroBatch(piece, packed_row(piece, self.cp_size, self.cp_rank, self.cp_group, multiple,
                                                          total), len(parts), part) for piece, part in zip(pieces, parts)]
        else:
            micro_batches = [MicroBatch(piece, padded_rows(piece, multiple), len(parts), part)
                             for piece, part in zip(pieces, parts)]
        if self.vision is not None:
            for mb in micro_batches:
                mb.inputs = with_vision(mb.inputs, mb.batch, self.vision.image_token_id, self.vision.spatial_merge_size)
        if packed:
            return micro_batches
        if len(self.chunks) > 1:
            rows = max(len(mb.batch) for mb in micro_batches)
            length = max(mb.inputs.tokens.shape[1] for mb in micro_batches)
            for mb in micro_batches:
                mb.inputs = pad_to(mb.inputs, rows, length)
        return micro_batches

    def run(
        self,
        batch: RLBatch,
        parts: list[list[int]],
        loss: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        forward_only: bool,
        packed: bool = True,
        routing: str | None = None,
        record_into: torch.Tensor | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Run ``parts`` of ``batch`` (packed or padded) through the schedule; the loss function's dicts
        on the last stage. ``routing`` (router replay): "replay" routes by ``batch.routed_experts``,
        "record" writes the routers' choices into ``record_into``; None: the live choice."""
        micro_batches = self.model_inputs(batch, parts, packed)
        if routing is not None:
            if self.replay is None:
                raise ValueError(f"routing={routing!r} needs router replay set up on this model (router_replay.mode)")
            self.replay.start(routing, batch, record_into)
        try:
            return run_micro_batches(
                self.chunks,
                micro_batches,
                forward=self.forward,
                loss=loss,
                forward_only=forward_only,
                seq_length=max(mb.inputs.global_length for mb in micro_batches),
                micro_batch_size=max(mb.inputs.tokens.shape[0] for mb in micro_batches),
                variable_shapes=len(self.chunks) == 1,
            )
        finally:
            if routing is not None:
                self.replay.finish()

    @torch.no_grad()
    def infer(
        self,
        batch: RLBatch,
        settings: BatchSettings,
        compute: Callable[[MicroBatch, torch.Tensor], dict[str, torch.Tensor]],
        names: Sequence[str],
        routing: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-token ``[B, R]`` fp32 outputs ``names`` of ``compute(micro_batch, output)``, on every rank.

        Positions that are padding in the response (attention mask 0) hold 0. With ``routing="record"``
        the result also holds ``routed_experts``, the routers' choices (``RoutingReplay``).
        """
        for chunk in self.chunks:
            chunk.eval()
        parts = self.split(batch, settings)
        zero = torch.zeros((), dtype=torch.float32)
        table = self.replay.empty_table(batch) if routing == "record" else None
        collected = self.run(batch, parts, lambda mb, output: (zero.clone(), compute(mb, output)), forward_only=True,
                             packed=settings.use_remove_padding, routing=routing, record_into=table)
        result = None
        if self.is_last_stage:
            order = restore_order(parts)
            result = {name: torch.cat([c[name] for c in collected])[order].float() for name in names}
        like = {name: torch.empty(batch.response_mask.shape, dtype=torch.float32, device=batch.response_mask.device)
                for name in names}
        shared = share_from_last_stage(result, like)
        if table is not None:
            shared = {**shared, "routed_experts": self.replay.gather_record(table)}
        return shared


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from megarl.models.loading import unwrap

    return unwrap(model)


def _vision_tower(chunk: torch.nn.Module):
    """The vision dims (``ModelDims.vision``) of a vision-language model chunk; None for a text model."""
    from megarl.models.vision_model import VisionLanguageModel

    model = _unwrap(chunk)
    return model.tower if isinstance(model, VisionLanguageModel) else None


def response_logits(output: torch.Tensor, micro_batch: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """``[n, V/tp]``: the logits that score this rank's real response tokens, divided by the temperature."""
    logits = gather_response(output, micro_batch.inputs)
    return logits / temperature if temperature != 1.0 else logits


def response_log_probs(
    output: torch.Tensor, micro_batch: MicroBatch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[b, R]`` of the response tokens (and their entropy) from ``[rows, S, V/tp]`` logits.

    Only the positions that score real response tokens go through the softmax; padding gives 0.
    """
    logits = response_logits(output, micro_batch, temperature)
    log_probs = micro_batch.to_response(vocab_parallel_log_probs(logits, micro_batch.response_targets()))
    entropy = micro_batch.to_response(vocab_parallel_entropy(logits)) if with_entropy else None
    return log_probs, entropy


def response_values(output: torch.Tensor, micro_batch: MicroBatch) -> torch.Tensor:
    """Values ``[b, R]`` of the states before each response token, from a ``[rows, S, 1]`` value head."""
    if output.dim() == 3:
        if output.shape[-1] != 1:
            raise ValueError(f"a critic must output one value per token, got a last dimension of {output.shape[-1]}")
        output = output.squeeze(-1)
    return micro_batch.to_response(gather_response(output.float(), micro_batch.inputs))
