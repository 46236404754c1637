"""The CUDA backend: CuPy for memory and cuBLAS, our kernels (kernels/*.cu) for everything else.

Weights stay in their GGUF block layout on the device (one arena, uploaded straight from the memory map);
the decode matvecs read the blocks directly, prefill dequantizes row chunks to fp16 for cuBLAS. The KV cache
is fp16 [layer, ctx, Hkv, Dh]. Two ways to run the model:

- the Backend operations (embed, rms_norm, matmul, ...) that model.forward calls, one kernel each: prefill
  and the reference-shaped path;
- `decode(token, pos)`: the fused decode step, 5 kernels per layer, every buffer allocated at load, the
  token and position read by the kernels from device memory (`step_ids`, `step_pos`), so it is captured
  once into a CUDA graph and replayed on the current stream (`use_graph`); the host uploads token/pos
  only when the device does not already hold them and reads back one id. Per layer: QKV matvec (RMSNorm
  fused into its input, + bias) | attention (RoPE, K/V store, splits and their merge in one kernel) |
  output matvec + residual | gate/up matvec (RMSNorm fused, + SwiGLU) | down matvec + residual; then the LM head with
  the final RMSNorm and, when greedy, the argmax fused in (kernels/matvec.cu mv1_*). Inside the graph the
  small matvecs and the attention are programmatic dependents (sm_90: each starts while the previous kernel
  finishes; _step_kernels), and decode_greedy queues the next step before it reads this step's id.

Prefill (`forward_prompt`, model.prefill's chunks of PREFILL_CHUNK tokens): a fused pass (see the comment
above forward_prompt), captured into a CUDA graph from the second time a chunk length comes round.

Measured 2026-11-22 on the H100 (BENCHMARKS.md): SmolLM2-135M-Instruct Q4_1 tg128 1,690 tok/s, pp512 245,913
tok/s; `llamacli bench --profile` breaks a step down by kernel family.

Sampling on the device (`sample`): penalties, then argmax (greedy), or top-k (k <= 1024) and the rest of
sampling.py's chain over the candidates (top-p, min-p, temperature, the draw with the uniform number the
host's seeded generator supplies): only the chosen id crosses, and the tokens equal sampling.py's for the
same seed (tests/test_gpu_kernels.py). top_k = 0 or > 1024 copies the logits and samples on the host.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as QT

from .. import rope as rope_tables
from ..config import ROPE_NEOX, ModelConfig
from ..errors import BackendError, DeviceMemoryError, NumericalError
from ..gguf_file import GGUFFile
from ..weights import model_specs
from . import cuda_kernels as K
from .base import Backend, LayerWeights, ModelWeights, Progress

log = logging.getLogger("llamacli.cuda")

RUNNABLE = (
    QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS,
)
_CUDA_R_32F, _CUDA_R_16F = 0, 2  # cudaDataType (library_types.h)
MATVEC_TMAX = 8  # kernels/matvec.cu: up to 8 tokens per matvec launch; more go through cuBLAS
DEQUANT_CHUNK = 1 << 25  # fp16 values per dequantized weight chunk in prefill (64 MiB)
PREFILL_CHUNK = 512  # prompt tokens per prefill pass (forward_prompt's buffers; llama.cpp's micro-batch)
PREFILL_GRAPHS = 8  # captured prefill passes kept, by length (least recently used dropped)
TOPK_MAX = 1024  # device top-k candidates
ATT_ROWS = 32  # kernels/attention.cu: query rows per block
ATT_TC_ROWS, ATT_TC_KEYS = 64, 64  # attention_tc_d*: query rows per block (TC_BR), keys per tile
ATT_TC_DIMS = (64, 80, 96, 112, 128)  # head dims with a tensor-core prefill kernel
ATT_WG_DIMS = (64, 128)  # of those, with a Hopper (wgmma, sm_90a) kernel: attention_wg*_d*
ATT_TC_MIN_T = 16  # shorter prefill chunks stay on the fp32 CUDA-core kernel
DEC_KEYS = 256  # attention_decode_npl*: keys per pass of a split (8 warps x 32 lanes)
MV1_WARPS = 8  # kernels/matvec.cu mv1_*: warps per block
# The captured decode step's programmatic launches (_step_kernels; measured on the H100, BENCHMARKS.md):
PDL_MAX_BYTES = 16 << 20  # matvecs under this many weight bytes (and the attention) launch as dependents
PDL_EARLY_BYTES = 2 << 20  # a kernel lets the next start early when the next reads under this many bytes
_ALIGN = 256


def _tc_smem(dh: int) -> int:
    """attention_tc*_d<dh>'s dynamic shared memory: K and V tiles of ATT_TC_KEYS rows of dh + 8 halves per
    stage (TC_STAGES: 3 up to head dim 64, else 2), and one int."""
    return (3 if dh <= 64 else 2) * 2 * ATT_TC_KEYS * (dh + 8) * 2 + 16


def _wg_smem(dh: int) -> int:
    """attention_wg*_d<dh>'s dynamic shared memory: 1024 for alignment, WG_STAGES(D) (3 up to head dim 64,
    else 2) K and V tiles of 64 keys x dh halves, WG_ONES(D) bytes of ones (2048 up to head dim 64, else
    256), one int (8 bytes with padding) and an 8-byte mbarrier per stage."""
    stages = 3 if dh <= 64 else 2
    return 1024 + stages * 2 * 64 * dh * 2 + (2048 if dh <= 64 else 256) + 8 + 8 * stages


def _tc_qscale(dh: int) -> float:
    """The factor attention_tc*_d* expects q multiplied by: log2(e) / sqrt(dh) (its softmax is base 2)."""
    return math.log2(math.e) / math.sqrt(dh)


def cuda_available() -> tuple[bool, str]:
    """(True, device name) if CuPy imports and sees a GPU, else (False, what is missing and how to fix it)."""
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
        return False, f"no usable NVIDIA GPU or driver ({exc}); `nvidia-smi` should list a GPU"
    if n == 0:
        return False, "CuPy found no NVIDIA GPU"
    try:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception as exc:
        return False, f"the GPU is not usable ({exc})"
    return True, name


class _Section:
    """Events around one family's launches (CudaBackend.profile)."""

    def __init__(self, be: "CudaBackend", name: str):
        self.be, self.name = be, name

    def __enter__(self) -> None:
        self.n0 = K.launch_count()
        self.a = self.be.cp.cuda.Event()
        self.a.record()

    def __exit__(self, *exc: object) -> None:
        b = self.be.cp.cuda.Event()
        b.record()
        if self.be._prof is not None:
            self.be._prof.append((self.name, self.a, b, K.launch_count() - self.n0))


_NULL = contextlib.nullcontext()


def _family(fam: str | None = None) -> Callable:
    """Time a Backend operation under `fam` while profiling (matmul: the weight's family)."""

    def deco(op: Callable) -> Callable:
        @functools.wraps(op)
        def timed(self: "CudaBackend", *args: Any, **kw: Any) -> Any:
            if self._prof is None:
                return op(self, *args, **kw)
            with _Section(self, fam or self._wfam.get(id(args[1]), "other")):
                return op(self, *args, **kw)

        return timed

    return deco


def qname(t: QT) -> str:
    return t.name.lower()


@dataclass(frozen=True)
class DeviceMatrix:
    """A weight [rows, cols] in device memory, GGUF block layout, rows row_bytes apart from ptr."""

    ptr: int
    rows: int
    cols: int
    qtype: QT
    row_bytes: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def slice_rows(self, start: int, n: int) -> "DeviceMatrix":
        return DeviceMatrix(self.ptr + start * self.row_bytes, n, self.cols, self.qtype, self.row_bytes)


@functools.lru_cache(maxsize=None)
def _cublas() -> Any:
    """libcublas through ctypes, for the prefill GEMMs: CuPy's wrappers refuse to run while a stream is being
    captured, while cuBLAS itself records into graphs. The library is the one CuPy loaded (cuda.pathfinder
    finds the same file), so CuPy's handle is valid here."""
    import ctypes

    names = []
    try:
        from cuda import pathfinder

        path = pathfinder.load_nvidia_dynamic_lib("cublas").abs_path
        if path:
            names.append(path)
    except Exception:  # an older CuPy without cuda.pathfinder: the loader's search path
        pass
    names += ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise BackendError("cuBLAS (libcublas) could not be loaded")
    vp, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
    lib.cublasGemmEx.restype = i
    set_stream = getattr(lib, "cublasSetStream_v2", None) or lib.cublasSetStream
    set_stream.argtypes, set_stream.restype = [vp, vp], i
    set_ws = getattr(lib, "cublasSetWorkspace_v2", None) or lib.cublasSetWorkspace
    set_ws.argtypes, set_ws.restype = [vp, vp, ctypes.c_size_t], i
    return lib, set_stream, set_ws


_OP_N, _OP_T, _COMPUTE_32F, _GEMM_DEFAULT = 0, 1, 68, -1  # cublas_api.h


