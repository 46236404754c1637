"""The CPU backend's kernels, compiled by numba (cached on disk after the first run): the matrix products on
re-packed weights (layouts.py), and the operations whose NumPy forms cost more in calls than in arithmetic on a
decode step of one token (RMSNorm, RoPE, GeGLU, the residual add, attention over the cache).

Matrix products (llama.cpp's CPU scheme, with int16 activations where it uses int8: simd.py says why): x [T, K]
is quantized per 32 values to int16 with one float32 scale each (xd = amax / 32767, q = rint(x * 32767 / amax)),
and each weight block's integer dot with them (simd.py) is scaled by both scales:

    y[t, n] = sum_b d[n, b] xd[t, b] dot(q_w[n, b], q_x[t, b])  (+ m[n, b] sum(x[t, b]) for layouts with a min)

The min's term uses the exact float32 sum of x over the block. Rows of W are split across the threads
(numba's prange; `numba.set_num_threads` as -t says). A block whose x holds a NaN or an infinity gets xd = NaN,
so that the output is NaN as the float32 product's would not be finite either (sampling reports it).

Float-reduction loops take fastmath's reassociation and contraction only: never 'nnan'/'ninf', under which LLVM
would drop the checks above. The dequantizing kernels take none, so that scale * q + min rounds as layouts.py's
reference (and gguf.quants) does.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from .simd import (
    dequant_s5,
    dequant_s8_16,
    dequant_s8_32,
    dequant_u4,
    dequant_u5,
    dequant_u8_16,
    dequant_u8_32,
    row_dot_s5,
    row_dot_s8_16,
    row_dot_s8_32,
    row_dot_u4,
    row_dot_u5,
    row_dot_u8_16,
    row_dot_u8_32,
)

FAST = {"reassoc", "contract", "nsz", "arcp"}


def jit(**options):
    """numba.njit with its on-disk cache where numba finds a writable place for it (beside this file, else the
    user's cache directory); where it finds none (a read-only install and home), compiled anew in each process
    rather than refused (numba raises at decoration then)."""

    def wrap(fn):
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:
            return njit(**options)(fn)

    return wrap

QMAX = 32767  # int16 activations: q = rint(x * QMAX / amax) per 32 values


@jit(parallel=True)
def _touch(out):
    for i in prange(out.shape[0]):
        out[i] = i


def threading_layer() -> str:
    """numba's threading layer ("omp", "tbb" or "workqueue"), started by a first parallel kernel if need be."""
    try:
        return numba.threading_layer()
    except ValueError:  # none started yet
        _touch(np.zeros(2))
        return numba.threading_layer()


# -- activations to int16 ------------------------------------------------------------------------------------


@jit(fastmath=FAST)
def quantize(x, xq, xd, xs):
    """x [T, K] float32 (K a multiple of 32) -> xq int16 [T * K] (row t at t * K), xd [T, K / 32] the scales, and
    the float32 sums of x per 16 values xs [T, K / 16]."""
    t_n, k = x.shape
    for t in range(t_n):
        for b in range(k // 32):
            amax = np.float32(0.0)
            finite = True
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            for j in range(32):
                v = x[t, 32 * b + j]
                a = abs(v)
                if not a <= np.float32(3.4028235e38):  # NaN or inf
                    finite = False
                elif a > amax:
                    amax = a
                if j < 16:
                    s0 += v
                else:
                    s1 += v
            xs[t, 2 * b] = s0
            xs[t, 2 * b + 1] = s1
            base = t * k + 32 * b
            if not finite:
                xd[t, b] = np.float32(np.nan)
                for j in range(32):
                    xq[base + j] = 0
                continue
            inv = np.float32(QMAX) / amax if amax > 0 else np.float32(0.0)
            xd[t, b] = amax / np.float32(QMAX)
            for j in range(32):
                xq[base + j] = np.int16(np.rint(x[t, 32 * b + j] * inv))


# -- y = x W^T on the re-packed layouts ----------------------------------------------------------------------


# The layouts (layouts.py kind and block) as the kernel's `layout` argument.
LAYOUTS = {("u4", 32): 0, ("u8", 32): 1, ("u8", 16): 2, ("s8", 32): 3, ("s8", 16): 4, ("u5", 32): 5, ("s5", 32): 6}
_BLOCKS = {0: (32, 16), 1: (32, 32), 2: (16, 16), 3: (32, 32), 4: (16, 16), 5: (32, 20), 6: (32, 20)}  # values, bytes
_WITH_MIN = (0, 1, 2, 5)



@jit(inline="always")
def _row_dot(layout, wq, w0, d, d0, xd, x0d, xq, x0, nb):
    """sum_b d[d0 + b] xd[x0d + b] dot(weight block b, x's block b) over a row (simd.py) for `layout` (a constant
    where it is called)."""
    if layout == 0:
        return row_dot_u4(wq, w0, d, d0, xd, x0d, xq, x0, nb)
    if layout == 1:
        return row_dot_u8_32(wq, w0, d, d0, xd, x0d, xq, x0, nb)
    if layout == 2:
        return row_dot_u8_16(wq, w0, d, d0, xd, x0d, xq, x0, nb)
    if layout == 3:
        return row_dot_s8_32(wq, w0, d, d0, xd, x0d, xq, x0, nb)
    if layout == 4:
        return row_dot_s8_16(wq, w0, d, d0, xd, x0d, xq, x0, nb)
    if layout == 5:
        return row_dot_u5(wq, w0, d, d0, xd, x0d, xq, x0, nb)
    return row_dot_s5(wq, w0, d, d0, xd, x0d, xq, x0, nb)


def _linear(layout: int):
    """The product kernel of one layout (LAYOUTS): (x [T, K] float32, wq flat, d [N, nb], m [N, nb] (unread without
    a min: any float32 array of that shape), out [T, N]). x is quantized first (one thread; microseconds a token),
    then the weight rows go to the threads, each running every token of x against its rows. The closure holds
    the layout's number only (numba freezes it into the code, and its cache keys on it: a closure over an
    intrinsic was compiled anew in every process)."""
    block, block_bytes = _BLOCKS[layout]
    has_min = layout in _WITH_MIN

    @jit(parallel=True, fastmath=FAST)
    def linear(x, wq, d, m, out):
        t_n, n_rows = out.shape
        nb = d.shape[1]
        k = nb * block
        xq = np.empty(t_n * k, np.int16)
        xd = np.empty((t_n, k // 32), np.float32)
        xs16 = np.empty((t_n, k // 16), np.float32)
        quantize(x, xq, xd, xs16)
        # per weight block: x's scale and its float sum (the min's term)
        xdb = np.empty(t_n * nb, np.float32)
        xsb = np.empty((t_n, nb), np.float32)
        for t in range(t_n):
            for b in range(nb):
                xdb[t * nb + b] = xd[t, (b * block) >> 5]
                xsb[t, b] = xs16[t, 2 * b] + xs16[t, 2 * b + 1] if block == 32 else xs16[t, b]
        df = d.reshape(-1)
        row_bytes = nb * block_bytes
        for n in prange(n_rows):
            for t in range(t_n):
                acc = _row_dot(layout, wq, n * row_bytes, df, n * nb, xdb, t * nb, xq, t * k, nb)
                if has_min:  # + sum_b m_b sum(x_b)
                    for b in range(nb):
                        acc += m[n, b] * xsb[t, b]
                out[t, n] = acc

    return linear


LINEAR = {key: _linear(layout) for key, layout in LAYOUTS.items()}


# -- dequantizing (prefill's large products, the embedding's rows) -------------------------------------------


@jit(inline="always")
def _dequant(layout, wq, wo, scale, low, out, oo):
    """One weight block's values, scale * q (+ low), into out[oo:] (simd.py) for `layout` (a constant where called)."""
    if layout == 0:
        dequant_u4(wq, wo, scale, low, out, oo)
    elif layout == 1:
        dequant_u8_32(wq, wo, scale, low, out, oo)
    elif layout == 2:
        dequant_u8_16(wq, wo, scale, low, out, oo)
    elif layout == 3:
        dequant_s8_32(wq, wo, scale, low, out, oo)
    elif layout == 4:
        dequant_s8_16(wq, wo, scale, low, out, oo)
    elif layout == 5:
        dequant_u5(wq, wo, scale, low, out, oo)
    else:
        dequant_s5(wq, wo, scale, low, out, oo)


def _dequantize(layout: int):
    """The dequantizing kernel of one layout: (wq flat, d [N, nb], m [N, nb] (unread without a min), rows [R] int64,
    out [R * K] float32): out's row i = row rows[i] of the matrix, the file's values (layouts.dequantize). On the
    calling thread alone: a long product's BLAS call follows it, and numba's OpenMP threads, spinning after a
    parallel dequantization, took the CPUs from BLAS's (SmolLM2's pp64 at -t 2 ran at 60% of the NumPy
    backend's)."""
    block, block_bytes = _BLOCKS[layout]
    has_min = layout in _WITH_MIN

    @jit()
    def dequantize(wq, d, m, rows, out):
        nb = d.shape[1]
        k = nb * block
        for i in range(rows.shape[0]):
            n = rows[i]
            for b in range(nb):
                low = m[n, b] if has_min else np.float32(0.0)
                _dequant(layout, wq, (n * nb + b) * block_bytes, d[n, b], low, out, i * k + b * block)

    return dequantize


DEQUANTIZE = {key: _dequantize(layout) for key, layout in LAYOUTS.items()}


# -- the small operations of a decode step -------------------------------------------------------------------


@jit()
def rms_norm(x, w, eps, out):
    """x [R, D] -> x / sqrt(mean(x^2) + eps) (in float64, then float32) * w, as the NumPy reference."""
    r_n, dim = x.shape
    for r in range(r_n):
        ss = 0.0
        for i in range(dim):
            v = np.float64(x[r, i])
            ss += v * v
        scale = math.sqrt(ss / dim + eps)
        for i in range(dim):
            out[r, i] = np.float32(np.float64(x[r, i]) / scale) * w[i]


@jit()
def rope(x, cos, sin, neox, rot, out):
    """x [T, H, Dh] rotated by cos, sin [T, rot / 2] in its first `rot` values per head -> out (the rest copied):
    pairs (i, i + rot / 2) when `neox`, else (2i, 2i + 1); float32 as the NumPy reference."""
    t_n, h_n, dh = x.shape
    half = rot // 2
    for t in range(t_n):
        for h in range(h_n):
            for i in range(rot, dh):
                out[t, h, i] = x[t, h, i]
            for i in range(half):
                c, s = cos[t, i], sin[t, i]
                ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a, b = x[t, h, ia], x[t, h, ib]
                out[t, h, ia] = a * c - b * s
                out[t, h, ib] = a * s + b * c


@jit()
def add(x, y, out):
    """x + y, elementwise (float32 arrays of one shape)."""
    a, b, o = x.reshape(-1), y.reshape(-1), out.reshape(-1)
    for i in range(a.shape[0]):
        o[i] = a[i] + b[i]


@jit()
def geglu(gate, up, out):
    """gelu_tanh(gate) * up in float64, then float32 (the NumPy reference's)."""
    g, u, o = gate.reshape(-1), up.reshape(-1), out.reshape(-1)
    c = math.sqrt(2.0 / math.pi)
    for i in range(g.shape[0]):
        v = np.float64(g[i])
        o[i] = np.float32(0.5 * v * (1.0 + math.tanh(c * (v + 0.044715 * v * v * v))) * u[i])


def _attend_one(q, kc, vc, lo, n, scale, softcap, sinks, out):
    """One query's attention over a layer's cache: q [Hkv, G, Dh] over the n positions lo .. lo + n - 1 of kc, vc
    [rows, Hkv, Dh] (row = position mod rows) -> out [Hkv, G, Dh]: softmax(q k * scale, soft-capped when
    softcap > 0, with the head's sink logit in the denominator when sinks has one per head [Hkv, G]) @ v. The G
    query heads of a KV head go together (each cache row read once for them), KV heads across the threads."""
    hkv, g_n, dh = q.shape
    rows = kc.shape[0]
    first = lo % rows
    for h in prange(hkv):
        scores = np.empty((g_n, n), np.float32)
        top = np.full(g_n, -np.inf, np.float32)
        r = first
        for s in range(n):
            for g in range(g_n):
                acc = np.float32(0.0)
                for i in range(dh):
                    acc += q[h, g, i] * kc[r, h, i]
                v = acc * scale
                if softcap > 0:
                    v = np.float32(softcap * np.tanh(v / softcap))
                scores[g, s] = v
                if v > top[g]:
                    top[g] = v
            r += 1
            if r == rows:
                r = 0
        total = np.zeros(g_n, np.float32)
        for g in range(g_n):
            if sinks.shape[0]:
                top[g] = max(top[g], sinks[h, g])
            for s in range(n):
                e = np.exp(scores[g, s] - top[g])
                scores[g, s] = e
                total[g] += e
            if sinks.shape[0]:
                total[g] += np.exp(sinks[h, g] - top[g])
            for i in range(dh):
                out[h, g, i] = 0.0
        r = first
        for s in range(n):
            for g in range(g_n):
                p = scores[g, s] / total[g]
                for i in range(dh):
                    out[h, g, i] += p * vc[r, h, i]
            r += 1
            if r == rows:
                r = 0


attend_one = jit(fastmath=FAST)(_attend_one)
attend_one_threads = jit(parallel=True, fastmath=FAST)(_attend_one)
