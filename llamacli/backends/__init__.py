"""Backends: numpy_backend (the readable reference) and the cuda package (CuPy + kernels/*.cu)."""

from __future__ import annotations

import threading
from typing import Callable

from ..errors import BackendError, UsageError
from .base import Backend

BACKENDS = ("auto", "cuda", "numpy")
EarlyStatus = Callable[[], "tuple[bool, str]"]


def start_early(name: str) -> EarlyStatus | None:
    """Begin the CUDA start-up (CuPy's import, the driver, the GPU's context: ~0.3-0.4 s) on a thread of its
    own when `name` may take the CUDA backend, so that it runs while the model file is opened and its
    tokenizer built. -> the function select_backend calls for its cuda_status() (it waits for the thread);
    None for the NumPy backend."""
    if name not in ("auto", "cuda"):
        return None
    result: list = []

    def run() -> None:
        _driver_context()
        result.append(cuda_status(context=True))

    thread = threading.Thread(target=run, name="llamacli-cuda-start", daemon=True)
    thread.start()

    def status() -> tuple[bool, str]:
        thread.join()
        return result[0] if result else cuda_status()  # (no result: the thread died; ask again here)

    return status


def _driver_context() -> None:
    """The CUDA driver's start and GPU 0's primary context (the one CuPy's runtime then uses) through libcuda
    directly: ctypes releases the GIL for each call, so the ~0.2-0.3 s they take overlap the Python work of the
    other thread, where CuPy's import would hold the GIL. Anything missing (no driver, no GPU) is left for
    cuda_status to report."""
    import ctypes

    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
        if cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0:
            cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    except (OSError, AttributeError):
        pass


def select_backend(name: str, notice: Callable[[str], None] | None = None, early: EarlyStatus | None = None,
                   ) -> Backend:
    """`auto` takes CUDA when CuPy imports and a GPU is visible, else NumPy (with a notice); `cuda` without
    either is a BackendError that says what is missing and how to install it. `early`: start_early's result
    for this name, where the check already began."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    ok, reason = early() if early is not None else cuda_status()
    if ok:
        from .cuda import CudaBackend

        return CudaBackend()
    if name == "cuda":
        raise BackendError(f"the CUDA backend is unavailable: {reason}")
    if notice:
        notice(f"using the NumPy backend ({reason})")
    from .numpy_backend import NumpyBackend

    return NumpyBackend()


def cuda_status(context: bool = False) -> tuple[bool, str]:
    """(True, device name) when the CUDA backend can run here, else (False, why and how to fix it).
    `context`: also create the GPU's context (what the first allocation would do)."""
    try:
        from .cuda import cuda_available
    except ImportError as exc:  # pragma: no cover - the module itself is always there
        return False, f"the CUDA backend failed to import ({exc})"
    return cuda_available(context)
