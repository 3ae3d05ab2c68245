"""Write the language model of a vision-language checkpoint as the text checkpoint its model family reads.

    python -m megarl.devtools.extract_language_model SRC OUT [--overwrite]

Published Qwen3.5 checkpoints are ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``
(the language model under ``model.language_model.*``, the vision tower under ``model.visual.*``), which
megarl refuses before the start (vision-language training is issue 28). OUT gets:

* ``config.json``: SRC's ``text_config`` as the text family's architecture (``Qwen3_5ForCausalLM``...), with
  SRC's top-level ``tie_word_embeddings`` (the one the vision-language model ties by) and dtype;
* every tensor but ``model.visual.*``, bit for bit, ``model.language_model.<x>`` renamed ``model.<x>``
  (``lm_head.weight`` and the multi-token-prediction ``mtp.*`` kept as they are), in files of SRC's names;
* the tokenizer, chat template and generation config.

SRC may also be a text checkpoint whose names keep ``model.language_model.`` (transformers writes that when
``Qwen3_5ForCausalLM`` loaded from the vision-language checkpoint is saved). One file is in memory at a time.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PREFIX, VISION = "model.language_model.", "model.visual."


def _text_config(config: dict) -> dict:
    from megarl.models.families import FAMILIES, vision_language_family

    architectures = config.get("architectures") or []
    found = vision_language_family(architectures)
    if found is not None:
        text = dict(config["text_config"])
        text["architectures"] = [found[1].architectures[0]]
        for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
            if key in config:
                text[key] = config[key]
        return text
    served = [spec for spec in FAMILIES.values() if spec.vision_language_architectures]
    if any(a in spec.architectures for spec in served for a in architectures):
        return config  # a text checkpoint of such a family, whose names may keep the prefix
    known = sorted(a for spec in served for a in spec.vision_language_architectures)
    raise ValueError(f"architectures={architectures}: not a vision-language model whose language model megarl reads "
                     f"(those are {', '.join(known)})")


def extract_language_model(src: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write SRC's language model to OUT (see the module docstring); returns OUT."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megarl.models.export import copy_tokenizer_files
    from megarl.models.loading import INDEX_FILE, checkpoint_files

    src, out = Path(src), Path(out)
    text = _text_config(json.loads((src / "config.json").read_text()))
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} exists and is not empty; pass --overwrite or choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    files = checkpoint_files(src)
    for file_name in sorted(set(files.values())):
        with safe_open(str(src / file_name), framework="pt") as f:
            tensors = {(("model." + name[len(PREFIX):]) if name.startswith(PREFIX) else name): f.get_tensor(name)
                       for name in f.keys() if not name.startswith(VISION)}
        if tensors:
            save_file(tensors, str(out / file_name), metadata={"format": "pt"})
            weight_map.update({name: file_name for name in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    if (src / INDEX_FILE).is_file():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(text, indent=2, sort_keys=True) + "\n")
    copy_tokenizer_files(src, out)
    for extra in ("preprocessor_config.json", "video_preprocessor_config.json"):  # the vision tower's, not needed
        if (out / extra).is_file():
            (out / extra).unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="the vision-language checkpoint directory")
    parser.add_argument("out", help="the text checkpoint to write")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")
    args = parser.parse_args(argv)
    out = extract_language_model(args.src, args.out, args.overwrite)
    print(f"wrote the language model of {args.src} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
