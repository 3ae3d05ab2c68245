"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE in this process at TP=PP=1 (gloo), against Hugging Face transformers.

The batch (``vision_fixture``): two images of different sizes in one row, a text-only row, one more image,
a short text-only row. Logits must equal HF's (1e-5 in fp32) at every real token, padded and packed; the
M-RoPE positions must equal ``get_rope_index``'s under any padding; the export must give back the
checkpoint (vision tower included) bit for bit; the vision tower is trained unless frozen.
"""
import copy

import pytest
import torch

from megarl.models import (ParallelLayout, build_model, freeze_vision_tower, gather_hf_tensors, load_hf_config,
                           model_dims)
from megarl.models.mrope import mrope_position_ids
from megarl.models.shards import hf_tensor_shapes, param_shards
from tests.models.test_bridge_tp1 import _checkpoint_tensors
from tests.models.vision_fixture import FAMILIES, MOE_FAMILIES, ZOO, hf_model

TOLERANCE = 1e-5


def _reference(vision_zoo, family):
    return torch.load(vision_zoo / "vision_reference.pt")[family]


def _positions(vision_zoo, family, batch, attention_mask=None):
    dims = model_dims(vision_zoo / family)
    return mrope_position_ids(batch["input_ids"], batch["image_grid_thw"], attention_mask, image_token_id=dims.vision.image_token_id,
                              spatial_merge_size=dims.vision.spatial_merge_size)


def _logits(model, batch, positions, **kwargs):
    model.eval()
    with torch.no_grad():
        return model(batch["input_ids"], positions, None, pixel_values=batch["pixel_values"],
                     image_grid_thw=batch["image_grid_thw"], **kwargs)


@pytest.mark.parametrize("family", ZOO)
@pytest.mark.usefixtures("world")
def test_logits_match_hugging_face(vision_zoo, family):
    reference = _reference(vision_zoo, family)
    [model] = build_model(vision_zoo / family, ParallelLayout())
    logits = _logits(model, reference, _positions(vision_zoo, family, reference, reference["attention_mask"]))
    real = reference["attention_mask"].bool()
    assert logits.shape == reference["logits"].shape
    assert (logits - reference["logits"])[real].abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("family", ZOO)
@pytest.mark.usefixtures("world")
def test_packed_rows_match_hugging_face(vision_zoo, family):
    """Every row's real tokens one after the other in one THD row, each with its own positions."""
    from megatron.core.packed_seq_params import PackedSeqParams

    reference = _reference(vision_zoo, family)
    real = reference["attention_mask"].bool()
    positions = _positions(vision_zoo, family, reference, reference["attention_mask"])
    lengths = real.sum(dim=1)
    tokens = reference["input_ids"][real].unsqueeze(0)
    packed_positions = positions.permute(1, 2, 0)[real].T.unsqueeze(1)  # [3, 1, T], row by row
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    longest = int(lengths.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest)
    [model] = build_model(vision_zoo / family, ParallelLayout())
    logits = _logits(model, {**reference, "input_ids": tokens}, packed_positions, packed_seq_params=params)[0]
    assert (logits - reference["logits"][real]).abs().max().item() <= TOLERANCE


def _repadded(batch, image_token_id, left: list[int], right: list[int]):
    """The batch's real tokens with ``left[b]`` padding tokens before and ``right[b]`` after them in row ``b``."""
    real = batch["attention_mask"].bool()
    rows = [batch["input_ids"][b][real[b]] for b in range(len(real))]
    width = max(l + len(r) + rr for l, r, rr in zip(left, rows, right))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, left[b]:left[b] + len(row)] = row
        mask[b, left[b]:left[b] + len(row)] = 1
    return ids, mask, (ids == image_token_id).int() * mask


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padding", ["right", "left", "both"])
def test_mrope_positions_equal_transformers(vision_zoo, family, padding):
    """Several images of different sizes, text-only rows; padding as the processor (left, right) or the RL
    batch (left-padded prompt, right-padded response) lays it out."""
    reference = _reference(vision_zoo, family)
    dims = model_dims(vision_zoo / family)
    pads = {"right": ([0, 0, 0, 0], [0, 3, 1, 5]), "left": ([4, 0, 2, 7], [0, 0, 0, 0]),
            "both": ([2, 0, 5, 1], [3, 4, 0, 2])}[padding]
    ids, mask, token_types = _repadded(reference, dims.vision.image_token_id, *pads)
    model = hf_model(vision_zoo / family).model
    expected, _ = model.get_rope_index(ids, token_types, image_grid_thw=reference["image_grid_thw"], attention_mask=mask)
    positions = mrope_position_ids(ids, reference["image_grid_thw"], mask, image_token_id=dims.vision.image_token_id,
                                   spatial_merge_size=dims.vision.spatial_merge_size)
    assert positions.shape == (3, *ids.shape) and torch.equal(positions, expected)
    assert len(set(positions[1][0][mask[0].bool()].tolist())) < mask[0].sum()  # images share positions


