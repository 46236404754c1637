"""Backends: numpy_backend (the readable reference) and the cuda package (CuPy + kernels/*.cu)."""

from __future__ import annotations

from typing import Callable

from ..errors import BackendError, UsageError
from .base import Backend

BACKENDS = ("auto", "cuda", "numpy")


def select_backend(name: str, notice: Callable[[str], None] | None = None) -> Backend:
    """`auto` takes CUDA when CuPy imports and a GPU is visible, else NumPy (with a notice); `cuda` without
    either is a BackendError that says what is missing and how to install it."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    ok, reason = cuda_status()
    if ok:
        from .cuda import CudaBackend

        return CudaBackend()
    if name == "cuda":
        raise BackendError(f"the CUDA backend is unavailable: {reason}")
    if notice:
        notice(f"using the NumPy backend ({reason})")
    from .numpy_backend import NumpyBackend

    return NumpyBackend()


def cuda_status() -> tuple[bool, str]:
    """(True, device name) when the CUDA backend can run here, else (False, why and how to fix it)."""
    try:
        from .cuda import cuda_available
    except ImportError as exc:  # pragma: no cover - the module itself is always there
        return False, f"the CUDA backend failed to import ({exc})"
    return cuda_available()
