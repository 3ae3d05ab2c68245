"""Megatron modules that megatron-core's local layer spec lacks, for the families whose ``decoder_spec``
builds their own layers (``FamilySpec.decoder_spec``).

* ``ZeroCenteredRMSNorm``: RMSNorm scaled by ``1 + weight``, computed in fp32 and cast back, as
  Gemma's (and Qwen3-Next's) HF norms do; a zero weight is the identity scale. megatron's own
  zero-centred gamma exists only in its apex / Transformer Engine norms.
* ``PostNormRowParallelLinear``: a row-parallel linear followed by a norm of its (reduced) output:
  Gemma's post-attention and post-feedforward norms, which sit inside the residual branch where
  megatron's ``TransformerLayer`` has no norm. Under sequence parallelism the output is already
  scattered over the sequence, and the norm is per token, so it needs no communication.
* ``LayerRopeSelfAttention``: self-attention with a RoPE of its own instead of the model's
  (Gemma-3's sliding-window layers use another base than its global ones).
* ``FreshOutputRowParallelLinear``: a row-parallel linear whose output megatron's MLP may add a
  bias to in place (gpt-oss's biased experts; see the class).

Norm parameters carry ``sequence_parallel`` under sequence parallelism, as megatron's fused norms
do, so that megatron all-reduces their gradients over the TP group.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import build_module


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``x / rms(x) * (1 + weight)`` in fp32, cast back to the input dtype (HF ``GemmaRMSNorm``)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        from megarl.platform import device

        self.eps = eps
        where = "cpu" if config.use_cpu_initialization else device()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=where))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).type_as(x)


class PostNormRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` whose output goes through ``post_layernorm`` (a norm module class)."""

    def __init__(self, input_size: int, output_size: int, *, config, post_norm, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = build_module(post_norm, config=config, hidden_size=output_size, eps=config.layernorm_epsilon)

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None:
            raise ValueError("a post-norm after a linear that returns its bias separately is not supported "
                             "(add_bias_linear must be False)")
        return self.post_layernorm(output), None


class LayerRopeSelfAttention(SelfAttention):
    """``SelfAttention`` applying its own RoPE (``rotary_base``, all channels) in place of the model's."""

    def __init__(self, config, submodules, layer_number: int, *, rotary_base: float, **kwargs):
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        super().__init__(config, submodules, layer_number, **kwargs)
        self.layer_rotary = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                            rotary_base=rotary_base, use_cpu_initialization=config.use_cpu_initialization)

    def forward(self, *args, **kwargs):
        emb = kwargs.get("rotary_pos_emb")
        if emb is not None:
            params = kwargs.get("packed_seq_params")
            packed = params is not None and params.qkv_format == "thd"
            if self.config.context_parallel_size > 1 and not packed:
                raise ValueError("context parallelism runs on packed sequences; a layer's own RoPE needs them too")
            # the model's table covers every position of the (packed) row: this layer's covers the same
            kwargs["rotary_pos_emb"] = self.layer_rotary(emb.shape[0], packed_seq=True)
        return super().forward(*args, **kwargs)


class FreshOutputRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` returning a fresh output tensor.

    megatron-core 0.16.1's ``MLP`` adds a MoE expert's output bias in place (``output += bias * prob``)
    when the expert has a per-token scale. Without sequence parallelism the row-parallel all-reduce
    returns its input itself, a view created inside a custom autograd Function, which autograd forbids
    modifying in place: gpt-oss's biased experts failed in backward ("Output 0 of
    _ReduceFromModelParallelRegion is a view and is being modified inplace"). The clone costs one
    copy of the expert's output.
    """

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output.clone(), bias
