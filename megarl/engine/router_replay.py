"""MoE router replay: record which experts each token was routed to, and route by a given table.

verl's ``router_replay.mode`` (arXiv:2507.18071 calls it routing replay): in RL on a mixture of
experts, the passes that must agree (the rollout, the old-log-prob pass, the update) compute the
router's top-k independently, and small numerical differences flip near-tied choices. Replay
removes that noise from the importance ratio: ``R2`` records the old-log-prob pass's choices and the
update routes every token to the same experts; ``R3`` takes the choices the rollout engine made.
Only the discrete choice is replayed: the gate weights are still the live router's softmax/sigmoid
over the chosen experts, so the router keeps its gradient.

The table is a batch field, ``RLBatch.routed_experts [B, T, L, k]`` (int16; ``T`` the batch's
token columns, ``L`` the model's decoder layers (dense layers hold -1), ``k`` the router's top-k),
so it travels with the samples through mini-batches, micro-batches, packing and data
parallelism. -1 marks a token with no recorded choice (padding; in R3 tokens the engine did not
route): it keeps the live router's choice.

How a table reaches megatron's router: each ``TopKRouter`` takes a ``router_replay`` object whose
``get_replay_topk`` picks the top-k (megatron-core's hook). ``LayerReplay`` is that object. Before
a model chunk runs a micro-batch (``RoutingReplay.before_forward``), every router of the chunk gets
the micro-batch's rows in its own token order (sequence-first, this TP rank's share under sequence
parallelism, this CP rank's tokens). Activation recompute runs a router a second time during the
backward pass; the pipeline schedule runs the backward passes of a chunk in the order of its
forwards, so each router keeps a queue with one cursor for forwards and one for recomputes.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megarl.platform.distributed import collective_device

MODES = ("R2", "R3")  # verl's router_replay.mode values megarl's engine takes (besides off)
UNKNOWN = -1  # a token with no recorded choice
TABLE_DTYPE = torch.int16


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass (a recompute of checkpointed layers)."""
    return torch._C._current_graph_task_id() != -1


class LayerReplay:
    """One MoE layer's router hook: the live choice (no mode), recording it, or replaying a table."""

    def __init__(self, layer: int):
        self.layer = layer  # 0-based decoder layer: the column of the routing table
        self.mode: str | None = None  # None | "record" | "replay"
        self.recorded: list[torch.Tensor] = []  # record: [tokens, k] per forward, in forward order
        self.targets: list[torch.Tensor] = []  # replay: [tokens, k] per forward (-1 rows: live choice)
        self._forward = self._backward = 0
        # tokens replayed, and of those the ones the live router would route elsewhere: device tensors once counting
        # starts, so a forward never waits on the device; ``RoutingReplay.take_stats`` reads them once per update
        self.replayed = self.overridden = 0

    def reset(self, mode: str | None) -> None:
        self.mode, self.recorded, self.targets = mode, [], []
        self._forward = self._backward = 0

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron's hook: ``(values, indices)`` of the top-k of ``scores [tokens, experts]``."""
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.mode == "record" and not _in_backward():
            self.recorded.append(indices.detach().to("cpu", TABLE_DTYPE))
        elif self.mode == "replay":
            recompute = _in_backward()
            if recompute:
                target, self._backward = self.targets[self._backward], self._backward + 1
            else:
                target, self._forward = self.targets[self._forward], self._forward + 1
            if target.shape != indices.shape:
                raise RuntimeError(f"router replay of layer {self.layer + 1}: the table gives {tuple(target.shape)} "
                                   f"choices for a micro-batch of {tuple(indices.shape)}")
            target = target.to(indices.device, indices.dtype)
            known = target[:, :1] >= 0
            if not recompute:
                moved = (indices.sort(-1).values != target.sort(-1).values).any(-1, keepdim=True) & known
                self.replayed = self.replayed + known.sum()
                self.overridden = self.overridden + moved.sum()
            indices = torch.where(known, target, indices)
            values = scores.gather(1, indices)
        return values, indices


