"""``RLBatch.multi_modal_inputs`` through every row operation, and the vision-language model inputs
(``packing.with_vision``): pure functions on a made-up batch, no model.

Each sample's ``pixel_values`` are filled with its row number, so a misaligned row shows.
"""
import pytest
import torch

from megarl.engine import RLBatch, concat_multi_modal_inputs, data_parallel_shard
from megarl.engine.batching import mini_batches
from megarl.engine.packing import pad_to, packed_row, padded_rows, with_vision
from megarl.models.mrope import mrope_position_ids

IMAGE = 99  # the image token id; a 1 x 4 x 4 patch grid merges (2 x 2) into 4 image tokens


def _sample(row: int, images: int) -> dict:
    if not images:
        return {}
    return {"pixel_values": torch.full((16 * images, 3), float(row)), "image_grid_thw": torch.tensor([[1, 4, 4]] * images)}


def make_batch() -> RLBatch:
    """Rows: 1 image (prompt left-padded), text, 2 images, text; row 0's response samples the image id as text."""
    prompts = torch.tensor([[0, 0, 0, 5, IMAGE, IMAGE, IMAGE, IMAGE, 6],
                            [0, 0, 0, 0, 0, 0, 0, 7, 8],
                            [IMAGE] * 4 + [4] + [IMAGE] * 4,
                            [0, 0, 0, 0, 0, 0, 9, 10, 11]])
    prompt_mask = (prompts != 0).long()
    responses = torch.tensor([[12, IMAGE, 13], [14, 0, 0], [15, 16, 0], [17, 18, 19]])
    return RLBatch.from_parts(prompts, prompt_mask, responses, (responses != 0).long(),
                              multi_modal_inputs=[_sample(0, 1), {}, _sample(2, 2), {}])


def _rows_of(batch: RLBatch) -> list:
    return [int(s["pixel_values"][0, 0]) if s else None for s in batch.multi_modal_inputs]


def test_row_operations_keep_the_pixel_inputs_with_their_rows():
    batch = make_batch()
    assert _rows_of(batch.select([2, 0, 3])) == [2, 0, None]
    assert _rows_of(data_parallel_shard(batch, 1, 2)) == [2, None]
    assert _rows_of(batch.to("cpu")) == [0, None, 2, None]
    assert _rows_of(batch.with_fields(old_log_probs=torch.zeros(4, 3))) == [0, None, 2, None]
    for step in mini_batches(4, 2, epochs=2, shuffle=True, seed=3):  # the update's shuffled mini-batches
        picked = batch.select(step)
        assert _rows_of(picked) == [i if i in (0, 2) else None for i in step]
        assert torch.equal(picked.input_ids, batch.input_ids[step])
    text = RLBatch.from_parts(batch.input_ids[:2, :9], batch.attention_mask[:2, :9], batch.responses[:2],
                              batch.response_mask[:2])
    joined = concat_multi_modal_inputs([batch.select([2]), text, batch.select([0])])
    assert [int(s["pixel_values"][0, 0]) if s else None for s in joined] == [2, None, None, 0]
    assert concat_multi_modal_inputs([text, text]) is None
    assert text.select([1]).multi_modal_inputs is None and not text.has_images()


def test_pixel_inputs_join_the_samples_in_row_order():
    pixels, grid = make_batch().select([2, 1, 0]).pixel_inputs()
    assert pixels[:, 0].tolist() == [2.0] * 32 + [0.0] * 16 and grid.shape == (3, 3)


@pytest.mark.parametrize("samples, match", [
    ([{}] * 3, "list of 4 dicts"),
    ([{"pixel_values": torch.zeros(16, 3)}, {}, {}, {}], r"exactly the keys"),
    ([{"pixel_values": torch.zeros(15, 3), "image_grid_thw": torch.tensor([[1, 4, 4]])}, {}, {}, {}], "sum\\(t\\*h\\*w\\)"),
    ([{"pixel_values": torch.zeros(16, 3), "image_grid_thw": torch.tensor([1, 4, 4])}, {}, {}, {}], r"\[images >= 1, 3\]"),
])
def test_malformed_pixel_inputs_are_refused_naming_the_sample(samples, match):
    batch = make_batch()
    with pytest.raises(ValueError, match=match):
        batch.with_fields(multi_modal_inputs=samples)


def _expected_positions(batch: RLBatch) -> torch.Tensor:
    """get_rope_index's positions of the batch layout, the prompts' image tokens only as images."""
    image_mask = (batch.input_ids == IMAGE) & batch.attention_mask.bool()
    image_mask[:, batch.prompt_length:] = False
    return mrope_position_ids(batch.input_ids, batch.pixel_inputs()[1], batch.attention_mask, image_token_id=IMAGE,
                              spatial_merge_size=2, image_mask=image_mask)


@pytest.mark.parametrize("layout", ["packed", "padded", "padded_grown"])
def test_model_inputs_carry_mrope_positions_the_prompt_image_mask_and_the_pixels(layout):
    batch = make_batch().select([3, 2, 0, 1])
    inputs = packed_row(batch) if layout == "packed" else padded_rows(batch)
    vision = with_vision(inputs, batch, IMAGE, 2)
    if layout == "padded_grown":  # a virtual pipeline's common shape
        vision = pad_to(vision, rows=6, length=20)
    source, real = vision.source, vision.source >= 0
    expected = _expected_positions(batch).reshape(3, -1)[:, source.clamp(min=0)] * real
    assert vision.position_ids.shape == (3, *vision.tokens.shape) and torch.equal(vision.position_ids, expected)
    # image tokens: the 8 + 4 of the prompts; row 0's sampled response id stays text
    assert int(vision.image_mask.sum()) == 12
    assert torch.equal(vision.tokens[vision.image_mask], torch.full((12,), IMAGE))
    assert int(((vision.tokens == IMAGE) & ~vision.image_mask).sum()) == 1
    assert vision.pixel_values[:, 0].tolist() == [2.0] * 32 + [0.0] * 16
    assert vision.image_grid_thw.shape == (3, 3)


def test_a_text_batch_gets_one_dimensional_positions_on_all_three_streams():
    batch = make_batch().select([1, 3]).with_fields(multi_modal_inputs=None)
    inputs = packed_row(batch)
    vision = with_vision(inputs, batch, IMAGE, 2)
    assert vision.pixel_values is None and not vision.image_mask.any()
    for stream in vision.position_ids:
        assert torch.equal(stream, inputs.position_ids)


def test_given_position_ids_are_refused_for_a_vision_language_model():
    batch = make_batch()
    batch = batch.with_fields(position_ids=torch.zeros_like(batch.input_ids))
    with pytest.raises(ValueError, match="position_ids cannot be given"):
        with_vision(padded_rows(batch), batch, IMAGE, 2)
