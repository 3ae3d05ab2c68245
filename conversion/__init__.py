"""Checkpoint conversion between Hugging Face safetensors and megatron-core distributed checkpoints.

    python -m conversion hf-to-megatron --hf HF_DIR --out MCORE_DIR [--tp/--pp/--ep/--etp/--vpp]
    python -m conversion megatron-to-hf --checkpoint RUN/actor --hf-config HF_DIR --out HF_OUT
    python -m conversion verify --hf HF_DIR [--megatron MCORE_DIR] [--tp ...]

(also ``megarl convert ...``). Modules: ``hf_to_megatron``, ``megatron_to_hf``, ``verify``;
``common`` holds the layout flags, world-size check and atomic output handling they share.
"""