class RoutingReplay:
    """The ``LayerReplay`` hooks of one model's MoE routers, and the tables they read and write."""

    def __init__(self, chunks: Sequence[torch.nn.Module], config):
        """``chunks``: the model chunks the pipeline schedule runs (the objects ``before_forward`` gets);
        ``config``: their TransformerConfig."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter

        check_replayable(config)
        self.num_layers, self.topk, self.num_experts = config.num_layers, config.moe_router_topk, config.num_moe_experts
        self.chunk_layers: dict[int, list[LayerReplay]] = {}
        for chunk in chunks:
            hooks = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter) and module.layer_number is not None \
                        and module.layer_number <= self.num_layers:  # MTP layers' routers keep their live choice
                    module.router_replay = LayerReplay(module.layer_number - 1)
                    hooks.append(module.router_replay)
            self.chunk_layers[id(chunk)] = hooks
        self.sequence_parallel_rank = None
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if config.sequence_parallel and tp > 1:
            self.sequence_parallel_rank = (parallel_state.get_tensor_model_parallel_rank(), tp)
        self.mode: str | None = None
        self._record_into: torch.Tensor | None = None

    @property
    def layers(self) -> list[LayerReplay]:
        return [hook for hooks in self.chunk_layers.values() for hook in hooks]

    # ------------------------------------------------------------------ one schedule run
    def start(self, mode: str | None, batch, record_into: torch.Tensor | None = None) -> None:
        """Before a schedule run over micro-batches of ``batch``: ``"replay"`` its ``routed_experts``,
        ``"record"`` into ``record_into [B, T, L, k]`` (rows in the run's order), or None (live)."""
        if mode == "replay":
            check_table(batch.routed_experts, batch.input_ids.shape, self.num_layers, self.topk, self.num_experts)
        self.mode, self._record_into = mode, record_into
        for hook in self.layers:
            hook.reset(mode)

    def finish(self) -> None:
        self.mode, self._record_into = None, None
        for hook in self.layers:
            hook.reset(None)

    def before_forward(self, chunk: torch.nn.Module, micro_batch) -> None:
        """Queue ``micro_batch``'s rows for the routers of ``chunk`` (replay)."""
        if self.mode != "replay":
            return
        order = self._token_order(micro_batch.inputs.source)
        table = micro_batch.batch.routed_experts
        flat = table.reshape(-1, *table.shape[2:])  # [b * T, L, k]
        for hook in self.chunk_layers.get(id(chunk), ()):
            rows = flat[order.clamp(min=0), hook.layer].clone()
            rows[order < 0] = UNKNOWN
            hook.targets.append(rows)

    def after_forward(self, chunk: torch.nn.Module, micro_batch) -> None:
        """Write what the routers of ``chunk`` chose for ``micro_batch`` into the record table."""
        if self.mode != "record":
            return
        order = self._token_order(micro_batch.inputs.source).cpu()  # the record table is on the host
        real = order >= 0
        columns = micro_batch.batch.input_ids.shape[1]
        rows = torch.as_tensor(micro_batch.rows, dtype=torch.long)[order[real] // columns]
        tokens = order[real] % columns
        for hook in self.chunk_layers.get(id(chunk), ()):
            chosen = hook.recorded.pop()
            self._record_into[rows, tokens, hook.layer] = chosen[real]

    def _token_order(self, source: torch.Tensor) -> torch.Tensor:
        """``source [rows, S]`` (the micro-batch token at each model position, -1 for padding) in the
        order a router sees its tokens: sequence-first, this rank's share under sequence parallelism."""
        order = source.t()
        if self.sequence_parallel_rank is not None:
            rank, size = self.sequence_parallel_rank
            order = order.chunk(size)[rank]
        return order.reshape(-1)

    def gather_record(self, table: torch.Tensor) -> torch.Tensor:
        """The whole table on every rank: pipeline stages hold their own layers, TP ranks (sequence
        parallelism) and CP ranks their own tokens; each entry is known on one of them."""
        from megatron.core import parallel_state

        groups = []
        if parallel_state.get_model_parallel_group() is not None and dist.get_world_size(
                parallel_state.get_model_parallel_group()) > 1:
            groups.append(parallel_state.get_model_parallel_group())
        if parallel_state.get_context_parallel_world_size() > 1:
            groups.append(parallel_state.get_context_parallel_group())
        if not groups:
            return table
        for layer in range(table.shape[2]):  # a layer at a time: the host table may be large; NCCL reduces on the GPU
            wide = table[:, :, layer].to(collective_device(groups[0]), torch.int32)  # gloo reduces no int16
            for group in groups:
                dist.all_reduce(wide, op=dist.ReduceOp.MAX, group=group)
            table[:, :, layer] = wide.to(table.device, TABLE_DTYPE)
        return table

    def reset_stats(self) -> None:
        for hook in self.layers:
            hook.replayed = hook.overridden = 0

    def take_stats(self) -> dict[str, float]:
        """Since the last call, over every rank: the share of replayed routing choices (token x layer) that the
        live router would have made differently (``actor/router_replay_overridden``), and how many were replayed."""
        place = collective_device() if dist.is_initialized() else torch.device("cpu")
        counts = torch.stack([torch.as_tensor(sum(getattr(h, name) for h in self.layers), dtype=torch.float64).to(place)
                              for name in ("replayed", "overridden")])
        self.reset_stats()
        if dist.is_initialized():
            dist.all_reduce(counts)
        replayed, overridden = counts.tolist()
        return {"router_replay_overridden": overridden / replayed if replayed else 0.0,
                "router_replay_tokens": replayed}

    def empty_table(self, batch) -> torch.Tensor:
        """On the host: the recorded choices go there (``LayerReplay``) and travel on with the batch."""
        return torch.full((*batch.input_ids.shape, self.num_layers, self.topk), UNKNOWN, dtype=TABLE_DTYPE)


def check_replayable(config) -> None:
    """A ValueError unless megatron's router consults the replay hook under ``config``."""
    if not config.num_moe_experts:
        raise ValueError("router replay (router_replay.mode) needs a mixture-of-experts model; this one has no router")
    if config.moe_router_fusion:
        raise ValueError("router replay cannot run with the fused router (moe_router_fusion): Transformer Engine's "
                         "fused top-k takes no given choice; turn moe_router_fusion off")
    if config.moe_router_load_balancing_type == "sinkhorn":
        raise ValueError("router replay cannot run with sinkhorn routing, which takes no given choice")


def check_table(table: torch.Tensor | None, tokens_shape: torch.Size, num_layers: int, topk: int, num_experts: int) -> None:
    """A routing table fits the batch and the model, or a ValueError naming what does not."""
    if table is None:
        raise ValueError("router replay needs batch.routed_experts: the old-log-prob pass records it (R2) or the "
                         "rollout returns it (R3)")
    want = (*tokens_shape, num_layers, topk)
    if tuple(table.shape) != want:
        raise ValueError(f"routed_experts {tuple(table.shape)} must be [batch, tokens, layers, top-k] = {want} for this "
                         "model (was it recorded with another model or top-k?)")
    if bool((table >= num_experts).any()) or bool((table < UNKNOWN).any()):
        raise ValueError(f"routed_experts names experts outside 0..{num_experts - 1} (-1: no recorded choice)")
