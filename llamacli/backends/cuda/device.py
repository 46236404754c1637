"""The device side of the CUDA backend: whether a GPU is usable, loading (the weight arena, the RoPE table,
the KV cache), the memory check before any upload, host <-> device transfers, graph capture, and the
figures bench reads (device name, copy bandwidth).

Weights stay in their GGUF block layout on the device: one arena for the matrices, read from the file in
chunks and uploaded; the 1-D tensors (norms, biases) as float32 arrays. The KV cache is fp16, one
[rows, Hkv, Dh] array per layer: ctx rows, or a sliding-window layer's ring (models/kv_cache.py); or 8-bit
(alloc_kv_cache).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

from ...errors import BackendError, DeviceMemoryError, UsageError
from ...ggufio.file import GGUFFile
from ...models import rope as rope_tables
from ...models.block import programs
from ...models.config import ModelConfig
from ...models.kv_cache import check_cache_types, ring_span
from ...models.weights import layer_tensor_names, model_specs
from ..base import LayerWeights, ModelWeights, Progress
from ..memory_fit import not_enough_memory, q8_pair_bytes
from . import loader as K
from .fusion import match_layer
from .linear import DEQUANT_CHUNK, DeviceMatrix
from .moe import check_moe, dense_ff, moe_family_needed, moe_scratch_bytes
from .prefill import PREFILL_CHUNK

_ALIGN = 256


def nvidia_driver_present() -> bool:
    """Whether the NVIDIA driver is installed here: its kernel module (/proc/driver/nvidia) or its user-space
    library (libcuda.so.1, which every CUDA program loads)."""
    import ctypes

    if os.path.exists("/proc/driver/nvidia/version"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def cuda_available(context: bool = False) -> tuple[bool, str]:
    """(True, device name) if CuPy imports and sees a GPU, else (False, what is missing and how to fix it).
    `context`: also create the device's primary context (cudaFree(0)), which any thread's later CUDA calls
    share."""
    try:
        import cupy as cp
    except Exception as exc:  # ImportError, or a CuPy built for another CUDA
        return False, (
            f"CuPy is not installed or failed to import ({type(exc).__name__}: {exc}); install it with "
            "`pip install 'llamacli[cuda12]'` or `pip install 'llamacli[cuda13]'` (matching your CUDA driver)"
        )
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:
        if not nvidia_driver_present():  # no driver at all: CUDA calls that "insufficient driver"
            return False, "no NVIDIA GPU found (this machine has no NVIDIA driver)"
        return False, f"no usable NVIDIA GPU or driver ({exc}); `nvidia-smi` should list a GPU"
    if n == 0:
        return False, "CuPy found no NVIDIA GPU"
    try:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        if context:
            cp.cuda.runtime.free(0)
    except Exception as exc:
        return False, f"the GPU is not usable ({exc})"
    return True, name


UPLOAD_CHUNK = 32 << 20  # bytes per read and copy of the weights' upload
UPLOAD_BUFFERS = 4  # pinned host buffers (and reader threads) in flight


def _upload(cp: Any, gguf: GGUFFile, jobs: list[tuple[int, int, int, str]],
            report: Callable[[int, str], None]) -> int:
    """Copy file ranges to device addresses: jobs of (file offset, device address, bytes, tensor name). Reader
    threads fill UPLOAD_BUFFERS pinned buffers with positioned reads (the page cache copies in parallel) while
    the device copies the ones already read, asynchronously on a stream of its own; a buffer is read into again
    once its copy has finished. -> the bytes uploaded (report(done, name) after each chunk)."""
    from concurrent.futures import ThreadPoolExecutor

    if not jobs:
        return 0
    n_buf = min(UPLOAD_BUFFERS, len(jobs))
    size = max(n for _, _, n, _ in jobs)
    bufs = [np.frombuffer(cp.cuda.alloc_pinned_memory(size), np.uint8, size) for _ in range(n_buf)]
    events = [cp.cuda.Event(disable_timing=True) for _ in range(n_buf)]
    stream = cp.cuda.Stream(non_blocking=True)
    done = 0
    with ThreadPoolExecutor(n_buf, thread_name_prefix="llamacli-upload") as pool:
        def read(j: int) -> Any:
            src, _, n, _ = jobs[j]
            return pool.submit(gguf.read_at, src, n, bufs[j % n_buf])

        pending = {j: read(j) for j in range(n_buf)}
        try:
            for j, (_, dst, n, name) in enumerate(jobs):
                pending.pop(j).result()  # (FileChangedError: the file was cut short meanwhile)
                b = j % n_buf
                cp.cuda.runtime.memcpyAsync(dst, bufs[b].ctypes.data, n, 1, stream.ptr)  # host -> device
                events[b].record(stream)
                done += n
                report(done, name)
                if j + n_buf < len(jobs):
                    events[b].synchronize()  # this buffer's copy has landed: read the next chunk into it
                    pending[j + n_buf] = read(j + n_buf)
        finally:
            for f in pending.values():
                f.cancel()
            stream.synchronize()  # no copy reads a pinned buffer after this
    return done


class DeviceMixin:
    """Mixed into backend.CudaBackend."""

    cp: Any

    # -- lifetime ------------------------------------------------------------------------------------------
    def load(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int, progress: Progress | None = None,
             cache_types: tuple[str, str] = ("f16", "f16")) -> None:
        if tuple(cache_types) not in (("f16", "f16"), ("q8_0", "q8_0")):  # as llama.cpp's CUDA flash attention
            raise UsageError(f"the CUDA backend takes K and V caches of one type (f16 or q8_0), not "
                             f"{'/'.join(cache_types)}; the NumPy backend (--backend numpy) takes any pair")
        check_cache_types(cfg.head_dim, cache_types)
        self.kv_q8 = cache_types[0] == "q8_0"  # (the memory check's decode splits depend on it)
        cp = self.cp
        t0 = time.perf_counter()  # load_stages: kernels, weights, the rest
        self.cfg, self.ctx = cfg, ctx
        report = progress or (lambda done, total, what: None)
        check_moe(cfg, gguf)
        # Each layer's program in the fused forms the prefill pass and the decode step launch (fusion.py);
        # a program they do not run is refused here, before anything is uploaded.
        self.fused = tuple(match_layer(ops, i) for i, ops in enumerate(programs(cfg)))
        for fam in K.FAMILIES:  # compile (or fetch from CuPy's cache) before touching device memory
            if fam != "moe" or moe_family_needed(cfg):  # the expert kernels only for models with experts
                K.module(fam)
        t_kernels = time.perf_counter()

        # Matrices (2-D, and 3-D expert tensors as one matrix of E * rows rows) go to the arena in their GGUF
        # layout; vectors and bias tables (the experts' [E, F] biases) become float32 arrays.
        specs = [s for s in model_specs(cfg) if s.name in gguf.tensors]
        mats = [gguf.tensors[s.name] for s in specs if not s.vector]
        vecs = [gguf.tensors[s.name] for s in specs if s.vector]
        offsets, total = {}, 0
        for info in mats:
            offsets[info.name] = total
            total += -(-info.n_bytes // _ALIGN) * _ALIGN
        vec_bytes = sum(4 * info.n_elements for info in vecs)
        self._check_memory(cfg, ctx, total + vec_bytes, cache_types)

        # Upload: one arena for the matrices, read from the file in chunks (progress per chunk). Nothing on the
        # host refers to the file afterwards (ggufio/file.py: no memory map).
        self._arena = cp.empty(max(total, 1), dtype=cp.uint8)
        base = self._arena.data.ptr
        grand = total + vec_bytes
        jobs = [(info.offset + s, base + offsets[info.name] + s, min(UPLOAD_CHUNK, info.n_bytes - s), info.name)
                for info in mats for s in range(0, info.n_bytes, UPLOAD_CHUNK)]
        done = _upload(cp, gguf, jobs, lambda n, name: report(n, grand, name))
        handles: dict[str, Any] = {}
        for info in mats:
            *rows, cols = info.shape
            handles[info.name] = DeviceMatrix(base + offsets[info.name], int(np.prod(rows)), cols, info.type,
                                              info.row_bytes)
        for info in vecs:  # 1-D, or [E, F] bias tables kept 2-D
            v = gguf.dequantize(info.name).astype(np.float32)
            handles[info.name] = cp.asarray(v.reshape(-1) if len(info.shape) == 1 else v.reshape(info.shape))
            done += 4 * info.n_elements
            report(done, grand, info.name)

        t_weights = time.perf_counter()
        layers = []
        for i in range(cfg.n_layer):  # every tensor the block's plan names (weights.layer_tensor_names)
            names = layer_tensor_names(cfg, i)
            layers.append(LayerWeights(**{field: handles[name] for field, name in names.items() if name in handles}))
        emb = handles["token_embd.weight"]
        self.weights = ModelWeights(emb, layers, handles["output_norm.weight"], handles.get("output.weight", emb))
        self._wfam = {id(self.weights.output): "LM head"}
        for L in layers:
            for m, fam in ((L.attn_q, "QKV"), (L.attn_k, "QKV"), (L.attn_v, "QKV"), (L.attn_qkv, "QKV"),
                           (L.attn_output, "O-proj"), (L.ffn_gate, "FFN"), (L.ffn_up, "FFN"), (L.ffn_down, "FFN"),
                           (L.ffn_gate_inp, "FFN"), (L.ffn_gate_exps, "FFN"), (L.ffn_up_exps, "FFN"),
                           (L.ffn_down_exps, "FFN")):
                if m is not None:
                    self._wfam[id(m)] = fam

        # RoPE table (float64 of the reference's float32 theta, so angles match the NumPy backend), KV cache.
        self.inv_freq = cp.asarray(rope_tables.inv_freq(cfg, gguf, ctx).astype(np.float64))
        self.inv_freq_local = None  # the local table (gemma's sliding-window layers: rope_args)
        if any(plan.rope_local for plan in cfg.layers):
            self.inv_freq_local = cp.asarray(rope_tables.inv_freq(cfg, gguf, ctx, local=True).astype(np.float64))
        for plan, n in zip(cfg.layers, cfg.cache_rows(ctx)):  # the fused prefill fills a ring a chunk at a time
            if n < ctx and (n % 64 or ring_span(plan.window, n, ctx) < min(ctx, PREFILL_CHUNK)):
                raise BackendError(f"internal: a ring of {n} rows cannot serve window {plan.window}")
        self.alloc_kv_cache(cfg, ctx, self.kv_q8)
        self._alloc_step_buffers()
        self._graphs.clear()
        self._pf = None
        self._pf_graphs.clear()
        self._pf_seen.clear()
        t_end = time.perf_counter()
        self.load_stages = (("kernels", (t_kernels - t0) * 1e3),
                            ("weights upload", (t_weights - t_kernels) * 1e3),
                            ("KV cache, buffers", (t_end - t_weights) * 1e3))

    def alloc_kv_cache(self, cfg: ModelConfig, ctx: int, q8: bool) -> None:
        """The KV cache, one K and one V array per layer of cfg.cache_rows(ctx) rows (ctx, or a sliding-window
        layer's ring: models/kv_cache.py), which every kernel takes with its row count (the ring, kc.shape[0]):
        fp16 [rows, Hkv, Dh]; or (`q8`, -ctk/-ctv q8_0) one byte buffer [rows, Hkv, Dh + Dh/16] per cache, rows
        rounded up to 64, holding int8 codes [rows, Hkv, Dh] and then fp16 scales [Hkv, rows, Dh/32]
        (kernels/attention_split.cu), with an fp16 [rows, Hkv, Dh] pair of the largest rows (kv16) that the
        prefill's writers and readers take instead (readable)."""
        cp = self.cp
        hkv, dh = cfg.n_head_kv, cfg.head_dim
        rows = [-(-n // 64) * 64 for n in cfg.cache_rows(ctx)] if q8 else cfg.cache_rows(ctx)
        shape = (hkv, dh + dh // 16) if q8 else (hkv, dh)
        self.kv_q8 = q8
        self.k_cache = [cp.zeros((n, *shape), dtype=cp.uint8 if q8 else cp.float16) for n in rows]
        self.v_cache = [cp.zeros_like(k) for k in self.k_cache]
        self.kv16 = tuple(cp.zeros((max(rows), hkv, dh), cp.float16) for _ in "kv") if q8 else None

    def _scratch_bytes(self, cfg: ModelConfig, ctx: int) -> int:
        """Decode buffers plus a prefill working set (a 512-token chunk and one fp16 weight chunk)."""
        t = min(ctx, 512)
        ff = dense_ff(cfg)
        widest = max(cfg.q_dim + 2 * cfg.kv_dim, 2 * ff, cfg.vocab_size)
        act = t * (4 * cfg.n_embd + cfg.q_dim + 2 * cfg.kv_dim + 3 * ff) * 4 + t * widest * 2 * 2
        split = self.decode_splits(ctx)
        step = 4 * (3 * cfg.n_embd + cfg.q_dim + 2 * cfg.kv_dim + cfg.q_dim + cfg.n_ff + cfg.vocab_size)
        step += split * cfg.n_head * (cfg.head_dim + 2) * 4
        return act + step + moe_scratch_bytes(cfg, t) + 2 * DEQUANT_CHUNK + (64 << 20)  # + CuPy/cuBLAS margin

    def _check_memory(self, cfg: ModelConfig, ctx: int, weight_bytes: int,
                      cache_types: tuple[str, str] = ("f16", "f16")) -> None:
        """DeviceMemoryError saying what the model needs, what the GPU has and what would fit
        (memory_fit.not_enough_memory), before anything is allocated. An 8-bit cache also takes its fp16 pair
        of one layer's rows (alloc_kv_cache)."""
        cp = self.cp
        free, total = cp.cuda.runtime.memGetInfo()
        free += cp.get_default_memory_pool().free_bytes()
        kv, scratch = cfg.kv_cache_bytes(ctx, cache_types), self._scratch_bytes(cfg, ctx)
        if cache_types[0] == "q8_0":
            scratch += q8_pair_bytes(cfg, ctx)
        if weight_bytes + kv + scratch <= free:
            return
        raise DeviceMemoryError(not_enough_memory(cfg, ctx, weights=weight_bytes, kv=kv, scratch=scratch,
                                                  free=free, total=total, cache_types=tuple(cache_types)))

    def close(self) -> None:
        self._graphs.clear()
        self._pf_graphs.clear()
        self._pf = None
        self._arena = None
        self.weights = None  # type: ignore[assignment]
        self.k_cache = self.v_cache = self.kv16 = None
        self.cp.get_default_memory_pool().free_all_blocks()

    # -- measuring (bench) ---------------------------------------------------------------------------------
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

    # -- host <-> device ---------------------------------------------------------------------------------
    def positions(self, start: int, n: int) -> Any:
        return self.cp.asarray(np.arange(start, start + n, dtype=np.int32))

    def token_ids(self, ids: np.ndarray) -> Any:
        return self.cp.asarray(np.asarray(ids, dtype=np.int32).reshape(-1))

    def to_host(self, x: Any) -> np.ndarray:
        return self.cp.asnumpy(x)

    def _f32(self, x: Any) -> Any:
        return self.cp.ascontiguousarray(x, dtype=self.cp.float32)

    def _capture(self, launch_all: Callable[[], None]) -> Any:
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
