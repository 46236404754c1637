"""The model on the device: whether a GPU is usable, the memory check before any upload, and loading
(`DeviceModel.upload`: the weight arena, the RoPE tables, each layer's fused form).

Weights stay in their GGUF block layout on the device: one arena for the matrices, read from the file in
chunks and uploaded; the 1-D tensors (norms, biases) as float32 arrays. The KV cache is kv.py's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...errors import BackendError, DeviceMemoryError, UsageError
from ...ggufio.file import GGUFFile
from ...models import rope as rope_tables
from ...models.block import Attention, Rope, programs
from ...models.config import ModelConfig
from ...models.kv_cache import check_cache_types, ring_span
from ...models.seq_cache import MAX_SNAPSHOTS, SNAPSHOT_EVERY
from ...models.weights import PER_LAYER_TABLES, layer_tensor_names, model_specs
from ..base import LayerWeights, ModelWeights
from ..memory_fit import not_enough_memory, q8_pair_bytes
from ..split_plan import DeviceMemory
from . import loader as K
from .attention import Heads, decode_splits, simt_smem
from .constants import BG_NMAX, BG_ROWS
from .fusion import FusedLayer, match_layer, op_by_op
from .gpu import Gpu
from .linear import BG_BLOCKS_PER_SM, DEQUANT_CHUNK, DeviceMatrix
from .moe import check_moe, dense_ff, moe_family_needed, moe_scratch_bytes
from .prefill import PREFILL_CHUNK

_ALIGN = 256
# Matrices the kernels read as float32 [rows, cols] arrays rather than in their GGUF layout (uploaded as the vectors
# are): a delta-net layer's convolution taps [C, K] (kernels/delta.cu conv_silu_f32)
FLOAT_FIELDS = frozenset({"ssm_conv1d"})


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


def cache_q8(cfg: ModelConfig, cache_types: tuple[str, str]) -> bool:
    """Whether the K and V `cache_types` make an 8-bit cache (q8_0) rather than fp16; UsageError for a pair the
    CUDA backend does not take."""
    if tuple(cache_types) not in (("f16", "f16"), ("q8_0", "q8_0")):  # as llama.cpp's CUDA flash attention
        raise UsageError(f"the CUDA backend takes K and V caches of one type (f16 or q8_0), not "
                         f"{'/'.join(cache_types)}; the CPU backend (--backend cpu) takes any pair")
    for dh in sorted({cfg.head_dim} | {cfg.layer_head_dim(i) for i in range(cfg.n_layer)}):  # (gemma4: each layer's)
        check_cache_types(dh, cache_types)
    return cache_types[0] == "q8_0"


def fused_layers(cfg: ModelConfig, gguf: GGUFFile | None = None) -> tuple[FusedLayer, ...]:
    """Each layer's program in the fused forms the prefill pass and the decode step launch (fusion.py); none for a
    model that runs op by op (fusion.op_by_op: the hybrid Qwen models, Gemma 4); a program no CUDA path runs, or
    experts the kernels do not serve, is refused here, before anything is uploaded."""
    if op_by_op(cfg):
        fused: tuple[FusedLayer, ...] = ()
    else:
        fused = tuple(match_layer(ops, i) for i, ops in enumerate(programs(cfg)))
    check_moe(cfg, gguf)
    return fused


def check_attention_smem(gpu: Gpu, cfg: ModelConfig) -> None:
    """Heads larger than 256 (Gemma 4's global layers: 512) have no tensor-core attention: the CUDA-core kernel
    takes them, whose shared memory grows with the head (attention.simt_smem). Refused before anything is
    uploaded where the GPU's per-block limit does not hold it (131 KB at 512: an H100 or A100 does, an RTX 4090,
    L4 or T4 does not)."""
    for dh in sorted({cfg.layer_head_dim(i) for i in range(cfg.n_layer)}):
        if dh > 256 and simt_smem(dh) > gpu.smem_block:
            raise BackendError(f"the CUDA backend's attention for heads of {dh} needs {simt_smem(dh):,} bytes of shared "
                               f"memory per block, this GPU allows {gpu.smem_block:,}: run the model on the CPU "
                               "backend (--backend cpu)")


def compile_kernels(cfg: ModelConfig) -> None:
    """Compile (or fetch from CuPy's cache) the kernel modules the model needs, before touching device memory:
    the expert kernels only for models with experts, the delta net's only for the models that run op by op."""
    for fam in K.FAMILIES:
        if (fam != "moe" or moe_family_needed(cfg)) and (fam != "delta" or op_by_op(cfg)):
            K.module(fam)


def scratch_bytes(gpu: Gpu, cfg: ModelConfig, ctx: int, q8: bool) -> int:
    """Decode buffers plus a prefill working set (a 512-token chunk, one fp16 weight chunk, bgemm's partials). Layers
    of their own shapes (gemma4) count the widest (as every other model, whose layers all have the config's), and
    gemma4's per-layer inputs [T, L, P] a few times over (block.per_layer_inputs' temporaries)."""
    t = min(ctx, 512)
    layers = range(cfg.n_layer)
    ff = max([dense_ff(cfg)] + [cfg.layer_n_ff(i) for i in layers if not cfg.layers[i].moe or cfg.layers[i].moe_dense])
    q_dim = max([cfg.q_dim] + [cfg.n_head * cfg.layer_head_dim(i) for i in layers])
    kv_dim = max([cfg.kv_dim] + [cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) for i in layers])
    widest = max(q_dim + 2 * kv_dim, 2 * ff, cfg.vocab_size)
    act = t * (4 * cfg.n_embd + q_dim + 2 * kv_dim + 3 * ff) * 4 + t * widest * 2 * 2
    act += 4 * t * 4 * cfg.n_layer * cfg.n_embd_per_layer
    split = max(decode_splits(gpu, cfg, ctx, q8), *(decode_splits(gpu, heads, ctx, q8) for heads in _geometries(cfg)))
    step = 4 * (3 * cfg.n_embd + q_dim + 2 * kv_dim + q_dim + max(cfg.n_ff, ff) + cfg.vocab_size)
    step += split * cfg.n_head * (max(cfg.head_dim, *(h.head_dim for h in _geometries(cfg))) + 2) * 4
    bgemm = 2 * BG_BLOCKS_PER_SM * gpu.n_sms * BG_ROWS * BG_NMAX * 4  # its split partials (Linear.bgemm_scratch)
    return act + step + moe_scratch_bytes(cfg, t) + 2 * DEQUANT_CHUNK + bgemm + (64 << 20)  # + CuPy/cuBLAS margin


