"""vLLM's reload warning for rotary embeddings is dropped; the same warning for any other layer is not.

The filter's install (``vllm_compat.apply_vllm_fixes`` inside the engine's worker) runs in every
weight sync of ``tests/trainer/test_console_run.py``, which checks the message is gone from the
replica's log."""
import logging

from megarl.rollout.vllm.compat import ROTARY_RELOAD_MESSAGE, RotaryCacheReloadFilter, set_tied_lm_head


def record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("vllm.model_executor.model_loader.reload.layerwise", logging.WARNING, "layerwise.py",
                             266, msg, args, None)


def test_only_rotary_layers_lose_the_reload_warning():
    quiet = RotaryCacheReloadFilter()
    for layer in ("RotaryEmbedding", "Llama3RotaryEmbedding", "DeepseekScalingRotaryEmbedding"):
        assert not quiet.filter(record(ROTARY_RELOAD_MESSAGE, layer))
    assert quiet.filter(record(ROTARY_RELOAD_MESSAGE, "QKVParallelLinear"))
    assert quiet.filter(record("%s: Excessive loading", "RotaryEmbedding"))


def test_a_tied_lm_head_loses_the_reload_warning_only_where_the_embeddings_are_tied():
    """SmolLM2 (tied): the head's weight is the embedding's, sent under that name, so its own reload gets nothing
    and warns on every sync; an untied head that gets nothing would be a missing tensor and still warns."""
    quiet = RotaryCacheReloadFilter()
    try:
        set_tied_lm_head(True)
        assert not quiet.filter(record(ROTARY_RELOAD_MESSAGE, "ParallelLMHead"))
        assert quiet.filter(record(ROTARY_RELOAD_MESSAGE, "VocabParallelEmbedding"))
        set_tied_lm_head(False)
        assert quiet.filter(record(ROTARY_RELOAD_MESSAGE, "ParallelLMHead"))
    finally:
        set_tied_lm_head(False)