def _merge_rows(mats: list[DeviceMatrix]) -> list[DeviceMatrix]:
    """Consecutive matrices that lie back to back in the arena with one type and width become one (Q, K, V
    or gate, up): one dequantize launch and one GEMM instead of two or three."""
    out = [mats[0]]
    for m in mats[1:]:
        p = out[-1]
        if (m.qtype, m.cols, m.row_bytes) == (p.qtype, p.cols, p.row_bytes) and m.ptr == p.ptr + p.nbytes:
            out[-1] = DeviceMatrix(p.ptr, p.rows + m.rows, p.cols, p.qtype, p.row_bytes)
        else:
            out.append(m)
    return out


# Weight types whose mv1 dots int8 activations (kernels/matvec.cu act8<>): x staged as int8 units (32 bytes)
# plus a scale and a sum per unit; the others stage x as floats (128 bytes) plus a sum.
MV1_ACT8 = frozenset({QT.Q4_K, QT.Q5_K, QT.Q6_K})
MV1_ACT8_BLOCKS_PER_SM = 4  # kernels/matvec.cu MV1_MINB8: the int8 forms' __launch_bounds__ minimum


def _mv1_kernel(ws: tuple[Any, ...]) -> str | None:
    """The mv1 kernel for these row segments: one type (mv1_<t>), or Q/K rows of one int8-activation type
    with V rows of another (mv1_mixed_<a>_<b>: Q4_K_M's Q6_K V layers keep one QKV launch); None else."""
    a, b = ws[0].qtype, ws[-1].qtype
    if all(w.qtype == a for w in ws):
        return f"mv1_{qname(a)}"
    if len(ws) == 3 and ws[1].qtype == a and a in MV1_ACT8 and b in MV1_ACT8:
        return f"mv1_mixed_{qname(a)}_{qname(b)}"
    return None


