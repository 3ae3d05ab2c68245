"""The ``hf`` rollout backend: Hugging Face transformers generation in a Ray actor (verl's
``rollout.name=hf``), with the same weight sync, probe and sampling semantics as vLLM.
"""
