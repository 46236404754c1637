"""Backends: numpy_backend (the readable reference), the cpu package (quantized weights, numba kernels) and the
cuda package (CuPy + kernels/*.cu)."""

from __future__ import annotations

from typing import Callable

from .. import gpu_driver
from ..background import Background
from ..errors import BackendError, UsageError
from ..models.config import ModelConfig
from .base import Backend

BACKENDS = ("auto", "cuda", "cpu", "numpy")
EarlyStatus = Callable[[], "tuple[bool, str]"]


def start_early(name: str) -> EarlyStatus | None:
    """Begin the CUDA start-up (the driver and the GPU's context, unless the CLI's entry began them already:
    llamacli.gpu_driver; then CuPy's import and check) on a thread of its own when `name` may take the CUDA
    backend, so that it overlaps what the caller does until select_backend. -> the function select_backend
    calls for its cuda_status() (it waits for the thread, and raises what the thread raised); None for the
    CPU and NumPy backends (which let go of a context the CLI's entry made). Call it, once started, on every way out
    (Model does), so that the process never exits with the thread inside the driver."""
    if name not in ("auto", "cuda"):
        gpu_driver.release()
        return None

    def check() -> tuple[bool, str]:
        gpu_driver.wait()
        gpu_driver.driver_context()
        return cuda_status(context=True)

    job = Background(check, name="llamacli-cuda-start")

    def status() -> tuple[bool, str]:
        ok, reason = job.result()
        if not ok:
            gpu_driver.release()
        return ok, reason

    return status


def select_backend(name: str, notice: Callable[[str], None] | None = None, early: EarlyStatus | None = None,
                   cfg: ModelConfig | None = None) -> Backend:
    """`auto` takes CUDA when CuPy imports and a GPU is visible and its kernels run the model `cfg` (a layer the
    fused paths lack, such as Qwen3.5's delta-net layers, or experts they do not serve: cuda.device.fused_layers),
    else the CPU backend (with a notice saying why), else, without numba, the NumPy reference (saying that too);
    `cuda` or `cpu` without what it needs is a BackendError that says what is missing and how to install it (a
    model CUDA cannot run: at load). `early`: start_early's result for this name, where the check already began."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "cpu":
        return _cpu_backend()
    ok, reason = early() if early is not None else cuda_status()
    if ok and name == "auto" and cfg is not None:
        from .cuda.device import fused_layers

        try:
            fused_layers(cfg)
        except BackendError as exc:  # (nothing is on the GPU yet)
            ok, reason = False, str(exc).rstrip(".")
            gpu_driver.release()
    if ok:
        from .cuda import CudaBackend

        return CudaBackend()
    if name == "cuda":
        raise BackendError(f"the CUDA backend is unavailable: {reason}")
    from .cpu import cpu_available

    cpu_ok, cpu_reason = cpu_available()
    if cpu_ok:
        if notice:
            notice(f"using the CPU backend ({reason})")
        return _cpu_backend()
    if notice:
        notice(f"using the NumPy backend ({reason}; the faster CPU backend needs numba: {cpu_reason})")
    from .numpy_backend import NumpyBackend

    return NumpyBackend()


def _cpu_backend() -> Backend:
    from .cpu import cpu_available

    ok, reason = cpu_available()
    if not ok:
        raise BackendError(f"the CPU backend is unavailable: {reason}")
    from .cpu.backend import CpuBackend

    return CpuBackend()


def cuda_status(context: bool = False) -> tuple[bool, str]:
    """(True, device name) when the CUDA backend can run here, else (False, why and how to fix it).
    `context`: also create the GPU's context (what the first allocation would do)."""
    try:
        from .cuda import cuda_available
    except ImportError as exc:  # pragma: no cover - the module itself is always there
        return False, f"the CUDA backend failed to import ({exc})"
    return cuda_available(context)
