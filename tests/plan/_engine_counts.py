"""Real engines on 4 ranks (torchrun, gloo), counted and measured next to the planner's numbers.

    torchrun --nproc-per-node 4 _engine_counts.py WORK_DIR

For each layout: build the actor (mcore DDP + megatron's distributed optimizer), take one
update under saved-tensor hooks, then count on every rank the bytes the engine allocated
(DDP's parameter and gradient buffers, the optimizer's state tensors) and the peak of the bytes
autograd kept for backward, and compute the planner's figures for that same rank. Rank 0 writes
every rank's pair to ``WORK_DIR/counts.pt``; the test compares them.

Activations are measured with ``torch.autograd.graph.saved_tensors_hooks`` (the counter of
tests/engine/_memory_worker.py): every tensor autograd saves for backward is counted once per
storage while it is alive, parameters excluded. On CPU there are no allocator statistics, and
resident-set sizes move with the allocator's caching and other processes; the saved tensors are
exactly the activations a GPU's allocator would hold.
"""
from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "engine"))
from _memory_worker import SavedActivations  # noqa: E402

from megarl.engine import MegatronActor  # noqa: E402
from megarl.engine.batch import RLBatch  # noqa: E402
from megarl.engine.settings import ActorSettings, BatchSettings, OptimizerSettings, PolicyLossSettings  # noqa: E402
from megarl.models import ParallelLayout, build_model, load_hf_config  # noqa: E402
from megarl.platform import destroy_model_parallel, init_distributed, initialize_model_parallel  # noqa: E402
from megarl.plan.activations import MicroBatch, Recompute  # noqa: E402
from megarl.plan.buffers import trained_bytes  # noqa: E402
from megarl.plan.memory import activation_bytes  # noqa: E402
from megarl.plan.model import ModelFacts  # noqa: E402

PROMPT, RESPONSE, MICRO, SAMPLES = 24, 40, 2, 4  # full-length samples: every micro-batch is 2 x 64 tokens


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # a directory under WORK_DIR
    layout: ParallelLayout
    recompute: dict
    entropy_coeff: float = 0.0


CASES = (
    Case("tiny TP1", "llama_tied", ParallelLayout(), {}, entropy_coeff=0.01),
    Case("tiny TP2+SP", "llama_tied", ParallelLayout(tp=2, sequence_parallel=True), {}),
    Case("tiny TP2+SP full recompute", "llama_tied", ParallelLayout(tp=2, sequence_parallel=True),
         {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}),
    Case("tiny PP2", "llama_small_tied", ParallelLayout(pp=2), {}),
    Case("tiny PP2 selective", "llama_small_tied", ParallelLayout(pp=2),
         {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}),
    Case("tiny MoE EP2", "qwen3_moe", ParallelLayout(ep=2), {}),
    Case("tiny CP2", "llama_tied", ParallelLayout(cp=2), {}),
    Case("SmolLM2 shape TP1", "smollm2-135m", ParallelLayout(), {}),
    Case("SmolLM2 shape PP2", "smollm2-135m", ParallelLayout(pp=2), {}),
)


def setup(layout: ParallelLayout) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, seed=3)


def local_batch(rank: int) -> RLBatch:
    g = torch.Generator().manual_seed(rank)
    shape = (SAMPLES, RESPONSE)
    batch = RLBatch.from_parts(torch.randint(3, 500, (SAMPLES, PROMPT), generator=g), torch.ones(SAMPLES, PROMPT, dtype=torch.long),
                               torch.randint(3, 500, shape, generator=g), torch.ones(shape, dtype=torch.long),
                               advantages=torch.randn(shape, generator=g), returns=torch.zeros(shape), values=torch.zeros(shape))
    return batch.with_fields(old_log_probs=torch.full(shape, -6.0), ref_log_probs=torch.full(shape, -6.0))


def settings(entropy_coeff: float) -> ActorSettings:
    train = BatchSettings(mini_batch_size=SAMPLES, micro_batch_size=MICRO)
    loss = PolicyLossSettings(entropy_coeff=entropy_coeff, use_kl_loss=True)
    return ActorSettings(train=train, log_prob=BatchSettings(micro_batch_size=MICRO), loss=loss,
                         optim=OptimizerSettings(lr=1e-4))


def storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def engine_counts(actor: MegatronActor) -> dict:
    buffers = [b for chunk in actor.model for b in chunk.buffers + chunk.expert_parallel_buffers]
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    state = [v for o in optimizers for s in o.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    masters = [p for o in optimizers for group in getattr(o, "shard_fp32_from_float16_groups", []) for p in group]
    return {"params": storage_bytes(b.param_data for b in buffers if b.param_data is not None),
            "param_tensors": sum(p.numel() * p.element_size() for chunk in actor.model for p in chunk.parameters()),
            "grads": storage_bytes(b.grad_data for b in buffers), "optimizer": storage_bytes(state + masters)}


def run_case(case: Case, work: Path) -> dict:
    from megatron.core import parallel_state as ps

    setup(case.layout)
    path = work / case.model
    actor = MegatronActor(build_model(path, case.layout, "actor", config_overrides=case.recompute, load_weights=False),
                          settings(case.entropy_coeff))
    counter = SavedActivations(p for chunk in actor.model for p in chunk.parameters())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        actor.update_policy(local_batch(ps.get_data_parallel_rank()))  # the same samples on TP, PP and CP peers
    measured = engine_counts(actor) | {"activations": counter.peak}

    model = ModelFacts(load_hf_config(path))
    stage = ps.get_pipeline_model_parallel_rank()
    dp, edp = ps.get_data_parallel_world_size(with_context_parallel=True), ps.get_expert_data_parallel_world_size()
    state = trained_bytes(model.stage_params(case.layout, stage), 4, dp, edp, True,
                          ps.get_data_parallel_rank(with_context_parallel=True), ps.get_expert_data_parallel_rank())
    mb = MicroBatch(MICRO, PROMPT + RESPONSE, RESPONSE)
    activations, _ = activation_bytes(model, case.layout, stage, mb, SAMPLES // MICRO, Recompute.from_overrides(case.recompute),
                                      case.entropy_coeff != 0, False, 4, "local", case.layout.cp)
    planned = {"params": state.params, "grads": state.grads, "optimizer": state.optimizer, "activations": activations,
               "param_tensors": model.stage_params(case.layout, stage).numel * 4}
    return {"rank": dist.get_rank(), "stage": stage, "measured": measured, "planned": planned}


def main() -> None:
    work = Path(sys.argv[1])
    init_distributed()
    torch.set_num_threads(1)
    results = {}
    try:
        for case in CASES:
            mine = run_case(case, work)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            results[case.name] = gathered
    except Exception:
        traceback.print_exc()
        raise
    if dist.get_rank() == 0:
        torch.save(results, work / "counts.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
