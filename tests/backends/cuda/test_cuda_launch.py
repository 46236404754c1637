"""The driver-API launch path of the decode step's programmatic dependent launches (cuda/loader.py): struct
layouts as cuda.h defines them and the kernel-parameter array, checked without a GPU; and mv1's shared-memory
size per weight type against the kernel source. (That the launches
work and give the plain launches' results is tests/backends/cuda/test_gpu_backend.py's programmatic-launch test.)"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from llamacli.backends.cuda import constants, loader as K


def test_launch_structs_match_cuda_h() -> None:
    A, C = K.LaunchAttribute, K.LaunchConfig
    # CUlaunchAttribute: CUlaunchAttributeID id; char pad[8 - sizeof(id)]; CUlaunchAttributeValue value (64)
    assert ctypes.sizeof(A) == 72 and A.value.offset == 8
    # CUlaunchConfig: gridDim{X,Y,Z}, blockDim{X,Y,Z}, sharedMemBytes, hStream, attrs, numAttrs
    assert [C.grid.offset, C.block.offset, C.shared.offset, C.stream.offset, C.attrs.offset, C.n_attrs.offset] == [
        0, 12, 24, 32, 40, 48]
    assert ctypes.sizeof(C) == 56


def test_kernel_params_point_at_each_value() -> None:
    args = (np.uint64(0xDEADBEEF00), np.int32(-3), np.float32(1.5), np.int64(1 << 40), np.uint64(0), np.float64(0.25))
    params, values = K.kernel_params(args)
    assert len(params) == len(args) == len(values)
    got = [ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64))[0],
           ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int32))[0],
           ctypes.cast(params[2], ctypes.POINTER(ctypes.c_float))[0],
           ctypes.cast(params[3], ctypes.POINTER(ctypes.c_int64))[0],
           ctypes.cast(params[4], ctypes.POINTER(ctypes.c_uint64))[0],
           ctypes.cast(params[5], ctypes.POINTER(ctypes.c_double))[0]]
    assert got == [0xDEADBEEF00, -3, 1.5, 1 << 40, 0, 0.25]


@pytest.mark.parametrize("bad", [3, 2.0, None, np.zeros(2)])
def test_kernel_params_refuse_untyped_arguments(bad) -> None:
    with pytest.raises(TypeError, match="pointers and scalars"):
        K.kernel_params((np.int32(1), bad))


def test_dependent_launches_off_without_a_gpu(monkeypatch) -> None:
    monkeypatch.setattr(K, "pdl_supported", lambda: False)
    with K.dependent_launches():
        assert not K.pdl_active()
    assert not K.pdl_active()


def test_launch_dependent_hands_the_driver_config_attribute_and_params(monkeypatch) -> None:
    """launch_dependent end to end against a stand-in for cuLaunchKernelEx (a ctypes callback with its
    signature) and for CuPy's current stream."""
    import sys
    import types

    seen = {}
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(K.LaunchConfig), ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)

    def fake_launch(cfg, f, params, extra):
        if "status" in seen:  # the failing call below
            return seen["status"]
        c = cfg.contents
        a = c.attrs.contents
        seen.update(grid=list(c.grid), block=list(c.block), shared=c.shared, stream=c.stream, f=f,
                    attr=(a.id, a.value[0], c.n_attrs),
                    p=(ctypes.cast(params[0], ctypes.POINTER(ctypes.c_uint64))[0],
                       ctypes.cast(params[1], ctypes.POINTER(ctypes.c_float))[0]))
        return 0

    launch = proto(fake_launch)
    attr = K.LaunchAttribute()
    attr.id, attr.value[0] = 6, 1
    monkeypatch.setattr(K, "cu_launch_kernel_ex", lambda: (launch, attr))
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0x1234))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    fn = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=0xABC))
    K.launch_dependent(fn, (7, 2), (256,), (np.uint64(99), np.float32(2.5)), 4096)
    assert seen == {"grid": [7, 2, 1], "block": [256, 1, 1], "shared": 4096, "stream": 0x1234, "f": 0xABC,
                    "attr": (6, 1, 1), "p": (99, 2.5)}
    seen["status"] = 1  # CUDA_ERROR_INVALID_VALUE
    from llamacli.errors import BackendError

    with pytest.raises(BackendError, match="CUresult 1"):
        K.launch_dependent(fn, (1,), (32,), (np.int32(0),), 0)


