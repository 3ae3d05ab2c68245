"""ParallelLayout arithmetic against megatron-core's own functions (pure: no processes)."""
import itertools

import pytest

from megarl.models import ParallelLayout, rank_coords


def _megatron_config(num_layers, layout):
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )


LAYER_CASES = [
    (8, ParallelLayout(pp=2)),
    (8, ParallelLayout(pp=4)),
    (8, ParallelLayout(pp=2, vpp=2)),
    (12, ParallelLayout(pp=2, vpp=3)),
    (16, ParallelLayout(pp=4, vpp=2)),
    (10, ParallelLayout(pp=3, first_stage_layers=2)),
    (10, ParallelLayout(pp=3, last_stage_layers=4)),
    (11, ParallelLayout(pp=4, first_stage_layers=2, last_stage_layers=3)),
    (12, ParallelLayout(pp=3, vpp=2, first_stage_layers=2, last_stage_layers=2)),
    (61, ParallelLayout(pp=16, last_stage_layers=1)),
]


@pytest.mark.parametrize("num_layers,layout", LAYER_CASES)
def test_chunk_layers_match_megatron(num_layers, layout):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = _megatron_config(num_layers, layout)
    seen = []
    for pp_stage, vpp_chunk in itertools.product(range(layout.pp), range(layout.vpp)):
        vp_stage = vpp_chunk if layout.vpp > 1 else None
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_stage)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_stage)
        layers = layout.chunk_layers(num_layers, pp_stage, vpp_chunk)
        assert layers == list(range(offset, offset + count)), (pp_stage, vpp_chunk)
        seen += layers
    assert sorted(seen) == list(range(num_layers))


def test_interleaved_chunks_by_hand():
    layout = ParallelLayout(pp=2, vpp=2)
    assert [layout.chunk_layers(8, p, v) for v in range(2) for p in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    "layout,world_size",
    [
        (ParallelLayout(tp=2), 2),
        (ParallelLayout(tp=2, pp=2), 8),
        (ParallelLayout(tp=2, ep=2), 2),
        (ParallelLayout(tp=2, pp=2, ep=4, etp=1), 16),
        (ParallelLayout(tp=4, pp=2, ep=2, etp=2), 16),
        (ParallelLayout(tp=8, pp=4), 64),
        (ParallelLayout(tp=2, pp=2, cp=2), 16),
        (ParallelLayout(tp=2, cp=2, ep=4, etp=1), 8),
    ],
)
def test_rank_coords_match_megatron_rank_generator(layout, world_size):
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"  # megatron-core's default
    dp = world_size // (layout.tp * layout.pp * layout.cp)
    edp = world_size // (layout.etp * layout.ep * layout.pp)
    dense = RankGenerator(tp=layout.tp, ep=1, dp=dp, pp=layout.pp, cp=layout.cp, order=order)
    expert = RankGenerator(tp=layout.etp, ep=layout.ep, dp=edp, pp=layout.pp, cp=1, order=order)
    coords = [rank_coords(layout, world_size, rank) for rank in range(world_size)]
    # Within each megatron group the coordinate along that dimension is 0..size-1 in order, and
    # every other coordinate is constant.
    for generator, token, field, others in [
        (dense, "tp", "tp", ("pp", "dp", "cp")),
        (dense, "cp", "cp", ("pp", "dp", "tp")),
        (dense, "dp", "dp", ("pp", "tp", "cp")),
        (dense, "pp", "pp", ("tp", "dp", "cp")),
        (expert, "tp", "etp", ("pp", "ep", "edp")),
        (expert, "ep", "ep", ("pp", "etp", "edp")),
        (expert, "dp", "edp", ("pp", "etp", "ep")),
    ]:
        for group in generator.get_ranks(token):
            assert [getattr(coords[r], field) for r in group] == list(range(len(group))), (token, group)
            for other in others:
                assert len({getattr(coords[r], other) for r in group}) == 1, (token, other, group)


def test_experts_of_rank():
    layout = ParallelLayout(ep=4)
    assert layout.experts_of_rank(16, 2) == [8, 9, 10, 11]
    assert layout.expert_owner(16, 9) == (2, 1)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tp=0), "tp=0"),
        (dict(vpp=2), "vpp=2 needs pipeline parallelism"),
        (dict(sequence_parallel=True), "sequence_parallel needs tp >= 2"),
        (dict(first_stage_layers=2), "need pp >= 2"),
        (dict(pp=2, vpp=2, first_stage_layers=3), "multiple of vpp=2"),
    ],
)
def test_invalid_layouts_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**kwargs)


def test_uneven_layer_split_is_rejected():
    with pytest.raises(ValueError, match="cannot be split evenly"):
        ParallelLayout(pp=3).chunk_layers(8, 0)
    with pytest.raises(ValueError, match="cannot be split over ep=3"):
        ParallelLayout(ep=3).experts_of_rank(8, 0)