def _geometries(cfg: ModelConfig) -> set[Heads]:
    """The attention geometries of a model's layers (one, the config's, but on gemma4)."""
    return {Heads(cfg.n_head, cfg.layer_kv_heads(i), cfg.layer_head_dim(i)) for i in range(cfg.n_layer)}


def check_memory(gpu: Gpu, cfg: ModelConfig, ctx: int, weight_bytes: int,
                 cache_types: tuple[str, str] = ("f16", "f16"), tensors: Any = None) -> None:
    """DeviceMemoryError saying what the model needs, what the GPU has and what would fit
    (memory_fit.not_enough_memory: with the host's other GPUs, the split modes that fit over them; `tensors`:
    the file's, for their plan), before anything is allocated. An 8-bit cache also takes its fp16 pair
    of one layer's rows (kv.KVCache). Delta-net layers take their recurrent states instead (recurrent_bytes)."""
    cp = gpu.cp
    free, total = cp.cuda.runtime.memGetInfo()
    free += cp.get_default_memory_pool().free_bytes()
    q8 = cache_types[0] == "q8_0"
    kv, scratch = cfg.kv_cache_bytes(ctx, cache_types) + recurrent_bytes(cfg), scratch_bytes(gpu, cfg, ctx, q8)
    if q8:
        scratch += q8_pair_bytes(cfg, ctx)
    if weight_bytes + kv + scratch <= free:
        return
    raise DeviceMemoryError(not_enough_memory(cfg, ctx, weights=weight_bytes, kv=kv, scratch=scratch,
                                              free=free, total=total, cache_types=tuple(cache_types),
                                              tensors=tensors, gpus=visible_gpus(cp, free, total)))


