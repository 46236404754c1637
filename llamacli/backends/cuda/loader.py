"""Loading kernels/*.cu and launching them: one cupy.RawModule per file, compiled once per process.

Each kernels/<family>.cu is one module. Local `#include "x.cuh"` lines are inlined here before compiling, so
the text CuPy hashes for its on-disk cache (~/.cupy/kernel_cache) is the whole program: editing a header
recompiles, and a cache hit in a new process costs milliseconds. CuPy adds `-arch=sm_XY` of the current
device itself; we add `-std=c++17`. An NVRTC error becomes KernelCompileError naming the file, with the log.

A family in FEATURE_ARCH holds code for one architecture's own features (attention_wgmma.cu: Hopper's wgmma,
which only `sm_90a` code may use, guarded by __CUDA_ARCH_FEAT_SM90_ALL). On that device it is compiled here
with NVRTC for that target (CuPy can only name `sm_XY`) into a cubin cached under the llamacli cache, keyed by
the source, the options and the NVRTC version, and loaded with RawModule(path=...); elsewhere as above. Every
other family, the other attention families included, is compiled by CuPy for the device's `sm_XY`.

`launch(family, kernel, grid, block, shared=..., **args)` is every kernel's typed launcher: the arguments go by
the names the kernel's declaration gives them and are converted to its C types (declarations.py). The caller
computes grid and block. With logging at DEBUG (the CLI's --debug) every launch is logged: name, grid, block,
dynamic shared memory.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BackendError, KernelCompileError
from .constants import defines
from .declarations import signature

log = logging.getLogger("llamacli.kernels")

NVRTC_OPTIONS = ("-std=c++17",)
# Our own NVRTC calls (compile_ptx, the FEATURE_ARCH builds) add what CuPy adds to its: unannotated functions
# (a generic lambda, say) are device functions.
_NVRTC_DIRECT = (*NVRTC_OPTIONS, "-default-device")
FEATURE_ARCH = {"attention_wgmma": ("90", "sm_90a")}  # family -> (compute capability, NVRTC target on it)
FAMILIES = ("attention_mma", "attention_simt", "attention_split", "attention_wgmma", "batch_gemm", "delta",
            "dequant", "elementwise", "matvec", "moe", "norm", "rope", "sampling")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def kernels_dir() -> Path:
    """`llamacli/kernels` inside an installed wheel (force-included), else the repository's `kernels/`
    (the one lookup lives in llamacli.paths)."""
    from ...paths import kernels_dir as find

    return find()


def kernel_source(family: str, directory: Path | None = None) -> str:
    """The text of kernels/<family>.cu with its local includes inlined (each header once), after the sizes it
    shares with the launchers (constants.py's #defines)."""
    root = directory or kernels_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        path = root / name
        if not path.is_file():
            raise KernelCompileError(f"kernel source {path} is missing")
        text = path.read_text(encoding="utf-8")

        def include(m: re.Match[str]) -> str:
            inc = m.group(1)
            if inc in seen:
                return f"// (already included: {inc})"
            seen.add(inc)
            return f"// ---- begin {inc}\n{expand(inc)}\n// ---- end {inc}"

        return _INCLUDE.sub(include, text).replace("#pragma once", "")

    return defines() + expand(f"{family}.cu")


def compile_ptx(family: str, arch: str = "compute_90", directory: Path | None = None) -> str:
    """Compile one family with NVRTC directly (no GPU needed): the CI check. Returns the PTX."""
    from cupy_backends.cuda.libs import nvrtc

    src = kernel_source(family, directory)
    prog = nvrtc.createProgram(src, f"{family}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", *_NVRTC_DIRECT])
        except Exception as exc:  # nvrtc.NVRTCError
            raise KernelCompileError(
                f"kernels/{family}.cu failed to compile for {arch}:\n{nvrtc.getProgramLog(prog)}"
            ) from exc
        return nvrtc.getPTX(prog).decode() if isinstance(nvrtc.getPTX(prog), bytes) else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


@lru_cache(maxsize=None)
def module(family: str) -> Any:
    """The compiled RawModule of kernels/<family>.cu (once per process; CuPy caches the binary on disk)."""
    import cupy as cp

    src = kernel_source(family)
    arch = feature_arch(family)
    if arch is not None:
        try:
            mod = cp.RawModule(path=str(feature_cubin(family, src, arch)))
        except Exception as exc:  # an NVRTC without that target, say: the portable build serves
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            log.warning("kernels/%s.cu for %s: %s; using the portable build", family, arch, first)
        else:
            _built_for[family] = arch
            return mod
    _built_for[family] = None
    mod = cp.RawModule(code=src, options=NVRTC_OPTIONS)
    try:
        mod.compile()
    except cp.cuda.compiler.CompileException as exc:
        raise KernelCompileError(f"kernels/{family}.cu failed to compile:\n{exc.get_message()}") from None
    return mod


