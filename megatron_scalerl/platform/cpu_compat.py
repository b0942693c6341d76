"""CPU compatibility layer: lets megatron-core 0.16.1 run on CPU processes joined by gloo.

megatron-core assumes CUDA in a handful of places (the list below; docs/design.md, "GPU paths"). Each
workaround below is one small function that replaces one thing, checks first that the thing it replaces still looks
the way it did in 0.16.1, and has its own test in tests/test_platform_cpu_compat.py. `install_cpu_compat()` applies
them all, once per process; GPU runs never call it (the backend switch in `platform.distributed` decides).

Workarounds, in the order they are installed:
  1. megatron's CUDA RNG-state tracker (attention dropout and weight init fork it) -> `CPURNGStatesTracker`; the
     device RNG state activation recomputation (`parallelism.recompute: full`) saves and restores -> the CPU one.
  2. `torch.cuda.current_device()` (memory buffers, MoE router, layer weights) -> "cpu".
  3. hard-coded `device="cuda"` tensors, `.cuda()` and `Tensor.type() == "torch.cuda.FloatTensor"` checks (pipeline
     schedules, grad clipping, optimizers, attention masks) -> a TorchFunctionMode that maps cuda to cpu (see
     Limits), entered again where activation recomputation re-runs a layer inside backward.
  4. `torch.cuda.Stream/current_stream/stream/synchronize/Event` (MoE alltoall dispatcher, DDP, async checkpoint)
     -> no-op stand-ins.
  5. `moe_utils.te_general_gemm` is undefined without Transformer Engine -> None.
  6. MoE alltoall split sizes stay tensors on CPU (gloo wants lists) -> converted to numpy.
  7. gloo cannot all-gather (or reduce-scatter) uneven sizes (MoE with TP x EP) -> pad/gather/slice and
     all-reduce/slice.
  8. megatron's fused kernels are `torch.compile`d (`megatron.core.jit.jit_fuser`); on CPU the first call compiles
     with inductor for ~30 s per process -> TorchDynamo off, fusers run eagerly.
  9. the unrelated import-time warnings of a CPU process (TE/Apex missing) are filtered.
(Sequence parallel with torch norms is handled by the layer spec, see `platform.layer_backend.TorchNorm`; fixes to
megatron's distributed optimizer that GPU runs need as much as CPU ones live in `platform.megatron_optimizer`.)

Limits: the cuda -> cpu mode (3) is a TorchFunctionMode, which torch keeps per thread; it is entered for the thread
that calls `install_cpu_compat()` (the main thread). A thread that runs megatron code which names "cuda" must enter
`CudaToCpuMode()` itself. Its overhead: ~2-3% on a small CPU transformer forward+backward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

SUPPORTED_MEGATRON_CORE = "0.16.1"

_installed = False


class MegatronVersionError(RuntimeError):
    """megatron-core is not the version this layer was written and tested against."""


def require_megatron_attr(module: Any, name: str) -> Any:
    """Return `module.name`, or fail naming what changed (the layer patches private megatron-core names)."""
    if not hasattr(module, name):
        raise MegatronVersionError(
            f"megatron-core changed: {module.__name__}.{name} is gone; the CPU layer supports "
            f"megatron-core {SUPPORTED_MEGATRON_CORE} only"
        )
    return getattr(module, name)


# 1. RNG tracker -------------------------------------------------------------------------------------------------


def _make_cpu_rng_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mcore_random

    base = require_megatron_attr(mcore_random, "CudaRNGStatesTracker")

    class CPURNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's named RNG streams ("model-parallel-rng", "expert-parallel-rng", ...) on the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"rng seed {seed} already exists")
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    return CPURNGStatesTracker


def patch_rng_tracker() -> None:
    """Every tracker megatron creates from now on (`initialize_rng_tracker`) is the CPU one, and the "CUDA" RNG
    state that activation checkpointing (`tensor_parallel.checkpoint`) saves before a layer's forward and restores
    for its recomputation is the CPU generator's, so a recomputed layer draws the same numbers."""
    from megatron.core.tensor_parallel import random as mcore_random

    require_megatron_attr(mcore_random, "initialize_rng_tracker")
    require_megatron_attr(mcore_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED")
    require_megatron_attr(mcore_random, "_get_cuda_rng_state")
    require_megatron_attr(mcore_random, "_set_cuda_rng_state")
    mcore_random.CudaRNGStatesTracker = _make_cpu_rng_tracker_class()
    mcore_random._CUDA_RNG_STATE_TRACKER = None
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


# 2. current device ----------------------------------------------------------------------------------------------


def patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]


# 3. cuda -> cpu ---------------------------------------------------------------------------------------------------


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Runs `torch.x(..., device="cuda")`, `t.cuda()`, `t.to("cuda")` on CPU; `t.type()` reports the CUDA name.

    megatron-core's optimizers and grad clipping accept only tensors whose `type()` is `torch.cuda.*Tensor`; a CPU
    tensor reports `torch.FloatTensor`, so `type()` without arguments answers with the CUDA spelling.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and result.startswith("torch."):
            return "torch.cuda." + result[len("torch.") :]
        return result


_cuda_to_cpu_mode: CudaToCpuMode | None = None


def patch_cuda_tensors() -> None:
    """Enter the mode for the main thread, and again inside activation recomputation: torch takes a mode off its
    stack while the mode handles a call, and backward is such a call, so the layer forward that
    `tensor_parallel.checkpoint` re-runs in backward (`parallelism.recompute: full`) would see "cuda" again."""
    global _cuda_to_cpu_mode
    if _cuda_to_cpu_mode is not None:
        return
    from megatron.core.tensor_parallel import random as mcore_random

    checkpoint_function = require_megatron_attr(mcore_random, "CheckpointFunction")
    recompute_and_backward = checkpoint_function.backward

    def backward_on_cpu(ctx, *args):  # noqa: ANN001, ANN202
        with CudaToCpuMode():
            return recompute_and_backward(ctx, *args)

    checkpoint_function.backward = staticmethod(backward_on_cpu)
    _cuda_to_cpu_mode = CudaToCpuMode()
    _cuda_to_cpu_mode.__enter__()  # process-wide for the main thread; never exited