def recurrent_bytes(cfg: ModelConfig) -> int:
    """One sequence's recurrent states on the device (delta.DeltaNet): the live one, the stored ones (MAX_SNAPSHOTS)
    and those one prefill pass stores before the oldest are dropped (one per SNAPSHOT_EVERY positions it passes,
    plus its end); 0 for a model without delta-net layers."""
    return (MAX_SNAPSHOTS + 2 + PREFILL_CHUNK // SNAPSHOT_EVERY) * cfg.recurrent_state_bytes()


def visible_gpus(cp: Any, free: int, total: int) -> list[DeviceMemory]:
    """Every GPU this process sees: the current one with the `free` and `total` bytes measured, the others with
    their total as free (no context is made on them to ask: it would take memory of its own); [] where the
    runtime will not say."""
    try:
        here = cp.cuda.runtime.getDevice()
        return [DeviceMemory(i, free, total) if i == here else
                DeviceMemory(i, *(2 * [int(cp.cuda.runtime.getDeviceProperties(i)["totalGlobalMem"])]))
                for i in range(cp.cuda.runtime.getDeviceCount())]
    except Exception:  # (a CUDA runtime error: the message goes without the other GPUs)
        return []


@dataclass
class DeviceModel:
    """The model as the executors read it: its config and context, the weights on the device (ModelWeights of
    DeviceMatrix handles and float32 vectors), each layer's fused form, the RoPE tables (float64 of the
    reference's float32 theta, so that angles match the NumPy backend; the local one for gemma's sliding-window
    layers), and the arena that holds the matrices. Kernel tests build one without a file (weights None)."""

    cfg: ModelConfig
    ctx: int
    weights: ModelWeights | None
    fused: tuple[FusedLayer, ...]
    inv_freq: Any
    inv_freq_local: Any = None
    arena: Any = None
    families: dict[int, str] = field(default_factory=dict)  # id(weight handle) -> kernel family (the profile)

    @classmethod
    def upload(cls, gpu: Gpu, gguf: GGUFFile, cfg: ModelConfig, ctx: int, fused: tuple[FusedLayer, ...],
               cache_types: tuple[str, str], report: Callable[[int, int, str], None]) -> "DeviceModel":
        """Check the memory, then upload: matrices (2-D, and 3-D expert tensors as one matrix of E * rows rows)
        into one arena in their GGUF layout, read from the file in chunks (report per chunk; nothing on the host
        refers to the file afterwards: ggufio/file.py maps no memory); vectors, bias tables (the experts'
        [E, F] biases) and FLOAT_FIELDS as float32 arrays; the RoPE tables."""
        cp = gpu.cp
        specs = [s for s in model_specs(cfg) if s.name in gguf.tensors]
        floats = [s.vector or s.field in FLOAT_FIELDS for s in specs]
        mats = [gguf.tensors[s.name] for s, f in zip(specs, floats) if not f]
        vecs = [gguf.tensors[s.name] for s, f in zip(specs, floats) if f]
        offsets, total = {}, 0
        for info in mats:
            offsets[info.name] = total
            total += -(-info.n_bytes // _ALIGN) * _ALIGN
        vec_bytes = sum(4 * info.n_elements for info in vecs)
        check_memory(gpu, cfg, ctx, total + vec_bytes, cache_types, gguf.tensors)

        arena = cp.empty(max(total, 1), dtype=cp.uint8)
        base = arena.data.ptr
        grand = total + vec_bytes
        jobs = [(info.offset + s, base + offsets[info.name] + s, min(UPLOAD_CHUNK, info.n_bytes - s), info.name)
                for info in mats for s in range(0, info.n_bytes, UPLOAD_CHUNK)]
        done = _upload(cp, gguf, jobs, lambda n, name: report(n, grand, name))
        handles: dict[str, Any] = {}
        for info in mats:
            *rows, cols = info.shape
            handles[info.name] = DeviceMatrix(base + offsets[info.name], int(np.prod(rows)), cols, info.type,
                                              info.row_bytes)
        for info in vecs:  # 1-D, or [E, F] bias tables (and FLOAT_FIELDS) kept 2-D
            v = gguf.dequantize(info.name).astype(np.float32)
            handles[info.name] = cp.asarray(v.reshape(-1) if len(info.shape) == 1 else v.reshape(info.shape))
            done += 4 * info.n_elements
            report(done, grand, info.name)

        layers = []
        for i in range(cfg.n_layer):  # every tensor the block's plan names (weights.layer_tensor_names)
            names = layer_tensor_names(cfg, i)
            layers.append(LayerWeights(**{field: handles[name] for field, name in names.items() if name in handles}))
        emb = handles["token_embd.weight"]
        weights = ModelWeights(emb, layers, handles["output_norm.weight"], handles.get("output.weight", emb))
        if cfg.n_embd_per_layer:  # gemma4: the per-layer token table (in its GGUF layout), projection and norm
            weights.per_layer_token_embd, weights.per_layer_model_proj, weights.per_layer_proj_norm = (
                handles[name] for name in PER_LAYER_TABLES)

        inv_freq = cp.asarray(rope_tables.inv_freq(cfg, gguf, ctx).astype(np.float64))
        inv_freq_local = None
        if any(plan.rope_local for plan in cfg.layers):
            inv_freq_local = cp.asarray(rope_tables.inv_freq(cfg, gguf, ctx, local=True).astype(np.float64))
        for plan, n in zip(cfg.layers, cfg.cache_rows(ctx)):  # the fused prefill fills a ring a chunk at a time
            if 0 < n < ctx and (n % 64 or ring_span(plan.window, n, ctx) < min(ctx, PREFILL_CHUNK)):
                raise BackendError(f"internal: a ring of {n} rows cannot serve window {plan.window}")
        return cls(cfg, ctx, weights, fused, inv_freq, inv_freq_local, arena, weight_families(weights))

    def rope_args(self, rope: Rope | None) -> tuple[int, Any, float]:
        """(dims that rotate, theta table on the device, attention factor) of a layer's RoPE (fusion.py's
        branch.rope): the config's rope_dim, and the local table with factor 1 for a local rotation (gemma's
        sliding-window layers), else the global table and the config's factor; no RoPE (smollm3's NoPE
        layers): 0 dims, which the kernels pass through."""
        if rope is not None and rope.local:
            return self.cfg.rope_dim, self.inv_freq_local, 1.0
        return (self.cfg.rope_dim if rope is not None else 0), self.inv_freq, self.cfg.rope_attn_factor

    def sinks(self, op: Attention | None) -> Any:
        """The attention sinks [Hq] of op's layer (gpt-oss), or None (also for kernel tests without weights)."""
        w = self.weights
        return None if w is None or op is None or not op.sinks else w.layers[op.layer].attn_sinks


def weight_families(weights: ModelWeights) -> dict[int, str]:
    """id(weight handle) -> the kernel family bench --profile counts its matmuls under."""
    fam = {id(weights.output): "LM head"}
    for L in weights.layers:
        for m, f in ((L.attn_q, "QKV"), (L.attn_k, "QKV"), (L.attn_v, "QKV"), (L.attn_qkv, "QKV"),
                     (L.attn_output, "O-proj"), (L.ffn_gate, "FFN"), (L.ffn_up, "FFN"), (L.ffn_down, "FFN"),
                     (L.ffn_gate_inp, "FFN"), (L.ffn_gate_exps, "FFN"), (L.ffn_up_exps, "FFN"),
                     (L.ffn_down_exps, "FFN")):
            if m is not None:
                fam[id(m)] = f
    return fam
