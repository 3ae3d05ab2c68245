"""PromptDataset on verl's multimodal parquet: geo3k's output unchanged, image tokens in the prompt ids and the
length rules, several images per row, text rows mixed in, bad image rows skipped and counted by reason."""
from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from megarl.data import DataFormatError, PromptDataset, collapse_image_tokens, collate
from megarl.data.images import pixel_inputs
from megarl.settings.data import build_dataset
from tests.data.conftest import VISION_FAMILIES
from tests.data.data_helpers import verl_row, write_parquet
from tests.data.vision_helpers import GEO3K_SOURCE, geo3k_row, noise_image, png, write_geo3k

SIZES = [(50, 90), (300, 200), (20, 20)]


def _runs(ids: list[int], token: int) -> list[int]:
    """The lengths of the runs of ``token`` in ``ids``."""
    runs, length = [], 0
    for t in ids + [None]:
        if t == token:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return runs


def _image_row(content: str, images: list, index: int, **extra) -> dict:
    return {**verl_row(content, str(index), index), "images": images, **extra}


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_verls_geo3k_parquet_loads_unchanged_with_the_ids_the_processor_makes(tmp_path, vision_models, family):
    tokenizer, processor, _ = vision_models[family]
    images = [[noise_image(h, w, seed=i)] for i, (h, w) in enumerate(SIZES)]
    problems = ["<image>Find x. Round to the nearest tenth.", "<image>Find the area of the figure.",
                "In the figure, <image> what is m \\angle 2?"]
    path = write_geo3k([geo3k_row(p, str(i), im, i) for i, (p, im) in enumerate(zip(problems, images))],
                       tmp_path / "train.parquet")
    dataset = PromptDataset(path, tokenizer, processor=processor, max_prompt_length=1024)
    assert len(dataset) == 3 and not dataset.skipped
    for item, originals in zip(dataset, images):
        expected = processor(text=[item.prompt_text], images=originals, return_tensors="pt")
        assert item.prompt_ids == expected["input_ids"][0].tolist()  # what the model sees, image tokens expanded
        got = pixel_inputs(item.images, processor)  # the stored images give the processor's pixels
        assert torch.equal(got["pixel_values"], expected["pixel_values"])
        assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
        assert item.prompt_text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1 and "<image>" not in \
            item.prompt_text
        assert item.data_source == GEO3K_SOURCE and item.ability == "math" and item.extra_info["split"] == "train"
        engine_ids = collapse_image_tokens(item.prompt_ids, processor.image_token_id, len(item.images))
        assert engine_ids == tokenizer(item.prompt_text, add_special_tokens=False)["input_ids"]  # vLLM's form
    assert dataset[2].raw_prompt[0]["content"][:2] == [{"type": "text", "text": "In the figure, "}, {"type": "image"}]
    assert collate(list(dataset))["images"] == [item.images for item in dataset]