def test_mrope_positions_refuse_images_that_do_not_fit(vision_zoo):
    reference = _reference(vision_zoo, "qwen2_5_vl")
    dims = model_dims(vision_zoo / "qwen2_5_vl")
    kwargs = dict(image_token_id=dims.vision.image_token_id, spatial_merge_size=dims.vision.spatial_merge_size)
    with pytest.raises(ValueError, match="3 images, the rows hold 2"):
        mrope_position_ids(reference["input_ids"][:2], reference["image_grid_thw"], reference["attention_mask"][:2], **kwargs)
    grids = reference["image_grid_thw"].clone()
    grids[0, 1] += 2  # one more row of merged tokens than the prompt holds
    with pytest.raises(ValueError, match="row 0: an image of grid"):
        mrope_position_ids(reference["input_ids"], grids, reference["attention_mask"], **kwargs)


@pytest.mark.usefixtures("world")
def test_deepstack_features_reach_the_first_layers(vision_zoo, monkeypatch):
    """Qwen3-VL without its DeepStack features is far from HF: the logits test sees them."""
    from megarl.models.vision_model import VisionLanguageModel

    reference = _reference(vision_zoo, "qwen3_vl")
    real_features = VisionLanguageModel.image_features
    monkeypatch.setattr(VisionLanguageModel, "image_features", lambda self, *a: (real_features(self, *a)[0], []))
    [model] = build_model(vision_zoo / "qwen3_vl", ParallelLayout())
    logits = _logits(model, reference, _positions(vision_zoo, "qwen3_vl", reference, reference["attention_mask"]))
    image_rows = reference["attention_mask"].bool() & (torch.arange(4) != 1)[:, None]
    assert (logits - reference["logits"])[image_rows].abs().max().item() > 1e-3


@pytest.mark.parametrize("family", ZOO)
@pytest.mark.usefixtures("world")
def test_export_reproduces_the_checkpoint_bit_for_bit(vision_zoo, family):
    [model] = build_model(vision_zoo / family, ParallelLayout())
    original = _checkpoint_tensors(vision_zoo / family)
    exported = dict(gather_hf_tensors([model], vision_zoo / family, ParallelLayout()))
    assert sorted(exported) == sorted(original)
    assert _packed(hf_tensor_shapes(vision_zoo / family), vision_zoo / family) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)


def _packed(names, checkpoint) -> list[str]:
    """The bridge's tensor names with every part of a packed checkpoint tensor replaced by that tensor's name."""
    from megarl.models import family_for
    from megarl.models.packed import packed_parts

    config = load_hf_config(checkpoint)
    parts = packed_parts(family_for(config), model_dims(checkpoint))
    return sorted({parts[name][0].name if name in parts else name for name in names})


def _train_step(model, reference, family, vision_zoo):
    model.train()
    logits = model(reference["input_ids"], _positions(vision_zoo, family, reference, reference["attention_mask"]), None,
                   pixel_values=reference["pixel_values"], image_grid_thw=reference["image_grid_thw"])
    logits.float().logsumexp(-1).mean().backward()


@pytest.mark.usefixtures("world")
def test_vision_tower_is_trained_unless_frozen(vision_zoo):
    reference = _reference(vision_zoo, "qwen2_5_vl")
    tower = [name for name in _checkpoint_tensors(vision_zoo / "qwen2_5_vl") if name.startswith("visual.")]
    [model] = build_model(vision_zoo / "qwen2_5_vl", ParallelLayout())
    params = dict(model.named_parameters())
    assert sorted(name for name in params if name.startswith("visual.")) == sorted(tower)
    _train_step(model, reference, "qwen2_5_vl", vision_zoo)
    assert all(params[name].grad is not None and params[name].grad.abs().sum() > 0 for name in tower)

    [frozen] = build_model(vision_zoo / "qwen2_5_vl", ParallelLayout(), freeze_vision_tower=True)
    params = dict(frozen.named_parameters())
    assert not any(params[name].requires_grad for name in tower)
    _train_step(frozen, reference, "qwen2_5_vl", vision_zoo)
    assert all(params[name].grad is None for name in tower)
    assert params["embedding.word_embeddings.weight"].grad is not None
    assert freeze_vision_tower([frozen], frozen=False) == len(tower)
    assert all(params[name].requires_grad for name in tower)


