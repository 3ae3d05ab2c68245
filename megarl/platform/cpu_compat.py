"""Run megatron-core on a machine without CUDA: a list of named redirects.

megatron-core (0.16.1 here) assumes CUDA in a handful of places. Each place is one ``Redirect``
below: its name, why it is needed (where megatron assumes CUDA and how it fails on CPU), and
``apply``, which points megatron at a CPU equivalent. Tests apply every redirect but one to show
that each is needed.

Narrow first: where megatron looks a name up in its own module (``_get_cuda_rng_state``,
``maybe_move_tensor_to_cpu``, a module's ``torch`` global, a class attribute), that name is
replaced. Four redirects replace ``torch.cuda`` attributes (or ``Tensor.cuda``) process-wide
instead, because megatron resolves them at call time from dozens of modules; on a CPU-only
process each of those functions can only raise "Torch not compiled with CUDA enabled", so
replacing them changes nothing that worked. ``Tensor.type`` is swapped only for the duration of
the megatron calls that compare CUDA type names.

``ensure_platform()`` is the entry point: it applies all redirects when there is no CUDA and does
nothing at all when CUDA is available.
"""

import importlib
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from megarl.platform import cpu_standins, hardware


@dataclass(frozen=True)
class Redirect:
    """One place where megatron-core assumes CUDA, and how it is pointed at the CPU."""

    name: str
    why: str
    apply: Callable[[], None]


def _module(name: str):
    return importlib.import_module(name)


def _require(owner, attribute: str, redirect: str):
    """The attribute a redirect replaces; a clear error if this megatron-core version lacks it."""
    if not hasattr(owner, attribute):
        raise RuntimeError(
            f"cpu_compat redirect {redirect!r}: {getattr(owner, '__name__', owner)}.{attribute} does not exist in "
            f"this megatron-core version; update megarl/platform/cpu_compat.py for it"
        )
    return getattr(owner, attribute)


def _redirect_rng_tracker() -> None:
    random = _module("megatron.core.tensor_parallel.random")
    tracker = _require(random, "CudaRNGStatesTracker", "rng_tracker")
    replacements = [
        (random, "_get_cuda_rng_state", cpu_standins.get_rng_state),
        (random, "_set_cuda_rng_state", cpu_standins.set_rng_state),
        (tracker, "add", cpu_standins.tracker_add),
        (tracker, "fork", cpu_standins.tracker_fork),
    ]
    for owner, attribute, standin in replacements:
        _require(owner, attribute, "rng_tracker")
        setattr(owner, attribute, standin)


def _redirect_current_device() -> None:
    torch.cuda.current_device = torch.cpu.current_device


def _redirect_tensor_cuda() -> None:
    torch.Tensor.cuda = _tensor_cuda_on_cpu


def _tensor_cuda_on_cpu(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """``Tensor.cuda()`` on CPU: the tensor stays where it is."""
    return self


# Megatron modules with ``device="cuda"`` literals on paths megarl runs on CPU.
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens in every forward_backward_func
    "megatron.core.optimizer.optimizer",  # found_inf / _scale buffers (FP32Optimizer, mixed precision)
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors
    "megatron.core.optimizer.clip_grads",  # grad-norm buffers
    "megatron.core.transformer.moe.moe_utils",  # MoE aux-loss tracker
    "megatron.core.transformer.utils",  # the default causal mask (attention_mask=None)
    "megatron.core.utils",  # local_multi_tensor_l2_norm: the grad norm without apex / TE
)


def _redirect_cuda_literals() -> None:
    for name in _MODULES_WITH_CUDA_LITERALS:
        module = _module(name)
        real_torch = _require(module, "torch", "cuda_device_literals")
        if not isinstance(real_torch, cpu_standins.CpuTorchView):
            module.torch = cpu_standins.CpuTorchView(real_torch)


def _redirect_synchronize() -> None:
    torch.cuda.synchronize = cpu_standins.synchronize


