"""Run micro-batches through megatron-core's pipeline schedule, and share the results.

``run_micro_batches`` wraps ``get_forward_backward_func()``: the same call runs without a
pipeline (PP=1), with the 1F1B schedule (PP>1) and with the interleaved schedule (virtual
pipeline chunks). Micro-batches may differ in length and size (dynamic batching, per-micro-batch
trimming), so shapes are exchanged between stages (``variable_seq_lengths``) where the schedule
allows it.

The loss function runs on the last pipeline stage only; what it returns there is collected per
micro-batch. ``share_from_last_stage`` then gives every rank of the pipeline the same tensors.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

# forward(model_chunk, micro_batch) -> output tensor (logits / values on the last stage)
ForwardFn = Callable[[torch.nn.Module, Any], torch.Tensor]
# loss(micro_batch, output) -> (scalar to backpropagate, dict of tensors to collect)
LossFn = Callable[[Any, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def run_micro_batches(
    model_chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[Any],
    forward: ForwardFn,
    loss: LossFn,
    forward_only: bool,
    seq_length: int,
    micro_batch_size: int,
    variable_shapes: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Forward (and backward unless ``forward_only``) every micro-batch, in order.

    The scalar the loss returns is backpropagated as megatron's schedule does it: divided by the
    number of micro-batches (callers that want a plain sum scale it up; see ``actor``).
    Returns the loss function's dicts, one per micro-batch, on the last pipeline stage; an empty
    list on the other stages. With ``variable_shapes`` micro-batches may differ in shape (each
    shape is sent ahead of its tensor); without, all are ``[micro_batch_size, seq_length]``.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(model_chunks[0])
    config.variable_seq_lengths = variable_shapes
    if len(model_chunks) > 1:
        # The interleaved schedule sends activations and gradients to the same peer in one step
        # when pp=2; batched p2p pairs those messages by order and mixes them up (seen on gloo).
        # Unbatched p2p uses a separate communicator per direction, as megatron does whenever it
        # overlaps p2p communication (its recommended setting for the interleaved schedule).
        config.batch_p2p_comm = False
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if len(model_chunks) > 1 and len(micro_batches) % pp_size:
        raise ValueError(
            f"the interleaved (virtual) pipeline needs a number of micro-batches divisible by pp={pp_size}, "
            f"got {len(micro_batches)}; change the micro-batch size or the token budget"
        )

    def forward_step(data_iterator, model):
        micro_batch = next(data_iterator)
        return forward(model, micro_batch), partial(loss, micro_batch)

    # Each model chunk (virtual pipeline stage) walks the same micro-batches.
    iterators = [iter(micro_batches) for _ in model_chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=list(model_chunks),
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def share_from_last_stage(tensors: dict[str, torch.Tensor] | None, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Broadcast tensors from the last pipeline stage to every stage.

    ``tensors`` is the last stage's result (ignored elsewhere); ``like`` gives each name's shape
    and dtype, the same on every rank. Every TP rank of the last stage holds the same values, so
    each pipeline group broadcasts independently.
    """
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensors
    group = parallel_state.get_pipeline_model_parallel_group()
    source = parallel_state.get_pipeline_model_parallel_last_rank()
    is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    shared = {}
    for name, template in like.items():
        buffer = tensors[name].contiguous() if is_last else torch.empty_like(template)
        dist.broadcast(buffer, src=source, group=group)
        shared[name] = buffer
    return shared
