"""Shared by the engine tests and their worker processes: the tiny checkpoints, the RL batch and
the settings every scenario uses.

The batch has prompts of 2..6 tokens (left-padded to 6) and responses of 1..6 tokens
(right-padded to 6), so packing, trimming and per-row offsets are exercised. Its
``old_log_probs`` and ``ref_log_probs`` are Hugging Face log-probs plus seeded noise (so PPO
clipping and the KL term are active); they are computed once in the test process and saved, so
every layout trains on identical tensors.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megarl.algorithms import RolloutCorrection, compute_rollout_correction
from megarl.engine.batch import RLBatch
from megarl.algorithms.distillation import DistillationLossSettings
from megarl.engine.settings import ActorSettings, BatchSettings, OptimizerSettings, PolicyLossSettings

DENSE = "qwen2_tied"  # Qwen2 (QKV bias) with tied embeddings: the PP path that all-reduces embedding grads
DENSE_SMALL = "qwen2_small"  # 4 layers, for PP=2 x VPP=2
MOE = "qwen3_moe"
CRITIC = "qwen2_critic"  # HF Qwen2ForTokenClassification(num_labels=1) on the dense backbone
BATCH, PROMPT, RESPONSE = 8, 6, 6
LR = 1e-3


def make_checkpoints(root: Path) -> None:
    """Write the tiny HF checkpoints the engine tests use."""
    from transformers import AutoModelForTokenClassification

    from megarl.devtools.tiny_model import make_tiny_model

    make_tiny_model("qwen2", "tiny", root / DENSE, seed=0, tie_word_embeddings=True)
    make_tiny_model("qwen2", "small", root / DENSE_SMALL, seed=0, tie_word_embeddings=True)
    make_tiny_model("qwen3_moe", "tiny", root / MOE, seed=0)
    make_tiny_model("qwen2", "tiny", root / "qwen2_untied", seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        critic = AutoModelForTokenClassification.from_pretrained(str(root / "qwen2_untied"), num_labels=1, dtype=torch.float32)
        with torch.no_grad():
            critic.score.weight.normal_(0.0, 0.1)
            critic.score.bias.fill_(0.3)
    critic.save_pretrained(str(root / CRITIC))


def base_batch(seed: int = 0, batch_size: int = BATCH) -> RLBatch:
    """Token ids with varied prompt and response lengths; advantages, returns and values drawn at random."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 500, (batch_size, PROMPT), generator=generator)
    responses = torch.randint(3, 500, (batch_size, RESPONSE), generator=generator)
    prompt_lengths = torch.randint(2, PROMPT + 1, (batch_size,), generator=generator)
    response_lengths = torch.randint(1, RESPONSE + 1, (batch_size,), generator=generator)
    columns = torch.arange(PROMPT)
    prompt_mask = (columns.unsqueeze(0) >= PROMPT - prompt_lengths.unsqueeze(1)).long()
    response_mask = (torch.arange(RESPONSE).unsqueeze(0) < response_lengths.unsqueeze(1)).long()
    prompts = prompts * prompt_mask  # padding id 0
    responses = responses * response_mask
    shape = (batch_size, RESPONSE)
    return RLBatch.from_parts(
        prompts,
        prompt_mask,
        responses,
        response_mask,
        advantages=torch.randn(shape, generator=generator) * response_mask,
        returns=torch.randn(shape, generator=generator) * response_mask,
        values=0.3 * torch.randn(shape, generator=generator) * response_mask,
    )


def with_behaviour_log_probs(batch: RLBatch, hf_log_probs: torch.Tensor, seed: int = 1) -> RLBatch:
    """old/ref log-probs near the model's own, so some ratios clip and the KL term is not zero."""
    generator = torch.Generator().manual_seed(seed)
    mask = batch.response_mask
    old = (hf_log_probs + 0.15 * torch.randn(hf_log_probs.shape, generator=generator)) * mask
    ref = (hf_log_probs + 0.1 * torch.randn(hf_log_probs.shape, generator=generator)) * mask
    return batch.with_fields(old_log_probs=old, ref_log_probs=ref)


