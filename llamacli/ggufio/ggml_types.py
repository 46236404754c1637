"""The numbers a GGUF file is written in: ggml's tensor types with their block sizes, and GGUF's metadata value
types. The same tables as the `gguf` package's (gguf/constants.py, from ggml.h and ggml-common.h).

Why our own copy: importing anything from `gguf` runs its package's __init__, which loads all of its
constants (every architecture's tensor names), its writer, its vocabulary module (sentencepiece) and its
metadata module (yaml): the largest import on the way to a model's first token after NumPy and CuPy, for
three small tables. With this module, opening a file, checking its tensors and running it on CUDA import no
`gguf`; dequantizing on the host (ggufio/quants.py: the NumPy backend) and writing test files still use it.
tests/ggufio/test_ggml_types.py keeps these tables equal to the installed package's.

The members are IntEnums, so they compare and hash as their numbers: a dict keyed by these members answers a
lookup with gguf's members of the same number, and the other way round.
"""

from __future__ import annotations

from enum import IntEnum

QK_K = 256  # the values of a K-quant super-block (ggml-common.h)


class GGMLQuantizationType(IntEnum):
    """ggml_type: how a tensor's values are stored."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_T = GGMLQuantizationType

# type -> (values per block, bytes per block)
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    _T.F32: (1, 4),
    _T.F16: (1, 2),
    _T.Q4_0: (32, 2 + 16),
    _T.Q4_1: (32, 2 + 2 + 16),
    _T.Q5_0: (32, 2 + 4 + 16),
    _T.Q5_1: (32, 2 + 2 + 4 + 16),
    _T.Q8_0: (32, 2 + 32),
    _T.Q8_1: (32, 4 + 4 + 32),
    _T.Q2_K: (256, 2 + 2 + QK_K // 16 + QK_K // 4),
    _T.Q3_K: (256, 2 + QK_K // 4 + QK_K // 8 + 12),
    _T.Q4_K: (256, 2 + 2 + QK_K // 2 + 12),
    _T.Q5_K: (256, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    _T.Q6_K: (256, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    _T.Q8_K: (256, 4 + QK_K + QK_K // 8),
    _T.IQ2_XXS: (256, 2 + QK_K // 4),
    _T.IQ2_XS: (256, 2 + QK_K // 4 + QK_K // 32),
    _T.IQ3_XXS: (256, 2 + QK_K // 4 + QK_K // 8),
    _T.IQ1_S: (256, 2 + QK_K // 8 + QK_K // 16),
    _T.IQ4_NL: (32, 2 + 16),
    _T.IQ3_S: (256, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    _T.IQ2_S: (256, 2 + QK_K // 4 + QK_K // 16),
    _T.IQ4_XS: (256, 2 + 2 + QK_K // 2 + QK_K // 64),
    _T.I8: (1, 1),
    _T.I16: (1, 2),
    _T.I32: (1, 4),
    _T.I64: (1, 8),
    _T.F64: (1, 8),
    _T.IQ1_M: (256, QK_K // 8 + QK_K // 16 + QK_K // 32),
    _T.BF16: (1, 2),
    _T.TQ1_0: (256, 2 + 4 * 13),
    _T.TQ2_0: (256, 2 + 64),
    _T.MXFP4: (32, 1 + 16),
    _T.NVFP4: (64, 4 + 32),
    _T.Q1_0: (128, 2 + 16),
}


class GGUFValueType(IntEnum):
    """The type of a metadata value (gguf.md)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12