def _redirect_streams() -> None:
    torch.cuda.Stream = cpu_standins.Stream
    torch.cuda.Event = cpu_standins.Event
    torch.cuda.current_stream = cpu_standins.current_stream
    torch.cuda.default_stream = cpu_standins.current_stream
    torch.cuda.stream = torch.cpu.stream


def _redirect_moe_split_sizes() -> None:
    moe_utils = _module("megatron.core.transformer.moe.moe_utils")
    dispatcher = _module("megatron.core.transformer.moe.token_dispatcher")
    original = _require(moe_utils, "maybe_move_tensor_to_cpu", "moe_split_sizes_numpy")
    _require(dispatcher, "maybe_move_tensor_to_cpu", "moe_split_sizes_numpy")
    if getattr(original, "__megarl_cpu_compat__", False):
        return

    def move_to_cpu_as_numpy_when_asked(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move_to_cpu_as_numpy_when_asked.__megarl_cpu_compat__ = True
    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu_as_numpy_when_asked
    dispatcher.maybe_move_tensor_to_cpu = move_to_cpu_as_numpy_when_asked


def _redirect_moe_router_without_te() -> None:
    moe_utils = _module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _redirect_checkpoint_without_output() -> None:
    random = _module("megatron.core.tensor_parallel.random")
    checkpoint = _require(random, "CheckpointWithoutOutput", "checkpoint_without_output_fp8")
    original_init = checkpoint.__init__
    if getattr(original_init, "__megarl_cpu_compat__", False) or getattr(random, "HAVE_TE", False):
        return

    def init_without_fp8(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = False  # without Transformer Engine there is no FP8 to enter or restore

    init_without_fp8.__megarl_cpu_compat__ = True
    checkpoint.__init__ = init_without_fp8


def _redirect_mla_without_te() -> None:
    mla = _module("megatron.core.transformer.multi_latent_attention")
    _require(mla, "HAVE_TE", "mla_without_te")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        mla.HAVE_TE = False


def _redirect_cuda_type_names() -> None:
    clip_grads = _module("megatron.core.optimizer.clip_grads")
    optimizer = _module("megatron.core.optimizer.optimizer")
    distrib_optimizer = _module("megatron.core.optimizer.distrib_optimizer")
    for module in (clip_grads, optimizer):
        function = _require(module, "clip_grad_by_total_norm_fp32", "cuda_type_names")
        if not getattr(function, "__megarl_cpu_compat__", False):
            module.clip_grad_by_total_norm_fp32 = cpu_standins.with_cuda_type_names(function)
    float16_optimizer = _require(optimizer, "Float16OptimizerWithFloat16Params", "cuda_type_names")
    if not getattr(float16_optimizer.__init__, "__megarl_cpu_compat__", False):
        float16_optimizer.__init__ = cpu_standins.with_cuda_type_names(float16_optimizer.__init__)
    distributed_optimizer = _require(distrib_optimizer, "DistributedOptimizer", "cuda_type_names")
    _require(distributed_optimizer, "_build_model_and_main_param_groups", "cuda_type_names")
    build = distributed_optimizer.__dict__["_build_model_and_main_param_groups"].__func__
    if not getattr(build, "__megarl_cpu_compat__", False):
        distributed_optimizer._build_model_and_main_param_groups = classmethod(cpu_standins.with_cuda_type_names(build))


def _redirect_sequence_parallel_norm() -> None:
    torch_norm = _module("megatron.core.transformer.torch_norm")
    wrapped_norm = _require(torch_norm, "WrappedTorchNorm", "sequence_parallel_norm")
    original_new = wrapped_norm.__dict__["__new__"]
    original_new = getattr(original_new, "__func__", original_new)
    if not getattr(original_new, "__megarl_cpu_compat__", False):
        wrapped_norm.__new__ = staticmethod(cpu_standins.sequence_parallel_torch_norm(original_new))


def _redirect_grouped_gemm() -> None:
    grouped_gemm_util = _module("megatron.core.transformer.moe.grouped_gemm_util")
    experts = _module("megatron.core.transformer.moe.experts")
    _require(grouped_gemm_util, "ops", "grouped_gemm")
    if grouped_gemm_util.grouped_gemm is None:  # the CUDA package is missing (always, without CUDA)
        grouped_gemm_util.grouped_gemm = cpu_standins.grouped_gemm
        grouped_gemm_util.ops = cpu_standins.grouped_gemm.ops
    grouped_mlp = _require(experts, "GroupedMLP", "grouped_gemm")
    if not getattr(grouped_mlp.forward, "__megarl_cpu_compat__", False):
        grouped_mlp.forward = cpu_standins.grouped_mlp_any_dtype(grouped_mlp.forward)


REDIRECTS: tuple[Redirect, ...] = (
    Redirect(
        "rng_tracker",
        "tensor_parallel.random's CudaRNGStatesTracker (add/fork) and _get/_set_cuda_rng_state use the "
        "CUDA generator; model_parallel_cuda_manual_seed fails with 'Torch not compiled with CUDA enabled'. "
        "On CPU the tracked states are CPU generator states.",
        _redirect_rng_tracker,
    ),
    Redirect(
        "current_device",
        "torch.cuda.current_device() is the device= of tensors built in layers, mappings, attention, "
        "p2p and the grad buffers (dozens of modules): 'Torch not compiled with CUDA enabled'. "
        "torch.cuda.current_device becomes torch.cpu.current_device ('cpu').",
        _redirect_current_device,
    ),
    Redirect(
        "cuda_device_literals",
        "device='cuda' literals in pipeline_parallel.schedules (every forward_backward_func), the optimizer, "
        "grad scaler, clip_grads, the MoE aux-loss tracker, the default causal mask (transformer.utils, used "
        "when attention_mask is None) and the grad norm's torch fallback (utils.local_multi_tensor_l2_norm): "
        "'Torch not compiled with CUDA enabled'. Those modules' torch global becomes a view whose tensor "
        "factories read a CUDA device as CPU.",
        _redirect_cuda_literals,
    ),
    Redirect(
        "tensor_cuda_method",
        "tensor.cuda() moves the tied word embeddings of the last pipeline stage before their all-reduce "
        "(LanguageModule.setup_embeddings_and_output_layer, PP>1 with tied embeddings): 'Torch not compiled "
        "with CUDA enabled'. Tensor.cuda returns the tensor itself.",
        _redirect_tensor_cuda,
    ),
    Redirect(
        "synchronize",
        "torch.cuda.synchronize() in pipeline p2p communication (batch_p2p_sync) and dist_checkpointing save "
        "(filesystem_async.preload_tensors): 'Torch not compiled with CUDA enabled'. It becomes "
        "a no-op of its own (CPU work is synchronous; not torch.cpu.synchronize itself, which torch.compile "
        "would then see under two names: 'Handler already registered' in the MoE router's compiled "
        "expert-bias update).",
        _redirect_synchronize,
    ),
    Redirect(
        "streams",
        "torch.cuda.Stream/Event/current_stream/default_stream/stream in the MoE alltoall dispatcher (and in "
        "DDP with several distributed-optimizer instances): 'torch.cuda.Stream requires CUDA support'. They "
        "become torch.cpu's no-op stream objects, accepting CUDA's arguments.",
        _redirect_streams,
    ),
    Redirect(
        "moe_split_sizes_numpy",
        "the MoE alltoall dispatcher gets split sizes from maybe_move_tensor_to_cpu(as_numpy=True), which "
        "converts only CUDA tensors; gloo's all_to_all_single then rejects a tensor as split sizes "
        "('incompatible function arguments'). The dispatcher's maybe_move_tensor_to_cpu returns numpy for "
        "CPU tensors too when asked.",
        _redirect_moe_split_sizes,
    ),
    Redirect(
        "moe_router_without_te",
        "megatron-core 0.16.1's router_gating_linear tests 'te_general_gemm is not None', but moe_utils "
        "defines te_general_gemm only when Transformer Engine imports (CUDA-only): every MoE forward fails "
        "with NameError. moe_utils.te_general_gemm is set to None, selecting megatron's torch matmul path.",
        _redirect_moe_router_without_te,
    ),
    Redirect(
        "checkpoint_without_output_fp8",
        "CheckpointWithoutOutput (selective recompute of 'layernorm', 'moe_act' and MLA's up-projection) sets "
        "self.fp8 = (fp8 is not None), True for its default fp8=False, and then calls Transformer Engine's "
        "FP8GlobalStateManager: NameError without TE. Its fp8 flag is set to False, as there is no FP8 without TE.",
        _redirect_checkpoint_without_output,
    ),
    Redirect(
        "mla_without_te",
        "multi_latent_attention sets HAVE_TE=True when Transformer Engine is missing (megatron's TE extension "
        "imports against mocks), then tests isinstance(linear_proj, TELinear) with a mock: every MLA layer "
        "(DeepSeek-V3) fails with 'isinstance() arg 2 must be a type'. HAVE_TE becomes False there when "
        "transformer_engine does not import.",
        _redirect_mla_without_te,
    ),
    Redirect(
        "cuda_type_names",
        "clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor' and the distributed / "
        "float16 optimizers accept only torch.cuda.* type names (AssertionError / TypeError). Inside those "
        "calls only, a CPU tensor's type() reads as its CUDA name.",
        _redirect_cuda_type_names,
    ),
    Redirect(
        "sequence_parallel_norm",
        "WrappedTorchNorm (the local spec's norm without apex) asserts 'sequence parallel not supported by "
        "torch LayerNorm'. With sequence parallelism it builds the same torch norm and tags its params "
        "sequence_parallel=True, so finalize_model_grads sums their grads over TP.",
        _redirect_sequence_parallel_norm,
    ),
    Redirect(
        "grouped_gemm",
        "moe_grouped_gemm=True builds megatron's GroupedMLP on the local spec, whose experts multiply through the "
        "CUDA-only grouped_gemm package (grouped_gemm_util.ops.gmm): 'Grouped GEMM is not available' at the build; "
        "its forward also asserts config.bf16 (the package's kernels), but a CPU run is fp32. grouped_gemm_util "
        "gets cpu_standins.gmm (a loop of matmuls over the experts' row groups), and GroupedMLP's forward runs "
        "with a copy of its config reading bf16=True.",
        _redirect_grouped_gemm,
    ),
)

_applied: set[str] = set()
_configured_explicitly = False


def redirect_names() -> list[str]:
    """The names of all redirects, in the order they are applied."""
    return [redirect.name for redirect in REDIRECTS]


def applied_redirects() -> list[str]:
    """The names of the redirects applied in this process."""
    return [name for name in redirect_names() if name in _applied]


def apply_cpu_compat(skip: Iterable[str] = ()) -> list[str]:
    """Apply the CPU redirects (all but ``skip``); idempotent. Returns the names applied.

    Does nothing at all when CUDA is available. ``skip`` exists for tests that show each
    redirect is needed; once this was called, ``ensure_platform`` leaves the choice as it is.
    """
    global _configured_explicitly
    skip = set(skip)
    unknown = skip - set(redirect_names())
    if unknown:
        raise ValueError(f"unknown cpu_compat redirect(s) {sorted(unknown)}; known: {redirect_names()}")
    if hardware.has_cuda():
        return []
    _configured_explicitly = True
    for redirect in REDIRECTS:
        if redirect.name not in skip and redirect.name not in _applied:
            redirect.apply()
            _applied.add(redirect.name)
    return applied_redirects()


def ensure_platform() -> list[str]:
    """Make megatron-core usable on this machine: on CPU apply all redirects; on GPU do nothing.

    If ``apply_cpu_compat`` was already called in this process (e.g. by a test that leaves a
    redirect out), that choice stands. Returns the names of the applied redirects.
    """
    if hardware.has_cuda():
        return []
    if _configured_explicitly:
        return applied_redirects()
    return apply_cpu_compat()
