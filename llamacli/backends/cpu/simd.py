"""The integer dot product of one weight block with one block of int16 activations, as numba intrinsics written in
LLVM's portable vector IR.

Why IR and not a numba loop: a numba loop over a block's 16 or 32 values is unrolled whole before LLVM's
vectorizers see it, and what comes out is scalar code (a multiply per value; for the 4-bit blocks nothing
better either), with numba widening small integers to int64 on the way. Written as whole vectors (load, widen,
multiply, llvm.vector.reduce.add), the x86 backend picks the machine's integer dot instructions itself (vpmaddwd
on AVX2 and AVX-512, pmaddwd on SSE2) for the one source: fast wherever numba runs and correct everywhere
(tests/backends/test_cpu_backend.py compares the kernels with NumPy on every layout).

Why int16 activations and not llama.cpp's int8 (whose unsigned-by-signed byte dots, vpdpbusd, run some 20%
faster here): with int8, the real SmolLM2's greedy replies left the NumPy reference's from their second or third
token on (its logits moved by up to 2.5 of 25); with int16 they are the reference's, 64 tokens of each of
tests/smollm2_greedy.json's five prompts, the logits within 0.01.

Each intrinsic reads `w[wo:]` (bytes) and `x[xo:]` (int16) of 1-D C-contiguous arrays without bounds checks: the
callers (kernels.py) index whole blocks of arrays whose shapes the backend made. The sums fit int32: at most 32
products of a byte (< 256) and an int16 (|x| <= 32767).

    dot_u4(w, wo, x, xo)   16 bytes: low nibbles times x[xo:xo+16], high nibbles times x[xo+16:xo+32]
    dot_u8_32 / dot_u8_16  32 / 16 unsigned bytes times as many int16
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _array(t: types.Type, dtype: types.Type) -> bool:
    return isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" and t.dtype == dtype


def _load(context, builder, arr_type, arr, offset, n: int, elem: ir.Type):
    """<n x elem> at arr[offset] (unaligned)."""
    data = context.make_array(arr_type)(context, builder, arr).data
    ptr = builder.bitcast(builder.gep(data, [offset]), _vec(elem, n).as_pointer())
    return builder.load(ptr, align=1)


def _sum(builder, v):
    """llvm.vector.reduce.add of an <n x i32>."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [v.type]),
                                        f"llvm.vector.reduce.add.v{v.type.count}i32")
    return builder.call(fn, [v])


def _dot_intrinsic(n: int, nibbles: bool):
    """An intrinsic (w, wo, x, xo) -> int32: n unsigned weights at w[wo:] (n / 2 bytes of two nibbles when
    `nibbles`) times n int16 at x[xo:]."""

    @intrinsic
    def dot(typingctx, w, wo, x, xo):
        if not (_array(w, types.uint8) and _array(x, types.int16)
                and isinstance(wo, types.Integer) and isinstance(xo, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            wa, woff, xa, xoff = args
            wt, wot, xt, xot = signature.args
            woff = context.cast(builder, woff, wot, types.intp)
            xoff = context.cast(builder, xoff, xot, types.intp)
            xv = builder.sext(_load(context, builder, xt, xa, xoff, n, _I16), _vec(_I32, n))
            if nibbles:  # n / 2 bytes -> n values: the low nibbles, then the high ones
                b = _load(context, builder, wt, wa, woff, n // 2, _I8)
                lo = builder.and_(b, ir.Constant(b.type, [15] * (n // 2)))
                hi = builder.lshr(b, ir.Constant(b.type, [4] * (n // 2)))
                wv = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, n), list(range(n))))
            else:
                wv = _load(context, builder, wt, wa, woff, n, _I8)
            return _sum(builder, builder.mul(builder.zext(wv, _vec(_I32, n)), xv))

        return types.int32(w, wo, x, xo), codegen

    return dot


dot_u4 = _dot_intrinsic(32, nibbles=True)
dot_u8_32 = _dot_intrinsic(32, nibbles=False)
dot_u8_16 = _dot_intrinsic(16, nibbles=False)


_F32 = ir.FloatType()


def _dequant_intrinsic(n: int, nibbles: bool, biased: bool, with_min: bool):
    """An intrinsic (w, wo, scale, low, out, oo) -> none: out[oo:oo+n] = scale * q (+ low) for the n values at w[wo:]
    (n / 2 bytes of two nibbles when `nibbles`; bytes q + 128 when `biased`), multiplied and then added in float32
    as layouts.dequantize does (no fused multiply-add: the file's values exactly)."""

    @intrinsic
    def dequant(typingctx, w, wo, scale, low, out, oo):
        if not (_array(w, types.uint8) and _array(out, types.float32) and isinstance(wo, types.Integer)
                and isinstance(oo, types.Integer) and scale == types.float32 and low == types.float32):
            return None

        def codegen(context, builder, signature, args):
            wa, woff, sc, lo_, oa, ooff = args
            wt, wot, _, _, ot, oot = signature.args
            woff = context.cast(builder, woff, wot, types.intp)
            ooff = context.cast(builder, ooff, oot, types.intp)
            if nibbles:
                b = _load(context, builder, wt, wa, woff, n // 2, _I8)
                lo = builder.and_(b, ir.Constant(b.type, [15] * (n // 2)))
                hi = builder.lshr(b, ir.Constant(b.type, [4] * (n // 2)))
                q = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, n), list(range(n))))
            else:
                q = _load(context, builder, wt, wa, woff, n, _I8)
            q = builder.zext(q, _vec(_I32, n))
            if biased:
                q = builder.sub(q, ir.Constant(q.type, [128] * n))
            f = builder.sitofp(q, _vec(_F32, n))
            splat = ir.Constant(_vec(_I32, n), [0] * n)
            sv = builder.shuffle_vector(builder.insert_element(ir.Constant(_vec(_F32, n), None), sc,
                                                               ir.Constant(_I32, 0)), ir.Constant(_vec(_F32, n), None), splat)
            f = builder.fmul(f, sv)
            if with_min:
                lv = builder.shuffle_vector(builder.insert_element(ir.Constant(_vec(_F32, n), None), lo_,
                                                                   ir.Constant(_I32, 0)), ir.Constant(_vec(_F32, n), None), splat)
                f = builder.fadd(f, lv)
            data = context.make_array(ot)(context, builder, oa).data
            ptr = builder.bitcast(builder.gep(data, [ooff]), _vec(_F32, n).as_pointer())
            builder.store(f, ptr, align=4)
            return context.get_dummy_value()

        return types.none(w, wo, scale, low, out, oo), codegen

    return dequant


dequant_u4 = _dequant_intrinsic(32, nibbles=True, biased=False, with_min=True)
dequant_u8_32 = _dequant_intrinsic(32, nibbles=False, biased=False, with_min=True)
dequant_u8_16 = _dequant_intrinsic(16, nibbles=False, biased=False, with_min=True)
dequant_s8_32 = _dequant_intrinsic(32, nibbles=False, biased=True, with_min=False)
dequant_s8_16 = _dequant_intrinsic(16, nibbles=False, biased=True, with_min=False)