_built_for: dict[str, str | None] = {}  # family -> the architecture-specific target its module was built for


def built_arch(family: str) -> str | None:
    """The architecture-specific target (FEATURE_ARCH) kernels/<family>.cu's module was built for, or None
    (the portable build: its architecture-specific kernels trap). Builds the module if need be."""
    module(family)
    return _built_for[family]


def feature_arch(family: str) -> str | None:
    """The architecture-specific target `family` is compiled for on this device (see the module docstring),
    or None."""
    import cupy as cp

    want = FEATURE_ARCH.get(family)
    return want[1] if want and cp.cuda.Device().compute_capability == want[0] else None


def feature_cubin(family: str, src: str, arch: str) -> Path:
    """kernels/<family>.cu compiled for `arch` (e.g. sm_90a): a cubin file in the cache, made once."""
    import hashlib
    import os
    import tempfile

    from cupy_backends.cuda.libs import nvrtc

    from ...paths import cache_home

    # -ftz=true as CuPy compiles every other family (same float behaviour whichever path compiled it).
    options = [f"-arch={arch}", *_NVRTC_DIRECT, "-ftz=true"]
    key = hashlib.sha256("\0".join([src, *options, repr(nvrtc.getVersion())]).encode()).hexdigest()[:24]
    path = cache_home() / "kernels" / f"{family}-{arch}-{key}.cubin"
    if path.is_file():
        return path
    prog = nvrtc.createProgram(src, f"{family}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except Exception as exc:  # nvrtc.NVRTCError
            log_text = nvrtc.getProgramLog(prog)
            raise KernelCompileError(f"kernels/{family}.cu failed to compile for {arch}:\n{log_text}") from exc
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".part")
    with os.fdopen(fd, "wb") as f:
        f.write(cubin)
    os.replace(tmp, path)  # atomic: a concurrent process finds the whole file or none
    return path


@lru_cache(maxsize=None)
def function(family: str, name: str) -> Any:
    return module(family).get_function(name)


_launches = [0]
_smem_limit: dict[tuple[str, str], int] = {}  # dynamic shared memory limit raised so far, per kernel


def launch_count() -> int:
    """Kernels launched through launch() in this process (the profiler counts them per section)."""
    return _launches[0]


def launch(family: str, kernel: str, grid: tuple[int, ...], block: tuple[int, ...], /, shared: int = 0,
           **args: Any) -> None:
    """Launch kernels/<family>.cu:<kernel> on the current stream with its arguments by name, converted to the
    types its declaration gives (declarations.py; a missing, unknown or ill-typed one is a TypeError before
    the launch). Inside `dependent_launches()` a kernel of PDL_KERNELS goes out with programmatic stream
    serialization."""
    values = signature(family, kernel).pack(kernel, args)
    fn = function(family, kernel)
    _launches[0] += 1
    if log.isEnabledFor(logging.DEBUG):
        log.debug("launch %s grid=%s block=%s shared=%d", kernel, grid, block, shared)
    if shared and _smem_limit.get((family, kernel), 0) < shared:
        # Dynamic plus static shared memory above 48 KiB only once raised (cudaFuncSetAttribute; once per kernel
        # and size): set for any dynamic size, since a kernel's static part is not known here.
        fn.max_dynamic_shared_size_bytes = shared
        _smem_limit[(family, kernel)] = shared
    if _pdl[0] and kernel.startswith(PDL_KERNELS):
        launch_dependent(fn, grid, block, values, shared)
    else:
        fn(grid, block, values, shared_mem=shared)


# -- programmatic dependent launch ---------------------------------------------------------------------------
# A kernel launched with programmatic stream serialization may start while the previous kernel of the stream
# still runs, up to its griddepcontrol.wait (common.cuh pdl_wait): its blocks' set-up and weight prefetch
# overlap the previous kernel's tail, and the launch gap between the two disappears. Only kernels that call
# pdl_wait() before touching anything an earlier kernel writes may be launched so: these name prefixes.
# CuPy's launcher cannot set launch attributes, so these go through the driver's cuLaunchKernelEx (ctypes);
# stream capture records them as programmatic edges of the graph.
PDL_KERNELS = ("mv1_", "attention_split_step_")
_pdl = [False]
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h CUlaunchAttributeID


@contextmanager
def dependent_launches(on: bool = True) -> Iterator[None]:
    """Launch PDL_KERNELS with programmatic stream serialization inside this block (sm_90+ only)."""
    prev = _pdl[0]
    _pdl[0] = on and pdl_supported()
    try:
        yield
    finally:
        _pdl[0] = prev


def pdl_active() -> bool:
    """Whether launches now go out as programmatic dependents (inside `dependent_launches()` on a GPU that
    supports them)."""
    return _pdl[0]


