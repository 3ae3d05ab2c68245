"""CPU stand-ins for the CUDA objects megatron-core uses.

Each object here is what one redirect in ``cpu_compat`` installs. They are small on purpose: each
does on CPU what its CUDA original does on a GPU, or nothing where CPU work is already synchronous.
"""

import contextlib
import copy
import functools
import types

import torch

# ---- RNG: the CPU default generator plays the role of the current GPU's generator. ----


def get_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    """Stand-in for megatron's ``_get_cuda_rng_state``: the CPU default generator's state."""
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device=-1, graph_safe=False) -> None:
    """Stand-in for megatron's ``_set_cuda_rng_state``: set the CPU default generator's state."""
    torch.set_rng_state(new_state)


def tracker_add(self, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` on CPU: record the state of a generator seeded with ``seed``.

    Same checks as megatron's, but the state comes from a fresh CPU generator instead of
    ``torch.cuda.manual_seed`` / ``torch.cuda.get_rng_state``.
    """
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    generator = torch.Generator()
    generator.manual_seed(seed)
    self.states_[name] = generator.get_state()


@contextlib.contextmanager
def tracker_fork(self, name: str = "model-parallel-rng"):
    """``CudaRNGStatesTracker.fork`` on CPU: run the block with the named state, then restore.

    Megatron's version also warns when the CPU generator changed inside the block. On CPU the
    tracked state *is* the CPU generator, so that warning would fire on every dropout; it is left out.
    Nested forks keep megatron's bookkeeping (``_current_state_name``).
    """
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer_state = torch.get_rng_state()
    outer_name = self._current_state_name
    if outer_name != "default-rng":
        self.states_[outer_name] = outer_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        if outer_name != "default-rng":
            outer_state = self.states_[outer_name]
        torch.set_rng_state(outer_state)
        self._current_state_name = outer_name


# ---- Streams and events: CPU work is synchronous, so these order nothing. ----


class Stream(torch.cpu.Stream):
    """``torch.cuda.Stream`` on CPU: torch's own no-op CPU stream, accepting CUDA's arguments."""

    def __init__(self, device=None, priority=0, **kwargs):
        super().__init__()

    def record_event(self, event=None):
        """Megatron waits on the returned event (``d2h_event.synchronize()``); torch.cpu's returns None."""
        return event if event is not None else Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Event(torch.cpu.Event):
    """``torch.cuda.Event`` on CPU: torch's own no-op CPU event, accepting CUDA's arguments."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        super().__init__()


def synchronize(device=None) -> None:
    """``torch.cuda.synchronize`` on CPU: nothing to wait for (CPU work is synchronous).

    A function of its own, not ``torch.cpu.synchronize`` itself: torch.compile (dynamo) registers
    one handler per synchronize function, and the same function under both names fails with
    "Handler already registered" (megatron compiles the MoE router's expert-bias update).
    """


def current_stream(device=None) -> torch.cpu.Stream:
    """``torch.cuda.current_stream`` / ``default_stream`` on CPU."""
    return torch.cpu.current_stream()


# ---- ``device="cuda"`` literals: a view of torch that reads them as CPU. ----

_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn")


def _cpu_if_cuda(device):
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class CpuTorchView(types.ModuleType):
    """``torch`` as seen from one megatron module: tensor factories map a CUDA ``device=`` to CPU.

    Installed as that module's ``torch`` global, so only code in that module is affected; every
    other attribute is the real torch's.
    """

    def __init__(self, real_torch: types.ModuleType):
        super().__init__(real_torch.__name__)
        self._real_torch = real_torch
        for name in _FACTORIES:
            setattr(self, name, self._redirect_device(getattr(real_torch, name)))

    @staticmethod
    def _redirect_device(factory):
        @functools.wraps(factory)
        def factory_on_cpu(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_if_cuda(kwargs["device"])
            return factory(*args, **kwargs)

        return factory_on_cpu

    def __getattr__(self, name):
        return getattr(self._real_torch, name)


# ---- ``tensor.type() == 'torch.cuda.FloatTensor'`` checks. ----


@contextlib.contextmanager
def cuda_type_names():
    """While active, ``tensor.type()`` of a CPU tensor reads as its CUDA name (``torch.cuda.FloatTensor``).

    Scoped to the megatron calls that compare type names (see the ``cuda_type_names`` redirect);
    the real ``Tensor.type`` is restored on exit.
    """
    original = torch.Tensor.type

    def type_with_cuda_names(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_with_cuda_names
    try:
        yield
    finally:
        torch.Tensor.type = original


def with_cuda_type_names(function):
    """Wrap ``function`` so that it runs inside ``cuda_type_names()``."""

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with cuda_type_names():
            return function(*args, **kwargs)

    wrapped.__megarl_cpu_compat__ = True
    return wrapped


# ---- Torch norms under sequence parallelism. ----


def sequence_parallel_torch_norm(original_new):
    """Make ``WrappedTorchNorm.__new__`` accept ``sequence_parallel``.

    The torch norm is built by megatron's own code from a copy of the config with sequence
    parallelism off; its weights are then tagged ``sequence_parallel=True``. Each TP rank sees
    only its part of the sequence, so those grads are partial; ``finalize_model_grads`` sums the
    grads of tagged params over the TP group, exactly as it does for megatron's fused norms.
    """

    def new(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, *args, **kwargs)
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = original_new(cls, config_without_sp, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new.__megarl_cpu_compat__ = True
    return new


# ---- Grouped GEMM: the ``grouped_gemm`` package's ``ops.gmm``, as a loop of matmuls. ----


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """``grouped_gemm.ops.gmm`` on CPU: the rows of ``a`` in consecutive groups of ``batch_sizes``, group
    ``i`` times ``b[i]`` (``b[i].T`` with ``trans_b``).

    ``a`` [sum(batch_sizes), k]; ``b`` [groups, k, n], or [groups, n, k] with ``trans_b``; the result is
    [sum(batch_sizes), n]. Plain torch ops, so autograd differentiates it (an empty group gets a zero
    gradient for its ``b[i]``); any dtype, where the CUDA kernels take bf16 only.
    """
    sizes = [int(size) for size in batch_sizes.tolist()]
    if a.dim() != 2 or b.dim() != 3 or len(sizes) != b.shape[0] or sum(sizes) != a.shape[0]:
        raise ValueError(f"gmm: a {tuple(a.shape)} and b {tuple(b.shape)} with batch_sizes {sizes}: expected "
                         "a [sum(batch_sizes), k] and b [len(batch_sizes), k, n] ([.., n, k] with trans_b)")
    groups = torch.split(a, sizes)
    return torch.cat([rows @ (weight.t() if trans_b else weight) for rows, weight in zip(groups, b)])


grouped_gemm = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=gmm))  # the package's shape: grouped_gemm.ops.gmm


def grouped_mlp_any_dtype(original_forward):
    """``GroupedMLP.forward`` without its "only supports bf16" assertion, which is about the CUDA kernels
    of ``grouped_gemm``: the forward runs with a copy of the module's config that reads ``bf16=True``
    (nothing else in the forward reads the field); the module's own config is left unchanged."""

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        config = self.config
        if config.bf16:
            return original_forward(self, *args, **kwargs)
        self.config = copy.copy(config)
        self.config.bf16 = True
        try:
            return original_forward(self, *args, **kwargs)
        finally:
            self.config = config

    forward.__megarl_cpu_compat__ = True
    return forward
