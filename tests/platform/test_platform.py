"""Device facts, platform-dependent config flags, and the CPU layer's entry points.

These run in the pytest process and never apply a redirect there; the one test that needs
megatron-core imported and redirects possibly applied runs in a subprocess.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from megarl import platform
from megarl.platform import hardware


@pytest.fixture
def cuda_present(monkeypatch):
    """Pretend this machine has CUDA (only ``has_cuda`` is faked; nothing touches a GPU)."""
    monkeypatch.setattr(hardware, "has_cuda", lambda: True)


def test_cpu_machine_picks_gloo_fp32_and_cpu_device():
    assert not torch.cuda.is_available(), "these tests describe the CPU machine"
    assert platform.has_cuda() is False
    assert platform.dist_backend() == "gloo"
    assert platform.default_dtype() == torch.float32
    assert platform.device() == torch.device("cpu")
    assert platform.set_device(0) == torch.device("cpu")
    platform.synchronize()
    platform.empty_cache()


def test_gpu_machine_picks_nccl_bf16_and_local_rank_device(cuda_present, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert platform.dist_backend() == "nccl"
    assert platform.default_dtype() == torch.bfloat16
    assert platform.device() == torch.device("cuda", 3)


def test_bad_local_rank_is_named(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(ValueError, match="LOCAL_RANK='first'"):
        platform.local_rank()


def test_memory_stats_reports_resident_memory_on_cpu():
    stats = platform.memory_stats()
    assert set(stats) == {"allocated_bytes", "reserved_bytes", "max_allocated_bytes"}
    with open("/proc/self/status") as f:
        vm_rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    assert abs(stats["allocated_bytes"] - vm_rss_kib * 1024) < 64 * 2**20  # same figure, read a moment apart
    assert stats["max_allocated_bytes"] >= stats["allocated_bytes"] > 0


def test_cpu_config_overrides_are_transformer_config_fields():
    from megatron.core.transformer import TransformerConfig

    overrides = platform.cpu_transformer_config_overrides()
    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    fusions = {f.name for f in dataclasses.fields(TransformerConfig) if f.name.endswith("_fusion") and f.default is True}
    # every fused kernel megatron-core turns on by default (CUDA-only) is off, and weights are initialised on the CPU
    assert fusions <= set(overrides) and all(overrides[name] is False for name in fusions), sorted(fusions - set(overrides))
    assert overrides["use_cpu_initialization"] is True and "moe_grouped_gemm" not in overrides  # the caller's choice
    assert overrides["moe_use_legacy_grouped_gemm"] is True  # grouped-GEMM experts on CPU: GroupedMLP + the stand-in
    on = ("use_cpu_initialization", "moe_use_legacy_grouped_gemm")
    assert all(value is False for name, value in overrides.items() if name not in on)
    assert set(overrides) <= fields
    assert platform.transformer_config_overrides() == overrides


def test_gpu_config_overrides_are_empty(cuda_present):
    assert platform.transformer_config_overrides() == {}


def test_redirect_registry_is_named_and_documented():
    names = platform.redirect_names()
    assert len(names) == len(set(names)) == len(platform.REDIRECTS)
    for redirect in platform.REDIRECTS:
        assert len(redirect.why) > 80 and callable(redirect.apply), redirect.name


# In a fresh process each: earlier tests in this pytest process may have applied the layer or
# initialised torch.distributed, and both checks are about a process where nothing happened yet.
_UNKNOWN_REDIRECT = r"""
import pytest
from megarl import platform
with pytest.raises(ValueError, match="unknown cpu_compat redirect.*'no_such_thing'.*known: \\['rng_tracker'"):
    platform.apply_cpu_compat(skip=["no_such_thing"])
