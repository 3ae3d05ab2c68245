"""The update loop shared by the actor and the critic: mini-batches, micro-batches, optimizer steps.

Loss scaling, so that a mini-batch's loss (and gradient) does not depend on how it is split:
every micro-batch's loss is aggregated with the totals of the whole mini-batch over all
data-parallel ranks (``agg_loss``'s ``batch_num_tokens`` / ``global_batch_size``, from
``global_batch_info``). The sum of those pieces over micro-batches and ranks is exactly the loss
of the mini-batch computed at once. Two factors turn that sum into the gradient megatron
accumulates: ``dp_size`` (DDP averages gradients over data-parallel ranks; ``agg_loss``
multiplies by it) and the number of micro-batches (megatron's schedule divides each micro-batch's
loss by it; the loss functions multiply by ``MicroBatch.count``). Loss metrics are collected
divided by ``dp_size``, so their sum over ranks is the mini-batch's loss.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from megarl.engine.batch import RLBatch
from megarl.engine.batching import mini_batches
from megarl.engine.optimizer import current_lr, guarded_step
from megarl.engine.runner import ModelRunner
from megarl.engine.schedule import LossFn
from megarl.engine.settings import BatchSettings

logger = logging.getLogger(__name__)


def global_batch_info(runner: ModelRunner, batch: RLBatch) -> dict:
    """``agg_loss``'s totals of a mini-batch over all data-parallel ranks."""
    mask = batch.response_mask.float()
    totals = runner.dp_sum(torch.stack([mask.sum(), (mask.sum(-1) > 0).float().sum()]))
    return {"dp_size": runner.dp_size, "batch_num_tokens": totals[0], "global_batch_size": totals[1]}


def run_update(
    role: str,
    runner: ModelRunner,
    optimizer,
    scheduler,
    batch: RLBatch,
    train: BatchSettings,
    make_loss: Callable[[dict], LossFn],
    sums: Sequence[str],
    token_means: Sequence[str],
    maxes: Sequence[str] = (),
    routing: str | None = None,
) -> dict[str, float]:
    """``train.epochs`` passes over ``batch`` in mini-batches, one (guarded) optimizer step each.

    ``make_loss(global_batch_info)`` gives the micro-batch loss of one mini-batch; it collects
    ``sums`` (summed), ``token_means`` (times the micro-batch's ``tokens``) and ``maxes`` (the
    micro-batch's largest value). Returns ``<role>/<name>`` metrics averaged over mini-batches
    (``maxes``: the largest), plus ``grad_norm`` (mean over the steps taken), ``lr`` (the learning
    rate used), ``optimizer_steps`` (tried) and ``skipped_steps`` (of those, skipped for a non-finite
    gradient norm). The LR schedule advances once per call (one trainer step), as verl's does.
    ``routing="replay"``: the MoE routers route by ``batch.routed_experts`` (router replay).
    """
    for chunk in runner.chunks:
        chunk.train()
    lr = current_lr(optimizer)
    per_mini_batch: dict[str, list[float]] = {}
    largest: dict[str, float] = {}
    grad_norms, skipped = [], 0
    names = [*sums, *token_means, "tokens"]
    steps = mini_batches(len(batch), train.mini_batch_size or len(batch), train.epochs, train.shuffle, train.seed)
    if runner.dp_max(len(steps)) != len(steps) or runner.dp_max(-len(steps)) != -len(steps):
        raise ValueError(
            f"data-parallel ranks would take different numbers of optimizer steps (this rank: {len(steps)} for "
            f"{len(batch)} samples); give every rank the same number of samples"
        )
    for indices in steps:
        mini_batch = batch.select(indices)
        loss = make_loss(global_batch_info(runner, mini_batch))
        for chunk in runner.chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        collected = runner.run(mini_batch, runner.split(mini_batch, train), loss, forward_only=False,
                               packed=train.use_remove_padding, routing=routing)
        stepped, grad_norm = guarded_step(optimizer)
        if stepped:
            grad_norms.append(grad_norm)
        else:
            skipped += 1
            logger.warning("%s: skipped an optimizer step: the gradient norm is %s", role, grad_norm)
        for name, value in runner.reduce(collected, names, token_means).items():
            per_mini_batch.setdefault(name, []).append(value)
        for name, value in runner.reduce_max(collected, maxes).items():
            largest[name] = max(largest.get(name, value), value)
    optimizer.zero_grad()  # the fp32 main grads (bf16 models) are dead until the next update: free them
    scheduler.step(1)
    metrics = {f"{role}/{name}": sum(values) / len(values) for name, values in per_mini_batch.items()}
    metrics.update({f"{role}/{name}": value for name, value in largest.items()})
    metrics[f"{role}/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics[f"{role}/lr"] = lr
    metrics[f"{role}/optimizer_steps"] = float(len(steps))
    metrics[f"{role}/skipped_steps"] = float(skipped)
    return metrics
