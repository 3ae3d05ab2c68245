"""Engine scenarios in worker processes; run by tests/engine/test_engine*.py. It measures, the tests assert.

    python _engine_worker.py single WORK_DIR                            # one process, TP=PP=DP=1
    torchrun --nproc-per-node 2 _engine_worker.py layouts WORK_DIR      # TP=2+SP, PP=2, DP=2, EP=2, checkpoints

WORK_DIR holds the tiny checkpoints and ``batch.pt`` (written by the test process). Results go to
``WORK_DIR/<mode>.pt`` (rank 0): per scenario, the engine's log-probs, metrics and the weights
after training, gathered into full Hugging Face tensors with the bridge's exporter.
"""
from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _engine_data as _data  # noqa: E402
import _padded_scenario as _padded  # noqa: E402

from megarl.engine import (  # noqa: E402
    BatchSettings,
    CriticSettings,
    MegatronActor,
    MegatronCritic,
    MegatronReference,
    OptimizerSettings,
    data_parallel_shard,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megarl.models import ParallelLayout, build_model, gather_hf_tensors  # noqa: E402
from megarl.platform import destroy_model_parallel, init_distributed, initialize_model_parallel  # noqa: E402


def setup(layout: ParallelLayout) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel(tp=layout.tp, pp=layout.pp, ep=layout.ep, vpp=layout.vpp if layout.vpp > 1 else None, seed=7)


def dp_coords() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def weights(models, model_dir, layout, role="actor") -> dict:
    """Full HF-named tensors on rank 0 ({} elsewhere)."""
    return dict(gather_hf_tensors(models, model_dir, layout, role))


def gather_dp(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate per-data-parallel-rank results in rank order (every rank gets the whole)."""
    from megatron.core import parallel_state

    size = parallel_state.get_data_parallel_world_size()
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_data_parallel_group())
    return torch.cat(parts)


def optimizer_moments(actor, model_dir, layout) -> dict:
    """Adam's exp_avg / exp_avg_sq as full HF-named tensors on rank 0 (data-parallel size 1 only).

    Reads each parameter's state from megatron's distributed optimizer and places it like the
    parameter itself, using the bridge's shard layout.
    """
    from megarl.models.loading import chunk_parameters, this_rank_shards

    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    pieces = []
    for spec, param in chunk_parameters(actor.model, this_rank_shards(model_dir, layout, "actor", "local")):
        if not spec.primary:
            continue
        owner = next(o for o in optimizers if param in o.model_param_group_index_map)
        state = owner._get_main_param_and_optimizer_states(param)
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state[key].detach().reshape(param.shape)
            for piece in spec.pieces:
                pieces.append((f"{key}/{piece.hf_name}", piece.hf_shape, piece.hf_slice, moment[piece.megatron_slice].clone()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    full = {}
    for rank_pieces in gathered:
        for name, shape, hf_slice, values in rank_pieces:
            full.setdefault(name, torch.zeros(shape))[hf_slice] = values
    return full


def adam_steps(actor) -> list[float]:
    """The distinct Adam step counts over all parameters of this rank."""
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    return sorted({float(state["step"]) for o in optimizers for state in o.optimizer.state.values()})


def actor_for(work: Path, model: str, layout: ParallelLayout, settings):
    return MegatronActor(build_model(work / model, layout, "actor"), settings)


# ---------------------------------------------------------------------------- one process
def single(work: Path, data: dict) -> dict:
    results = {}
    layout = ParallelLayout()
    setup(layout)
    batch, dense = data["batches"][_data.DENSE], work / _data.DENSE

    actor = actor_for(work, _data.DENSE, layout, _data.actor_settings())
    log_probs, entropy = actor.compute_log_prob(batch, with_entropy=True)
    results["log_probs"] = {"log_probs": log_probs, "entropy": entropy}

    reference = MegatronReference(build_model(dense, layout, "ref"), BatchSettings(micro_batch_size=5))
    results["reference"] = {
        "log_probs": reference.compute_ref_log_prob(batch),
        "trainable": sum(p.requires_grad for chunk in reference.runner.chunks for p in chunk.parameters()),
    }

    splits = {
        "mbs1": _data.actor_settings(micro_batch_size=1),
        "mbs2": _data.actor_settings(micro_batch_size=2),
        "mbs4": _data.actor_settings(micro_batch_size=4),
        "dynamic": _data.actor_settings(micro_batch_size=None, use_dynamic_bsz=True, max_token_len=24),
        "recompute": _data.actor_settings(micro_batch_size=2),
        "two_mini_batches": _data.actor_settings(micro_batch_size=2, mini_batch_size=4),
        "seq_mean": _data.actor_settings(micro_batch_size=1, loss=_data.SEQ_MEAN_LOSS),
        "decoupled_tis": _data.actor_settings(micro_batch_size=2),
        "bypass_reinforce": _data.actor_settings(micro_batch_size=2, loss=_data.BYPASS_LOSS),
        "token_sum": _data.actor_settings(micro_batch_size=2, loss=_data.TOKEN_SUM_LOSS),
        "sapo": _data.actor_settings(micro_batch_size=2, loss=_data.SAPO_LOSS),
    }
    full_recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    for name, settings in splits.items():
        overrides = full_recompute if name == "recompute" else None
        actor = MegatronActor(build_model(dense, layout, "actor", config_overrides=overrides), settings)
        metrics = actor.update_policy(_data.with_importance_weights(batch) if name == "decoupled_tis" else batch)
        results[f"update/{name}"] = {"metrics": metrics, "weights": weights(actor.model, dense, layout)}
    # trainer.ref_update_freq: the reference takes the trained actor's weights (DDP-wrapped chunks)
    reference.take_weights(actor.model)
    results["reference/refreshed"] = {"log_probs": reference.compute_ref_log_prob(batch),
                                      "actor_log_probs": actor.compute_log_prob(batch)[0]}

    moe = work / _data.MOE
    actor = actor_for(work, _data.MOE, layout, _data.actor_settings())
    moe_batch = data["batches"][_data.MOE]
    results["moe/log_probs"] = actor.compute_log_prob(moe_batch)[0]
    results["moe/update"] = {"metrics": actor.update_policy(moe_batch), "weights": weights(actor.model, moe, layout)}

    results["on_policy"] = on_policy_pair(work, _data.DENSE, layout, batch)
    results["masked"] = loss_isolation(work, layout, batch)
    results["nonfinite"] = nonfinite(work, layout, batch)
    results["learning"] = learning(work, layout)
    results["critic"] = critic(work, layout, batch)
    results["padded"] = _padded.padded(work, layout, batch)
    return results


def loss_isolation(work: Path, layout: ParallelLayout, batch) -> dict:
    """Tool tokens inside the responses (attention 1, loss mask 0): the loss pieces and every
    gradient, with the logits that score those tokens perturbed or not; and, as a control, with
    the logits of one trained token perturbed."""
    from megarl.engine.update import global_batch_info

    mask = batch.response_mask.clone()
    lengths = mask.sum(-1)
    for row in range(len(batch)):
        if lengths[row] >= 3:
            mask[row, 1:int(lengths[row]) - 1] = 0  # the middle of the response is a tool turn
    tool_batch = batch.with_fields(response_mask=mask)  # old log-probs and advantages stay non-zero there
    settings = _data.actor_settings(micro_batch_size=3)
    actor = actor_for(work, _data.DENSE, layout, settings)
    forward = actor.runner.forward

    def measure(perturb: str | None) -> dict:
        generator = torch.Generator().manual_seed(3)

        def perturbed_forward(model, micro_batch):
            out = forward(model, micro_batch)
            if perturb is None:
                return out
            inputs, trained = micro_batch.inputs, micro_batch.batch.response_mask.bool()
            pick = inputs.response_valid & ~trained if perturb == "tool" else trained & (trained.cumsum(-1) == 1)
            noise = torch.zeros_like(out)
            flat = noise.view(-1, out.shape[-1])  # response_index counts positions over all rows
            for row, k in pick.nonzero().tolist():
                flat[inputs.response_index[row, k]] = 5.0 * torch.randn(out.shape[-1], generator=generator)
            return out + noise

        actor.runner.forward = perturbed_forward
        try:
            for chunk in actor.runner.chunks:
                chunk.zero_grad_buffer()
            loss = actor._loss_fn(global_batch_info(actor.runner, tool_batch))
            collected = actor.runner.run(tool_batch, actor.runner.split(tool_batch, settings.train), loss, forward_only=False)
        finally:
            actor.runner.forward = forward
        pieces = {name: float(sum(c[name] for c in collected)) for name in ("pg_loss", "entropy", "kl_loss")}
        grads = {name: p.main_grad.clone() for chunk in actor.runner.chunks for name, p in chunk.named_parameters()}
        return {"loss": pieces, "grads": grads}

    return {"clean": measure(None), "tool": measure("tool"), "trained": measure("trained"),
            "masked_tokens": int((batch.response_mask - mask).sum())}


def on_policy_pair(work: Path, model: str, layout: ParallelLayout, batch, **settings_kw) -> dict:
    """One on-policy update (one mini-batch, one epoch) twice from the same start: with old log-probs
    from a separate pass (and the controller's sync probe on them), and without (the update's own
    forward; the probe from that forward). Also the gradients of one loss evaluation both ways, and
    the error of an update without old log-probs that is not on-policy."""
    from megarl.algorithms.mismatch import rollout_mismatch_metrics
    from megarl.engine.update import global_batch_info

    dp_rank, dp_size = dp_coords()
    generator = torch.Generator().manual_seed(9)
    rollout = (batch.old_log_probs + 1e-3 * torch.randn(batch.old_log_probs.shape, generator=generator)) * batch.response_mask
    local = data_parallel_shard(batch.with_fields(old_log_probs=None, ref_log_probs=None, rollout_log_probs=rollout),
                                dp_rank, dp_size)
    loss = dataclasses.replace(_data.LOSS, use_kl_loss=False)
    # the pass batches like the update: the two forwards run the same shapes
    settings = _data.actor_settings(loss=loss, **settings_kw)
    settings.log_prob = settings.train
    result = {}
    for mode in ("pass", "skip"):
        actor = actor_for(work, model, layout, settings)
        if mode == "pass":
            old, _ = actor.compute_log_prob(local)
            probe = rollout_mismatch_metrics(gather_dp(old), rollout, batch.response_mask)  # the controller's probe
            train = local.with_fields(old_log_probs=old, rollout_log_probs=None)
        else:
            probe, train = {}, local
        for chunk in actor.runner.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        actor.runner.run(train, actor.runner.split(train, settings.train), actor._loss_fn(global_batch_info(actor.runner, train)),
                         forward_only=False)
        grads = {name: p.main_grad.clone() for chunk in actor.runner.chunks for name, p in chunk.named_parameters()}
        metrics = actor.update_policy(train)
        result[mode] = {"metrics": {**metrics, **probe}, "grads": grads, "weights": weights(actor.model, work / model, layout)}
    several = dataclasses.replace(settings, train=dataclasses.replace(settings.train, mini_batch_size=max(len(local) // 2, 1)))
    try:
        actor_for(work, model, layout, several).update_policy(local)
        result["off_policy_error"] = None
    except ValueError as exc:
        result["off_policy_error"] = str(exc)
    return result


def nonfinite(work: Path, layout: ParallelLayout, batch) -> dict:
    """A NaN advantage on one valid token: the step is skipped; the next good step still trains."""
    dense = work / _data.DENSE
    actor = actor_for(work, _data.DENSE, layout, _data.actor_settings())
    before = weights(actor.model, dense, layout)
    advantages = batch.advantages.clone()
    advantages[0, 0] = float("nan")
    bad = actor.update_policy(batch.with_fields(advantages=advantages))
    after_bad = weights(actor.model, dense, layout)
    good = actor.update_policy(batch)
    after_good = weights(actor.model, dense, layout)
    return {"bad": bad, "good": good, "before": before, "after_bad": after_bad, "after_good": after_good}


def learning(work: Path, layout: ParallelLayout, steps: int = 20) -> dict:
    """GRPO on a fixed preference: reward 1 when the one-token response is CHOSEN.

    Each of 4 prompts has a group of 8 candidate responses: 3 of them CHOSEN, the others random
    tokens. Advantages come from the algorithms library's GRPO estimator.
    """
    from megarl.algorithms import compute_grpo_outcome_advantage
    from megarl.engine import RLBatch

    chosen, prompts, group = 77, 4, 8
    generator = torch.Generator().manual_seed(11)
    prompt_ids = torch.randint(3, 500, (prompts, 4), generator=generator).repeat_interleave(group, 0)
    settings = _data.actor_settings(micro_batch_size=8, loss=_data.PolicyLossSettings(), optim=OptimizerSettings(lr=2e-3, weight_decay=0.0))
    actor = actor_for(work, _data.DENSE, layout, settings)
    probe = RLBatch.from_parts(prompt_ids[::group], torch.ones(prompts, 4, dtype=torch.long), torch.full((prompts, 1), chosen), torch.ones(prompts, 1, dtype=torch.long))
    chosen_log_probs = [actor.compute_log_prob(probe)[0].mean().item()]
    for step in range(steps):
        responses = torch.randint(3, 500, (prompts * group, 1), generator=generator)
        responses[torch.arange(prompts * group) % group < 3] = chosen
        mask = torch.ones_like(responses)
        batch = RLBatch.from_parts(prompt_ids, torch.ones_like(prompt_ids), responses, mask)
        rewards = (responses == chosen).float()
        advantages, _ = compute_grpo_outcome_advantage(rewards, mask, index=list(torch.arange(prompts).repeat_interleave(group).tolist()))
        old, _ = actor.compute_log_prob(batch)
        actor.update_policy(batch.with_fields(old_log_probs=old, advantages=advantages))
        chosen_log_probs.append(actor.compute_log_prob(probe)[0].mean().item())
    return {"chosen_log_probs": chosen_log_probs}


def critic(work: Path, layout: ParallelLayout, batch, steps: int = 15) -> dict:
    """Values against HF, then regression on fixed returns: the value loss must fall."""
    settings = CriticSettings(
        train=BatchSettings(micro_batch_size=4),
        values=BatchSettings(micro_batch_size=3),
        cliprange_value=100.0,
        optim=OptimizerSettings(lr=1e-4, weight_decay=0.0),
    )
    model = MegatronCritic(build_model(work / _data.CRITIC, layout, "critic"), settings)
    values = model.compute_values(batch)
    losses = []
    for _ in range(steps):
        current = model.compute_values(batch)
        losses.append(model.update_critic(batch.with_fields(values=current))["critic/vf_loss"])
    return {"values": values, "vf_losses": losses}


# ---------------------------------------------------------------------------- two processes
LAYOUTS = {
    "tp2_sp": ParallelLayout(tp=2, sequence_parallel=True),
    "pp2": ParallelLayout(pp=2),
    "dp2": ParallelLayout(),
    "pp2_vpp2": ParallelLayout(pp=2, vpp=2),
}


def layouts(work: Path, data: dict) -> dict:
    results = {}
    for name, layout in LAYOUTS.items():
        setup(layout)
        model = _data.DENSE_SMALL if layout.vpp > 1 else _data.DENSE
        settings = _data.actor_settings(micro_batch_size=None, use_dynamic_bsz=True) if name == "dp2" else _data.actor_settings()
        results[name] = train_once(work, model, layout, settings, data["batches"][model])
    setup(ParallelLayout(ep=2))
    results["ep2"] = train_once(work, _data.MOE, ParallelLayout(ep=2), _data.actor_settings(), data["batches"][_data.MOE])

    layout = ParallelLayout(tp=2, sequence_parallel=True)
    setup(layout)
    results["distill_topk_tp2_sp"] = train_once(work, _data.DENSE, layout, _data.actor_settings(loss=_data.DISTILL_LOSS),
                                                data["distill"])
    settings = CriticSettings(train=BatchSettings(micro_batch_size=4), values=BatchSettings(micro_batch_size=3))
    critic_model = MegatronCritic(build_model(work / _data.CRITIC, layout, "critic"), settings)
    results["critic_tp2_sp"] = critic_model.compute_values(data["batches"][_data.DENSE])

    for name, layout in (("dp2", ParallelLayout()), ("pp2", ParallelLayout(pp=2))):
        setup(layout)
        results[f"on_policy/{name}"] = on_policy_pair(work, _data.DENSE, layout, data["batches"][_data.DENSE])

    results["checkpoint"] = checkpoint(work, data)
    return results


def train_once(work: Path, model: str, layout: ParallelLayout, settings, batch) -> dict:
    dp_rank, dp_size = dp_coords()
    local = data_parallel_shard(batch, dp_rank, dp_size)
    actor = actor_for(work, model, layout, settings)
    log_probs, entropy = actor.compute_log_prob(local, with_entropy=True)
    metrics = actor.update_policy(local)
    return {
        "log_probs": gather_dp(log_probs),
        "entropy": gather_dp(entropy),
        "metrics": metrics,
        "weights": weights(actor.model, work / model, layout),
    }


def random_draws() -> list[float]:
    """One draw from each RNG a checkpoint restores: Python, NumPy, torch, megatron's TP tracker."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(1).item()
    return [random.random(), float(np.random.rand()), torch.rand(1).item(), tracked]


def checkpoint(work: Path, data: dict) -> dict:
    """Step 1 at TP=2 and save; step 2 continues there. Then a fresh PP=2 actor loads and does step 2."""
    from megatron.core import dist_checkpointing

    root = work / "checkpoints"
    optim = dataclasses.replace(_data.OPTIM, lr_warmup_steps=2)  # lrs 0, lr/2, lr: the schedule must resume
    settings = _data.actor_settings(optim=optim)
    first, second = data["batches"][_data.DENSE], data["batch_b"]
    dense = work / _data.DENSE
    result = {}

    tp2 = ParallelLayout(tp=2, sequence_parallel=True)
    setup(tp2)
    actor = actor_for(work, _data.DENSE, tp2, settings)
    actor.update_policy(first)
    save_checkpoint(root, 1, actor.model, actor.optimizer, actor.scheduler, extra={"trainer_step": 1})
    result["draws_after_save"] = random_draws()
    result["saved_weights"] = weights(actor.model, dense, tp2)
    result["saved_moments"] = optimizer_moments(actor, dense, tp2)

    real_save = dist_checkpointing.save

    def crash(state, directory, *args, **kwargs):  # a save that dies after writing part of its files
        (Path(directory) / "partial").write_text("x")
        raise RuntimeError("simulated crash during save")

    dist_checkpointing.save = crash
    try:
        save_checkpoint(root, 2, actor.model, actor.optimizer, actor.scheduler)
        result["crash_raised"] = False
    except RuntimeError:
        result["crash_raised"] = True
    finally:
        dist_checkpointing.save = real_save
    dist.barrier()
    result["latest_after_crash"] = latest_checkpoint(root).name
    result["dirs_after_crash"] = sorted(p.name for p in root.iterdir())
    result["continued"] = {"metrics": actor.update_policy(second), "weights": weights(actor.model, dense, tp2)}
    load_checkpoint(root, actor.model, actor.optimizer, actor.scheduler)  # same layout: the RNG states come back too
    result["draws_after_same_layout_load"] = random_draws()

    pp2 = ParallelLayout(pp=2)
    setup(pp2)
    actor = actor_for(work, _data.DENSE, pp2, settings)
    extra = load_checkpoint(root, actor.model, actor.optimizer, actor.scheduler)
    result["extra"] = extra
    result["loaded_weights"] = weights(actor.model, dense, pp2)
    result["loaded_moments"] = optimizer_moments(actor, dense, pp2)
    result["loaded_steps"] = adam_steps(actor)
    result["resumed"] = {"metrics": actor.update_policy(second), "weights": weights(actor.model, dense, pp2)}
    result["resumed_steps"] = adam_steps(actor)
    return result


def run_worker_mode(modes: dict, **init) -> None:
    """A worker script's entry, ``<script> MODE WORK_DIR``: ``modes[MODE](work, data)`` on every rank, rank 0's
    result saved to ``WORK_DIR/MODE.pt`` (``_engine_launch.run_worker`` reads it). ``init``: ``init_distributed``'s."""
    mode, work = sys.argv[1], Path(sys.argv[2])
    init_distributed(**init)
    data = _data.load(work / "batch.pt")
    try:
        results = modes[mode](work, data)
    except Exception:
        traceback.print_exc()
        raise
    if dist.get_rank() == 0:
        torch.save(results, work / f"{mode}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_worker_mode({"single": single, "layouts": layouts})
