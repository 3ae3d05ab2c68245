"""The HF <-> megatron-core bridge: model families, the shard layout, model building, load and export.

Public API:
  ParallelLayout, RankCoords, rank_coords          -- layout.py: TP/PP/VPP/EP/ETP arithmetic
  ModelDims, model_dims, load_hf_config            -- dims.py / shards.py: what the bridge reads from an HF config
  VllmSplit, vllm_splits, vllm_hf_overrides,       -- vllm_layout.py: how vLLM splits each HF tensor over TP,
  uses_mla                                            the config fields it needs, its attention kind
  HFPiece, ShardSpec, param_shards, rank_shards,   -- shards.py: the public shard layout (pure functions)
  hf_tensor_shapes, check_layout
  FAMILIES, FamilySpec, ParamMap, family_for,      -- families/: the per-family declarative maps
  register_family
  build_model, default_transformer_impl            -- build.py: GPTModel chunks for a rank (actor/ref/critic)
  load_hf_weights, LoadReport                      -- loading.py: sliced, per-rank safetensors loading
  export_hf_pieces, gather_hf_tensors,             -- export.py: HF-named pieces / full tensors / checkpoint
  save_hf_checkpoint, ExportedPiece
  ValueHead                                        -- value_head.py: the critic head
"""
from megarl.models.build import build_model, default_transformer_impl
from megarl.models.dims import ModelDims, load_hf_config
from megarl.models.export import ExportedPiece, export_hf_pieces, gather_hf_tensors, save_hf_checkpoint
from megarl.models.families import FAMILIES, FamilySpec, ParamMap, family_for, register_family
from megarl.models.layout import ParallelLayout, RankCoords, rank_coords
from megarl.models.loading import LoadReport, load_hf_weights
from megarl.models.shards import HFPiece, ShardSpec, check_layout, hf_tensor_shapes, model_dims, param_shards, rank_shards
from megarl.models.value_head import ValueHead
from megarl.models.vllm_layout import VllmSplit, uses_mla, vllm_hf_overrides, vllm_splits

__all__ = [
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
]
