"""Engine test fixtures: the tiny checkpoints and the RL batches (old/ref log-probs derived from
Hugging Face log-probs), made once per session and shared by the worker launches."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _engine_data as _data  # noqa: E402
import _engine_hf as _hf_reference  # noqa: E402


@pytest.fixture(scope="session")
def engine_work(tmp_path_factory) -> Path:
    """A directory with the checkpoints and ``batch.pt``: per model, a batch whose old/ref
    log-probs are that model's HF log-probs plus noise; ``batch_b`` a second dense batch."""
    work = tmp_path_factory.mktemp("engine")
    _data.make_checkpoints(work)
    batches = {}
    for model, seed in [(_data.DENSE, 0), (_data.MOE, 0), (_data.DENSE_SMALL, 0)]:
        batch = _data.base_batch(seed)
        batches[model] = _data.with_behaviour_log_probs(batch, _hf_reference.hf_log_probs(work / model, batch)[0])
    second = _data.base_batch(1)
    batch_b = _data.with_behaviour_log_probs(second, _hf_reference.hf_log_probs(work / _data.DENSE, second)[0], seed=2)
    distill = _data.with_teacher_topk(batches[_data.DENSE])
    torch.save({"batches": batches, "batch_b": batch_b, "distill": distill}, work / "batch.pt")
    return work


@pytest.fixture(scope="session")
def data(engine_work) -> dict:
    return _data.load(engine_work / "batch.pt")