def test_layouts_the_vision_language_models_cannot_take(vision_zoo):
    config = copy.deepcopy(load_hf_config(vision_zoo / "qwen3_vl"))
    config.vision_config.deepstack_visual_indexes = [0, 1]  # features for both layers; PP=2 puts layer 1 on stage 1
    with pytest.raises(ValueError, match="DeepStack features and must be on the first pipeline stage"):
        param_shards(config, ParallelLayout(pp=2))
    with pytest.raises(ValueError, match="M-RoPE under context parallelism"):
        param_shards(vision_zoo / "qwen2_5_vl", ParallelLayout(cp=2))


@pytest.mark.parametrize("family", ZOO)
def test_vllm_splits_name_the_checkpoint_and_send_the_tower_whole(vision_zoo, family):
    """The weight sync's vLLM splits use the checkpoint's names; vLLM splits the tower with its own loaders."""
    from megarl.models.vllm_layout import vllm_splits

    splits = vllm_splits(vision_zoo / family)
    names = _checkpoint_tensors(vision_zoo / family)
    assert _packed(splits, vision_zoo / family) == sorted(names)  # Qwen3-VL-MoE's experts: one part per expert
    language = model_dims(vision_zoo / family).hf_prefix
    assert splits[language + "layers.0.self_attn.q_proj.weight"].kind == "column"
    mlp = language + ("layers.0.mlp.experts.3." if family in MOE_FAMILIES else "layers.0.mlp.")
    assert splits[mlp + "down_proj.weight"].kind == "row" and splits[mlp + "up_proj.weight"].kind == "column"
    tower = [name for name in names if "visual." in name]
    assert tower and all(splits[name].kind == "whole" for name in tower)


@pytest.mark.usefixtures("world")
def test_an_image_token_sampled_in_a_response_is_text(vision_zoo):
    """A response holding the image token id (sampled: vLLM embeds and positions it as text). With
    ``image_mask`` (the prompt's image tokens) the positions equal ``get_rope_index``'s with that
    ``mm_token_type_ids`` and the logits HF's language model's on the prompt's images; without it, refused."""
    reference = _reference(vision_zoo, "qwen2_5_vl")
    image_token = model_dims(vision_zoo / "qwen2_5_vl").vision.image_token_id
    prompt = reference["attention_mask"].bool()
    lengths = prompt.sum(dim=1)
    ids = torch.nn.functional.pad(reference["input_ids"], (0, 3))
    mask = torch.nn.functional.pad(reference["attention_mask"], (0, 3))
    for b, length in enumerate(lengths.tolist()):  # a 3-token response right after each prompt
        ids[b, length:length + 3] = torch.tensor([7, image_token, 9])
        mask[b, length:length + 3] = 1
    image_mask = (ids == image_token) & torch.nn.functional.pad(prompt, (0, 3))
    hf = hf_model(vision_zoo / "qwen2_5_vl")
    expected_positions, _ = hf.model.get_rope_index(ids, image_mask.int(), image_grid_thw=reference["image_grid_thw"],
                                                    attention_mask=mask)
    kwargs = dict(image_token_id=image_token, spatial_merge_size=2)
    positions = mrope_position_ids(ids, reference["image_grid_thw"], mask, image_mask=image_mask, **kwargs)
    assert torch.equal(positions, expected_positions)
    with pytest.raises(ValueError, match="need image_mask"):
        mrope_position_ids(ids, reference["image_grid_thw"], mask, **kwargs)

    with torch.no_grad():
        embeds = hf.model.get_input_embeddings()(ids)
        features = hf.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"]).pooler_output
        embeds[image_mask] = torch.cat(features)
        hidden = hf.model.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask).last_hidden_state
        expected = hf.lm_head(hidden)
    [model] = build_model(vision_zoo / "qwen2_5_vl", ParallelLayout())
    logits = _logits(model, {**reference, "input_ids": ids}, positions, image_mask=image_mask)
    assert (logits - expected)[mask.bool()].abs().max().item() <= TOLERANCE
