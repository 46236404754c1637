"""A row's integer dot products with int16 activations, and a weight block's dequantization, as numba intrinsics
written in LLVM's portable vector IR.

Why IR and not numba loops: a numba loop over a block's 16 or 32 values is unrolled whole before LLVM's vectorizers
see it, and what comes out is scalar code (a multiply or a conversion per value), with numba widening small
integers to int64 on the way. Written as whole vectors (load, widen, multiply, add in pairs, convert, scale), the
x86 backend picks the machine's instructions itself (vpmaddwd and vcvtdq2ps on AVX2 and AVX-512; pmaddwd on SSE2)
for the one source: fast wherever numba runs and correct everywhere (tests/backends/test_cpu_backend.py compares
the kernels with NumPy on every layout).

Why int16 activations and not llama.cpp's int8 (whose unsigned-by-signed byte dots, vpdpbusd, ran some 20% faster
here): with int8, the real SmolLM2's greedy replies left the NumPy reference's from their second or third token on
(its logits moved by up to 2.5 of 25); with int16 they are the reference's, 64 tokens of each of
tests/smollm2_greedy.json's five prompts, the logits within 0.01.

The intrinsics read and write 1-D C-contiguous arrays at the offsets given, without bounds checks: the callers
(kernels.py) index whole blocks of arrays whose shapes the backend made. A block's integer sums fit int32: 32
products of a byte (< 256) and an int16 (|x| <= 32767).

    row_dot_<layout>   sum_b scale_b * dot(block b, x's block b): a row's float32
    dequant_<layout>   one block: scale * q (+ min) into float32
(layouts u4, u5, s5, u8_32, u8_16, s8_32, s8_16: layouts.py's kinds and block sizes)
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


_F32 = ir.FloatType()


def _splat(builder, value, n: int):
    """<n x float> of `value`."""
    v = builder.insert_element(ir.Constant(_vec(_F32, n), None), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_vec(_F32, n), None), ir.Constant(_vec(_I32, n), [0] * n))


# A block's bytes and its values, per layout kind (layouts.py).
_BLOCK_BYTES = {"u4": 16, "u5": 20, "s5": 20}


def _values(context, builder, wt, wa, woff, n: int, kind: str):
    """Block `kind`'s n values at w[woff:] as <n x i32>: u4 two nibbles a byte (the low ones first); u5 those and a
    32-bit mask of fifth bits; s5 u5's less 16; u8 and s8 a byte each, unsigned and signed."""
    if kind in ("u4", "u5", "s5"):
        raw = _load(context, builder, wt, wa, woff, 16, _I8)
        lo = builder.and_(raw, ir.Constant(raw.type, [15] * 16))
        hi = builder.lshr(raw, ir.Constant(raw.type, [4] * 16))
        v = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))
        if kind != "u4":
            data = context.make_array(wt)(context, builder, wa).data
            mask = builder.load(builder.bitcast(builder.gep(data, [builder.add(woff, ir.Constant(woff.type, 16))]),
                                                _I32.as_pointer()), align=1)
            bits = builder.zext(builder.bitcast(mask, _vec(ir.IntType(1), 32)), _vec(_I8, 32))
            v = builder.or_(v, builder.shl(bits, ir.Constant(_vec(_I8, 32), [4] * 32)))
        v = builder.zext(v, _vec(_I32, n))
        return builder.sub(v, ir.Constant(v.type, [16] * n)) if kind == "s5" else v
    v = _load(context, builder, wt, wa, woff, n, _I8)
    return builder.sext(v, _vec(_I32, n)) if kind == "s8" else builder.zext(v, _vec(_I32, n))


