"""Linear layers on the CUDA backend: weights in their GGUF block layout on the device (DeviceMatrix), the
matvec kernels that read those blocks directly (kernels/matvec.cu: up to MATVEC_TMAX tokens; one token through
mv1 / mv1_stream / mv1_tile, with RMSNorm, bias, residual, SwiGLU and the greedy argmax fused in), bgemm for a
few fp16 rows (kernels/batch_gemm.cu: the batched step's rows and prompt chunks of up to BG_NMAX tokens, the
weight decoded inside the kernel), and longer prefill chunks' GEMMs: row chunks dequantized to fp16
(kernels/dequant.cu) and multiplied by cuBLAS on tensor cores.

The grid rules of each kernel (rows per block, row groups, one wave of blocks, shared memory) live here next to
the launch, and mirror the kernel's own constants (tests/backends/cuda/test_cuda_launch.py checks them against the source).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BackendError
from ...ggufio.ggml_types import GGMLQuantizationType as QT
from . import loader as K
from .constants import (
    BG_NMAX,
    BG_ROWS,
    BG_WARPS,
    MATVEC_TMAX,
    MV1_MINB8,
    MV1S_BLOCKS_PER_SM,
    MV1T_ROWS,
    MV1T_STAGES,
    MV1T_WARPS,
)

RUNNABLE = (
    QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.MXFP4,
)
_CUDA_R_32F, _CUDA_R_16F = 0, 2  # cudaDataType (library_types.h)
DEQUANT_CHUNK = 1 << 25  # fp16 values per dequantized weight chunk in prefill (64 MiB)
MV1_WARPS = 8  # kernels/matvec.cu mv1_*: warps per block


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


def merge_rows(mats: list[DeviceMatrix]) -> list[DeviceMatrix]:
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
MV1_ACT8 = frozenset({QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.MXFP4})
MV1_MIXED = frozenset({QT.Q4_K, QT.Q5_K, QT.Q6_K})  # kernels/matvec.cu mv1_mixed_<a>_<b>: pairs of these
MV1_ACT8_BLOCKS_PER_SM = MV1_MINB8  # the int8 forms' __launch_bounds__ minimum


def mv1_kernel(ws: tuple[Any, ...]) -> str | None:
    """The mv1 kernel for these row segments: one type (mv1_<t>), or Q/K rows of one int8-activation type
    with V rows of another (mv1_mixed_<a>_<b>: Q4_K_M's Q6_K V layers keep one QKV launch); None else."""
    a, b = ws[0].qtype, ws[-1].qtype
    if all(w.qtype == a for w in ws):
        return f"mv1_{qname(a)}"
    if len(ws) == 3 and ws[1].qtype == a and a in MV1_MIXED and b in MV1_MIXED:
        return f"mv1_mixed_{qname(a)}_{qname(b)}"
    return None


def mv1_groups(rows: int, cols: int, qtype: QT | None = None, sms: int | None = None) -> int:
    """Row groups per mv1 block (kernels/matvec.cu), one staging of x for all: where staging x costs as
    much as the rows (long rows: 57 KB of x at 14336 columns; short rows: a lane's whole share is one or two
    units) and the matrix has rows enough to keep every SM busy: faster at tg128 on the 0.5B, 1B and 8B
    Q4_K_M shapes; 4096-column matrices were slower with 2 (float x). The int8-activation forms also take 4
    on 4096-column matrices of 12288 rows or more (faster than 1 or 2 there: Q4_K 14336x4096 and its SwiGLU);
    2 where one group per block would need more than one wave of blocks on `sms` multiprocessors
    (MV1_ACT8_BLOCKS_PER_SM each: the 8B's 6144-row QKV launch, 768 blocks on 132 SMs); and 8 on a small
    model's int8 LM head (Llama-3.2-1B's Q6_K 128256x2048: a little faster than 4). The figures are in
    docs/perf-log.md."""
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


def mv1_stream_ok(ws: tuple[Any, ...]) -> bool:
    """Whether mv1_stream serves these row segments: one 16-bit float type, rows of whole 16-byte chunks
    (K % 8 == 0), every segment 16-byte aligned."""
    a, k = ws[0].qtype, ws[0].cols
    return (a in MV1S_TYPES and k % 8 == 0
            and all(w.qtype == a and w.cols == k and w.row_bytes == 2 * k and w.ptr % 16 == 0 for w in ws))


def mv1_stream_grid(rows: int, sms: int) -> int:
    """mv1_stream's grid: at most one wave (MV1S_BLOCKS_PER_SM blocks per SM), each warp a row of every
    `per` (its rows w, w + warps, ...): the fewest blocks that still give every warp at most `per` rows, so the
    warps end together (6144 rows: 256 blocks of 3 rows a warp rather than 264 of 2 or 3)."""
    per = K.cdiv(rows, MV1_WARPS * MV1S_BLOCKS_PER_SM * sms)
    return K.cdiv(rows, MV1_WARPS * per)


# Short Q8_0 rows by the many (a small model's LM head: Gemma 3's 262,144 x 640) take the tiled one-token matvec
# (kernels/matvec.cu mv1_tile_q8_0): each warp streams tiles of MV1T_ROWS rows through MV1T_STAGES buffers of
# its own shared memory; one block of MV1T_WARPS warps per SM.
MV1T_MAX_COLS = 1024  # 12 warps x 2 stages x 8 rows of 1088 bytes, plus x: within an H100 block's 227 KiB
MV1T_STATIC_SMEM = 1024  # its static shared memory (mv1_argmax's keys, block_sum's partials), with a margin


def mv1_tile_ok(ws: tuple[Any, ...], smem_block: int) -> bool:
    """Whether mv1_tile serves these rows: one Q8_0 segment 16-byte aligned, rows packed (34 bytes per 32
    values), at most MV1T_MAX_COLS columns, 32768 rows or more (the LM head of a small model), and its shared
    memory within the device's per-block limit `smem_block` (an A100's 163 KiB takes up to 768 columns, a
    99 KiB GPU up to 480; the rest go through mv1)."""
    w = ws[0]
    return (len(ws) == 1 and w.qtype == QT.Q8_0 and w.cols <= MV1T_MAX_COLS and w.rows >= 32768
            and w.ptr % 16 == 0 and w.row_bytes == K.cdiv(w.cols, 32) * 34
            and mv1_tile_smem(w.cols) + MV1T_STATIC_SMEM <= smem_block)


def mv1_tile_smem(cols: int) -> int:
    """mv1_tile's dynamic shared memory: x as mv1's float staging (its slots), then each warp's stages."""
    units = K.cdiv(cols, 32)
    return units * 128 + MV1T_WARPS * MV1T_STAGES * MV1T_ROWS * units * 34


def mv1_tile_grid(rows: int, sms: int) -> int:
    """mv1_tile's grid: a block per SM, fewer where the tiles do not give every warp one."""
    return max(1, min(sms, K.cdiv(K.cdiv(rows, MV1T_ROWS), MV1T_WARPS)))


def mv1_smem(qtype: QT, cols: int) -> int:
    """mv1's dynamic shared memory: x staged per 32-value unit (kernels/matvec.cu stage_x / stage_xq)."""
    return K.cdiv(cols, 32) * (40 if qtype in MV1_ACT8 else 132)


BG_BLOCKS_PER_SM = 4  # the grid bgemm_splits aims at: this many blocks per SM, the K range split to get there


def bgemm_splits(rows: int, cols: int, sms: int) -> int:
    """bgemm's K splits for a [rows, cols] weight on `sms` multiprocessors: enough that the grid holds about
    BG_BLOCKS_PER_SM blocks per SM, at most one per group of four units per warp. A function of the shape and
    the GPU only (never of the batch), so that a row's sums are the same in any batch."""
    tiles, groups = K.cdiv(rows, BG_ROWS), K.cdiv(cols // 32, 4)
    target = BG_BLOCKS_PER_SM * sms
    if tiles >= target:
        return 1
    return max(1, min(K.cdiv(target, tiles), groups // BG_WARPS))


def bgemm_ok(mats: list[DeviceMatrix]) -> bool:
    """Whether bgemm multiplies these matrices: whole 32-value units per row (K % 32 == 0, so x rows are
    16-byte aligned too)."""
    return all(m.cols % 32 == 0 for m in mats)


def _lpr(cols: int) -> int:
    """Lanes per row in matvec.cu: the power of two <= 32 closest above the row's 32-value unit count."""
    units = -(-cols // 32)
    lpr = 1
    while lpr < 32 and lpr < units:
        lpr *= 2
    return lpr


class Linear:
    """The matvec and GEMM launchers of one model (its config's RMSNorm epsilon), with what they own: cuBLAS's
    workspace and host scalars, and the fp16 scratch prefill dequantizes weights into (gemm_weights)."""

    def __init__(self, gpu: Any, options: Any, cfg: Any):
        self.gpu, self.options, self.cfg = gpu, options, cfg
        self.cp = gpu.cp
        self.alpha_beta = np.array([1.0, 0.0, 1.0], dtype=np.float32)  # host scalars for cuBLAS: 1, beta 0 or 1
        self.cublas_ws: Any = None
        self.dq: Any = None  # gemm_weights' dequantized fp16 weights (dequant_scratch)
        self.bg: tuple[Any, Any] | None = None  # bgemm's split partials and per-tile counters (bgemm_scratch)

    def workspace(self) -> Any:
        """cuBLAS's workspace for the GEMMs (32 MiB), made once."""
        if self.cublas_ws is None:
            self.cublas_ws = self.cp.empty(32 << 20, dtype=self.cp.uint8)
        return self.cublas_ws

    def dequant_scratch(self) -> Any:
        """gemm_weights' fp16 scratch of DEQUANT_CHUNK values, made once (before any capture: a captured pass
        allocates nothing)."""
        if self.dq is None:
            self.dq = self.cp.empty(DEQUANT_CHUNK, self.cp.float16)
        return self.dq

    def bgemm_scratch(self) -> tuple[Any, Any]:
        """bgemm's partial sums of split launches and its counters (zeroed; each launch leaves them zero), made
        once (before any capture): a split launch has fewer than 2 * BG_BLOCKS_PER_SM * SMs blocks' tiles of
        BG_ROWS x BG_NMAX sums (bgemm_splits)."""
        if self.bg is None:
            target = BG_BLOCKS_PER_SM * self.gpu.n_sms
            self.bg = (self.cp.empty(2 * target * BG_ROWS * BG_NMAX, self.cp.float32),
                       self.cp.zeros(target, self.cp.uint32))
        return self.bg

    def bgemm(self, x16_ptr: int, t: int, w: DeviceMatrix, y_ptr: int, ldy: int, accumulate: bool = False,
              rs: Any = None) -> None:
        """Y[t, :N] (=, or += with accumulate) rs * X16 [t, K] . W^T (rs [t] per row, None: 1) on tensor cores
        with the weight decoded in the kernel (kernels/batch_gemm.cu), BG_NMAX rows of X per launch; X16 rows K
        apart, Y rows ldy apart; bgemm_ok(W)."""
        part, counters = self.bgemm_scratch()
        k = w.cols
        splits = bgemm_splits(w.rows, k, self.gpu.n_sms)
        for r in range(0, t, BG_NMAX):
            n = min(BG_NMAX, t - r)
            nt = 8 if n <= 8 else 16 if n <= 16 else 32 if n <= 32 else 64
            K.launch("batch_gemm", f"bgemm_{qname(w.qtype)}_n{nt}", (K.cdiv(w.rows, BG_ROWS), splits), (32 * BG_WARPS,),
                     w=w.ptr, N=w.rows, K=k, x=x16_ptr + 2 * r * k, ldx=k, B=n, y=y_ptr + 4 * r * ldy, ldy=ldy,
                     rs=None if rs is None else rs[r:], accumulate=accumulate, splits=splits, part=part,
                     counters=counters)

    def matmul(self, x: Any, w: DeviceMatrix, bias: Any = None) -> Any:
        """Backend.matmul: x [t, K] @ W^T (+ bias) -> [t, N] f32; mv1/matvec for few tokens, else dequantized row
        chunks times x in fp16 on cuBLAS."""
        cp = self.cp
        x = self.gpu.f32(x)
        t, k = x.shape
        if k != w.cols:
            raise BackendError(f"matmul: x has {k} columns, the weight {w.cols}")
        if t <= MATVEC_TMAX:
            y = cp.empty((t, w.rows), dtype=cp.float32)
            self.matvec((w,), x, t, y, bias=bias)
            return y
        y = cp.empty((t, w.rows), dtype=cp.float32)
        # Prefill: dequantize row chunks to fp16, multiply with cuBLAS on tensor cores. Accumulation and output
        # are fp32 (GemmEx): an fp16 output overflowed at 65504 on FFN down projections (Llama-3.2-1B shape,
        # 512 tokens). Rows of x beyond fp16's comfortable range are scaled down by a power of two first and
        # the result scaled back, exactly, with no host sync.
        x16, scale = self.to_f16_scaled(x)
        bias = None if bias is None else self.gpu.f32(bias)
        if w.qtype == QT.F16 and w.row_bytes == 2 * k:  # F16 weights are used where they lie (no copy)
            self.gemm16(x16, w.ptr, w.rows, k, y, 0)
        else:
            step = max(1, min(w.rows, DEQUANT_CHUNK // max(k, 1)))
            buf = cp.empty((step, k), dtype=cp.float16)
            for r0 in range(0, w.rows, step):
                n = min(step, w.rows - r0)
                part = w.slice_rows(r0, n)
                units = n * K.cdiv(k, 32)
                K.launch("dequant", f"dequant_{qname(w.qtype)}", (min(K.cdiv(units, 256), 65535),), (256,),
                         w=part.ptr, N=n, K=k, out=buf)
                self.gemm16(x16, buf.data.ptr, n, k, y, r0)
        n_all = y.size
        K.launch("elementwise", "rowscale_bias_f32", (min(K.cdiv(n_all, 256), 4096),), (256,), y=y, scale=scale,
                 b=bias, n=n_all, N=w.rows)
        return y

    def to_f16_scaled(self, x: Any) -> tuple[Any, Any]:
        """x [t, k] float32 -> (x / s as fp16 [t, k], s [t]): s = 1, or the power of two that brings a row's
        max |x| under 16384 (kernels/elementwise.cu). One launch: prefill is not graph-captured, so every
        extra CuPy operation per matmul costs host time."""
        cp = self.cp
        t, k = x.shape
        x16 = cp.empty((t, k), dtype=cp.float16)
        scale = cp.empty(t, dtype=cp.float32)
        K.launch("elementwise", "to_f16_rowscale_f32", (t,), (256,), x=x, x16=x16, scale=scale, k=k)
        return x16, scale

    def gemm16(self, x16: Any, w_ptr: int, n_rows: int, k: int, y: Any, col0: int) -> None:
        """y[:, col0:col0+n_rows] = x16 [t, k] . W[n_rows, k]^T: fp16 inputs, fp32 accumulation and output."""
        self.gemm(x16.data.ptr, x16.shape[0], k, w_ptr, n_rows, y.data.ptr, y.shape[1], col0, False)

    def gemm(self, x_ptr: int, t: int, k: int, w_ptr: int, n_rows: int, y_ptr: int, ldy: int, col0: int,
              accumulate: bool) -> None:
        """Y[t, col0:col0+n_rows] (=, or += with accumulate) X16 [t, k] . W16[n_rows, k]^T; Y float32 rows ldy
        apart. Row-major buffers read as column-major: Y^T [N, t] (ld ldy) = op_T(W^T [k, N]) . X^T [k, t].
        CuPy's cuBLAS handle, called through ctypes (_cublas), set to the current stream (so a graph capture
        records the GEMM) with our own workspace (nothing allocated inside a capture)."""
        cp = self.cp
        lib, set_stream, set_ws = _cublas()
        handle = cp.cuda.device.get_cublas_handle()
        self.workspace()
        st = set_stream(handle, cp.cuda.get_current_stream().ptr)
        st = st or set_ws(handle, self.cublas_ws.data.ptr, self.cublas_ws.nbytes)  # after setStream (it resets)
        ab = self.alpha_beta.ctypes.data
        st = st or lib.cublasGemmEx(
            handle, _OP_T, _OP_N, n_rows, t, k,
            ab, w_ptr, _CUDA_R_16F, k,
            x_ptr, _CUDA_R_16F, k,
            ab + (8 if accumulate else 4), y_ptr + 4 * col0, _CUDA_R_32F, ldy,
            _COMPUTE_32F, _GEMM_DEFAULT,
        )
        if st:
            raise BackendError(f"cuBLAS GEMM ({t} x {n_rows} x {k}) failed with status {st}")

    def matvec(self, ws: tuple[DeviceMatrix, ...], x: Any, t: int, y: Any, bias: Any = None, resid: Any = None,
               norm: Any = None, argmax: Any = None, early: bool = False, post: Any = None) -> None:
        """y [t, sum rows] = [W0; W1; W2] x (+ bias) (+ resid): up to three row segments of one type (one
        token: W2 may be another int8-activation type than W0 and W1, mv1_kernel).
        One token goes through mv1 (x in shared memory), which can also apply RMSNorm(x) * norm first and
        reduce the rows to the greedy argmax (`argmax`: the argmax cells, decode.DecodeStep.am: the id goes to
        step_ids, and step_pos advances); `early`: where it lets a programmatic dependent start
        (decode.DecodeStep.launch_step). `post` (one token): a device array
        of three pointers {blk, w, out}: the input is x + RMSNorm(blk) * w (a gemma block's post-norm and
        residual add, kernels/matvec.cu PostIn), also written to out."""
        w0 = ws[0]
        kernel = mv1_kernel(ws) if t == 1 else None
        if kernel is None and any(w.qtype != w0.qtype for w in ws):
            raise BackendError("matvec segments of mixed types need one token and int8-activation types")
        n = sum(w.rows for w in ws)
        lpr = _lpr(w0.cols)
        segs = [w.ptr for w in ws] + [0] * (3 - len(ws))
        n0 = ws[0].rows
        n1 = ws[1].rows if len(ws) > 1 else 0
        if t == 1 and self.options.mv1_stream and mv1_stream_ok(ws):
            K.launch("matvec", f"mv1_stream_{qname(w0.qtype)}", (mv1_stream_grid(n, self.gpu.n_sms),), (32 * MV1_WARPS,),
                     shared=mv1_smem(w0.qtype, w0.cols), w0=segs[0], w1=segs[1], w2=segs[2], n0=n0, n1=n1, N=n,
                     K=w0.cols, x=x, y=y, bias=bias, resid=resid, norm_w=norm, eps=self.cfg.rms_eps,
                     am=argmax, early=early, post=post)
            return
        if t == 1 and mv1_tile_ok(ws, self.gpu.smem_block):
            K.launch("matvec", "mv1_tile_q8_0", (mv1_tile_grid(n, self.gpu.n_sms),), (32 * MV1T_WARPS,),
                     shared=mv1_tile_smem(w0.cols), w=w0.ptr, N=n, K=w0.cols, x=x, y=y, bias=bias, resid=resid,
                     norm_w=norm, eps=self.cfg.rms_eps, am=argmax, early=early, post=post)
            return
        if t == 1:
            groups = mv1_groups(n, w0.cols, w0.qtype, self.gpu.n_sms)
            rows_per_block = MV1_WARPS * (32 // lpr) * groups
            K.launch("matvec", kernel, (K.cdiv(n, rows_per_block),), (32 * MV1_WARPS,),
                     shared=mv1_smem(w0.qtype, w0.cols), w0=segs[0], w1=segs[1], w2=segs[2], n0=n0, n1=n1, N=n,
                     K=w0.cols, x=x, y=y, bias=bias, resid=resid, norm_w=norm, eps=self.cfg.rms_eps, lpr=lpr,
                     groups=groups, am=argmax, early=early, post=post)
            return
        if norm is not None or argmax is not None or post is not None:
            raise BackendError("fused RMSNorm / argmax / post-norm need one token")
        rows_per_block = 4 * (32 // lpr)
        K.launch("matvec", f"matvec_{qname(w0.qtype)}", (K.cdiv(n, rows_per_block),), (128,), w0=segs[0], w1=segs[1],
                 w2=segs[2], n0=n0, n1=n1, N=n, K=w0.cols, x=x, T=t, y=y, bias=bias, resid=resid, lpr=lpr)

    def matvec_swiglu(self, wg: DeviceMatrix, wu: DeviceMatrix, x: Any, t: int, y: Any, norm: Any = None,
                      early: bool = False, act: str = "silu", post: Any = None) -> None:
        """y [t, rows] = silu(Wg x) * (Wu x), gate and up of one type and shape (one token: RMSNorm(x) * norm
        first when given; `early` and `post` as in matvec); act "gelu_tanh": gelu (the _geglu kernels) for
        silu."""
        glu = "geglu" if act == "gelu_tanh" else "swiglu"
        lpr = _lpr(wg.cols)
        if t == 1 and self.options.mv1_stream and mv1_stream_ok((wg, wu)):
            K.launch("matvec", f"mv1_stream_{qname(wg.qtype)}_{glu}", (mv1_stream_grid(wg.rows, self.gpu.n_sms),),
                     (32 * MV1_WARPS,), shared=mv1_smem(wg.qtype, wg.cols), wg=wg.ptr, wu=wu.ptr, N=wg.rows,
                     K=wg.cols, x=x, y=y, norm_w=norm, eps=self.cfg.rms_eps, early=early, post=post)
            return
        if t == 1:
            groups = mv1_groups(wg.rows, wg.cols, wg.qtype, self.gpu.n_sms)
            rows_per_block = MV1_WARPS * (32 // lpr) * groups
            K.launch("matvec", f"mv1_{qname(wg.qtype)}_{glu}", (K.cdiv(wg.rows, rows_per_block),), (32 * MV1_WARPS,),
                     shared=mv1_smem(wg.qtype, wg.cols), wg=wg.ptr, wu=wu.ptr, N=wg.rows, K=wg.cols, x=x, y=y,
                     norm_w=norm, eps=self.cfg.rms_eps, lpr=lpr, groups=groups, early=early, post=post)
            return
        if norm is not None or post is not None:
            raise BackendError("fused RMSNorm / post-norm need one token")
        rows_per_block = 4 * (32 // lpr)
        K.launch("matvec", f"matvec_{qname(wg.qtype)}_{glu}", (K.cdiv(wg.rows, rows_per_block),), (128,), wg=wg.ptr,
                 wu=wu.ptr, N=wg.rows, K=wg.cols, x=x, T=t, y=y, lpr=lpr)

    def bgemm_serves(self, t: int, mats: list[DeviceMatrix], rows_apart: bool) -> bool:
        """Whether gemm_weights multiplies these through bgemm: up to BG_NMAX rows, or any number of rows that
        are separate sequences (`rows_apart`: their sums must not depend on the batch), where bgemm_ok."""
        return (t <= BG_NMAX or rows_apart) and self.options.batch_gemm and bgemm_ok(mats)

    def gemm_weights(self, x16_ptr: int, t: int, mats: list[DeviceMatrix], y_ptr: int, ldy: int,
                     accumulate: bool = False, rows_apart: bool = False, rs: Any = None) -> None:
        """Y[t, :] (=, or +=) X16 [t, K] . [W0; W1; ...]^T, the rows of the matrices side by side in Y's
        columns: through bgemm where bgemm_serves (there each row's sums times rs [t] when given); otherwise F16
        weights multiplied where they lie, others dequantized into the fp16 scratch (up to DEQUANT_CHUNK values
        per GEMM; dequant_scratch must exist) and multiplied by cuBLAS (rs must be None)."""
        if self.bgemm_serves(t, mats, rows_apart):
            col0 = 0
            for m in mats:
                self.bgemm(x16_ptr, t, m, y_ptr + 4 * col0, ldy, accumulate, rs)
                col0 += m.rows
            return
        if rs is not None:
            raise BackendError("row scales on the GEMM's output need bgemm")
        dq = self.dq.data.ptr
        k = mats[0].cols
        cap = max(1, DEQUANT_CHUNK // k)
        col0, filled = 0, 0  # Y column of the scratch's first row; rows in the scratch

        def flush() -> None:
            nonlocal col0, filled
            if filled:
                self.gemm(x16_ptr, t, k, dq, filled, y_ptr, ldy, col0, accumulate)
                col0, filled = col0 + filled, 0

        for m in mats:
            if m.qtype == QT.F16 and m.row_bytes == 2 * k:
                flush()
                self.gemm(x16_ptr, t, k, m.ptr, m.rows, y_ptr, ldy, col0, accumulate)
                col0 += m.rows
                continue
            r = 0
            while r < m.rows:
                n = min(cap - filled, m.rows - r)
                units = n * K.cdiv(k, 32)
                K.launch("dequant", f"dequant_{qname(m.qtype)}", (min(K.cdiv(units, 256), 65535),), (256,),
                         w=m.ptr + r * m.row_bytes, N=n, K=k, out=dq + 2 * filled * k)
                filled, r = filled + n, r + n
                if filled == cap:
                    flush()
        flush()
