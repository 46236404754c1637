"""Backends: numpy_backend (the readable reference), the cpu package (quantized weights, numba kernels) and the
cuda package (CuPy + kernels/*.cu)."""

from __future__ import annotations

import contextlib
from typing import Callable

from .. import gpu_driver
from ..background import Background
from ..errors import BackendError, UsageError
from ..models.config import ModelConfig
from .base import Backend
from .cpu import cpu_available
from .split_plan import SplitOptions

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
                   cfg: ModelConfig | None = None, split: SplitOptions | None = None) -> Backend:
    """`auto` takes CUDA when CuPy imports and a GPU is visible and its kernels run the model `cfg` (a layer no CUDA
    path runs, such as Gemma 4's, or experts they do not serve: cuda.device.fused_layers; the hybrid Qwen models
    run op by op there),
    else the CPU backend (with a notice saying why), else, without numba, the NumPy reference (saying that too);
    `cuda` or `cpu` without what it needs is a BackendError that says what is missing and how to install it (a
    model CUDA cannot run: at load). `early`: start_early's result for this name, where the check already began.
    `split`: --split-mode and its options (split_plan.py): the NumPy backend emulates the devices of a split (and
    `auto` takes it for one, without a GPU); a backend runs the modes its `split_modes` lists; `-dev none` means no
    GPU."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    split = split or SplitOptions()
    if split.devices == ():  # -dev none: llama.cpp's "no GPU"
        if name == "cuda":
            raise UsageError("-dev none runs on no GPU: leave it out, or use --backend cpu")
        if name == "auto":
            if early is not None:  # (the thread leaves the driver before the process may exit)
                with contextlib.suppress(Exception):
                    early()
                gpu_driver.release()
            name = "numpy" if split.split or not cpu_available()[0] else "cpu"
            if notice:
                notice(f"-dev none: running on the CPU (the {'NumPy' if name == 'numpy' else 'CPU'} backend)")
    if name == "numpy":
        return _numpy(split, notice)
    if name == "cpu":
        return _cpu(split, notice)
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

        return takes_split(CudaBackend(), split)
    if name == "cuda":
        raise BackendError(f"the CUDA backend is unavailable: {reason}")
    cpu_ok, cpu_reason = cpu_available()
    if cpu_ok and not split.split:
        if notice:
            notice(f"using the CPU backend ({reason})")
        return _cpu(split, notice)
    if notice:
        why = "" if cpu_ok else f"; the faster CPU backend needs numba: {cpu_reason}"
        notice(f"using the NumPy backend ({reason}{why})")
    return _numpy(split, notice)


def _numpy(split: SplitOptions, notice: Callable[[str], None] | None) -> Backend:
    """The NumPy backend, over the devices it emulates for a split (numpy_split.py)."""
    if split.split:
        from .numpy_split import NumpySplitBackend

        return NumpySplitBackend(split)
    if notice and (split.main_gpu or split.devices):
        notice("--main-gpu and -dev choose a GPU: the NumPy backend runs on the CPU")
    from .numpy_backend import NumpyBackend

    return NumpyBackend()


def _cpu(split: SplitOptions, notice: Callable[[str], None] | None) -> Backend:
    """The CPU backend (numba): a BackendError saying why where it cannot run, or where a split is asked of it."""
    ok, reason = cpu_available()
    if not ok:
        raise BackendError(f"the CPU backend is unavailable: {reason}")
    if split.split:
        raise BackendError(f"the CPU backend runs a model in one process: --backend numpy emulates --split-mode "
                           f"{split.mode} on the CPU")
    if notice and (split.main_gpu or split.devices):
        notice("--main-gpu and -dev choose a GPU: the CPU backend runs on the CPU")
    from .cpu.backend import CpuBackend

    return CpuBackend()


def takes_split(backend: Backend, split: SplitOptions) -> Backend:
    """`backend` with the split options it will load with, where it runs that split (Backend.split_modes);
    a BackendError naming the way that does, where it does not."""
    if split.mode not in backend.split_modes:
        raise BackendError(f"the {backend.name} backend runs a model on one GPU for now: --split-mode {split.mode} "
                           "over several is on its way (issue 43); --backend numpy emulates it on the CPU")
    if split.mode == "none" and (split.main_gpu or (split.devices and split.devices[0] != 0)) \
            and not backend.any_gpu:
        gpu = split.devices[split.main_gpu] if split.devices else split.main_gpu
        raise BackendError(f"the {backend.name} backend runs on the first visible GPU for now: to run on GPU {gpu}, "
                           f"set CUDA_VISIBLE_DEVICES={gpu}")
    backend.split = split
    return backend


def cuda_status(context: bool = False) -> tuple[bool, str]:
    """(True, device name) when the CUDA backend can run here, else (False, why and how to fix it).
    `context`: also create the GPU's context (what the first allocation would do)."""
    try:
        from .cuda import cuda_available
    except ImportError as exc:  # pragma: no cover - the module itself is always there
        return False, f"the CUDA backend failed to import ({exc})"
    return cuda_available(context)