assert platform.applied_redirects() == []
print("OK")
"""

_INCOMPLETE_TORCHRUN_ENV = r"""
import os, pytest
from megarl import platform
for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(name, None)
os.environ["RANK"] = "0"
with pytest.raises(RuntimeError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT unset while RANK set"):
    platform.init_distributed()
assert platform.applied_redirects() == []
print("OK")
"""


def _run_fresh(script: str) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr


@pytest.mark.heavy  # starts a process
@pytest.mark.timeout(300)
def test_unknown_redirect_name_is_rejected_before_anything_is_applied():
    _run_fresh(_UNKNOWN_REDIRECT)


@pytest.mark.heavy  # starts a process
@pytest.mark.timeout(300)
def test_incomplete_torchrun_environment_is_named():
    _run_fresh(_INCOMPLETE_TORCHRUN_ENV)


# Runs in a subprocess: imports megatron-core, fakes CUDA, calls both entry points and compares every
# attribute a redirect replaces before and after; then, without the fake, ensure_platform applies all.
_CUDA_LEAVES_EVERYTHING_ALONE = r"""
import torch
import megatron.core.optimizer.clip_grads as clip_grads, megatron.core.optimizer.optimizer as optimizer
import megatron.core.optimizer.distrib_optimizer as distrib_optimizer, megatron.core.utils as mcore_utils
import megatron.core.pipeline_parallel.schedules as schedules
import megatron.core.tensor_parallel.random as random
import megatron.core.transformer.moe.moe_utils as moe_utils
import megatron.core.transformer.moe.token_dispatcher as dispatcher
import megatron.core.transformer.torch_norm as torch_norm
from megarl import platform
from megarl.platform import hardware

def snapshot():
    return {
        **{f"torch.cuda.{n}": getattr(torch.cuda, n) for n in
           ("current_device", "synchronize", "Stream", "Event", "current_stream", "default_stream", "stream")},
        "Tensor.cuda": torch.Tensor.cuda, "Tensor.type": torch.Tensor.type,
        "random._get_cuda_rng_state": random._get_cuda_rng_state,
        "random._set_cuda_rng_state": random._set_cuda_rng_state,
        "tracker.add": random.CudaRNGStatesTracker.add, "tracker.fork": random.CudaRNGStatesTracker.fork,
        "schedules.torch": schedules.torch, "utils.torch": mcore_utils.torch,
        "dispatcher.maybe_move_tensor_to_cpu": dispatcher.maybe_move_tensor_to_cpu,
        "moe_utils.te_general_gemm": getattr(moe_utils, "te_general_gemm", "absent"),
        "clip_grads.clip": clip_grads.clip_grad_by_total_norm_fp32,
        "optimizer.clip": optimizer.clip_grad_by_total_norm_fp32,
        "float16.__init__": optimizer.Float16OptimizerWithFloat16Params.__init__,
        "distrib.build": distrib_optimizer.DistributedOptimizer.__dict__["_build_model_and_main_param_groups"],
        "WrappedTorchNorm.__new__": torch_norm.WrappedTorchNorm.__dict__["__new__"],
    }

before = snapshot()
real_has_cuda = hardware.has_cuda
hardware.has_cuda = lambda: True
assert platform.ensure_platform() == [] and platform.apply_cpu_compat() == []
assert platform.applied_redirects() == []
after = snapshot()
changed = [name for name in before if before[name] is not after[name]]
assert not changed, changed

hardware.has_cuda = real_has_cuda
assert platform.ensure_platform() == platform.redirect_names()
unchanged = [name for name, value in snapshot().items() if value is before[name]]
assert unchanged == ["Tensor.type"], unchanged  # cuda_type_names swaps it only inside the wrapped calls
print("OK")
"""


@pytest.mark.heavy  # starts a process
@pytest.mark.timeout(120)
def test_with_cuda_ensure_platform_changes_nothing_and_without_it_applies_all():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    process = subprocess.run(
        [sys.executable, "-c", _CUDA_LEAVES_EVERYTHING_ALONE], capture_output=True, text=True, timeout=110, env=env
    )
    assert process.returncode == 0 and "OK" in process.stdout, process.stdout + process.stderr[-4000:]


def test_nothing_outside_the_platform_layer_touches_torch_cuda():
    """One place knows whether CUDA is there: every other module asks megarl.platform."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in list((root / "megarl").rglob("*.py")) + list((root / "conversion").rglob("*.py")):
        if "platform" in path.relative_to(root).parts[:2]:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\btorch\.cuda\b", code):
                offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders, "torch.cuda used outside megarl/platform:\n" + "\n".join(offenders)


def test_destroy_model_parallel_closes_the_groups_megatron_made(world):
    """megatron's own teardown forgets its ~20 groups but leaves them open; a process that sets up model
    parallelism again and again then slows with every round (tests/models: 250 s -> 21 s over 69 layouts)."""
    from torch.distributed import distributed_c10d

    made = len(distributed_c10d._world.pg_map)
    assert made > 5, "megatron should have made its TP/PP/DP/EP/CP groups"
    platform.destroy_model_parallel()
    assert list(distributed_c10d._world.pg_map) == [distributed_c10d._get_default_group()]
    platform.initialize_model_parallel()  # and it can be set up again, with as many groups
    assert len(distributed_c10d._world.pg_map) == made
