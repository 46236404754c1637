"""The sizes the kernels (kernels/*.cu) and their Python launchers must agree on, in one table.

loader.kernel_source puts `defines()` in front of every kernel family's source, so the .cu files use these
names and define none of them; the launchers import them from here. A size that only one side uses stays on
that side. Changing a value here changes the kernels' text, so CuPy's cache and the sm_90a cubins are rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ByHeadDim:
    """A size that depends on the head dim D: `small` up to D = `limit`, else `large` (a macro NAME(D) in CUDA)."""

    limit: int
    small: int
    large: int

    def __call__(self, dh: int) -> int:
        return self.small if dh <= self.limit else self.large

    def macro(self, name: str) -> str:
        return f"#define {name}(D) ((D) <= {self.limit} ? {self.small} : {self.large})"


# kernels/matvec.cu
MATVEC_TMAX = 8  # tokens per matvec launch (matvec_<t>)
MV1_MINB8 = 4  # the int8-activation mv1 forms' __launch_bounds__ minimum blocks per SM
MV1S_BLOCKS_PER_SM = 2  # mv1_stream's blocks per SM (its grid is one wave of them)
MV1T_ROWS, MV1T_STAGES, MV1T_WARPS = 8, 2, 12  # mv1_tile: rows per tile, tiles in flight, warps per block
# kernels/attention_simt.cu: warps per block and query rows per warp
ATT_WARPS, ATT_RPW = 8, 4
# kernels/attention_mma.cu: warps per block (16 query rows each), keys per tile, K/V tiles in flight
TC_WARPS, TC_BC = 4, 64
TC_STAGES = ByHeadDim(64, 3, 2)  # D = 128 at 3 stages (104 KB) would fit 2 blocks per SM, not 3
# kernels/attention_wgmma.cu: keys per tile, tiles in flight, bytes of fp16 ones (16 swizzled rows of 64, or 16 x 8)
WG_BC = 64
WG_STAGES = ByHeadDim(64, 3, 2)
WG_ONES = ByHeadDim(64, 2048, 256)
# kernels/attention_split.cu: warps per block, keys per tile, spans of up to SP_SOLO tiles taken whole by one
# split (no merge), K/V tiles in flight (D = 128 at three stages still fits two blocks per SM at G <= 8)
SP_WARPS, SP_BK, SP_SOLO = 4, 64, 4
SP_STAGES = ByHeadDim(128, 3, 2)
# kernels/moe.cu: experts per layer and per token; moe_gemm's pairs per tile and weight rows per block
MOE_EMAX, MOE_KMAX = 1024, 32
MG_BM, MG_BN = 64, 128
# kernels/batch_gemm.cu: the most rows (activations) per launch, weight rows per block, warps per block, and
# whether a warp loads its next group's weights before decoding the current one
BG_NMAX, BG_ROWS, BG_WARPS, BG_PIPE = 64, 32, 4, 0
# kernels/delta.cu: delta_rule_f32's state columns per block and threads per block (THREADS / COLS row groups)
DR_COLS, DR_THREADS = 16, 128

_INTS = ("MATVEC_TMAX", "MV1_MINB8", "MV1S_BLOCKS_PER_SM", "MV1T_ROWS", "MV1T_STAGES", "MV1T_WARPS", "ATT_WARPS",
         "ATT_RPW", "TC_WARPS", "TC_BC", "WG_BC", "SP_WARPS", "SP_BK", "SP_SOLO", "MOE_EMAX", "MOE_KMAX", "MG_BM",
         "MG_BN", "BG_NMAX", "BG_ROWS", "BG_WARPS", "BG_PIPE", "DR_COLS", "DR_THREADS")
_BY_HEAD_DIM = ("TC_STAGES", "WG_STAGES", "WG_ONES", "SP_STAGES")
NAMES = _INTS + _BY_HEAD_DIM  # every name the kernels take from here


def defines() -> str:
    """The table as the #define lines every kernel family's source starts with."""
    g = globals()
    lines = [f"#define {name} {g[name]}" for name in _INTS] + [g[name].macro(name) for name in _BY_HEAD_DIM]
    return "// ---- llamacli/backends/cuda/constants.py\n" + "\n".join(lines) + "\n// ----\n"