def _row_dot_intrinsic(n: int, kind: str):
    """An intrinsic (w, w0, d, d0, s, s0, x, x0, nb) -> float32: sum over b < nb of d[d0 + b] * s[s0 + b] * (the
    integer dot of block b's n values of layout `kind` (_values) at w[w0 + b * bytes:] with the n int16 at
    x[x0 + b * n:]).

    Each block's products are summed in pairs (vpmaddwd's pattern) and then to eight int32 lanes, converted and
    multiplied by the block's scale into eight float32 lanes, which are summed once at the end of the row (a
    reduction to one number per block costs more than the block's dot)."""
    nbytes = _BLOCK_BYTES.get(kind, n)

    @intrinsic
    def row_dot(typingctx, w, w0, d, d0, s, s0, x, x0, nb):
        ints = (w0, d0, s0, x0, nb)
        if not (_array(w, types.int8 if kind == "s8" else types.uint8) and _array(d, types.float32)
                and _array(s, types.float32) and _array(x, types.int16)
                and all(isinstance(i, types.Integer) for i in ints)):
            return None

        def codegen(context, builder, signature, args):
            wa, w0v, da, d0v, sa, s0v, xa, x0v, nbv = args
            wt, w0t, dt, d0t, st, s0t, xt, x0t, nbt = signature.args
            w0v, d0v, s0v, x0v, nbv = (context.cast(builder, v, t, types.intp)
                                       for v, t in ((w0v, w0t), (d0v, d0t), (s0v, s0t), (x0v, x0t), (nbv, nbt)))
            dp = context.make_array(dt)(context, builder, da).data
            sp = context.make_array(st)(context, builder, sa).data
            acc = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 8), None))
            with cgutils.for_range(builder, nbv) as loop:
                b = loop.index
                woff = builder.add(w0v, builder.mul(b, ir.Constant(b.type, nbytes)))
                xoff = builder.add(x0v, builder.mul(b, ir.Constant(b.type, n)))
                wv = _values(context, builder, wt, wa, woff, n, kind)
                xv = _load(context, builder, xt, xa, xoff, n, _I16)
                p = builder.mul(wv, builder.sext(xv, _vec(_I32, n)))
                even = builder.shuffle_vector(p, p, ir.Constant(_vec(_I32, n // 2), list(range(0, n, 2))))
                odd = builder.shuffle_vector(p, p, ir.Constant(_vec(_I32, n // 2), list(range(1, n, 2))))
                pairs = builder.add(even, odd)
                if n == 32:  # 16 pair sums -> 8
                    pairs = builder.add(
                        builder.shuffle_vector(pairs, pairs, ir.Constant(_vec(_I32, 8), list(range(8)))),
                        builder.shuffle_vector(pairs, pairs, ir.Constant(_vec(_I32, 8), list(range(8, 16)))))
                scale = builder.fmul(builder.load(builder.gep(dp, [builder.add(d0v, b)])),
                                     builder.load(builder.gep(sp, [builder.add(s0v, b)])))
                term = builder.fmul(builder.sitofp(pairs, _vec(_F32, 8)), _splat(builder, scale, 8), flags=["contract"])
                builder.store(builder.fadd(builder.load(acc), term, flags=["contract", "reassoc"]), acc)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, _vec(_F32, 8)]),
                                                "llvm.vector.reduce.fadd.v8f32")
            total = builder.call(fn, [ir.Constant(_F32, 0.0), builder.load(acc)])
            total.flags = ["reassoc"]  # (the lanes in any order: a tree, not eight dependent adds)
            return total

        return types.float32(w, w0, d, d0, s, s0, x, x0, nb), codegen

    return row_dot


row_dot_u4 = _row_dot_intrinsic(32, "u4")
row_dot_u5 = _row_dot_intrinsic(32, "u5")
row_dot_s5 = _row_dot_intrinsic(32, "s5")
row_dot_u8_32 = _row_dot_intrinsic(32, "u8")
row_dot_u8_16 = _row_dot_intrinsic(16, "u8")
row_dot_s8_32 = _row_dot_intrinsic(32, "s8")
row_dot_s8_16 = _row_dot_intrinsic(16, "s8")


def _dequant_intrinsic(n: int, kind: str):
    """An intrinsic (w, wo, scale, low, out, oo) -> none: out[oo:oo+n] = scale * q (+ low, for the kinds with a min)
    for block `kind`'s n values at w[wo:] (_values), multiplied and then added in float32 as layouts.dequantize does
    (no fused multiply-add: the file's values exactly)."""
    with_min = kind in ("u4", "u5", "u8")

    @intrinsic
    def dequant(typingctx, w, wo, scale, low, out, oo):
        if not (_array(w, types.int8 if kind == "s8" else types.uint8) and _array(out, types.float32)
                and isinstance(wo, types.Integer) and isinstance(oo, types.Integer)
                and scale == types.float32 and low == types.float32):
            return None

        def codegen(context, builder, signature, args):
            wa, woff, sc, lo_, oa, ooff = args
            wt, wot, _, _, ot, oot = signature.args
            woff = context.cast(builder, woff, wot, types.intp)
            ooff = context.cast(builder, ooff, oot, types.intp)
            q = _values(context, builder, wt, wa, woff, n, kind)
            f = builder.fmul(builder.sitofp(q, _vec(_F32, n)), _splat(builder, sc, n))
            if with_min:
                f = builder.fadd(f, _splat(builder, lo_, n))
            data = context.make_array(ot)(context, builder, oa).data
            ptr = builder.bitcast(builder.gep(data, [ooff]), _vec(_F32, n).as_pointer())
            builder.store(f, ptr, align=4)
            return context.get_dummy_value()

        return types.none(w, wo, scale, low, out, oo), codegen

    return dequant


dequant_u4 = _dequant_intrinsic(32, "u4")
dequant_u5 = _dequant_intrinsic(32, "u5")
dequant_s5 = _dequant_intrinsic(32, "s5")
dequant_u8_32 = _dequant_intrinsic(32, "u8")
dequant_u8_16 = _dequant_intrinsic(16, "u8")
dequant_s8_32 = _dequant_intrinsic(32, "s8")
dequant_s8_16 = _dequant_intrinsic(16, "s8")
