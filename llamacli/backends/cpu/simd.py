"""The integer dot product of one weight block with one block of int8 activations, as numba intrinsics written in
LLVM's portable vector IR.

Why IR and not a numba loop: a numba loop over a block's 16 or 32 values is unrolled whole before LLVM's
vectorizers see it, and what comes out is scalar code (an imul per value) or, for the 4-bit blocks, nothing
better; numba also widens small integers to int64. Written as whole vectors (load <32 x i8>, widen, multiply,
llvm.vector.reduce.add), the x86 backend picks the machine's integer dot instructions itself: vpdpbusd
(AVX-512 VNNI / AVX-VNNI: unsigned weights, signed activations) or vpmaddwd (AVX2, SSE2) for the same IR, so
one source is fast wherever numba runs and correct everywhere (tests/backends/test_cpu_backend.py compares the
kernels with NumPy on every layout).

Each intrinsic reads `w[wo:]` and `x[xo:]` of 1-D C-contiguous arrays without bounds checks: the callers
(kernels.py) index whole blocks of arrays whose shapes the backend made.

    dot_u4(w, wo, x, xo)   16 bytes, low nibbles times x[xo:xo+16], high nibbles times x[xo+16:xo+32]
    dot_u8_32 / dot_u8_16  32 / 16 unsigned bytes times as many int8
    dot_s8_32 / dot_s8_16  32 / 16 signed bytes times as many int8
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I32 = ir.IntType(8), ir.IntType(32)


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _byte_array(t: types.Type) -> bool:
    return isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" and t.dtype in (types.uint8, types.int8)


def _load(context, builder, arr_type, arr, offset, n: int):
    """<n x i8> at arr[offset] (unaligned)."""
    data = context.make_array(arr_type)(context, builder, arr).data
    ptr = builder.bitcast(builder.gep(data, [offset]), _vec(_I8, n).as_pointer())
    return builder.load(ptr, align=1)


def _sum(builder, v):
    """llvm.vector.reduce.add of an <n x i32>."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [v.type]),
                                        f"llvm.vector.reduce.add.v{v.type.count}i32")
    return builder.call(fn, [v])


def _dot_intrinsic(n: int, unsigned: bool, nibbles: bool):
    """An intrinsic (w, wo, x, xo) -> int32: n weights at w[wo:] (n / 2 bytes when `nibbles`) times n int8 at x[xo:]."""

    @intrinsic
    def dot(typingctx, w, wo, x, xo):
        if not (_byte_array(w) and _byte_array(x) and x.dtype == types.int8
                and isinstance(wo, types.Integer) and isinstance(xo, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            wa, woff, xa, xoff = args
            wt, wot, xt, xot = signature.args
            woff = context.cast(builder, woff, wot, types.intp)
            xoff = context.cast(builder, xoff, xot, types.intp)
            xv = builder.sext(_load(context, builder, xt, xa, xoff, n), _vec(_I32, n))
            if nibbles:  # 16 bytes -> 32 values: the low nibbles, then the high ones
                b = _load(context, builder, wt, wa, woff, n // 2)
                lo = builder.and_(b, ir.Constant(b.type, [15] * (n // 2)))
                hi = builder.lshr(b, ir.Constant(b.type, [4] * (n // 2)))
                wv = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, n), list(range(n))))
            else:
                wv = _load(context, builder, wt, wa, woff, n)
            wv = builder.zext(wv, _vec(_I32, n)) if unsigned else builder.sext(wv, _vec(_I32, n))
            return _sum(builder, builder.mul(wv, xv))

        return types.int32(w, wo, x, xo), codegen

    return dot


dot_u4 = _dot_intrinsic(32, unsigned=True, nibbles=True)
dot_u8_32 = _dot_intrinsic(32, unsigned=True, nibbles=False)
dot_u8_16 = _dot_intrinsic(16, unsigned=True, nibbles=False)
dot_s8_32 = _dot_intrinsic(32, unsigned=False, nibbles=False)
dot_s8_16 = _dot_intrinsic(16, unsigned=False, nibbles=False)
