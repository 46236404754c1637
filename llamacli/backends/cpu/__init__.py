"""The CPU backend (`--backend cpu`; what `auto` takes without a GPU): the NumPy reference's forward pass with
the weights kept quantized in memory and the hot operations compiled by numba.

    layouts.py   GGUF blocks re-packed, exactly, into a few kernel layouts (4-bit pairs, 5-bit with a mask of
                 fifth bits, a byte a value), float32 scales (and mins) per 16 or 32 values
    simd.py      a row's integer dots with int16 activations, and a block's dequantization, as LLVM vector IR
    kernels.py   the matrix products (int16 activations, rows across threads), dequantizing, RMSNorm, RoPE,
                 GeGLU, the residual add and a decode step's attention
    backend.py   CpuBackend: NumpyBackend with those in place of its float32 weights and NumPy operations

Why a backend of its own and not a faster NumPy backend: the NumPy backend is the reference every other
backend is tested against, written to be read; this one trades some of that (activations quantized to int16 per
32 values, where llama.cpp's CPU backend takes int8) for speed, and is tested against it.

Importing the package needs no numba: `cpu_available()` says whether the backend can run here.
"""

from __future__ import annotations

import os

# GNU OpenMP (numba's threading layer on Linux) spins its idle threads for GOMP_SPINCOUNT rounds of `pause` (300,000
# by default: milliseconds) before it puts them to sleep. A decode step opens a parallel region per product,
# microseconds apart, so a spin of a fraction of a millisecond keeps the threads awake through a step; spinning
# milliseconds longer only takes CPUs from other programs, and where they keep the CPUs busy every region waits
# for a thread that lost its CPU (SmolLM2 at -t 2 on a machine loaded 2x over: 0.8 to 3 s a token with the
# default, 40 to 70 ms with 10,000 or with none). libgomp reads it when it loads (numba's first parallel region);
# a user's own setting wins.
if not os.environ.get("GOMP_SPINCOUNT") and not os.environ.get("OMP_WAIT_POLICY"):
    os.environ["GOMP_SPINCOUNT"] = "10000"


def cpu_available() -> tuple[bool, str]:
    """(True, numba's version) when the CPU backend can run here, else (False, why and how to fix it)."""
    try:
        import numba
    except ImportError as exc:  # not installed, or built for another NumPy
        missing = getattr(exc, "name", None) == "numba"
        return False, "numba is not installed (pip install numba)" if missing else f"numba failed to import ({exc})"
    return True, f"numba {numba.__version__}"