def _mv1_groups(rows: int, cols: int, qtype: QT | None = None, sms: int | None = None) -> int:
    """Row groups per mv1 block (kernels/matvec.cu), one staging of x for all: where staging x costs as
    much as the rows (long rows: 57 KB of x at 14336 columns; short rows: a lane's whole share is one or two
    units) and the matrix has rows enough to keep every SM busy. Measured on the H100 (BENCHMARKS.md):
    tg128 +3-6% on the 0.5B/1B shapes, +12% on 8B Q4_K_M; 4096-column matrices were slower with 2 (float
    x). The int8-activation forms also take 4 on 4096-column matrices of 12288 rows or more: Q4_K
    14336x4096 19.0 us vs 23.3, its SwiGLU 33.9 vs 40.4 (fifth session); and 2 where one group per block
    would need more than one wave of blocks on `sms` multiprocessors (MV1_ACT8_BLOCKS_PER_SM each): the 8B's 6144-row QKV launch, 768 blocks on 132 SMs, tg +1.3%; and 8 on a small
    model's int8 LM head (Llama-3.2-1B's Q6_K 128256x2048: tg128 1,363 -> 1,372; seventh session)."""
    if cols <= 2048 and rows >= 32768:  # the LM head of a small model
        return 8 if qtype in MV1_ACT8 else 4
    if qtype in MV1_ACT8 and 4096 <= cols < 8192 and rows >= 12288:
        return 4
    if rows >= 4096 and (cols >= 8192 or cols <= 2048):
        return 2
    if qtype in MV1_ACT8 and sms and K.cdiv(rows, MV1_WARPS * (32 // _lpr(cols))) > MV1_ACT8_BLOCKS_PER_SM * sms:
        return 2
    return 1


# 16-bit float rows with whole 16-byte chunks take the streaming one-token matvec (kernels/matvec.cu
# mv1_stream_<t>): one wave of MV1S_BLOCKS_PER_SM blocks per SM, loads in flight across row ends and the
# kernel boundary.
MV1S_TYPES = frozenset({QT.F16, QT.BF16})
MV1S_BLOCKS_PER_SM = 2  # kernels/matvec.cu MV1S_BLOCKS_PER_SM


def _mv1_stream_ok(ws: tuple[Any, ...]) -> bool:
    """Whether mv1_stream serves these row segments: one 16-bit float type, rows of whole 16-byte chunks
    (K % 8 == 0), every segment 16-byte aligned."""
    a, k = ws[0].qtype, ws[0].cols
    return (a in MV1S_TYPES and k % 8 == 0
            and all(w.qtype == a and w.cols == k and w.row_bytes == 2 * k and w.ptr % 16 == 0 for w in ws))


def _mv1_stream_grid(rows: int, sms: int) -> int:
    """mv1_stream's grid: at most one wave (MV1S_BLOCKS_PER_SM blocks per SM), each warp a row of every
    `per` (its rows w, w + warps, ...): the fewest blocks that still give every warp at most `per` rows, so the
    warps end together (6144 rows: 256 blocks of 3 rows a warp rather than 264 of 2 or 3)."""
    per = K.cdiv(rows, MV1_WARPS * MV1S_BLOCKS_PER_SM * sms)
    return K.cdiv(rows, MV1_WARPS * per)


def _mv1_smem(qtype: QT, cols: int) -> int:
    """mv1's dynamic shared memory: x staged per 32-value unit (kernels/matvec.cu stage_x / stage_xq)."""
    return K.cdiv(cols, 32) * (40 if qtype in MV1_ACT8 else 132)


def _lpr(cols: int) -> int:
    """Lanes per row in matvec.cu: the power of two <= 32 closest above the row's 32-value unit count."""
    units = -(-cols // 32)
    lpr = 1
    while lpr < 32 and lpr < units:
        lpr *= 2
    return lpr


class CudaBackend(Backend):
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
        # ... with Hopper's warpgroup MMA where attention.cu is built for sm_90a and the driver makes TMA
        # descriptors (False: mma.sync everywhere)
        self.attention_wg = K.built_arch("attention") == "sm_90a" and K.tma_supported()
        # Query rows per block in the fused step's attention (of the G sharing a KV head): 1 gives the
        # shortest dependent chain per lane (decode at short contexts is latency-bound); each block re-reads
        # its split's K/V from L2. Set before the first decode (the graph keeps it).
        self.decode_rows = 1
        self.n_sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
        # The captured decode step launches its matvecs and attention as programmatic dependents (sm_90+):
        # set before the first decode (the graph keeps it).
        self.pdl = True
        # 16-bit float matvecs of one token through mv1_stream, as programmatic dependents in the decode step
        # (False: mv1, as before it; for comparisons).
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
    # -- lifetime ------------------------------------------------------------------------------------------
    def load(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int, progress: Progress | None = None) -> None:
        cp = self.cp
        self.cfg, self.ctx = cfg, ctx
        report = progress or (lambda done, total, what: None)
        for fam in K.FAMILIES:  # compile (or fetch from CuPy's cache) before touching device memory
            K.module(fam)

        specs = [s for s in model_specs(cfg) if s.name in gguf.tensors]
        mats = [gguf.tensors[s.name] for s in specs if len(s.shape) == 2]
        vecs = [gguf.tensors[s.name] for s in specs if len(s.shape) == 1]
        offsets, total = {}, 0
        for info in mats:
            offsets[info.name] = total
            total += -(-info.n_bytes // _ALIGN) * _ALIGN
        vec_bytes = sum(4 * info.n_elements for info in vecs)
        self._check_memory(cfg, ctx, total + vec_bytes)

        # Upload: one arena for the matrices, copied from the memory map in chunks (progress per chunk).
        self._arena = cp.empty(max(total, 1), dtype=cp.uint8)
        base = self._arena.data.ptr
        grand = total + vec_bytes
        done = 0
        handles: dict[str, Any] = {}
        chunk = 64 << 20
        for info in mats:
            raw = gguf.raw(info.name).reshape(-1).view(np.uint8)
            dst = self._arena[offsets[info.name] : offsets[info.name] + info.n_bytes]
            for s in range(0, info.n_bytes, chunk):
                e = min(s + chunk, info.n_bytes)
                dst[s:e].set(np.ascontiguousarray(raw[s:e]))
                done += e - s
                report(done, grand, info.name)
            rows, cols = info.shape
            handles[info.name] = DeviceMatrix(base + offsets[info.name], rows, cols, info.type, info.row_bytes)
        for info in vecs:
            handles[info.name] = cp.asarray(gguf.dequantize(info.name).astype(np.float32).reshape(-1))
            done += 4 * info.n_elements
            report(done, grand, info.name)

        layers = []
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            g = lambda n: handles.get(p + n)  # noqa: E731
            layers.append(
                LayerWeights(
                    attn_norm=g("attn_norm.weight"), attn_q=g("attn_q.weight"), attn_k=g("attn_k.weight"),
                    attn_v=g("attn_v.weight"), attn_qkv=g("attn_qkv.weight"), attn_q_bias=g("attn_q.bias"),
                    attn_k_bias=g("attn_k.bias"), attn_v_bias=g("attn_v.bias"),
                    attn_output=g("attn_output.weight"), ffn_norm=g("ffn_norm.weight"),
                    ffn_gate=g("ffn_gate.weight"), ffn_up=g("ffn_up.weight"), ffn_down=g("ffn_down.weight"),
                )
            )
        emb = handles["token_embd.weight"]
        self.weights = ModelWeights(emb, layers, handles["output_norm.weight"], handles.get("output.weight", emb))
        self._wfam = {id(self.weights.output): "LM head"}
        for L in layers:
            for m, fam in ((L.attn_q, "QKV"), (L.attn_k, "QKV"), (L.attn_v, "QKV"), (L.attn_qkv, "QKV"),
                           (L.attn_output, "O-proj"), (L.ffn_gate, "FFN"), (L.ffn_up, "FFN"), (L.ffn_down, "FFN")):
                if m is not None:
                    self._wfam[id(m)] = fam

        # RoPE table (float64 of the reference's float32 theta, so angles match the NumPy backend), KV cache.
        self.inv_freq = cp.asarray(rope_tables.inv_freq(cfg, gguf, ctx).astype(np.float64))
        shape = (cfg.n_layer, ctx, cfg.n_head_kv, cfg.head_dim)
        self.k_cache = cp.zeros(shape, dtype=cp.float16)
        self.v_cache = cp.zeros(shape, dtype=cp.float16)
        self._alloc_step_buffers()
        self._graphs.clear()
        self._pf = None
        self._pf_graphs.clear()
        self._pf_seen.clear()

    def _scratch_bytes(self, cfg: ModelConfig, ctx: int) -> int:
        """Decode buffers plus a prefill working set (a 512-token chunk and one fp16 weight chunk)."""
        t = min(ctx, 512)
        widest = max(cfg.q_dim + 2 * cfg.kv_dim, 2 * cfg.n_ff, cfg.vocab_size)
        act = t * (4 * cfg.n_embd + cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.n_ff) * 4 + t * widest * 2 * 2
        split = self._n_split(ctx)
        step = 4 * (3 * cfg.n_embd + cfg.q_dim + 2 * cfg.kv_dim + cfg.q_dim + cfg.n_ff + cfg.vocab_size)
        step += split * cfg.n_head * (cfg.head_dim + 2) * 4
        return act + step + 2 * DEQUANT_CHUNK + (64 << 20)  # + CuPy/cuBLAS workspace margin

    def _check_memory(self, cfg: ModelConfig, ctx: int, weight_bytes: int) -> None:
        cp = self.cp
        free, _total = cp.cuda.runtime.memGetInfo()
        free += cp.get_default_memory_pool().free_bytes()
        kv = cfg.kv_cache_bytes(ctx)
        scratch = self._scratch_bytes(cfg, ctx)
        need = weight_bytes + kv + scratch
        if need <= free:
            return
        per_token = cfg.kv_cache_bytes(1)
        room = free - weight_bytes - self._scratch_bytes(cfg, 256)
        fit = (room // per_token) // 256 * 256 if room > 0 else 0
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        hint = (
            f"try --ctx {int(fit)} (the KV cache needs {gib(per_token * ctx)} at --ctx {ctx})"
            if fit >= 256
            else "the weights alone do not fit: use a smaller quantization or a larger GPU"
        )
        raise DeviceMemoryError(
            f"not enough GPU memory: the model needs {gib(need)} (weights {gib(weight_bytes)}, KV cache "
            f"{gib(kv)}, scratch {gib(scratch)}), {gib(free)} is free; {hint}"
        )

    def close(self) -> None:
        self._graphs.clear()
        self._pf_graphs.clear()
        self._pf = None
        self._arena = None
        self.weights = None  # type: ignore[assignment]
        self.k_cache = self.v_cache = None
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

    # -- profiling (bench --profile) ---------------------------------------------------------------------------
    def _section(self, name: str) -> Any:
        """Context for one kernel family's launches: CUDA events around them while profiling, else nothing."""
        if self._prof is None:
            return _NULL
        return _Section(self, name)

    def profile(self, fn: Callable[[], Any], spin_ms: float = 50.0) -> tuple[list[tuple[str, float, int]], float]:
        """Run fn() (op-by-op or un-captured launches) with events around each section; -> ([(section, ms,
        our launches)] in first-seen order, total ms). A spin kernel holds the GPU while the host queues
        the work, so the kernels run back to back as in a graph replay (no host launch gaps); if queueing
        takes longer than the spin, the gaps show up in the total but not in the sections."""
        cp = self.cp
        K.launch("elementwise", "spin_ns", (1,), (1,), (K.i64(int(spin_ms * 1e6)),))
        self._prof = []
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        try:
            fn()
        finally:
            end.record()
            recs, self._prof = self._prof, None
        end.synchronize()
        agg: dict[str, list] = {}
        for name, a, b, n in recs:
            v = agg.setdefault(name, [0.0, 0])
            v[0] += cp.cuda.get_elapsed_time(a, b)
            v[1] += n
        return [(k, v[0], v[1]) for k, v in agg.items()], cp.cuda.get_elapsed_time(start, end)

    def elapsed(self, fn: Callable[[], Any]) -> float:
        """Seconds fn() takes on the GPU timeline (CUDA events around it; bench's clock)."""
        cp = self.cp
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) / 1e3

    # -- host <-> device ---------------------------------------------------------------------------------
    def positions(self, start: int, n: int) -> Any:
        return self.cp.asarray(np.arange(start, start + n, dtype=np.int32))

    def token_ids(self, ids: np.ndarray) -> Any:
        return self.cp.asarray(np.asarray(ids, dtype=np.int32).reshape(-1))

    def to_host(self, x: Any) -> np.ndarray:
        return self.cp.asnumpy(x)

    # -- operations (one kernel each) --------------------------------------------------------------------
    @_family("embedding")
    def embed(self, ids: Any) -> Any:
        w: DeviceMatrix = self.weights.token_embd
        t = int(ids.shape[0])
        out = self.cp.empty((t, w.cols), dtype=self.cp.float32)
        self._embed(ids, w, out, t)
        return out

    def _embed(self, ids: Any, w: DeviceMatrix, out: Any, t: int) -> None:
        units = K.cdiv(w.cols, 32)
        K.launch("dequant", f"embed_{qname(w.qtype)}", (t, K.cdiv(units, 128)), (128,),
                 (K.ptr(ids), K.ptr(w.ptr), K.i32(w.cols), K.ptr(out)))

    @_family("norm")
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        x = self._f32(x)
        out = self.cp.empty_like(x)
        self._rms_norm(x, weight, eps, out)
        return out

    def _rms_norm(self, x: Any, weight: Any, eps: float, out: Any) -> None:
        d = x.shape[-1]
        rows = x.size // d
        K.launch("norm", "rms_norm_f32", (rows,), (256,), (K.ptr(x), K.ptr(weight), K.ptr(out), K.i32(d), K.f32(eps)))

    @_family()
    def matmul(self, x: Any, w: DeviceMatrix, bias: Any = None) -> Any:
        cp = self.cp
        x = self._f32(x)
        t, k = x.shape
        if k != w.cols:
            raise BackendError(f"matmul: x has {k} columns, the weight {w.cols}")
        y = cp.empty((t, w.rows), dtype=cp.float32)
        if t <= MATVEC_TMAX:
            self._matvec((w,), x, t, y, bias=bias)
            return y
        # Prefill: dequantize row chunks to fp16, multiply with cuBLAS on tensor cores. Accumulation and output
        # are fp32 (GemmEx): an fp16 output overflowed at 65504 on FFN down projections (Llama-3.2-1B shape,
        # 512 tokens). Rows of x beyond fp16's comfortable range are scaled down by a power of two first and
        # the result scaled back, exactly, with no host sync.
        x16, scale = self._to_f16_scaled(x)
        bias = None if bias is None else self._f32(bias)
        if w.qtype == QT.F16 and w.row_bytes == 2 * k:  # F16 weights are used where they lie (no copy)
            self._gemm16(x16, w.ptr, w.rows, k, y, 0)
        else:
            step = max(1, min(w.rows, DEQUANT_CHUNK // max(k, 1)))
            buf = cp.empty((step, k), dtype=cp.float16)
            for r0 in range(0, w.rows, step):
                n = min(step, w.rows - r0)
                part = w.slice_rows(r0, n)
                units = n * K.cdiv(k, 32)
                K.launch("dequant", f"dequant_{qname(w.qtype)}", (min(K.cdiv(units, 256), 65535),), (256,),
                         (K.ptr(part.ptr), K.i64(n), K.i32(k), K.ptr(buf)))
                self._gemm16(x16, buf.data.ptr, n, k, y, r0)
        n_all = y.size
        K.launch("elementwise", "rowscale_bias_f32", (min(K.cdiv(n_all, 256), 4096),), (256,),
                 (K.ptr(y), K.ptr(scale), K.ptr(bias), K.i64(n_all), K.i32(w.rows)))
        return y

    def _to_f16_scaled(self, x: Any) -> tuple[Any, Any]:
        """x [t, k] float32 -> (x / s as fp16 [t, k], s [t]): s = 1, or the power of two that brings a row's
        max |x| under 16384 (kernels/elementwise.cu). One launch: prefill is not graph-captured, so every
        extra CuPy operation per matmul costs host time."""
        cp = self.cp
        t, k = x.shape
        x16 = cp.empty((t, k), dtype=cp.float16)
        scale = cp.empty(t, dtype=cp.float32)
        K.launch("elementwise", "to_f16_rowscale_f32", (t,), (256,), (K.ptr(x), K.ptr(x16), K.ptr(scale), K.i32(k)))
        return x16, scale

    def _gemm16(self, x16: Any, w_ptr: int, n_rows: int, k: int, y: Any, col0: int) -> None:
        """y[:, col0:col0+n_rows] = x16 [t, k] . W[n_rows, k]^T: fp16 inputs, fp32 accumulation and output."""
        self._gemm(x16.data.ptr, x16.shape[0], k, w_ptr, n_rows, y.data.ptr, y.shape[1], col0, False)

    def _gemm(self, x_ptr: int, t: int, k: int, w_ptr: int, n_rows: int, y_ptr: int, ldy: int, col0: int,
              accumulate: bool) -> None:
        """Y[t, col0:col0+n_rows] (=, or += with accumulate) X16 [t, k] . W16[n_rows, k]^T; Y float32 rows ldy
        apart. Row-major buffers read as column-major: Y^T [N, t] (ld ldy) = op_T(W^T [k, N]) . X^T [k, t].
        CuPy's cuBLAS handle, called through ctypes (_cublas), set to the current stream (so a graph capture
        records the GEMM) with our own workspace (nothing allocated inside a capture)."""
        cp = self.cp
        lib, set_stream, set_ws = _cublas()
        handle = cp.cuda.device.get_cublas_handle()
        if self._cublas_ws is None:
            self._cublas_ws = cp.empty(32 << 20, dtype=cp.uint8)
        st = set_stream(handle, cp.cuda.get_current_stream().ptr)
        st = st or set_ws(handle, self._cublas_ws.data.ptr, self._cublas_ws.nbytes)  # after setStream (it resets)
        ab = self._alpha_beta.ctypes.data
        st = st or lib.cublasGemmEx(
            handle, _OP_T, _OP_N, n_rows, t, k,
            ab, w_ptr, _CUDA_R_16F, k,
            x_ptr, _CUDA_R_16F, k,
            ab + (8 if accumulate else 4), y_ptr + 4 * col0, _CUDA_R_32F, ldy,
            _COMPUTE_32F, _GEMM_DEFAULT,
        )
        if st:
            raise BackendError(f"cuBLAS GEMM ({t} x {n_rows} x {k}) failed with status {st}")

    def _matvec(self, ws: tuple[DeviceMatrix, ...], x: Any, t: int, y: Any, bias: Any = None, resid: Any = None,
                norm: Any = None, argmax: bool = False, early: bool = False) -> None:
        """y [t, sum rows] = [W0; W1; W2] x (+ bias) (+ resid): up to three row segments of one type (one
        token: W2 may be another int8-activation type than W0 and W1, _mv1_kernel).
        One token goes through mv1 (x in shared memory), which can also apply RMSNorm(x) * norm first and
        reduce the rows to the greedy argmax (into step_ids, advancing step_pos); `early`: where it lets a
        programmatic dependent start (_step_kernels)."""
        w0 = ws[0]
        kernel = _mv1_kernel(ws) if t == 1 else None
        if kernel is None and any(w.qtype != w0.qtype for w in ws):
            raise BackendError("matvec segments of mixed types need one token and int8-activation types")
        n = sum(w.rows for w in ws)
        lpr = _lpr(w0.cols)
        segs = [w.ptr for w in ws] + [0] * (3 - len(ws))
        n0 = ws[0].rows
        n1 = ws[1].rows if len(ws) > 1 else 0
        if t == 1 and self.mv1_stream and _mv1_stream_ok(ws):
            K.launch("matvec", f"mv1_stream_{qname(w0.qtype)}", (_mv1_stream_grid(n, self.n_sms),), (32 * MV1_WARPS,),
                     (K.ptr(segs[0]), K.ptr(segs[1]), K.ptr(segs[2]), K.i32(n0), K.i32(n1), K.i32(n), K.i32(w0.cols),
                      K.ptr(x), K.ptr(y), K.ptr(bias), K.ptr(resid), K.ptr(norm), K.f32(self.cfg.rms_eps),
                      K.ptr(self._am if argmax else None), K.i32(early)),
                     shared=_mv1_smem(w0.qtype, w0.cols))
            return
        if t == 1:
            groups = _mv1_groups(n, w0.cols, w0.qtype, self.n_sms)
            rows_per_block = MV1_WARPS * (32 // lpr) * groups
            K.launch("matvec", kernel, (K.cdiv(n, rows_per_block),), (32 * MV1_WARPS,),
                     (K.ptr(segs[0]), K.ptr(segs[1]), K.ptr(segs[2]), K.i32(n0), K.i32(n1), K.i32(n), K.i32(w0.cols),
                      K.ptr(x), K.ptr(y), K.ptr(bias), K.ptr(resid), K.ptr(norm), K.f32(self.cfg.rms_eps), K.i32(lpr),
                      K.i32(groups), K.ptr(self._am if argmax else None), K.i32(early)),
                     shared=_mv1_smem(w0.qtype, w0.cols))
            return
        if norm is not None or argmax:
            raise BackendError("fused RMSNorm / argmax need one token")
        rows_per_block = 4 * (32 // lpr)
        K.launch("matvec", f"matvec_{qname(w0.qtype)}", (K.cdiv(n, rows_per_block),), (128,),
                 (K.ptr(segs[0]), K.ptr(segs[1]), K.ptr(segs[2]), K.i32(n0), K.i32(n1), K.i32(n), K.i32(w0.cols),
                  K.ptr(x), K.i32(t), K.ptr(y), K.ptr(bias), K.ptr(resid), K.i32(lpr)))

    def _matvec_swiglu(self, wg: DeviceMatrix, wu: DeviceMatrix, x: Any, t: int, y: Any, norm: Any = None,
                       early: bool = False) -> None:
        lpr = _lpr(wg.cols)
        if t == 1 and self.mv1_stream and _mv1_stream_ok((wg, wu)):
            K.launch("matvec", f"mv1_stream_{qname(wg.qtype)}_swiglu", (_mv1_stream_grid(wg.rows, self.n_sms),),
                     (32 * MV1_WARPS,),
                     (K.ptr(wg.ptr), K.ptr(wu.ptr), K.i32(wg.rows), K.i32(wg.cols), K.ptr(x), K.ptr(y), K.ptr(norm),
                      K.f32(self.cfg.rms_eps), K.i32(early)),
                     shared=_mv1_smem(wg.qtype, wg.cols))
            return
        if t == 1:
            groups = _mv1_groups(wg.rows, wg.cols, wg.qtype, self.n_sms)
            rows_per_block = MV1_WARPS * (32 // lpr) * groups
            K.launch("matvec", f"mv1_{qname(wg.qtype)}_swiglu", (K.cdiv(wg.rows, rows_per_block),), (32 * MV1_WARPS,),
                     (K.ptr(wg.ptr), K.ptr(wu.ptr), K.i32(wg.rows), K.i32(wg.cols), K.ptr(x), K.ptr(y), K.ptr(norm),
                      K.f32(self.cfg.rms_eps), K.i32(lpr), K.i32(groups), K.i32(early)),
                     shared=_mv1_smem(wg.qtype, wg.cols))
            return
        if norm is not None:
            raise BackendError("fused RMSNorm needs one token")
        rows_per_block = 4 * (32 // lpr)
        K.launch("matvec", f"matvec_{qname(wg.qtype)}_swiglu", (K.cdiv(wg.rows, rows_per_block),), (128,),
                 (K.ptr(wg.ptr), K.ptr(wu.ptr), K.i32(wg.rows), K.i32(wg.cols), K.ptr(x), K.i32(t), K.ptr(y),
                  K.i32(lpr)))

    @_family("RoPE")
    def rope(self, x: Any, pos: Any) -> Any:
        cfg = self.cfg
        out = self._f32(x).copy()
        t, h, dh = out.shape
        mode = "neox" if cfg.rope_type == ROPE_NEOX else "normal"
        K.launch("rope", f"rope_{mode}", (t, h), (max(32, K.cdiv(dh // 2, 32) * 32),),
                 (K.ptr(out), K.i32(h * dh), K.i32(h), K.i32(dh), K.i32(cfg.rope_dim), K.ptr(pos),
                  K.ptr(self.inv_freq), K.f32(cfg.rope_attn_factor)))
        return out

    @_family("attention")
    def attention(self, layer: int, q: Any, k: Any, v: Any, pos: Any) -> Any:
        cp, cfg = self.cp, self.cfg
        q, k, v = self._f32(q), self._f32(k), self._f32(v)
        t = q.shape[0]
        hkv, dh = cfg.n_head_kv, cfg.head_dim
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        n = t * hkv * dh
        K.launch("attention", "kv_store", (min(K.cdiv(n, 256), 4096),), (256,),
                 (K.ptr(k), K.i32(hkv * dh), K.ptr(v), K.i32(hkv * dh), K.i32(t), K.i32(hkv), K.i32(dh), K.ptr(pos),
                  K.ptr(kc), K.ptr(vc)))
        out = cp.empty((t, cfg.q_dim), dtype=cp.float32)
        if t == 1:
            n_split, chunk = self._n_split(self.ctx), self._chunk(self.ctx)
            part_o = cp.empty((n_split, cfg.n_head, dh), dtype=cp.float32)
            part_ml = cp.empty((n_split, cfg.n_head, 2), dtype=cp.float32)
            self._attend(q, cfg.q_dim, kc, vc, pos, 1, out, n_split, chunk, part_o, part_ml)
        else:
            self._attend(q, cfg.q_dim, kc, vc, pos, t, out, 1, self.ctx, None, None)
        return out

    def _attend(self, q: Any, q_stride: int, kc: Any, vc: Any, pos: Any, t: int, out: Any, n_split: int,
                chunk: int, part_o: Any, part_ml: Any) -> None:
        cfg = self.cfg
        hq, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        if n_split == 1 and t >= ATT_TC_MIN_T and dh in ATT_TC_DIMS and self.attention_tc:
            # Prefill on tensor cores: q as the kernel reads it (fp16, times log2(e)/sqrt(dh)), as the fused
            # prefill's RoPE epilogue writes it.
            q32 = q.reshape(t, q_stride)[:, : hq * dh]
            q16 = (q32 * np.float32(_tc_qscale(dh))).astype(self.cp.float16)
            self._attend_tc(q16, hq * dh, kc, vc, pos, t, out)
            return
        npl = next(n for n in (1, 2, 3, 4, 8) if 32 * n >= dh)
        if n_split > 1 and t == 1 and self._decode_kernel_fits():
            # Decode: the split's keys spread over all 8 warps (chunk is a multiple of 256 here).
            K.launch("attention", f"attention_decode_npl{npl}", (hkv, n_split), (256,),
                     (K.ptr(q), K.ptr(kc), K.ptr(vc), K.ptr(pos), K.i32(hq), K.i32(hkv), K.i32(dh),
                      K.f32(1.0 / math.sqrt(dh)), K.i32(chunk), K.ptr(part_o), K.ptr(part_ml)),
                     shared=self._decode_smem())
            K.launch("attention", "attention_combine", (hq,), (max(32, K.cdiv(dh, 32) * 32),),
                     (K.ptr(part_o), K.ptr(part_ml), K.ptr(pos), K.i32(1), K.i32(hq), K.i32(dh), K.i32(n_split),
                      K.i32(chunk), K.ptr(out), K.i32(cfg.q_dim)))
            return
        smem = ATT_ROWS * dh * 4 + 32 * (dh // 2 + 1) * 4 + 32 * dh * 2
        grid = (K.cdiv(t * cfg.n_group, ATT_ROWS), hkv, n_split)
        K.launch("attention", f"attention_npl{npl}", grid, (256,),
                 (K.ptr(q), K.i32(q_stride), K.ptr(kc), K.ptr(vc), K.ptr(pos), K.i32(t), K.i32(hq), K.i32(hkv),
                  K.i32(dh), K.f32(1.0 / math.sqrt(dh)), K.i32(chunk), K.ptr(out), K.i32(cfg.q_dim),
                  K.ptr(part_o), K.ptr(part_ml), K.i32(n_split)), shared=smem)
        if n_split > 1:
            K.launch("attention", "attention_combine", (t * hq,), (max(32, K.cdiv(dh, 32) * 32),),
                     (K.ptr(part_o), K.ptr(part_ml), K.ptr(pos), K.i32(t), K.i32(hq), K.i32(dh), K.i32(n_split),
                      K.i32(chunk), K.ptr(out), K.i32(cfg.q_dim)))

    def _attend_tc(self, q16: Any, q16_stride: int, kc: Any, vc: Any, pos: Any, t: int, out: Any) -> None:
        """Causal prefill attention on tensor cores: q16 [t, Hq*dh] fp16 rows q16_stride apart, already times
        _tc_qscale; out [t, q_dim] f32, or fp16 (the O-projection GEMM's input). attention_wg*_d* (Hopper,
        K/V through TMA descriptors of the caches) where it serves, else attention_tc*_d* (mma.sync)."""
        cfg = self.cfg
        hq, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        f16 = "16" if out.dtype == self.cp.float16 else ""
        if self.attention_wg and dh in ATT_WG_DIMS:  # 64 query rows per block, one warpgroup
            # K and V by the tensor copy engine: each cache a [rows, hkv * dh] matrix in [64 x 64] boxes.
            rows = kc.size // (hkv * dh)
            maps = [K.tensor_map_2d(x.data.ptr, rows, hkv * dh, 64, 64) for x in (kc, vc)]
            args = (K.ptr(q16), K.i32(q16_stride), *maps, K.ptr(pos), K.i32(t), K.i32(hq), K.i32(hkv), K.ptr(out),
                    K.i32(cfg.q_dim))
            K.launch("attention", f"attention_wg{f16}_d{dh}", (K.cdiv(t * cfg.n_group, 64), hkv), (128,), args,
                     shared=_wg_smem(dh))
            return
        args = (K.ptr(q16), K.i32(q16_stride), K.ptr(kc), K.ptr(vc), K.ptr(pos), K.i32(t), K.i32(hq), K.i32(hkv),
                K.ptr(out), K.i32(cfg.q_dim))
        K.launch("attention", f"attention_tc{f16}_d{dh}", (K.cdiv(t * cfg.n_group, ATT_TC_ROWS), hkv), (128,), args,
                 shared=_tc_smem(dh))

    def _decode_smem(self) -> int:
        """attention_decode / attention_step: q [G, Dh] + per-warp o [8, G, Dh] and (m, l) f32, V tiles [8, 32, Dh] fp16."""
        g, dh = self.cfg.n_group, self.cfg.head_dim
        return (9 * g * dh + 16 * g) * 4 + 8 * 32 * dh * 2

    def _decode_kernel_fits(self) -> bool:
        """attention_decode_npl*: up to 8 query heads per KV head, head dim a multiple of 8, at most 128."""
        cfg = self.cfg
        return cfg.n_group <= 8 and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128

    def _chunk(self, ctx: int) -> int:
        """Keys per split in decode attention. attention_decode: 256 (one key per lane of 8 warps), more
        only past 256 splits (ctx > 65536). The CUDA-core fallback (G > 8): 32-key tiles, at most 256 splits."""
        if self._decode_kernel_fits():
            return K.cdiv(K.cdiv(ctx, 256), DEC_KEYS) * DEC_KEYS
        return max(32, K.cdiv(K.cdiv(ctx, 256), 32) * 32)

    def _n_split(self, ctx: int) -> int:
        return K.cdiv(ctx, self._chunk(ctx))

    @_family("FFN")
    def swiglu(self, gate: Any, up: Any) -> Any:
        gate, up = self._f32(gate), self._f32(up)
        out = self.cp.empty_like(gate)
        n = gate.size
        K.launch("elementwise", "swiglu_f32", (min(K.cdiv(n, 256), 4096),), (256,),
                 (K.ptr(gate), K.ptr(up), K.ptr(out), K.i64(n)))
        return out

    @_family("other (residual add)")
    def add(self, x: Any, y: Any) -> Any:
        x, y = self._f32(x), self._f32(y)
        out = self.cp.empty_like(x)
        n = x.size
        K.launch("elementwise", "add_f32", (min(K.cdiv(n, 256), 4096),), (256,),
                 (K.ptr(x), K.ptr(y), K.ptr(out), K.i64(n)))
        return out

    def _f32(self, x: Any) -> Any:
        return self.cp.ascontiguousarray(x, dtype=self.cp.float32)

    # -- the fused prefill pass ---------------------------------------------------------------------------
    # forward_prompt runs a prompt chunk of T tokens (MATVEC_TMAX < T <= PREFILL_CHUNK) through preallocated
    # buffers, activations between GEMMs as fp16 with a power-of-two row scale (kernels/common.cuh
    # f16_rowscale). Per layer: rms_norm_f16 | dequantize Q,K,V into one fp16 scratch (one launch when they
    # lie back to back with one type; F16 weights are read in place) + one GEMM | scale, bias, RoPE, K/V
    # store (rope_store_pf) | attention on tensor cores, fp16 out | O GEMM accumulating into the residual
    # (beta = 1) | rms_norm_f16 | gate/up dequantize + one GEMM | swiglu_f16_rowscale | down dequantize +
    # GEMM | rowscale_add into the residual. Then the LM head on the last row only (mv1 with the final
    # RMSNorm fused). 11-17 launches per layer where the op-by-op path (model.forward) took ~45.
    # The token ids and positions live in device buffers, so a chunk length seen before is captured once
    # into a CUDA graph and replayed (the first sighting runs the kernels directly: compilation, cuBLAS
    # plans); long prompts repeat PREFILL_CHUNK, so every chunk after the second replays.
    def forward_prompt(self, ids: np.ndarray, start: int) -> Any:
        self._ahead = None  # a decode step queued ahead is stale once the cache changes
        t = int(np.asarray(ids).size)
        if t <= MATVEC_TMAX or t > min(self.ctx, PREFILL_CHUNK):
            return super().forward_prompt(ids, start)
        cp = self.cp
        b = self._pf_alloc()
        b.ids[:t].set(np.asarray(ids, dtype=np.int32).reshape(-1))
        b.pos[:t].set(np.arange(start, start + t, dtype=np.int32))
        graph = self._pf_graphs.get(t) if self._prof is None else None  # profiling times the kernels one by one
        if graph is None and self.use_graph and self._pf_graph_ok and self._prof is None and t in self._pf_seen:
            try:
                graph = self._capture(lambda: self._prefill_kernels(t))
            except Exception as exc:  # a cuBLAS that cannot be captured: the kernels run directly from now on
                log.warning("prefill graph capture failed (%s: %s); prefill runs without graphs", type(exc).__name__, exc)
                self._pf_graph_ok = False
            else:
                self._pf_graphs[t] = graph
                while len(self._pf_graphs) > PREFILL_GRAPHS:
                    self._pf_graphs.popitem(last=False)
        if graph is not None:
            self._pf_graphs.move_to_end(t)
            graph.launch(cp.cuda.get_current_stream())
        else:
            self._prefill_kernels(t)
            self._pf_seen.add(t)
        return b.logits

    def _pf_alloc(self) -> SimpleNamespace:
        """forward_prompt's buffers (counted in _scratch_bytes) and per-layer GEMM plans, made once."""
        if self._pf is not None:
            return self._pf
        cp, cfg = self.cp, self.cfg
        tm = min(self.ctx, PREFILL_CHUNK)
        d, f, nqkv = cfg.n_embd, cfg.n_ff, cfg.q_dim + 2 * cfg.kv_dim
        f32 = cp.float32
        b = SimpleNamespace(
            ids=cp.zeros(tm, cp.int32), pos=cp.zeros(tm, cp.int32),
            x=cp.empty(tm * d, f32),  # the residual stream
            h16=cp.empty(tm * max(d, cfg.q_dim, f), cp.float16), scale=cp.empty(tm, f32),  # GEMM input
            att16=cp.empty(tm * cfg.q_dim, cp.float16),  # attention output (O-projection input)
            qkv=cp.empty(tm * nqkv, f32), gu=cp.empty(tm * 2 * f, f32), y=cp.empty(tm * max(d, cfg.q_dim), f32),
            dq=cp.empty(DEQUANT_CHUNK, cp.float16), logits=cp.empty((1, cfg.vocab_size), f32), layers=[],
        )
        for i, L in enumerate(self.weights.layers):
            qkv = [L.attn_qkv] if L.attn_qkv is not None else [L.attn_q, L.attn_k, L.attn_v]
            gu = [L.ffn_up] if L.ffn_gate is None else [L.ffn_gate, L.ffn_up]
            b.layers.append((_merge_rows(qkv), self._qkv_plan[i][1], [L.attn_output], _merge_rows(gu), [L.ffn_down]))
        self._pf = b
        return b

    def _gemm_weights(self, x16_ptr: int, t: int, mats: list[DeviceMatrix], y_ptr: int, ldy: int,
                      accumulate: bool = False) -> None:
        """Y[t, :] (=, or +=) X16 [t, K] . [W0; W1; ...]^T, the rows of the matrices side by side in Y's
        columns: F16 weights multiplied where they lie, others dequantized into the fp16 scratch (up to
        DEQUANT_CHUNK values per GEMM)."""
        dq = self._pf.dq.data.ptr
        k = mats[0].cols
        cap = max(1, DEQUANT_CHUNK // k)
        col0, filled = 0, 0  # Y column of the scratch's first row; rows in the scratch

        def flush() -> None:
            nonlocal col0, filled
            if filled:
                self._gemm(x16_ptr, t, k, dq, filled, y_ptr, ldy, col0, accumulate)
                col0, filled = col0 + filled, 0

        for m in mats:
            if m.qtype == QT.F16 and m.row_bytes == 2 * k:
                flush()
                self._gemm(x16_ptr, t, k, m.ptr, m.rows, y_ptr, ldy, col0, accumulate)
                col0 += m.rows
                continue
            r = 0
            while r < m.rows:
                n = min(cap - filled, m.rows - r)
                units = n * K.cdiv(k, 32)
                K.launch("dequant", f"dequant_{qname(m.qtype)}", (min(K.cdiv(units, 256), 65535),), (256,),
                         (K.ptr(m.ptr + r * m.row_bytes), K.i64(n), K.i32(k), K.ptr(dq + 2 * filled * k)))
                filled, r = filled + n, r + n
                if filled == cap:
                    flush()
        flush()

    def _prefill_kernels(self, t: int) -> None:
        """Launch the fused prefill of b.ids[:t] at b.pos[:t] (see forward_prompt) -> b.logits."""
        cfg, w, b = self.cfg, self.weights, self._pf
        d, f, eps = cfg.n_embd, cfg.n_ff, cfg.rms_eps
        hq, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        nqkv = cfg.q_dim + 2 * cfg.kv_dim
        mode = "neox" if cfg.rope_type == ROPE_NEOX else "normal"
        tc = t >= ATT_TC_MIN_T and dh in ATT_TC_DIMS and self.attention_tc
        x, h16, sc, qkv, gu, y = b.x, b.h16.data.ptr, b.scale, b.qkv, b.gu, b.y
        sec = self._section

        def norm16(weight: Any) -> None:  # h16, sc = fp16 RMSNorm(x) * weight with its row scales
            K.launch("norm", "rms_norm_f16", (t,), (256,), (K.ptr(x), K.ptr(weight), h16, K.ptr(sc), K.i32(d), K.f32(eps)))

        def add_scaled() -> None:  # x += y * sc (rows)
            K.launch("elementwise", "rowscale_add_f32", (min(K.cdiv(t * d, 256), 4096),), (256,),
                     (K.ptr(x), K.ptr(y), K.ptr(sc), K.i64(t * d), K.i32(d)))

        with sec("embedding"):
            self._embed(b.ids, w.token_embd, x, t)
        for i, L in enumerate(w.layers):
            qkv_w, bias, o_w, gu_w, down_w = b.layers[i]
            with sec("norm"):
                norm16(L.attn_norm)
            with sec("QKV"):
                self._gemm_weights(h16, t, qkv_w, qkv.data.ptr, nqkv)
            with sec("RoPE"):
                K.launch("rope", f"rope_store_pf_{mode}", (t, hq + 2 * hkv), (max(32, K.cdiv(dh // 2, 32) * 32),),
                         (K.ptr(qkv), K.i32(nqkv), K.i32(hq), K.i32(hkv), K.i32(dh), K.i32(cfg.rope_dim), K.ptr(b.pos),
                          K.ptr(self.inv_freq), K.f32(cfg.rope_attn_factor), K.ptr(self.k_cache[i]),
                          K.ptr(self.v_cache[i]), K.ptr(sc), K.ptr(bias), K.ptr(h16 if tc else None),
                          K.i32(cfg.q_dim), K.f32(_tc_qscale(dh))))
            with sec("attention"):
                if tc:  # q16 in h16 (the QKV GEMM is done with it), written by rope_store_pf
                    self._attend_tc(b.h16, cfg.q_dim, self.k_cache[i], self.v_cache[i], b.pos, t, b.att16)
                else:  # fp32 CUDA-core attention, then fp16 with a row scale
                    att = y[: t * cfg.q_dim].reshape(t, cfg.q_dim)
                    self._attend(qkv, nqkv, self.k_cache[i], self.v_cache[i], b.pos, t, att, 1, self.ctx, None, None)
                    K.launch("elementwise", "to_f16_rowscale_f32", (t,), (256,),
                             (K.ptr(att), K.ptr(b.att16), K.ptr(sc), K.i32(cfg.q_dim)))
            with sec("O-proj"):
                if tc:  # unscaled fp16 input: accumulate straight into the residual stream
                    self._gemm_weights(b.att16.data.ptr, t, o_w, x.data.ptr, d, accumulate=True)
                else:
                    self._gemm_weights(b.att16.data.ptr, t, o_w, y.data.ptr, d)
                    add_scaled()
            with sec("norm"):
                norm16(L.ffn_norm)
            with sec("FFN"):
                self._gemm_weights(h16, t, gu_w, gu.data.ptr, 2 * f)
                K.launch("elementwise", "swiglu_f16_rowscale", (t,), (256,),
                         (K.ptr(gu), K.ptr(sc), K.i32(f), h16, K.ptr(sc)))
                self._gemm_weights(h16, t, down_w, y.data.ptr, d)
                add_scaled()
        with sec("LM head"):
            last = x[(t - 1) * d : t * d].reshape(1, d)
            self._matvec((w.output,), last, 1, b.logits, norm=w.output_norm)

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

    # -- the fused decode step (CUDA-graph shaped) --------------------------------------------------------
    def _alloc_step_buffers(self) -> None:
        cp, cfg = self.cp, self.cfg
        f = cp.float32
        self.step_ids = cp.zeros(2, dtype=cp.int32)  # [token, flag]: argmax writes both
        self.step_pos = cp.zeros(1, dtype=cp.int32)
        self._x = cp.empty((1, cfg.n_embd), f)
        self._qkv = cp.empty((1, cfg.q_dim + 2 * cfg.kv_dim), f)
        self._att = cp.empty((1, cfg.q_dim), f)
        self._ff = cp.empty((1, cfg.n_ff), f)
        self.step_logits = cp.empty((1, cfg.vocab_size), f)
        n_split = self._n_split(self.ctx)
        self._part_o = cp.empty((n_split, cfg.n_head, cfg.head_dim), f)
        self._part_ml = cp.empty((n_split, cfg.n_head, 2), f)
        self._att_count = cp.zeros(cfg.n_head_kv, cp.uint32)  # attention_step: finished splits per KV head
        # Fused argmax cells (kernels/matvec.cu mv1): key, block counter, flag, &step_ids, &step_pos.
        self._am = cp.asarray(np.asarray([0, 0, 0, self.step_ids.data.ptr, self.step_pos.data.ptr], np.uint64))
        self._dev_state: tuple[int, int] | None = None
        # decode_greedy's step queued ahead: ((token, pos) it computes, its pinned slot, launch count then)
        self._ahead: tuple[tuple[int, int], int, int] | None = None
        self._ids_slot = 0
        self._ids_out = []
        for _ in range(2):  # pinned host slots for the (id, flag) of a step, each with its copy's event
            mem = cp.cuda.alloc_pinned_memory(8)
            self._ids_out.append((np.frombuffer(mem, np.int32, 2), cp.cuda.Event(disable_timing=True)))
        self._topk_vals = cp.empty(TOPK_MAX, f)
        self._topk_ids = cp.empty(TOPK_MAX, cp.int32)
        self._sample_out = cp.zeros(2, cp.int32)  # (token id, flag) from sample_topk_f32
        # Per layer: the QKV matvec segments (one launch when the three share a type) and the bias.
        self._qkv_plan = []
        for L in self.weights.layers:
            if L.attn_qkv is not None:
                segs = [(L.attn_qkv,)]
            elif _mv1_kernel((L.attn_q, L.attn_k, L.attn_v)) is not None:
                segs = [(L.attn_q, L.attn_k, L.attn_v)]
            else:
                segs = [(L.attn_q,), (L.attn_k,), (L.attn_v,)]
            bias = None
            if L.attn_q_bias is not None:
                bias = cp.concatenate([L.attn_q_bias, L.attn_k_bias, L.attn_v_bias])
            self._qkv_plan.append((segs, bias))
        # Gate/up: separate tensors, or phi3's ffn_up rows [gate; up].
        self._ffn_plan = []
        for L in self.weights.layers:
            if L.ffn_gate is not None and L.ffn_gate.qtype == L.ffn_up.qtype:
                self._ffn_plan.append((L.ffn_gate, L.ffn_up))
            elif L.ffn_gate is None:
                f_ = self.cfg.n_ff
                self._ffn_plan.append((L.ffn_up.slice_rows(0, f_), L.ffn_up.slice_rows(f_, f_)))
            else:
                self._ffn_plan.append(None)  # mixed types: two matvecs and a swiglu kernel

    def _step_kernels(self, greedy: bool) -> None:
        """Launch one decode step reading step_ids[0] and step_pos[0]; logits -> step_logits. Per layer:
        QKV matvec (+ RMSNorm, bias) | attention step (RoPE + K/V store + splits + their merge; where the head
        shape has no such kernel: rope_store, attention split, combine) | O matvec + residual | gate/up matvec
        (+ RMSNorm, SwiGLU) | down matvec + residual; then the LM head (+ RMSNorm, argmax)."""
        cfg, w = self.cfg, self.weights
        x, qkv, att, ff = self._x, self._qkv, self._att, self._ff
        mode = "neox" if cfg.rope_type == ROPE_NEOX else "normal"
        hq, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        n_split, chunk = self._n_split(self.ctx), self._chunk(self.ctx)
        npl = next(n for n in (1, 2, 3, 4, 8) if 32 * n >= dh)
        row_blocks = K.cdiv(cfg.n_group, self.decode_rows)
        sec = self._section
        with sec("embedding"):
            self._embed(self.step_ids, w.token_embd, x, 1)
        # The step as (section, weight bytes, streams, launch(early)). Inside the capture (_capture_step) the
        # kernels of matrices under pdl_max_bytes, the streaming matvecs (mv1_stream) and the attention
        # launch as programmatic dependents: each starts while the one before finishes (hiding the launch gap
        # and its prologue; mv1_stream also loads its first weights then); other large matvecs launch
        # plainly (there it measured slower). `early` tells a kernel to let the next one start right after
        # its own pdl_wait() rather than after its main loop: right for a next kernel that is latency-bound
        # (a matrix under pdl_early_bytes) and for a streaming one, whose blocks then take each SM a block of
        # this kernel leaves and load their first weights during this kernel's tail (8B F16 tg128 173.5 ->
        # 176.8 t/s); an mv1 matvec whose blocks wait on SMs busy with this one streamed slower. Measured on
        # the H100 (BENCHMARKS.md): tg128 SmolLM2 +17%, Qwen2.5-0.5B +9-10%, Llama-3.2-1B +4%, 8B F16 159 -> 177.
        step: list[tuple[str, int, bool, Callable[[bool], None]]] = []

        def mv(name: str, ws: tuple[DeviceMatrix, ...], src: Any, dst: Any, **kw: Any) -> None:
            step.append((name, sum(m.nbytes for m in ws), self.mv1_stream and _mv1_stream_ok(ws),
                         lambda early: self._matvec(ws, src, 1, dst, early=early, **kw)))

        for i, L in enumerate(w.layers):
            segs, bias = self._qkv_plan[i]
            if len(segs) == 1:
                mv("norm+QKV", segs[0], x, qkv, bias=bias, norm=L.attn_norm)
            else:  # mixed types: three launches into the row ranges of qkv, each normalising x itself
                off = 0
                for (m,) in segs:
                    b = None if bias is None else bias[off : off + m.rows]
                    mv("norm+QKV", (m,), x, qkv[:, off : off + m.rows], bias=b, norm=L.attn_norm)
                    off += m.rows
            if self._decode_kernel_fits():  # one kernel: RoPE, K/V store, the attention splits and their merge
                step.append(("RoPE+KV+attention", 0, False, lambda early, i=i: K.launch(
                    "attention", f"attention_step_{mode}_npl{npl}", (hkv, n_split, row_blocks), (256,),
                    (K.ptr(qkv), K.ptr(self.k_cache[i]), K.ptr(self.v_cache[i]), K.ptr(self.step_pos),
                     K.i32(hq), K.i32(hkv), K.i32(dh), K.f32(1.0 / math.sqrt(dh)), K.i32(chunk),
                     K.ptr(self._part_o), K.ptr(self._part_ml), K.ptr(qkv.data.ptr + 4 * cfg.q_dim),
                     K.i32(cfg.rope_dim), K.ptr(self.inv_freq), K.f32(cfg.rope_attn_factor),
                     K.ptr(self._att_count), K.ptr(att), K.i32(early)),
                    shared=self._decode_smem())))
            else:
                step.append(("RoPE+KV", 0, False, lambda early, i=i: K.launch(
                    "rope", f"rope_store_{mode}", (1, hq + 2 * hkv), (max(32, K.cdiv(dh // 2, 32) * 32),),
                    (K.ptr(qkv), K.i32(qkv.shape[1]), K.i32(hq), K.i32(hkv), K.i32(dh), K.i32(cfg.rope_dim),
                     K.ptr(self.step_pos), K.ptr(self.inv_freq), K.f32(cfg.rope_attn_factor),
                     K.ptr(self.k_cache[i]), K.ptr(self.v_cache[i])))))
                step.append(("attention", 0, False, lambda early, i=i: self._attend(
                    qkv, qkv.shape[1], self.k_cache[i], self.v_cache[i], self.step_pos, 1, att, n_split, chunk,
                    self._part_o, self._part_ml)))
            mv("O-proj", (L.attn_output,), att, x, resid=x)
            plan = self._ffn_plan[i]
            if plan is not None:
                step.append(("norm+FFN", plan[0].nbytes + plan[1].nbytes, self.mv1_stream and _mv1_stream_ok(plan),
                             lambda early, plan=plan, L=L:
                             self._matvec_swiglu(plan[0], plan[1], x, 1, ff, norm=L.ffn_norm, early=early)))
            else:
                g = self._ff_tmp()
                mv("norm+FFN", (L.ffn_gate,), x, g[0], norm=L.ffn_norm)
                mv("norm+FFN", (L.ffn_up,), x, g[1], norm=L.ffn_norm)
                step.append(("norm+FFN", 0, False, lambda early, g=g: K.launch(
                    "elementwise", "swiglu_f32", (K.cdiv(cfg.n_ff, 256),), (256,),
                    (K.ptr(g[0]), K.ptr(g[1]), K.ptr(ff), K.i64(cfg.n_ff)))))
            mv("norm+FFN", (L.ffn_down,), ff, x, resid=x)
        mv("norm+LM head+argmax" if greedy else "norm+LM head", (w.output,), x, self.step_logits,
           norm=w.output_norm, argmax=greedy)
        for j, (name, nbytes, streams, launch) in enumerate(step):
            nxt_bytes, nxt_streams = step[j + 1][1:3] if j + 1 < len(step) else (0, False)
            plain = nbytes >= self.pdl_max_bytes and not streams
            with sec(name), (K.dependent_launches(False) if plain else _NULL):
                launch(nxt_bytes < self.pdl_early_bytes or nxt_streams)

    def _ff_tmp(self) -> Any:
        if not hasattr(self, "_ff2"):
            self._ff2 = self.cp.empty((2, 1, self.cfg.n_ff), dtype=self.cp.float32)
        return self._ff2

    def _run_step(self, greedy: bool) -> None:
        cp = self.cp
        key = "greedy" if greedy else "logits"
        if not self.use_graph:
            self._step_kernels(greedy)
            return
        graph = self._graphs.get(key)
        if graph is None:
            self._ff_tmp()
            self._step_kernels(greedy)  # warm up: compile, first-launch setup, outside the capture
            graph = self._graphs[key] = self._capture_step(greedy)
            # The warm-up ran the step once (it wrote this position's K/V and, when greedy, advanced pos):
            # restore the inputs so the first replay computes the same step.
            self.step_ids[:1].set(np.asarray([self._cur_token], np.int32))
            self.step_pos.set(np.asarray([self._cur_pos], np.int32))
        # Replay on the current stream: ordered after the prefill and the input copies, and the host waits
        # only where it reads a result (step_ids.get(), or the caller's use of the logits).
        graph.launch(cp.cuda.get_current_stream())

    def _capture_step(self, greedy: bool) -> Any:
        """The decode step's graph, its matvecs and attention launched as programmatic dependents (each starts
        while the one before finishes; cuda_kernels.dependent_launches) unless `pdl` is off or that capture
        fails (then a plain one, with a warning)."""
        if self.pdl:
            try:
                with K.dependent_launches():
                    return self._capture(lambda: self._step_kernels(greedy))
            except Exception as exc:  # a driver that refuses the attribute in capture: the plain graph
                log.warning("decode step capture with programmatic launches failed (%s); capturing without", exc)
                self.pdl = False
        return self._capture(lambda: self._step_kernels(greedy))

    def _set_inputs(self, token: int, pos: int) -> None:
        """Upload token and position unless the device already holds them (a greedy step leaves its output
        id in step_ids[0] and pos + 1 in step_pos): one host-to-device copy fewer per generated token."""
        self._cur_token, self._cur_pos = int(token), int(pos)
        if self._dev_state != (self._cur_token, self._cur_pos):
            self.step_ids[:1].set(np.asarray([token], np.int32))
            self.step_pos.set(np.asarray([pos], np.int32))
        self._dev_state = None
        self._ahead = None

    def decode(self, token: int, pos: int) -> Any:
        """The fused decode step for `token` at position `pos` -> logits [1, V] (a device buffer that the
        next step overwrites). Writes that position's K/V into the cache."""
        self._set_inputs(token, pos)
        self._run_step(greedy=False)
        return self.step_logits

    def decode_greedy(self, token: int, pos: int) -> int:
        """The fused decode step with the argmax fused into the LM head: only the chosen id comes back.

        With graphs on, the following step is queued before this one's id is read: the device already holds
        its inputs (this step's id and pos + 1), so the GPU does not wait for the host between tokens (~20 us
        a token on the H100, BENCHMARKS.md). That step writes position pos + 1's K/V for the predicted token;
        the next call, (that id, pos + 1), takes its result, and any other call or launch recomputes (positions
        past pos must hold nothing the caller needs: true of generation, which extends the cache one token a
        time). Each result leaves the device through its own pinned slot, copied between the two steps."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (int(token), int(pos)) and ahead[2] == K.launch_count():
            slot = ahead[1]
            self._cur_token, self._cur_pos = int(token), int(pos)
        else:
            self._set_inputs(token, pos)
            self._run_step(greedy=True)
            slot = self._copy_ids()
        nxt = None
        if self.use_graph and pos + 1 < self.ctx and "greedy" in self._graphs:
            self._run_step(greedy=True)  # reads (id, pos + 1) from the device
            nxt = self._copy_ids()
        ids, event = self._ids_out[slot]
        event.synchronize()
        tok, bad = int(ids[0]), int(ids[1])
        if bad:
            raise NumericalError("the logits contain NaN or +inf: the model output is broken")
        if nxt is None:
            self._dev_state = (tok, self._cur_pos + 1)
        else:
            self._dev_state = None  # the queued step moved the device on to (its id, pos + 2)
            self._ahead = ((tok, self._cur_pos + 1), nxt, K.launch_count())
        return tok

    def _copy_ids(self) -> int:
        """Queue the copy of step_ids into the next pinned slot (after the step just queued) -> the slot."""
        cp = self.cp
        slot = self._ids_slot = 1 - self._ids_slot
        ids, event = self._ids_out[slot]
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(ids.ctypes.data, self.step_ids.data.ptr, 8, 2, stream.ptr)  # device -> host
        event.record(stream)
        return slot

    def profile_decode(self, token: int, pos: int) -> tuple[list[tuple[str, float, int]], float]:
        """profile() of one fused greedy decode step, launched un-captured (the graph's kernels, one by one)."""
        self._set_inputs(token, pos)
        self._ff_tmp()
        try:
            return self.profile(lambda: self._step_kernels(True), spin_ms=30.0)
        finally:
            self._dev_state = None

    # -- sampling on the device -----------------------------------------------------------------------
    @_family("sampling")
    def sample(self, logits: Any, params: Any, rng: np.random.Generator, recent: list[int]) -> int:
        from .. import sampling as S

        cp, v = self.cp, self.cfg.vocab_size
        params.validate()
        if not params.greedy and not 0 < params.top_k <= TOPK_MAX:
            return S.sample(self.to_host(logits)[-1], params, rng, recent)  # host path (documented)
        x = self._f32(logits[-1]).copy()  # [V]; penalties write into it
        penal = params.repeat_last_n != 0 and (
            params.repeat_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        )
        if penal and recent:
            window = np.asarray(recent, dtype=np.int32)
            if params.repeat_last_n > 0:
                window = window[-params.repeat_last_n :]
            if window.size:
                hist = cp.asarray(window)
                K.launch("sampling", "penalties_f32", (1,), (256,),
                         (K.ptr(x), K.ptr(hist), K.i32(window.size), K.f32(params.repeat_penalty),
                          K.f32(params.frequency_penalty), K.f32(params.presence_penalty)))
        if params.greedy:
            out = cp.empty(2, dtype=cp.int32)
            K.launch("sampling", "argmax_f32", (1,), (1024,), (K.ptr(x), K.i32(v), K.ptr(out), K.ptr(None)))
            host = out.get()
            if host[1]:
                raise NumericalError("the logits contain NaN or +inf: the model output is broken")
            return int(host[0])
        k = min(params.top_k, v)
        K.launch("sampling", "topk_f32", (1,), (1024,),
                 (K.ptr(x), K.i32(v), K.i32(k), K.ptr(self._topk_vals), K.ptr(self._topk_ids)))
        # top-p, min-p, temperature and the draw over the k candidates, on the device too (sampling.cu):
        # the host's seeded generator supplies the one uniform number, and only the id comes back.
        out = self._sample_out
        log_min_p = math.log(params.min_p) if params.min_p > 0 else -math.inf
        K.launch("sampling", "sample_topk_f32", (1,), (1024,),
                 (K.ptr(self._topk_vals), K.ptr(self._topk_ids), K.i32(k), np.float64(params.top_p),
                  np.float64(log_min_p), np.float64(params.temperature), np.float64(rng.random()), K.ptr(out)))
        token, flag = (int(a) for a in out.get())
        if flag == 1:
            raise NumericalError("the logits contain NaN or +inf: the model output is broken")
        if flag == 2:
            raise NumericalError(f"all {v} logits are -inf: no token can be sampled")
        return token