def test_tensor_map_2d_hands_the_driver_the_matrix_and_box(monkeypatch) -> None:
    """tensor_map_2d against a stand-in for cuTensorMapEncodeTiled (a ctypes callback with its signature):
    fp16, rank 2, dims innermost first, the row stride in bytes, the box, the 128-byte swizzle, zeros past the
    end; the result is a one-element 128-byte array (CuPy passes it by value) holding what the driver wrote
    at a 64-byte aligned address; a failing status or an unaligned matrix raises BackendError."""
    from llamacli.errors import BackendError

    seen = {}
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                             u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)

    def fake_encode(out, dtype, rank, address, dims, strides, box, elem, interleave, swizzle, l2, oob):
        seen.update(aligned=out % 64 == 0, dtype=dtype, rank=rank, address=address, dims=(dims[0], dims[1]),
                    strides=strides[0], box=(box[0], box[1]), elem=(elem[0], elem[1]), interleave=interleave,
                    swizzle=swizzle, oob=oob)
        ctypes.memmove(out, bytes(range(128)), 128)
        return seen.get("status", 0)

    encode = proto(fake_encode)
    monkeypatch.setattr(K, "cu_tensor_map_encoder", lambda: encode)
    K.tensor_map_2d.cache_clear()
    m = K.tensor_map_2d(0x7F0000001000, 700, 3 * 64, 64, 64)
    assert m.dtype == K.TENSOR_MAP and m.size == 1 and m.tobytes() == bytes(range(128))
    assert seen == {"aligned": True, "dtype": 6, "rank": 2, "address": 0x7F0000001000, "dims": (192, 700),
                    "strides": 384, "box": (64, 64), "elem": (1, 1), "interleave": 0, "swizzle": 3, "oob": 0}
    assert K.tensor_map_2d(0x7F0000001000, 700, 3 * 64, 64, 64) is m  # cached
    seen.clear()
    seen["status"] = 1
    K.tensor_map_2d.cache_clear()
    with pytest.raises(BackendError, match="CUresult 1"):
        K.tensor_map_2d(0x7F0000001000, 700, 192, 64, 64)
    for bad in ((0x7F0000001008, 700, 192, 64, 64), (0x7F0000001000, 700, 196, 64, 64),
                (0x7F0000001000, 700, 192, 64, 128)):
        with pytest.raises(BackendError, match="no TMA descriptor"):
            K.tensor_map_2d(*bad)
    K.tensor_map_2d.cache_clear()


def test_merge_rows_joins_back_to_back_matrices_of_one_layout() -> None:
    """The prefill merges Q/K/V (gate/up) lying back to back in the arena into one GEMM; nbytes is what the
    decode step's launch plan sizes each matvec by."""
    from gguf import GGMLQuantizationType as QT

    from llamacli.backends.cuda.linear import DeviceMatrix, merge_rows

    a = DeviceMatrix(1000, 4, 64, QT.Q8_0, 68)
    assert a.nbytes == 272
    b = DeviceMatrix(1000 + a.nbytes, 2, 64, QT.Q8_0, 68)
    gap = DeviceMatrix(b.ptr + b.nbytes + 256, 2, 64, QT.Q8_0, 68)
    other = DeviceMatrix(gap.ptr + gap.nbytes, 3, 64, QT.F16, 128)
    assert merge_rows([a, b, gap, other]) == [DeviceMatrix(1000, 6, 64, QT.Q8_0, 68), gap, other]


def test_mv1_int8_activation_types_match_the_kernel_source() -> None:
    """cuda/linear.py sizes mv1's shared memory by MV1_ACT8 (int8 x, 40 bytes a unit; float x, 132): it must list
    exactly the types kernels/matvec.cu stages as int8 (its act8<> specialisations)."""
    import re
    from pathlib import Path

    from llamacli.backends.cuda.linear import MV1_ACT8, mv1_smem

    src = (Path(__file__).resolve().parents[3] / "kernels" / "matvec.cu").read_text()
    in_source = set(re.findall(r"template <> struct act8<Q(\w+)> \{ static constexpr bool value = true; \};", src))
    assert in_source and in_source == {t.name for t in MV1_ACT8}
    assert mv1_smem(QT.Q4_K, 4096) == 128 * 40 and mv1_smem(QT.Q8_0, 4096) == 128 * 132
    assert mv1_smem(QT.F16, 33) == 2 * 132


