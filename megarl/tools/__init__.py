"""Developer tools: tiny random-initialised Hugging Face checkpoints for tests and quickstart."""
