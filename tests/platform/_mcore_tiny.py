"""A tiny megatron-core GPTModel for the platform tests (local spec, CPU flags from megarl.platform).

hidden 64, 2 layers, 4 heads, vocab 128, sequence 16; RMSNorm, SwiGLU, RoPE, tied embeddings
(the layout of the small Qwen/Llama models megarl trains), optionally MoE.
"""

import torch

from megarl.platform import transformer_config_overrides

HIDDEN, LAYERS, HEADS, VOCAB, SEQ = 64, 2, 4, 128, 16


def tiny_config(**overrides):
    """The TransformerConfig of the tiny model, the current parallel sizes filled in from parallel_state."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    fields = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
    )
    fields.update(transformer_config_overrides())
    fields.update(overrides)
    return TransformerConfig(**fields)


def tiny_model(config, num_experts=None, grouped_gemm=False):
    """A GPTModel for this rank's pipeline stage (``grouped_gemm``: megatron's GroupedMLP experts)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=grouped_gemm,
                                                         normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )


def batch(seed, batch_size=2):
    """Token ids, position ids and next-token labels, the same on every rank for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(batch_size, -1)
    return tokens[:, :-1].contiguous(), positions, tokens[:, 1:].contiguous()


def perturb_norms(model, seed=3):
    """Give every norm weight a random value (the same on every rank), so norms are not the identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=generator))


def full_state(model):
    """The model's tensors by name (no ``_extra_state`` entries), detached copies."""
    return {name: value.detach().clone() for name, value in model.state_dict().items() if torch.is_tensor(value)}


def gather_tensor_parallel(tensor, param):
    """Reassemble the full tensor from this TP rank's shard of ``param`` (``tensor`` is the shard or its grad).

    Megatron splits a TP param along ``partition_dim`` into ``tp * stride`` pieces and gives rank r the
    pieces r, r+tp, ... (stride 2 for a gated MLP's [gate; up] fc1).
    """
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    return gather_along(tensor, param.partition_dim, getattr(param, "partition_stride", 1))


def gather_along(tensor, dim, stride=1):
    """All-gather TP shards of ``tensor`` split on ``dim`` in ``stride`` interleaved pieces per rank."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_model_parallel_world_size()
    shards = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[rank][s] for s in range(stride) for rank in range(world)], dim=dim)
