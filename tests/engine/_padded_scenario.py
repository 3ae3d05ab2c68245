"""The padded layout in the single-process engine worker (``_engine_worker.py single``): the same
scenarios as the packed default with ``use_remove_padding=False``, and padding isolation."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import _engine_data as _data
from megarl.engine import BatchSettings, CriticSettings, MegatronCritic, MegatronReference
from megarl.models import ParallelLayout, build_model


def padded(work: Path, layout: ParallelLayout, batch) -> dict:
    """The padded layout (use_remove_padding=False): log-probs, entropy, the reference, values and
    updates (fixed micro-batches of 2 and a padded token budget); and a loss evaluation with other
    token ids at every padding position and noise on their logits, against the same without."""
    from megarl.engine.update import global_batch_info

    dense, result = work / _data.DENSE, {}
    for name, settings in (("mbs2", _data.actor_settings(packed=False)),
                           ("dynamic", _data.actor_settings(micro_batch_size=None, use_dynamic_bsz=True, packed=False))):
        actor = _actor(work, layout, settings)
        if name == "mbs2":
            result["log_probs"], result["entropy"] = actor.compute_log_prob(batch, with_entropy=True)
        result[f"update/{name}"] = {"metrics": actor.update_policy(batch), "weights": _weights(actor.model, dense, layout)}
    reference = MegatronReference(build_model(dense, layout, "ref"), BatchSettings(micro_batch_size=5, use_remove_padding=False))
    result["reference"] = reference.compute_ref_log_prob(batch)
    settings = CriticSettings(train=BatchSettings(micro_batch_size=4), values=BatchSettings(micro_batch_size=3, use_remove_padding=False))
    result["values"] = MegatronCritic(build_model(work / _data.CRITIC, layout, "critic"), settings).compute_values(batch)

    settings = _data.actor_settings(micro_batch_size=4, packed=False)
    actor = _actor(work, layout, settings)
    forward = actor.runner.forward
    touched = []

    def measure(noisy: bool) -> dict:
        def noisy_forward(model, micro_batch):
            """Other token ids at every padding position of the rows, and noise on their logits."""
            inputs = micro_batch.inputs
            lengths = micro_batch.batch.sequence_lengths()
            padding = torch.arange(inputs.tokens.shape[1]).unsqueeze(0) >= lengths.unsqueeze(1)  # [rows, S]
            if noisy:
                touched.append(int(padding.sum()))
                other = torch.randint(3, 500, inputs.tokens.shape, generator=torch.Generator().manual_seed(5))
                micro_batch.inputs = dataclasses.replace(inputs, tokens=torch.where(padding, other, inputs.tokens))
            out = forward(model, micro_batch)
            noise = 50.0 * torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
            return torch.where(padding.unsqueeze(-1), out + noise, out) if noisy else out

        actor.runner.forward = noisy_forward
        try:
            for chunk in actor.runner.chunks:
                chunk.zero_grad_buffer()
            loss = actor._loss_fn(global_batch_info(actor.runner, batch))
            collected = actor.runner.run(batch, actor.runner.split(batch, settings.train), loss, forward_only=False,
                                         packed=False)
        finally:
            actor.runner.forward = forward
        grads = {name: p.main_grad.clone() for chunk in actor.runner.chunks for name, p in chunk.named_parameters()}
        return {"loss": {n: float(sum(c[n] for c in collected)) for n in ("pg_loss", "entropy", "kl_loss")}, "grads": grads}

    result["isolation"] = {"clean": measure(False), "noisy": measure(True), "padding_positions": sum(touched)}
    return result


def _actor(work: Path, layout: ParallelLayout, settings):
    from megarl.engine import MegatronActor

    return MegatronActor(build_model(work / _data.DENSE, layout, "actor"), settings)


def _weights(models, model_dir, layout) -> dict:
    """Full HF-named tensors on rank 0."""
    from megarl.models import gather_hf_tensors

    return dict(gather_hf_tensors(models, model_dir, layout, "actor"))