def test_mv1_kernel_names_mixed_qkv_launches() -> None:
    """One type: mv1_<t>; Q/K of one int8-activation type with V of another (Q4_K_M's Q6_K V layers): one
    mixed launch, a kernel the source defines for every such pair; any other mix has no single kernel."""
    import itertools
    import re
    from pathlib import Path

    from llamacli.backends.cuda.linear import MV1_ACT8, MV1_MIXED, DeviceMatrix, mv1_kernel, qname

    def m(t: QT) -> DeviceMatrix:
        return DeviceMatrix(0, 32, 256, t, 0)

    src = (Path(__file__).resolve().parents[3] / "kernels" / "matvec.cu").read_text()
    defined = set(re.findall(r"^MV1_MIXED\((\w+), \w+, (\w+), \w+\)$", src, re.M))
    assert mv1_kernel((m(QT.Q8_0), m(QT.Q8_0), m(QT.Q8_0))) == "mv1_q8_0"
    assert mv1_kernel((m(QT.Q4_K),)) == "mv1_q4_k"
    assert MV1_MIXED <= MV1_ACT8
    for a, b in itertools.permutations(sorted(MV1_MIXED), 2):
        assert mv1_kernel((m(a), m(a), m(b))) == f"mv1_mixed_{qname(a)}_{qname(b)}"
        assert (qname(a), qname(b)) in defined
    assert len(defined) == 6
    assert mv1_kernel((m(QT.Q4_K), m(QT.Q4_K), m(QT.MXFP4))) is None  # MXFP4 dots int8 x, but pairs with none
    for ws in [(m(QT.Q4_K), m(QT.Q6_K), m(QT.Q6_K)), (m(QT.Q4_K), m(QT.Q4_K), m(QT.Q8_0)),
               (m(QT.Q4_0), m(QT.Q4_0), m(QT.Q6_K)), (m(QT.Q4_K), m(QT.Q6_K))]:
        assert mv1_kernel(ws) is None, ws


def test_mv1_groups_keep_int8_launches_to_one_wave() -> None:
    """An int8-activation matrix whose one-group blocks (8 rows each at 4096 columns) would overflow one wave
    (4 blocks per SM) takes two row groups per block; other types, or enough SMs, keep one."""
    from pathlib import Path

    from llamacli.backends.cuda.linear import MV1_ACT8_BLOCKS_PER_SM, mv1_groups

    src = (Path(__file__).resolve().parents[3] / "kernels" / "matvec.cu").read_text()
    assert MV1_ACT8_BLOCKS_PER_SM == constants.MV1_MINB8 and "act8<Q>::value ? MV1_MINB8 : 0" in src
    assert mv1_groups(6144, 4096, QT.Q4_K, 132) == 2  # Llama-3-8B's QKV: 768 blocks > 528
    assert mv1_groups(6144, 4096, QT.Q4_K, 200) == 1
    assert mv1_groups(6144, 4096, QT.Q8_0, 132) == 1
    assert mv1_groups(4096, 4096, QT.Q6_K, 132) == 1  # 512 blocks: one wave
    assert mv1_groups(14336, 4096, QT.Q4_K, 132) == 4  # the rules before it still decide first
    assert mv1_groups(128256, 2048, QT.Q6_K, 132) == 8 and mv1_groups(128256, 2048, QT.Q8_0, 132) == 4


def test_tensor_core_attention_rows_per_block_match_the_kernel_source() -> None:
    """ATT_TC_ROWS sizes attention_tc*'s grid: TC_BR = 16 rows x TC_WARPS warps per block, and
    tc_smem its shared memory: TC_STAGES(D) x (K + V) tiles of TC_BC keys, as kernels/attention_mma.cu defines them
    (a grid too small would leave query rows unwritten; too little shared memory, tiles overwritten)."""
    import re
    from pathlib import Path

    from llamacli.backends.cuda.attention import ATT_TC_DIMS, ATT_TC_ROWS, tc_smem

    src = (Path(__file__).resolve().parents[3] / "kernels" / "attention_mma.cu").read_text()
    warps = constants.TC_WARPS
    assert re.search(r"^#define TC_BR \(TC_WARPS \* 16\)", src, re.M)
    assert ATT_TC_ROWS == 16 * warps
    assert re.search(r"constexpr bool QSM = D > 128;", src)  # past 128: the warps' Q rows in shared memory too
    assert "constexpr int NST = TC_STAGES(D);" in src and "TC_BC" in src
    for dh in ATT_TC_DIMS:
        stages = 3 if dh <= 64 else 2  # (constants.TC_STAGES)
        q_rows = warps * 16 * (dh + 8) * 2 if dh > 128 else 0
        assert tc_smem(dh) == stages * 2 * 64 * (dh + 8) * 2 + 16 + q_rows, dh
    assert tc_smem(256) <= 227 * 1024  # one block fits an H100 SM's shared memory


