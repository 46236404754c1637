"""The CUDA backend: CuPy for memory and cuBLAS, our kernels (kernels/*.cu) for everything else.

Two ways to run the model:

- the Backend operations (embed, rms_norm, matmul, rope, attention, ...) that models/block.run calls, one
  kernel each (ops.py, linear.py, attention.py): the reference-shaped path;
- the fused paths: `forward_prompt`, the prefill pass of a prompt chunk (prefill.py), and `decode(token,
  pos)` / `decode_greedy`, the decode step captured into a CUDA graph with programmatic dependent launches
  and a look-ahead step (decode.py).

CudaBackend is assembled from one mixin per concern, each in its own module: device.py (loading, memory,
transfers), linear.py (matvec / GEMM), ops.py, attention.py, moe.py (mixtures of experts), prefill.py,
decode.py, sampling.py (device sampling) and profile.py (bench --profile); loader.py compiles and launches the
kernels.

The current figures are in BENCHMARKS.md, their history in docs/perf-log.md; `llamacli bench --profile`
breaks a step down by kernel family.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

import numpy as np

from ...errors import BackendError
from ...models.block import Rope
from ..base import Backend
from . import loader as K
from .attention import AttentionMixin
from .decode import PDL_EARLY_BYTES, PDL_MAX_BYTES, DecodeMixin
from .device import DeviceMixin, cuda_available
from .linear import RUNNABLE, LinearMixin
from .moe import MoEMixin
from .ops import OpsMixin
from .prefill import PREFILL_CHUNK, PrefillMixin
from .profile import ProfileMixin
from .sampling import SamplingMixin


class CudaBackend(DeviceMixin, LinearMixin, OpsMixin, AttentionMixin, MoEMixin, PrefillMixin, DecodeMixin,
                  SamplingMixin, ProfileMixin, Backend):
    name = "cuda"
    runnable_types = frozenset(RUNNABLE)
    prefill_chunk = PREFILL_CHUNK

    def __init__(self, use_graph: bool = True):
        ok, reason = cuda_available()
        if not ok:
            raise BackendError(f"the CUDA backend is unavailable: {reason}")
        import cupy as cp

        self.cp = cp
        self.use_graph = use_graph
        self.attention_tc = True  # prefill attention on tensor cores (False: the fp32 CUDA-core kernel)
        # ... with Hopper's warpgroup MMA where attention_wgmma.cu is built for sm_90a and the driver makes TMA
        # descriptors (False: mma.sync everywhere)
        self.attention_wg = K.built_arch("attention_wgmma") == "sm_90a" and K.tma_supported()
        attrs = cp.cuda.Device().attributes
        self.n_sms = int(attrs["MultiProcessorCount"])
        # Shared memory a block may opt into and an SM holds (attention_split's fit and its splits).
        self.smem_block = int(attrs["MaxSharedMemoryPerBlockOptin"])
        self.smem_sm = int(attrs["MaxSharedMemoryPerMultiprocessor"])
        self.kv_q8, self.kv16 = False, None  # an 8-bit KV cache and its fp16 pair (device.alloc_kv_cache)
        # The captured decode step launches its matvecs and attention as programmatic dependents (sm_90+):
        # set before the first decode (the graph keeps it).
        self.pdl = True
        # 16-bit float matvecs of one token through mv1_stream, as programmatic dependents in the decode step
        # (False: mv1; for comparisons).
        self.mv1_stream = True
        self.pdl_max_bytes, self.pdl_early_bytes = PDL_MAX_BYTES, PDL_EARLY_BYTES
        self._alpha_beta = np.array([1.0, 0.0, 1.0], dtype=np.float32)  # host scalars for cuBLAS: 1, beta 0 or 1
        self._graphs: dict[str, Any] = {}
        self._pf: SimpleNamespace | None = None  # forward_prompt's buffers and per-layer plans
        self._pf_graphs: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._pf_seen: set[int] = set()
        self._pf_graph_ok = True
        self._cublas_ws = None
        self._arena = None
        self._prof: list | None = None  # (section, start event, end event, our launches) while profiling
        self._wfam: dict[int, str] = {}  # id(weight handle) -> kernel family, for the profile

    def rope_args(self, rope: Rope | None) -> tuple[int, Any, float]:
        """(dims that rotate, theta table on the device, attention factor) of a layer's RoPE (fusion.py's
        branch.rope): the config's rope_dim, and the local table with factor 1 for a local rotation (gemma's
        sliding-window layers), else the global table and the config's factor; no RoPE (smollm3's NoPE
        layers): 0 dims, which the kernels pass through."""
        if rope is not None and rope.local:
            return self.cfg.rope_dim, self.inv_freq_local, 1.0
        return (self.cfg.rope_dim if rope is not None else 0), self.inv_freq, self.cfg.rope_attn_factor