# 4. streams -------------------------------------------------------------------------------------------------------


class NoOpEvent:
    def synchronize(self) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool:
        return True


class NoOpStream:
    """A CUDA stream stand-in: CPU work is already ordered, so every method is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_stream(self, stream: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, event: Any = None) -> NoOpEvent:
        return NoOpEvent()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoOpStream)

    def __hash__(self) -> int:
        return 0


_DEFAULT_STREAM = NoOpStream()


def patch_streams() -> None:
    torch.cuda.Stream = NoOpStream  # type: ignore[misc, assignment]
    torch.cuda.Event = NoOpEvent  # type: ignore[misc, assignment]
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


# 5. te_general_gemm -----------------------------------------------------------------------------------------------


def patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# 6. alltoall split sizes ------------------------------------------------------------------------------------------


def patch_alltoall_splits() -> None:
    """The alltoall dispatcher moves its split sizes to host memory only when they live on CUDA."""
    from megatron.core.transformer.moe import token_dispatcher

    original = require_megatron_attr(token_dispatcher, "maybe_move_tensor_to_cpu")
    if getattr(original, "_scalerl_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._scalerl_cpu = True  # type: ignore[attr-defined]
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# 7. uneven collectives --------------------------------------------------------------------------------------------


def gather_uneven_along_first_dim(
    input_: torch.Tensor, group: dist.ProcessGroup, output_split_sizes: list[int]
) -> torch.Tensor:
    """All-gather rows of different counts per rank with equal-size collectives: pad, gather, slice.

    input_: [output_split_sizes[rank], ...]; returns [sum(output_split_sizes), ...] in rank order.
    """
    sizes = [int(n) for n in output_split_sizes]
    rows = max(sizes)
    padded = input_.new_zeros((rows, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(gathered, sizes, strict=True)], dim=0)


def reduce_scatter_uneven_along_first_dim(
    input_: torch.Tensor, group: dist.ProcessGroup, input_split_sizes: list[int]
) -> torch.Tensor:
    """Reduce-scatter with rows of different counts per rank: all-reduce (sum), keep this rank's rows.

    input_: [sum(input_split_sizes), ...]; returns [input_split_sizes[rank], ...].
    """
    reduced = input_.clone()
    dist.all_reduce(reduced, group=group)
    sizes = [int(n) for n in input_split_sizes]
    start = sum(sizes[: group.rank()])
    return reduced[start : start + sizes[group.rank()]].contiguous()


def patch_uneven_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    original_gather = require_megatron_attr(mappings, "_gather_along_first_dim")
    original_reduce_scatter = require_megatron_attr(mappings, "_reduce_scatter_along_first_dim")
    if getattr(original_gather, "_scalerl_cpu", False):
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):  # noqa: ANN001
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        return gather_uneven_along_first_dim(input_, group, output_split_sizes)

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):  # noqa: ANN001
        if input_split_sizes is None or group.size() == 1:
            return original_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        return reduce_scatter_uneven_along_first_dim(input_, group, input_split_sizes)

    _gather_along_first_dim._scalerl_cpu = True  # type: ignore[attr-defined]
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


# 8. torch.compile'd fusers -----------------------------------------------------------------------------------------


def patch_jit_fuser() -> None:
    """Modules imported later get a no-op fuser; functions already wrapped by torch.compile run eagerly."""
    import torch._dynamo
    from megatron.core import jit

    require_megatron_attr(jit, "disable_jit_fuser")()
    torch._dynamo.config.disable = True


# 9. multi-latent attention without Transformer Engine ---------------------------------------------------------------


def patch_mla_without_te() -> None:
    """megatron's MLA module sets HAVE_TE when TE's wrapper module imports, which it does without TE (its classes
    are then MagicMocks), and `isinstance(layer, TELinear)` fails: tell it TE is absent."""
    from megatron.core.transformer import multi_latent_attention

    require_megatron_attr(multi_latent_attention, "HAVE_TE")
    multi_latent_attention.HAVE_TE = False


# ------------------------------------------------------------------------------------------------------------------


def silence_cpu_import_warnings() -> None:
    """megatron-core warns on import that TE/Apex are missing (expected on CPU) and torch 2.13 flags megatron's
    collective calls as deprecated: noise in every CPU worker's output, so they are filtered."""
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed", category=UserWarning)
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )


def check_megatron_version() -> None:
    import megatron.core

    if megatron.core.__version__ != SUPPORTED_MEGATRON_CORE:
        raise MegatronVersionError(
            f"megatron-core {megatron.core.__version__} is installed; the CPU layer (megatron_scalerl/platform/"
            f"cpu_compat.py) supports {SUPPORTED_MEGATRON_CORE} only (pin it in pyproject.toml)"
        )


def install_cpu_compat() -> None:
    """Apply every CPU workaround (idempotent). Call before building models on a CPU-only process."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("install_cpu_compat() is for CPU-only processes; CUDA is available here")
    silence_cpu_import_warnings()
    check_megatron_version()
    patch_rng_tracker()
    patch_current_device()
    patch_cuda_tensors()
    patch_streams()
    patch_te_general_gemm()
    patch_alltoall_splits()
    patch_uneven_collectives()
    patch_jit_fuser()
    patch_mla_without_te()
    _installed = True

