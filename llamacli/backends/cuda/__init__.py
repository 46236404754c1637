"""The CUDA backend as a package (CuPy + kernels/*.cu); backend.py's CudaBackend is the Backend over its parts:

    loader.py       compiling kernels/<family>.cu (NVRTC, the sm_90a cubin cache), launching, TMA descriptors
    declarations.py each kernel's parameters, read from its declaration (launch() converts by name)
    constants.py    the sizes kernels and launchers share, put in front of every kernel source as #defines
    gpu.py          Gpu (the device's facts, capture) and Options (the executors' switches)
    device.py       is there a GPU, the memory check, DeviceModel (the weights uploaded, RoPE tables)
    kv.py           KVCache: the KV cache and its writers
    kv_pool.py      KVPool: the prefix cache's rows, copied to and from a slot's cache
    linear.py       DeviceMatrix, Linear: the matvec kernels and their grid rules, the prefill GEMMs (cuBLAS)
    ops.py          embedding, RMSNorm, RoPE, SwiGLU, soft-cap, add: one-kernel launchers
    attention.py    AttentionKernels: prefill (CUDA cores, mma.sync, wgmma), decode splits, the step's kernel
    moe.py          Experts: the mixture-of-experts launchers and buffers
    delta.py        DeltaNet: the hybrid models' delta-net launchers and each slot's recurrent states
    fusion.py       a layer's program (models/block.py) read into the fused forms prefill and decode launch
    prefill.py      PrefillPass: the fused prefill pass, its buffers and graphs
    decode.py       DecodeStep: the fused decode step, its graph capture and look-ahead
    sampling.py     DeviceSampler: sampling on the device
    profile.py      Profiler: bench --profile's sections, bench's clock; kernel_bench.py bench --kernels

Importing the package needs no CuPy: `cuda_available()` says whether the backend can run here.
"""

from .backend import CudaBackend
from .device import cuda_available
from .linear import RUNNABLE, DeviceMatrix, qname

__all__ = ["RUNNABLE", "CudaBackend", "DeviceMatrix", "cuda_available", "qname"]
