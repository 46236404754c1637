"""The CUDA backend as a package (CuPy + kernels/*.cu); backend.py assembles CudaBackend from its parts:

    loader.py     compiling kernels/<family>.cu (NVRTC, the sm_90a cubin cache), launching, TMA descriptors
    constants.py  the sizes kernels and launchers share, put in front of every kernel source as #defines
    device.py     is there a GPU, loading (weight arena, KV cache), the memory check, graph capture
    linear.py     DeviceMatrix, the matvec kernels and their grid rules, the prefill GEMMs (cuBLAS)
    ops.py        embedding, RMSNorm, RoPE, SwiGLU, add: the one-kernel Backend operations
    attention.py  the attention launchers (prefill: CUDA cores, mma.sync, wgmma; decode splits) and sizes
    fusion.py     a layer's program (models/block.py) read into the fused forms prefill and decode launch
    prefill.py    forward_prompt's fused pass, its buffers and graphs
    decode.py     the fused decode step, its graph capture and look-ahead
    sampling.py   sampling on the device
    profile.py    bench --profile's sections, bench's clock; kernel_bench.py bench --kernels

Importing the package needs no CuPy: `cuda_available()` says whether the backend can run here.
"""

from .backend import CudaBackend
from .device import cuda_available
from .linear import RUNNABLE, DeviceMatrix, qname

__all__ = ["RUNNABLE", "CudaBackend", "DeviceMatrix", "cuda_available", "qname"]