def test_hopper_attention_shared_memory_matches_the_kernel_source() -> None:
    """wg_smem sizes attention_wg*'s shared memory: 1024 (alignment) + WG_STAGES(D) x (K + V) tiles of WG_BC
    keys + WG_ONES(D) (ones) + 8 (one int, padded) + an 8-byte mbarrier per stage, as
    kernels/attention_wgmma.cu defines them; its kernels exist for ATT_WG_DIMS."""
    import re
    from pathlib import Path

    from llamacli.backends.cuda.attention import ATT_WG_DIMS, wg_smem

    src = (Path(__file__).resolve().parents[3] / "kernels" / "attention_wgmma.cu").read_text()
    assert set(ATT_WG_DIMS) == {int(d) for d in re.findall(r"^ATTENTION_WG_KERNEL\((\d+)\)$", src, re.M)}
    assert "constexpr int NST = WG_STAGES(D);" in src and "WG_ONES(D)" in src
    for dh in ATT_WG_DIMS:
        stages, ones = constants.WG_STAGES(dh), constants.WG_ONES(dh)
        assert wg_smem(dh) == 1024 + stages * 2 * constants.WG_BC * dh * 2 + ones + 8 + 8 * stages, dh


def test_mv1_tile_takes_short_q8_0_rows_and_fits_a_block() -> None:
    """mv1_tile serves one packed, 16-byte aligned Q8_0 segment of 32768+ rows of at most MV1T_MAX_COLS
    columns whose shared memory fits the device's per-block limit; its constants are the kernel's, its tiles
    whole multiples of 8 rows (16-byte aligned), its grid a block per SM at most."""
    from pathlib import Path

    from llamacli.backends.cuda.linear import (
        MV1T_MAX_COLS,
        MV1T_ROWS,
        MV1T_STATIC_SMEM,
        DeviceMatrix,
        mv1_tile_grid,
        mv1_tile_ok,
        mv1_tile_smem,
    )

    src = (Path(__file__).resolve().parents[3] / "kernels" / "matvec.cu").read_text()
    assert "__launch_bounds__(32 * MV1T_WARPS, 1) mv1_tile_q8_0(" in src
    assert MV1T_ROWS == 8  # the lane layout (row = lane % 8) and the tiles' 16-byte alignment

    def m(rows: int = 262144, cols: int = 640, ptr: int = 1 << 20, t: QT = QT.Q8_0) -> DeviceMatrix:
        return DeviceMatrix(ptr, rows, cols, t, cols // 32 * 34)

    h100, a100, small = 227 << 10, 163 << 10, 99 << 10  # per-block opt-in shared memory
    assert mv1_tile_ok((m(),), h100) and mv1_tile_ok((m(32768, 1024),), h100)
    assert mv1_tile_ok((m(49152, 576, 16),), h100)
    assert not mv1_tile_ok((m(32767),), h100) and not mv1_tile_ok((m(cols=MV1T_MAX_COLS + 32),), h100)
    assert not mv1_tile_ok((m(ptr=8),), h100) and not mv1_tile_ok((m(), m()), h100)
    assert not mv1_tile_ok((m(t=QT.Q4_0),), h100)
    assert not mv1_tile_ok((DeviceMatrix(1 << 20, 262144, 640, QT.Q8_0, 688),), h100)  # padded rows
    # The device's limit decides (with the static shared memory): an A100 takes 768 columns, not 896 (Qwen2.5-
    # 0.5B's head); a 99 KiB GPU 480, not SmolLM2's 576 or Gemma 3's 640: those go through mv1.
    assert mv1_tile_ok((m(cols=768),), a100) and not mv1_tile_ok((m(cols=896),), a100)
    assert mv1_tile_ok((m(cols=480),), small) and not mv1_tile_ok((m(cols=576),), small)
    assert all(mv1_tile_ok((m(cols=cols),), h100) for cols in range(32, MV1T_MAX_COLS + 1, 32))
    for cols in range(32, MV1T_MAX_COLS + 1, 32):
        for limit in (h100, a100, small):
            assert mv1_tile_ok((m(cols=cols),), limit) == (mv1_tile_smem(cols) + MV1T_STATIC_SMEM <= limit)
    assert mv1_tile_grid(262144, 132) == 132 and mv1_tile_grid(32768, 132) == 132
    assert mv1_tile_grid(8 * 12 * 10, 132) == 10 and mv1_tile_grid(1, 132) == 1


def test_mv1_stream_takes_aligned_16_bit_float_rows_in_one_wave() -> None:
    """mv1_stream serves one 16-bit float type in rows of whole 16-byte chunks, every segment 16-byte aligned
    (else mv1 does); its grid is at most one wave of the kernel's blocks per SM, with every warp's row count
    within one of the others' and as few blocks as that allows."""
    from pathlib import Path

    from llamacli.backends.cuda.linear import (
        MV1_WARPS,
        MV1S_BLOCKS_PER_SM,
        DeviceMatrix,
        mv1_stream_grid,
        mv1_stream_ok,
    )

    src = (Path(__file__).resolve().parents[3] / "kernels" / "matvec.cu").read_text()
    assert "__launch_bounds__(256, MV1S_BLOCKS_PER_SM) mv1_stream_" in src

    def m(t: QT, cols: int = 4096, ptr: int = 1 << 20) -> DeviceMatrix:
        return DeviceMatrix(ptr, 8, cols, t, cols * (2 if t in (QT.F16, QT.BF16) else 4))

    assert mv1_stream_ok((m(QT.F16),)) and mv1_stream_ok((m(QT.BF16), m(QT.BF16), m(QT.BF16)))
    assert mv1_stream_ok((m(QT.F16, 8),)) and mv1_stream_ok((m(QT.F16, 40),))
    assert not mv1_stream_ok((m(QT.F32),)) and not mv1_stream_ok((m(QT.F16, 100),))
    assert not mv1_stream_ok((m(QT.F16), m(QT.F16, ptr=(1 << 20) + 8)))  # a segment off 16-byte alignment
    assert not mv1_stream_ok((m(QT.F16), m(QT.BF16)))
    assert not mv1_stream_ok((DeviceMatrix(1 << 20, 8, 4096, QT.F16, 8200),))  # padded rows
    sms = 132
    for rows in (1, 5, 8, 9, 4096, 6144, 14336, 128256, 2 * MV1_WARPS * sms + 1):
        grid = mv1_stream_grid(rows, sms)
        assert 1 <= grid <= MV1S_BLOCKS_PER_SM * sms
        warps = grid * MV1_WARPS
        per = -(-rows // warps)
        assert rows > (grid - 1) * MV1_WARPS * per  # no block without a row; fewer blocks would need per + 1
    assert mv1_stream_grid(6144, 132) == 256 and mv1_stream_grid(4096, 132) == 256


def test_shared_sizes_have_one_source() -> None:
    """The sizes kernels and launchers share live in constants.py alone: every family's source starts with its
    #defines, no kernel file defines one of those names itself, every name is used by some kernel, and the
    launchers' values are the table's (cuda/moe.py's limits and tiles, linear.py's, attention.py's)."""
    import re
    from pathlib import Path

    from llamacli.backends.cuda import attention as A, linear as L, moe as M

    files = {p.name: p.read_text() for p in (Path(__file__).resolve().parents[3] / "kernels").glob("*.cu*")}
    for name in constants.NAMES:
        assert not any(re.search(rf"^\s*#\s*define\s+{name}\b", t, re.M) for t in files.values()), name
        assert any(re.search(rf"\b{name}\b", t) for t in files.values()), f"{name} is used by no kernel"
    for family in K.FAMILIES:
        assert K.kernel_source(family).startswith(constants.defines())
    assert "#define TC_STAGES(D) ((D) <= 64 ? 3 : 2)" in constants.defines()
    assert (M.MG_BM, M.MG_BN, M.MOE_EMAX, M.MOE_KMAX) == (constants.MG_BM, constants.MG_BN, constants.MOE_EMAX,
                                                          constants.MOE_KMAX)
    assert (L.MATVEC_TMAX, L.MV1S_BLOCKS_PER_SM, L.MV1T_WARPS) == (constants.MATVEC_TMAX,
                                                                   constants.MV1S_BLOCKS_PER_SM, constants.MV1T_WARPS)
    assert A.ATT_ROWS == constants.ATT_WARPS * constants.ATT_RPW and A.SPLIT_KEYS == constants.SP_BK
    assert [constants.SP_STAGES(d) for d in (64, 128, 256)] == [3, 3, 2]


def test_check_moe_refuses_what_the_expert_kernels_cannot_read() -> None:
    """Gate and up experts of two types (one decoder and one stride read both), too many experts or slots, and
    widths off the GEMM's 32-value steps: a BackendError before anything is uploaded."""
    from types import SimpleNamespace

    from llamacli.backends.cuda.moe import check_moe, dense_ff
    from llamacli.errors import BackendError
    from llamacli.models.base import LayerPlan

    plan = LayerPlan(moe=True, qk_norm=True)
    cfg = SimpleNamespace(layers=(plan, plan), n_expert=128, n_expert_used=8, n_embd=2048, n_ff_exp=768, n_ff=6144)
    info = lambda t, rb: SimpleNamespace(type=t, row_bytes=rb)  # noqa: E731
    same = SimpleNamespace(tensors={f"blk.{i}.ffn_{n}_exps.weight": info(QT.Q4_K, 1152)
                                    for i in range(2) for n in ("gate", "up")})
    check_moe(cfg, same)
    mixed = SimpleNamespace(tensors=dict(same.tensors))
    mixed.tensors["blk.1.ffn_up_exps.weight"] = info(QT.Q5_K, 1408)
    with pytest.raises(BackendError, match="layer 1.*Q4_K and Q5_K"):
        check_moe(cfg, mixed)
    for bad in (dict(n_expert=2000), dict(n_expert_used=33, n_expert=64), dict(n_expert_used=0), dict(n_ff_exp=760)):
        with pytest.raises(BackendError):
            check_moe(SimpleNamespace(**{**vars(cfg), **bad}), same)
    assert dense_ff(cfg) == 0  # no dense layer: the dense FFN buffers are not needed
    assert dense_ff(SimpleNamespace(**{**vars(cfg), "layers": (plan, LayerPlan())})) == 6144


def test_decode_splits_keep_the_merge_within_split_merge_max() -> None:
    """decode_splits on an H100 (132 SMs, 228 KB of shared memory per SM): as many splits as the GPU holds
    blocks, one per 64-key tile of a short context, and no more than SPLIT_MERGE_MAX partial values (splits x G
    x D) for the last block of a KV head to merge, but at least 16 splits."""
    from types import SimpleNamespace

    from llamacli.backends.cuda.attention import SPLIT_MERGE_MAX, decode_splits

    h100 = SimpleNamespace(n_sms=132, smem_sm=233_472, smem_block=232_448)

    def splits(hkv: int, group: int, dh: int, ctx: int) -> int:
        return decode_splits(h100, SimpleNamespace(n_head_kv=hkv, n_group=group, head_dim=dh), ctx, False)

    assert SPLIT_MERGE_MAX == 1 << 15
    assert splits(4, 8, 128, 4225) == 32  # Qwen3-30B-A3B: 66 blocks' worth, merge-capped
    assert splits(4, 8, 128, 512) == 8  # one per tile
    assert splits(8, 4, 128, 40_960) == 33  # Llama-3-8B: the GPU's blocks (two an SM)
    assert splits(8, 4, 64, 40_960) == 50  # Llama-3.2-1B: three an SM
    assert splits(1, 16, 256, 40_960) == 16  # the floor (the cap alone would give 8)


@pytest.mark.parametrize("q8", [False, True])
def test_decode_splits_leave_the_merge_its_shared_memory(q8) -> None:
    """kernels/attention_split.cu's merge keeps 2 x splits x G floats (rounded up to float4s) and its group sums
    in the stages: decode_splits never gives more splits than that room allows, for every head dim, group size
    and KV head count, on a GPU with SMs enough that the GPU's own limit is not the one that binds."""
    from types import SimpleNamespace

    from llamacli.backends.cuda.attention import (
        SPLIT_MERGE_SUMS,
        SPLIT_Q8_DIMS,
        decode_splits,
        split_fits,
        split_stage_bytes,
    )

    huge = SimpleNamespace(n_sms=100_000, smem_sm=233_472, smem_block=232_448)
    assert SPLIT_MERGE_SUMS >= 128 * 16 + 12
    for dh in SPLIT_Q8_DIMS if q8 else (64, 80, 96, 112, 128, 256):
        for group in range(1, 17):
            for hkv in (1, 8):
                cfg = SimpleNamespace(n_head_kv=hkv, n_group=group, head_dim=dh)
                if not split_fits(huge, cfg, q8):
                    continue
                n = decode_splits(huge, cfg, 1 << 30, q8)
                assert n >= 1
                assert 16 * -(-2 * n * group // 4) + 128 * 16 <= split_stage_bytes(dh, q8), (dh, group, hkv, n)
