"""Backends: numpy_backend (the readable reference) and the cuda package (CuPy + kernels/*.cu)."""

from __future__ import annotations

import threading
from typing import Callable

from ..errors import BackendError, UsageError
from .base import Backend

BACKENDS = ("auto", "cuda", "numpy")
EarlyStatus = Callable[[], "tuple[bool, str]"]


def start_early(name: str) -> EarlyStatus | None:
    """Begin the CUDA start-up (the driver, the GPU's context, CuPy's import: ~0.3-0.5 s) on a thread of its
    own when `name` may take the CUDA backend, so that it overlaps the tokenizer's build. -> the function
    select_backend calls for its cuda_status() (it waits for the thread, and raises what the thread raised);
    None for the NumPy backend. Call it, once started, on every way out (Model does), so that the process
    never exits with the thread inside the driver."""
    if name not in ("auto", "cuda"):
        return None
    result: list = []

    def run() -> None:
        try:
            _driver_context()
            result.append(cuda_status(context=True))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by status()
            result.append(exc)

    thread = threading.Thread(target=run, name="llamacli-cuda-start", daemon=True)
    thread.start()

    def status() -> tuple[bool, str]:
        thread.join()
        if not result:  # (the thread cannot end without a result; ask again here all the same)
            return cuda_status()
        if isinstance(result[0], BaseException):
            raise result[0]
        ok, reason = result[0]
        if not ok:
            _driver_release()
        return ok, reason

    return status


_driver: dict = {"retained": None}  # (libcuda, device) whose primary context _driver_context retained, or None


def _driver_context() -> None:
    """The CUDA driver's start and GPU 0's primary context (the one CuPy's runtime then uses) through libcuda
    directly: ctypes releases the GIL for each call, so the ~0.2-0.3 s they take overlap the Python work of the
    other thread, where CuPy's import would hold the GIL. Only where CuPy is installed (else the CUDA backend
    cannot run and no context should be made), and once per process; anything missing (no driver, no GPU)
    is left for cuda_status to report, and _driver_release lets the context go where the CUDA backend is not
    taken after all."""
    import ctypes
    import importlib.util

    if _driver["retained"] is not None or importlib.util.find_spec("cupy") is None:
        return
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
        if (cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
                and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0):
            _driver["retained"] = (cu, dev)
    except (OSError, AttributeError):
        pass


def _driver_release() -> None:
    """Release the primary context _driver_context retained (the NumPy backend runs after all)."""
    retained, _driver["retained"] = _driver["retained"], None
    if retained is not None:
        cu, dev = retained
        cu.cuDevicePrimaryCtxRelease(dev)


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