@lru_cache(maxsize=None)
def pdl_supported() -> bool:
    """True on a GPU of compute capability 9.0 or later whose driver has cuLaunchKernelEx."""
    import cupy as cp

    try:
        return int(cp.cuda.Device().compute_capability) >= 90 and cu_launch_kernel_ex() is not None
    except Exception:
        return False


class LaunchAttribute(ctypes.Structure):  # cuda.h CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):  # cuda.h CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


_CTYPE_OF = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.uint32: ctypes.c_uint32,
             np.float32: ctypes.c_float, np.float64: ctypes.c_double}


def kernel_params(args: tuple) -> tuple[Any, list]:
    """cuLaunchKernelEx's void** kernelParams for arguments as declarations.Signature.pack makes them (np.uint64
    pointers, NumPy scalars) -> (the array, the values it points into: keep both alive)."""
    bad = [type(a).__name__ for a in args if type(a) not in _CTYPE_OF]
    if bad:
        raise TypeError(f"programmatic launches take pointers and scalars, got {', '.join(bad)}")
    values = [_CTYPE_OF[type(a)](a) for a in args]
    return (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values]), values


@lru_cache(maxsize=None)
def cu_launch_kernel_ex() -> Any:
    """(the driver's cuLaunchKernelEx, the programmatic-serialization attribute to pass it), or None where
    the driver has no such entry point."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    attr = LaunchAttribute()
    attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    return fn, attr


def launch_dependent(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared: int) -> None:
    """Launch `fn` on the current stream through cuLaunchKernelEx with programmatic stream serialization."""
    import cupy as cp

    launch_ex, attr = cu_launch_kernel_ex()
    params, _values = kernel_params(args)
    g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    cfg = LaunchConfig(g, b, shared, cp.cuda.get_current_stream().ptr, ctypes.pointer(attr), 1)
    st = launch_ex(ctypes.byref(cfg), fn.kernel.ptr, params, None)
    if st:
        raise BackendError(f"cuLaunchKernelEx failed with CUresult {st}")


# -- TMA descriptors -----------------------------------------------------------------------------------------
# Hopper's tensor copy engine copies a box of a matrix into shared memory in one instruction, described by a
# CUtensorMap that the host encodes (the driver's cuTensorMapEncodeTiled) and the kernel takes by value
# (a __grid_constant__ parameter): CuPy passes the bytes of a one-element NumPy array by value.
TENSOR_MAP = np.dtype("V128")  # cuda.h CUtensorMap: 128 opaque bytes
_TMA_FLOAT16, _TMA_SWIZZLE_128B, _TMA_L2_PROMOTION_128B = 6, 3, 2  # cuda.h CUtensorMap* enums


@lru_cache(maxsize=None)
def cu_tensor_map_encoder() -> Any:
    """The driver's cuTensorMapEncodeTiled, or None where it has none."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def tma_supported() -> bool:
    """True where the CUDA driver can encode TMA descriptors (cuTensorMapEncodeTiled, CUDA 12 and later)."""
    return cu_tensor_map_encoder() is not None


@lru_cache(maxsize=256)
def tensor_map_2d(address: int, rows: int, cols: int, box_rows: int, box_cols: int) -> np.ndarray:
    """The TMA descriptor (a one-element TENSOR_MAP array, a kernel argument) of a row-major fp16 matrix
    [rows, cols] at device address `address`, copied in boxes of [box_rows, box_cols] (box_cols x 2 = 128
    bytes) into shared memory with the 128-byte swizzle; rows past `rows` read as zeros. A pure function of
    its arguments, so cached."""
    if address % 16 or cols % 8 or box_cols * 2 != 128 or not 0 < box_rows <= 256:
        raise BackendError(f"no TMA descriptor for a [{rows}, {cols}] fp16 matrix at {address:#x} in "
                           f"[{box_rows}, {box_cols}] boxes")
    encode = cu_tensor_map_encoder()
    if encode is None:
        raise BackendError("this CUDA driver has no cuTensorMapEncodeTiled")
    raw = np.zeros(TENSOR_MAP.itemsize + 64, np.uint8)  # the driver writes it 64-byte aligned
    at = -raw.ctypes.data % 64
    st = encode(raw.ctypes.data + at, _TMA_FLOAT16, 2, address, (ctypes.c_uint64 * 2)(cols, rows),
                (ctypes.c_uint64 * 1)(cols * 2), (ctypes.c_uint32 * 2)(box_cols, box_rows),
                (ctypes.c_uint32 * 2)(1, 1), 0, _TMA_SWIZZLE_128B, _TMA_L2_PROMOTION_128B, 0)
    if st:
        raise BackendError(f"cuTensorMapEncodeTiled failed with CUresult {st}")
    out = raw[at : at + TENSOR_MAP.itemsize].view(TENSOR_MAP)
    out.flags.writeable = False
    return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
