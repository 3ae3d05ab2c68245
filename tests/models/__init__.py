"""Tests of the HF <-> megatron-core bridge (megarl.models)."""
