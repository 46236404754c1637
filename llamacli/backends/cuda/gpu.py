"""The GPU the CUDA backend runs on, and the switches of its executors: the two things every part reads and
none owns.

`Gpu` holds CuPy and the device's facts that grids are sized by (SMs, shared memory per block and per SM),
with the small host <-> device helpers and graph capture. `Options` holds the switches CudaBackend exposes as
attributes (graphs, the attention kernels, programmatic launches, the streaming matvec): the parts hold the
one Options object, so a switch set on the backend reaches every part, and the decode step reads it when it
captures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# The captured decode step's programmatic launches (decode.py DecodeStep.launch_step; the thresholds that
# measured best, docs/perf-log.md):
PDL_MAX_BYTES = 16 << 20  # matvecs under this many weight bytes (and the attention) launch as dependents
PDL_EARLY_BYTES = 2 << 20  # a kernel lets the next start early when the next reads under this many bytes


@dataclass
class Options:
    """The CUDA executors' switches (CudaBackend's attributes of the same names)."""

    use_graph: bool = True  # the decode step and the prefill passes captured as CUDA graphs and replayed
    attention_tc: bool = True  # prefill attention on tensor cores (False: the fp32 CUDA-core kernel)
    # ... with Hopper's warpgroup MMA where attention_wgmma.cu is built for sm_90a and the driver makes TMA
    # descriptors (False: mma.sync everywhere)
    attention_wg: bool = False
    # The captured decode step launches its matvecs and attention as programmatic dependents (sm_90+): set
    # before the first decode (the graph keeps it).
    pdl: bool = True
    # 16-bit float matvecs of one token through mv1_stream, as programmatic dependents in the decode step
    # (False: mv1; for comparisons).
    mv1_stream: bool = True
    # Linear layers of a few rows (the batched step's, prefill chunks of up to BG_NMAX tokens) through bgemm on the
    # quantized weights (linear.Linear.gemm_weights; False: dequantized to fp16 and multiplied on cuBLAS; for
    # comparisons).
    batch_gemm: bool = True
    # A verification of drafts (speculative decoding) through the batched step's pass, its rows in one slot (False:
    # block.run op by op up to MATVEC_TMAX tokens, the fused prefill pass beyond; for comparisons)
    verify_batched: bool = True
    pdl_max_bytes: int = PDL_MAX_BYTES
    pdl_early_bytes: int = PDL_EARLY_BYTES


class Gpu:
    """CuPy and the current device's facts."""

    def __init__(self) -> None:
        import cupy as cp

        self.cp = cp
        attrs = cp.cuda.Device().attributes
        self.n_sms = int(attrs["MultiProcessorCount"])
        # Shared memory a block may opt into and an SM holds (attention_split's fit and its splits).
        self.smem_block = int(attrs["MaxSharedMemoryPerBlockOptin"])
        self.smem_sm = int(attrs["MaxSharedMemoryPerMultiprocessor"])

    def f32(self, x: Any) -> Any:
        return self.cp.ascontiguousarray(x, dtype=self.cp.float32)

    def to_host(self, x: Any) -> np.ndarray:
        return self.cp.asnumpy(x)

    def capture(self, launch_all: Callable[[], None]) -> Any:
        """Record launch_all()'s kernels into a CUDA graph (nothing runs) on a side stream."""
        cp = self.cp
        stream = cp.cuda.Stream(non_blocking=True)
        cp.cuda.get_current_stream().synchronize()
        with stream:
            stream.begin_capture()
            try:
                launch_all()
            finally:
                graph = stream.end_capture()
        stream.synchronize()
        return graph

    def synchronize(self) -> None:
        self.cp.cuda.Device().synchronize()

    def device_name(self) -> str:
        cp = self.cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        v = cp.cuda.runtime.runtimeGetVersion()
        return f"{name} (CuPy {cp.__version__}, CUDA runtime {v // 1000}.{v % 1000 // 10})"

    def memory_bandwidth(self) -> float:
        """Device-to-device copy of 256 MiB, best of 5 by CUDA events; bytes read + written per second."""
        cp = self.cp
        src = cp.ones(256 << 20, dtype=cp.uint8)
        dst = cp.empty_like(src)
        dst[...] = src  # warm up
        best = float("inf")
        for _ in range(5):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            dst[...] = src
            b.record()
            b.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(a, b) / 1e3)
        del src, dst
        return 2 * (256 << 20) / best
