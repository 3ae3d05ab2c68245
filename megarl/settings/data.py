"""The data the config names: the train and validation datasets and the training loader.

Config keys read (``data.*``, verl's names; defaults in brackets): ``train_files``, ``val_files``,
``prompt_key`` ["prompt"], ``reward_fn_key`` ["data_source"], ``max_prompt_length`` [1024],
``truncation`` ["error"], ``filter_overlong_prompts`` [True], ``apply_chat_template_kwargs`` [{}],
``train_max_samples`` / ``val_max_samples`` [-1: all rows], ``train_batch_size`` (required for
training), ``shuffle`` [True], ``seed`` [1], ``drop_last`` [True], ``image_key`` ["images"],
``video_key`` ["videos"], ``audio_key`` ["audios"] (rows holding videos or audio are refused).
(``val_batch_size`` is the trainer's: ``megarl.settings.trainer``.) A vision-language model
(``load_processor``) gives the datasets its ``AutoProcessor``.
"""
from __future__ import annotations

from typing import Any

from megarl.data.dataset import PromptDataset
from megarl.data.loader import PromptDataLoader


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    """Read a key from a dict, an OmegaConf node or a dataclass-like object."""
    if cfg is None:
        return default
    if hasattr(cfg, "get"):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def build_dataset(data_cfg: Any, tokenizer: Any, split: str, need_reward_fn_key: bool = True,
                  chat_tools=None, processor: Any = None) -> PromptDataset:
    """The train (``split="train"``) or validation (``split="val"``) dataset from ``data.*``.

    ``need_reward_fn_key=False`` (a custom reward function is given) accepts files without the
    ``data.reward_fn_key`` column. ``chat_tools(agent_name)`` gives the tool schemas to render
    into a row's prompt (None: none). ``processor``: a vision-language model's (``load_processor``).
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    files = _get(data_cfg, "train_files" if split == "train" else "val_files")
    if files is None:
        raise ValueError(f"data.{split}_files is not set: give a parquet path or a list of paths")
    if not isinstance(files, str) and hasattr(files, "__iter__"):
        files = [str(f) for f in files]  # OmegaConf ListConfig -> plain list
    return PromptDataset(
        files,
        tokenizer,
        prompt_key=_get(data_cfg, "prompt_key", "prompt"),
        max_prompt_length=int(_get(data_cfg, "max_prompt_length", 1024)),
        truncation=_get(data_cfg, "truncation", "error"),
        filter_overlong_prompts=bool(_get(data_cfg, "filter_overlong_prompts", True)),
        apply_chat_template_kwargs=dict(_get(data_cfg, "apply_chat_template_kwargs", {})),
        reward_fn_key=str(_get(data_cfg, "reward_fn_key", "data_source")),
        need_reward_fn_key=need_reward_fn_key,
        max_samples=int(_get(data_cfg, "train_max_samples" if split == "train" else "val_max_samples", -1)),
        shuffle=bool(_get(data_cfg, "shuffle", True)),
        seed=_get(data_cfg, "seed", 1),  # None: 1 as for the batches (resume needs a fixed draw)
        chat_tools=chat_tools,
        processor=processor,
        image_key=str(_get(data_cfg, "image_key", "images")),
        video_key=str(_get(data_cfg, "video_key", "videos")),
        audio_key=str(_get(data_cfg, "audio_key", "audios")),
    )


def build_train_loader(data_cfg: Any, tokenizer: Any, need_reward_fn_key: bool = True,
                       chat_tools=None, processor: Any = None) -> PromptDataLoader:
    """The training loader: ``data.train_batch_size`` prompts per batch, shuffled per epoch."""
    batch_size = _get(data_cfg, "train_batch_size")
    if batch_size is None:
        raise ValueError("data.train_batch_size is not set")
    return PromptDataLoader(
        build_dataset(data_cfg, tokenizer, "train", need_reward_fn_key, chat_tools, processor),
        int(batch_size),
        shuffle=bool(_get(data_cfg, "shuffle", True)),
        seed=int(_get(data_cfg, "seed", 1)),
        drop_last=bool(_get(data_cfg, "drop_last", True)),
    )


def load_tokenizer(cfg):
    """The driver's tokenizer (verl: ``data.trust_remote_code``), with ``model.custom_chat_template``."""
    from transformers import AutoTokenizer

    model = cfg.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_path or model.path,
                                              trust_remote_code=cfg.data.trust_remote_code)
    if model.custom_chat_template:
        tokenizer.chat_template = model.custom_chat_template
    return tokenizer


def load_processor(cfg):
    """The model's ``AutoProcessor`` when it is a vision-language model (its config.json has a ``vision_config``,
    as Qwen2.5-VL's and Qwen3-VL's do), else None: a text model's datasets need none."""
    import json
    from pathlib import Path

    from megarl.models.locate import resolve_model_path

    path = cfg.actor_rollout_ref.model.path
    config = Path(resolve_model_path(str(path)) or str(path)) / "config.json"
    if not config.is_file() or "vision_config" not in json.loads(config.read_text(encoding="utf-8")):
        return None  # a text model (a missing config.json is the model check's to report)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(config.parent, trust_remote_code=cfg.data.trust_remote_code)
    if getattr(processor, "image_processor", None) is None or not getattr(processor, "image_token", None):
        raise ValueError(f"{path}: the model has a vision_config but its AutoProcessor ({type(processor).__name__}) "
                         "has no image processor or image token: add its preprocessor_config.json")
    return processor