LOSS = PolicyLossSettings(loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
SEQ_MEAN_LOSS = PolicyLossSettings(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
# token-sum (SPIN's update): micro-batches must add up to the global token sum, unnormalised
TOKEN_SUM_LOSS = PolicyLossSettings(loss_mode="reinforce", loss_agg_mode="token-sum", entropy_coeff=0.01,
                                    use_kl_loss=True, kl_loss_coef=0.1)
# a loss with options of its own (not the defaults), which must reach the engine's loss call
SAPO_LOSS = PolicyLossSettings(loss_mode="sapo", loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01,
                               options={"tau_pos": 0.5, "tau_neg": 3.0})
# bypass mode: old_log_probs are the rollout's; REINFORCE weighted by the truncated pi_theta / pi_rollout, token
# rejection outside [1/1.3, 1.3] (the batch's noisy old log-probs make both bite)
BYPASS_LOSS = PolicyLossSettings(loss_agg_mode="token-mean", entropy_coeff=0.01, rollout_correction=RolloutCorrection(
    rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token", rollout_rs_threshold=1.3, bypass_mode=True,
    loss_type="reinforce"))


def with_importance_weights(batch: RLBatch) -> RLBatch:
    """Decoupled mode's input: seeded truncated weights of a made-up rollout policy in the batch."""
    generator = torch.Generator().manual_seed(11)
    rollout = batch.old_log_probs + 0.3 * torch.randn(batch.old_log_probs.shape, generator=generator)
    c = compute_rollout_correction(batch.old_log_probs, rollout * batch.response_mask, batch.response_mask,
                                   RolloutCorrection(rollout_is="token", rollout_is_threshold=1.5))
    return batch.with_fields(rollout_is_weights=c.weights)
# eps 1e-6: Adam divides by sqrt(v) + eps, so a parameter whose true gradient is 0 (the k_proj bias:
# it shifts all scores of a query alike) moves by lr * noise / |noise| at eps 1e-8, amplifying fp32
# rounding noise into differences of ~1e-5 between any two correct implementations.
OPTIM = OptimizerSettings(lr=LR, weight_decay=0.0, clip_grad=1.0, betas=(0.9, 0.999), eps=1e-6)


TOPK = 5
# the task's loss plus the top-k forward KL to a teacher (distillation_loss_coef 0.5): the gradient of both
DISTILL_LOSS = PolicyLossSettings(loss_agg_mode="token-mean", entropy_coeff=0.01, distillation=DistillationLossSettings(
    loss_mode="forward_kl_topk", topk=TOPK, distillation_loss_coef=0.5, log_prob_min_clamp=-8.0))


def with_teacher_topk(batch: RLBatch, vocab_size: int = 512, seed: int = 4) -> RLBatch:
    """A made-up teacher's top-k at every response position: distinct token ids, log-probs from a peaked
    softmax over vocab_size (so the top-k hold most but not all of the mass), 0 at padding."""
    generator = torch.Generator().manual_seed(seed)
    B, R = batch.response_mask.shape
    logits = 3 * torch.randn(B, R, vocab_size, generator=generator)
    top = torch.log_softmax(logits, -1).topk(TOPK, dim=-1)
    real = batch.attention_mask[:, batch.prompt_length:].bool().unsqueeze(-1)
    return batch.with_fields(teacher_topk_ids=torch.where(real, top.indices, 0),
                             teacher_topk_log_probs=torch.where(real, top.values, 0.0))


def actor_settings(
    micro_batch_size: int | None = 2,
    use_dynamic_bsz: bool = False,
    max_token_len: int = 24,
    mini_batch_size: int | None = None,
    loss: PolicyLossSettings = LOSS,
    optim: OptimizerSettings = OPTIM,
    packed: bool = True,
) -> ActorSettings:
    """One mini-batch of the whole (per-rank) batch by default, micro-batches of 2, packed sequences
    (``packed=False``: padded rows)."""
    train = BatchSettings(mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size, use_dynamic_bsz=use_dynamic_bsz,
                          max_token_len=max_token_len, use_remove_padding=packed)
    log_prob = BatchSettings(micro_batch_size=3, use_remove_padding=packed)
    return ActorSettings(train=train, log_prob=log_prob, loss=loss, optim=optim)


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)
