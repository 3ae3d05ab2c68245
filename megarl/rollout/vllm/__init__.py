"""The vLLM rollout backend: everything that knows vLLM (the engine replica actor, its engine
arguments, the worker extension that receives weights inside vLLM's workers, LoRA requests, the
OpenAI-compatible HTTP server, and the compatibility fixes for vLLM's own defects).
"""
