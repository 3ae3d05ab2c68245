"""The independent reference: Hugging Face transformers on the padded batch, no megarl engine code.

Log-probs: one HF forward of the whole batch (attention mask + position ids, as verl builds
them), ``log_softmax`` and ``gather`` at the positions that predict the response tokens.
A training step: the same forward, the loss built from the algorithms library on the whole
mini-batch at once, ``backward``, global-norm clipping and ``torch.optim.AdamW``.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from megarl.algorithms import agg_loss, compute_rollout_correction, get_policy_loss, kl_penalty


def load_causal_lm(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def response_outputs(model: torch.nn.Module, batch) -> torch.Tensor:
    """Model outputs at the positions that predict each response token: ``[B, R, out]``."""
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
    prompt = batch.prompt_length
    return output[:, prompt - 1 : -1].float()


def log_probs_and_entropy(logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    valid = batch.attention_mask[:, batch.prompt_length :]
    return log_probs * valid, entropy * valid


@torch.no_grad()
def hf_log_probs(model_dir, batch) -> tuple[torch.Tensor, torch.Tensor]:
    model = load_causal_lm(model_dir).eval()
    return log_probs_and_entropy(response_outputs(model, batch), batch)


@torch.no_grad()
def hf_values(critic_dir, batch) -> torch.Tensor:
    model = AutoModelForTokenClassification.from_pretrained(str(critic_dir), dtype=torch.float32).eval()
    values = response_outputs(model, batch).squeeze(-1)
    return values * batch.attention_mask[:, batch.prompt_length :]


def policy_loss(model: torch.nn.Module, batch, loss) -> tuple[torch.Tensor, torch.Tensor]:
    """(total loss, pg_loss) of the whole batch at once, as the engine's settings ``loss`` describe."""
    log_probs, entropy = log_probs_and_entropy(response_outputs(model, batch), batch)
    mask = batch.response_mask
    loss_mode, weights = loss.loss_mode, batch.rollout_is_weights
    correction = loss.rollout_correction
    if correction is not None and correction.bypass_mode:  # the whole batch at once (the engine: per micro-batch)
        # a rejected token contributes nothing but stays in token-mean's count: the count is the mini-batch's
        # response tokens, known before the forward that decides the rejection
        c = compute_rollout_correction(log_probs.detach(), batch.old_log_probs, mask, correction)
        keep = c.mask.to(log_probs.dtype)
        weights = keep * c.weights if correction.loss_type == "reinforce" else keep
        loss_mode = "reinforce" if correction.loss_type == "reinforce" else loss_mode
    pg_loss, _ = get_policy_loss(loss_mode)(
        old_log_prob=batch.old_log_probs,
        log_prob=log_probs,
        advantages=batch.advantages,
        response_mask=mask,
        rollout_is_weights=weights,
        loss_agg_mode=loss.loss_agg_mode,
        clip_ratio=loss.clip_ratio,
        clip_ratio_low=loss.clip_ratio_low,
        clip_ratio_high=loss.clip_ratio_high,
        clip_ratio_c=loss.clip_ratio_c,
        **loss.options,
    )
    total = pg_loss - loss.entropy_coeff * agg_loss(entropy, mask, loss.loss_agg_mode)
    if loss.distillation is not None:  # forward KL over the teacher's top-k, from HF's full log-softmax
        d = loss.distillation
        student = torch.log_softmax(response_outputs(model, batch), -1).gather(-1, batch.teacher_topk_ids)
        student, teacher = student.clamp_min(d.log_prob_min_clamp), batch.teacher_topk_log_probs.clamp_min(d.log_prob_min_clamp)
        per_token = (teacher.exp() * (teacher - student)).sum(-1)
        total = total + d.coef * (per_token * mask).sum() / mask.sum()
    if loss.use_kl_loss:
        kl = kl_penalty(log_probs, batch.ref_log_probs, loss.kl_loss_type)
        total = total + loss.kl_loss_coef * agg_loss(kl, mask, loss.loss_agg_mode)
    return total, pg_loss


def hf_training_steps(model_dir, mini_batches: list, loss, optim) -> dict:
    """One AdamW step per mini-batch (weight decay must be 0: megatron exempts norms and biases).

    Returns the per-step pg_loss and pre-clip grad norm, and the final weights by HF name.
    """
    if optim.weight_decay != 0:
        raise ValueError("the reference assumes weight_decay=0")
    model = load_causal_lm(model_dir).train()
    adam = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=0.0)
    pg_losses, grad_norms = [], []
    for batch in mini_batches:
        adam.zero_grad()
        total, pg_loss = policy_loss(model, batch, loss)
        total.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads)).item()
        if optim.clip_grad > 0 and norm > optim.clip_grad:
            for g in grads:
                g.mul_(optim.clip_grad / (norm + 1e-6))
        adam.step()
        pg_losses.append(pg_loss.item())
        grad_norms.append(norm)
    return {"pg_losses": pg_losses, "grad_norms": grad_norms, "weights": checkpoint_tensors(model)}


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the names of its saved checkpoint (transformers 5 keeps MoE
    experts fused in memory but writes them per expert, as the bridge exports them)."""
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        tensors = {}
        for path in sorted(Path(directory).glob("*.safetensors")):
            tensors.update(load_file(str(path)))
    return tensors