def test_several_images_of_different_sizes_in_one_row_and_text_rows_mixed_in(tmp_path, vision_models):
    tokenizer, processor, _ = vision_models["qwen2_5_vl"]
    originals = [noise_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    rows = [
        _image_row("Compare <image> with <image>, then <image>.", [{"bytes": png(im)} for im in originals], 0),
        _image_row("What is 3 + 4?", [], 1),  # a text row: an empty images list
        _image_row("What is 5 + 6?", None, 2),  # and a null one
    ]
    dataset = PromptDataset(write_parquet(rows, tmp_path / "mixed.parquet"), tokenizer, processor=processor)
    tokens = (processor.image_processor(images=originals, return_tensors="pt")["image_grid_thw"].prod(-1) // 4).tolist()
    first = dataset[0]
    assert _runs(first.prompt_ids, processor.image_token_id) == tokens == [6, 54, 4]  # in placeholder order
    assert [im.size for im in first.images] == [(84, 56), (168, 252), (56, 56)]  # PIL: (width, height)
    assert len(collapse_image_tokens(first.prompt_ids, processor.image_token_id, 3)) == len(first.prompt_ids) - 61
    with pytest.raises(ValueError, match="3 runs of image tokens for 2 images"):
        collapse_image_tokens(first.prompt_ids, processor.image_token_id, 2)
    for item, question in zip(dataset.items[1:], ["What is 3 + 4?", "What is 5 + 6?"]):
        text_ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        assert item.images == () and item.prompt_ids == list(text_ids) and item.raw_prompt[0]["content"] == question


def test_image_tokens_count_against_max_prompt_length(tmp_path, vision_models, caplog):
    tokenizer, processor, _ = vision_models["qwen2_5_vl"]
    big = noise_image(300, 200)  # 54 image tokens
    rows = [_image_row("<image>Describe.", [{"bytes": png(big)}], 0), _image_row("Describe nothing.", [], 1)]
    path = write_parquet(rows, tmp_path / "t.parquet")
    full = len(PromptDataset(path, tokenizer, processor=processor)[0].prompt_ids)
    assert full > 54 > full - 54  # the text alone would fit a limit of 54
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        filtered = PromptDataset(path, tokenizer, processor=processor, max_prompt_length=full - 1)
    assert [it.index for it in filtered] == [1] and filtered.num_filtered == 1 and "filtered 1 of 2" in caplog.text
    with pytest.raises(DataFormatError, match=rf"t\.parquet: row 0: prompt has {full} tokens"):
        PromptDataset(path, tokenizer, processor=processor, max_prompt_length=full - 1, filter_overlong_prompts=False)


@pytest.mark.parametrize("mode, keeps", [("left", False), ("right", True), ("middle", True)])
def test_truncation_never_cuts_through_an_image(tmp_path, vision_models, caplog, mode, keeps):
    """The image at the start: keeping the head keeps it whole; left truncation would cut it: the row is skipped."""
    tokenizer, processor, _ = vision_models["qwen2_5_vl"]
    rows = [_image_row("<image>" + "Describe it in detail. " * 4, [{"bytes": png(noise_image(56, 56))}], 0),
            _image_row("A text row.", [], 1)]
    path = write_parquet(rows, tmp_path / "t.parquet")
    full = PromptDataset(path, tokenizer, processor=processor)[0].prompt_ids
    limit = len(full) - 5
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        dataset = PromptDataset(path, tokenizer, processor=processor, max_prompt_length=limit,
                                filter_overlong_prompts=False, truncation=mode)
    if keeps:
        assert dataset[0].index == 0 and len(dataset[0].prompt_ids) == limit and len(dataset[0].images) == 1
        assert _runs(dataset[0].prompt_ids, processor.image_token_id) == [4]
    else:
        assert [it.index for it in dataset] == [1]
        assert dataset.skipped.counts == {"truncation would cut an image's tokens": 1}
        assert "skipped 1 of 2 rows: 1 truncation would cut an image's tokens (" in caplog.text
        assert "t.parquet: row 0" in caplog.text


def test_bad_image_rows_are_skipped_and_counted_by_reason_with_their_locations(tmp_path, vision_models, caplog):
    tokenizer, processor, _ = vision_models["qwen3_vl"]
    good = {"bytes": png(noise_image(40, 40))}
    rows = [
        _image_row("<image>ok", [good], 0),
        _image_row("<image>broken", [{"bytes": b"\x89PNG garbage"}], 1),
        _image_row("<image>gone", [{"bytes": None, "path": str(tmp_path / "nope.png")}], 2),
        _image_row("<image> and <image>", [good], 3),
        _image_row("no placeholder", [good], 4),
        _image_row("<image><video>", [good], 5),
        _image_row("<image>broken again", [{"bytes": b"junk"}], 6),
        _image_row("<image>broken thrice", [{"bytes": b"junk"}], 7),
        _image_row("<image>broken four", [{"bytes": b"junk"}], 8),
        _image_row("text with a literal <|image_pad|> token", [], 9),
        _image_row("<image>ok too", [good], 10),
    ]
    path = write_parquet(rows, tmp_path / "bad.parquet")
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        dataset = PromptDataset(path, tokenizer, processor=processor)
    assert [it.index for it in dataset] == [0, 10]
    assert dataset.skipped.counts == {"undecodable image": 4, "missing image file": 1,
                                      "more <image> placeholders than images": 1,
                                      "fewer <image> placeholders than images": 1, "a <video> placeholder": 1,
                                      "image tokens do not match the images": 1}
    text = caplog.text
    assert "skipped 9 of 11 rows: 4 undecodable image (" in text
    assert "bad.parquet: row 1 (" in text and "bad.parquet: row 7 (" in text and "; and 1 more)" in text
    assert "bad.parquet: row 8" not in text  # the first three locations per reason
    assert "1 missing image file (" in text and "nope.png" in text and "bad.parquet: row 9 (" in text


def test_all_rows_bad_is_an_error_naming_the_reasons(tmp_path, vision_models):
    tokenizer, processor, _ = vision_models["qwen2_5_vl"]
    path = write_parquet([_image_row("<image>", [{"bytes": b"junk"}], i) for i in range(2)], tmp_path / "b.parquet")
    with pytest.raises(DataFormatError, match=r"no usable rows in .*skipped 2 of 2 rows: 2 undecodable image"):
        PromptDataset(path, tokenizer, processor=processor)


def test_videos_and_audio_are_refused_and_images_need_a_vision_language_model(tmp_path, vision_models, tokenizer):
    vl_tokenizer, processor, _ = vision_models["qwen2_5_vl"]
    image = [{"bytes": png(noise_image(30, 30))}]
    videos = write_parquet([_image_row("<image>", image, 0, videos=[]),
                            _image_row("<image><video>", image, 1, videos=[{"video": "clip.mp4"}])],
                           tmp_path / "v.parquet")
    with pytest.raises(DataFormatError, match=r"v\.parquet: 1 row\(s\) hold 'videos' \(data.video_key; rows 1\): "
                                              "megarl does not train on videos"):
        PromptDataset(videos, vl_tokenizer, processor=processor)
    audio = write_parquet([_image_row("hi", [], 0, clips=[{"bytes": b"x"}])], tmp_path / "a.parquet")
    with pytest.raises(DataFormatError, match=r"data.audio_key"):
        PromptDataset(audio, vl_tokenizer, processor=processor, audio_key="clips")
    images = write_parquet([_image_row("<image>", image, 0), _image_row("x", [], 1)], tmp_path / "i.parquet")
    with pytest.raises(DataFormatError, match=r"1 of 2 rows have images \(column 'images', data.image_key; "
                                              r".*i\.parquet: row 0\) but the model is not a vision-language model"):
        PromptDataset(images, tokenizer)
    text = write_parquet([_image_row("x", [], 0), _image_row("y", None, 1, videos=None)], tmp_path / "t.parquet")
    assert len(PromptDataset(text, tokenizer)) == 2  # empty images and videos columns: a text dataset


def test_image_key_from_the_config(tmp_path, vision_models):
    tokenizer, processor, _ = vision_models["qwen2_5_vl"]
    rows = [{**verl_row("<image>Which colour?", "red", i), "pictures": [{"bytes": png(noise_image(30, 30, seed=i))}]}
            for i in range(2)]
    path = write_parquet(rows, tmp_path / "p.parquet")
    cfg = OmegaConf.create({"train_files": path, "image_key": "pictures", "max_prompt_length": 256})
    dataset = build_dataset(cfg, tokenizer, "train", processor=processor)
    assert [len(it.images) for it in dataset] == [1, 1]
    with pytest.raises(DataFormatError, match="more <image> placeholders than images"):  # the default column: none
        build_dataset(OmegaConf.create({"train_files": path, "max_prompt_length": 256}), tokenizer, "train",
                      processor=processor)


def test_the_processor_is_loaded_for_a_vision_language_model_only(tmp_path, vision_models):
    from megarl.settings.data import load_processor

    def cfg(path):
        return OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(path)}}, "data": {"trust_remote_code": False}})

    _, expected, path = vision_models["qwen3_vl"]
    processor = load_processor(cfg(path))
    assert type(processor) is type(expected) and processor.image_token == "<|image_pad|>"
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}')
    assert load_processor(cfg(tmp_path / "text")) is None
