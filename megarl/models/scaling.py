"""An embedding scale and final-logit soft-capping: what some families' HF models do that GPTModel does not.

Gemma multiplies the embedding output by ``sqrt(hidden_size)``, cast to the model's dtype first as
transformers and vLLM do (sqrt(3072) = 55.4256 is 55.5 in bf16), and Gemma-2 caps its logits at ``cap * tanh(logits / cap)``. Both are forward hooks
on GPTModel's own modules (the embedding; the output layer), so parameter names, pipeline stages,
sequence parallelism (the scale and the cap are per element) and every consumer of the logits
(the engine's log-probs and entropy, megatron's loss, a user's forward) are unchanged. The
soft-capping hook is registered before the vocabulary-padding mask (``vocab_padding``): a masked
``-inf`` would otherwise become ``-cap``, a real probability.
"""
from __future__ import annotations

import torch


def scale_embedding(model, scale: float) -> None:
    """Multiply the output of ``model.embedding`` (the first chunk's) by ``scale`` in its own dtype."""

    def hook(module, args, output):
        return output * torch.tensor(scale, dtype=output.dtype, device=output.device)

    model.embedding.register_forward_hook(hook)


def softcap_logits(models: list, cap: float) -> None:
    """``cap * tanh(logits / cap)`` at the output layer of the chunk that holds it (post-process)."""

    def hook(module, args, output):
        logits, bias = output
        return cap * torch.tanh(logits / cap), bias

    for model in models:
        if getattr(model, "post_process", False) and getattr(model, "output_layer", None) is not None:
            model.output_layer.register_forward_hook(hook)
