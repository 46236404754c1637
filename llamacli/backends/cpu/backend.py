"""CpuBackend: the NumPy reference (numpy_backend.py) with its weights kept quantized and its hot operations
compiled (kernels.py).

What differs from the reference, and what does not:
- The matrices the layers multiply by (every Linear weight of the block programs, the router and the experts)
  and the LM head are re-packed at load into kernel layouts (layouts.py: the file's values, exactly), about the
  file's size instead of four bytes a weight; token_embd is the same re-packed matrix (one copy when tied), its
  rows dequantized on demand to the reference's floats. Types without a layout (F32, F16, BF16, the IQ1-IQ3
  grids) stay float32 matrices, multiplied as the reference does.
- A product of fewer than DEQUANT_ROWS tokens (a decode step, a short prompt) quantizes x to int16 per 32 values
  and runs the integer kernels (kernels.py): each value moves by at most half a step of its block's scale,
  amax / 32767. From DEQUANT_ROWS tokens on the matrix is dequantized to float32 (the reference's values) and
  multiplied by BLAS, as the reference does.
- RMSNorm, RoPE, GeGLU and the residual add run compiled, computing what the reference computes in the same
  precision; a decode step's attention (one query) runs compiled in float32; a prompt's attention, and SwiGLU
  (NumPy's vectorised tanh is faster than a compiled loop's), are the reference's.
- A verification pass (speculative decoding: forward_verify) computes every row as a decode step at its position
  would (the integer products however many rows, float32 matrices row by row, one query's attention at a time):
  its logits are the decode steps' bit for bit, so a speculative reply is the plain one.
- Everything else (embedding scale, soft-caps, experts' routing, the delta-net layers, the KV caches, the slots,
  sampling) is the reference's own code.
The kernels use -t/--threads threads (cpu_threads.threads_in_force), set for the calling thread at every forward
pass.
"""

from __future__ import annotations

import contextlib
import math
import platform
import threading

import numba
import numpy as np

from ...cpu_threads import threads_in_force
from ...ggufio.file import GGUFFile
from ...models import rope as rope_tables
from ...models.block import Attention, Linear, programs
from ...models.config import ROPE_NEOX, ModelConfig
from ...models.kv_cache import q8_0_roundtrip
from ...models.weights import layer_tensor_names, model_specs
from ..numpy_backend import NumpyBackend, check_host_memory
from . import kernels
from .layouts import Packed, pack, packable, packed_bytes

# Tokens from which a product dequantizes its matrix and multiplies in float32 (BLAS) instead of quantizing x
# to int16: the integer kernels' time grows with the tokens, the dequantized matrix's is paid once a product.
DEQUANT_ROWS = 12
DEQUANT_BYTES = 64 << 20  # float32 rows dequantized at once by such a product
# Score-and-value work (positions x query heads x head dim) from which a decode step's attention splits its KV
# heads across the threads.
ATTENTION_THREADS_FROM = 1 << 16
# LayerWeights fields multiplied by (beyond the programs' Linear weights): the router and the experts (moe()).
EXPERT_FIELDS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")
_NO_SINKS = np.zeros((0, 0), np.float32)
PASSES = threading.Lock()  # the forward passes, where numba cannot run two at once (CpuBackend.pass_context)


class PackedMatrix:
    """A weight matrix [N, K] in a kernel layout, with what multiplies by it."""

    def __init__(self, p: Packed):
        self.packed, self.shape, self.qtype = p, p.shape, p.qtype
        self._q = p.q.reshape(-1)
        self._m = p.m if p.m is not None else p.d  # (s8 layouts have no min: their kernel never reads it)
        self._kernel = kernels.LINEAR[(p.kind, p.block)]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def product(self, x: np.ndarray, rows_alike: bool = False) -> np.ndarray:
        """x [T, K] float32 -> x @ W^T [T, N]: the integer kernel below DEQUANT_ROWS tokens (or with `rows_alike`:
        each row exactly what it gives alone), else BLAS on the dequantized matrix, DEQUANT_BYTES of its rows at a
        time (an LM head's all-token logits would otherwise dequantize gigabytes at once)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        n, k = self.shape
        if x.shape[0] < DEQUANT_ROWS or rows_alike:
            out = np.empty((x.shape[0], n), np.float32)
            self._kernel(x, self._q, self.packed.d, self._m, out)
            return out
        step = max(1, DEQUANT_BYTES // (4 * k))
        if n <= step:
            return x @ self.rows(None).T
        out = np.empty((x.shape[0], n), np.float32)
        for r in range(0, n, step):
            out[:, r : r + step] = x @ self.rows(np.arange(r, min(n, r + step))).T
        return out

    def rows(self, ids: np.ndarray | None) -> np.ndarray:
        """Rows `ids` (None: all) as float32 [len(ids), K]: the file's values (the embedding's lookup)."""
        n, k = self.shape
        idx = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(f"row index out of range [0, {n})")
        out = np.empty(idx.size * k, np.float32)
        kernels.DEQUANTIZE[(self.packed.kind, self.packed.block)](self._q, self.packed.d, self._m, idx, out)
        return out.reshape(idx.size, k)


def _rows(p: Packed, first: int, end: int) -> PackedMatrix:
    """Rows first .. end - 1 of a re-packed matrix (views of its arrays)."""
    return PackedMatrix(Packed(p.kind, p.block, p.q[first:end], p.d[first:end], None if p.m is None else p.m[first:end],
                               (end - first, p.shape[1]), p.qtype))


class PackedExperts:
    """Experts' matrices [E, rows, cols] in one re-packed array: [e] is expert e's PackedMatrix, [e, a:b] its rows
    a .. b - 1 (a fused gate/up tensor's halves)."""

    def __init__(self, p: Packed, n_expert: int):
        self.packed, self.nbytes = p, p.nbytes
        self.rows = p.shape[0] // n_expert
        self.shape = (n_expert, self.rows, p.shape[1])
        self._experts = [_rows(p, e * self.rows, (e + 1) * self.rows) for e in range(n_expert)]

    def __getitem__(self, key) -> PackedMatrix:
        if not isinstance(key, tuple):
            return self._experts[key]
        e, part = key
        first, end, step = part.indices(self.rows)
        if step != 1:
            raise IndexError("an expert's rows are taken in one run")
        return _rows(self.packed, e * self.rows + first, e * self.rows + max(first, end))

    def __len__(self) -> int:
        return len(self._experts)


def linear_fields(cfg: ModelConfig) -> frozenset[str]:
    """The LayerWeights fields that are only multiplied by: every Linear weight of the programs, and the
    experts' (and their router's) tensors."""
    return frozenset({op.weight for ops in programs(cfg) for op in ops if isinstance(op, Linear)} | set(EXPERT_FIELDS))


class CpuBackend(NumpyBackend):
    name = "cpu"
    label = "CPU"
    _rows_alike = False  # a verification pass runs (forward_verify)

    # -- load: the weights re-packed --------------------------------------------------------------------
    def _check_memory(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int) -> None:
        check_host_memory(cfg, ctx, weights=weight_bytes(gguf, cfg), backend=self.label)

    def _embedding(self, gguf: GGUFFile):
        info = gguf.tensors["token_embd.weight"]
        if not packable(info.type):
            return super()._embedding(gguf)
        return PackedMatrix(pack(gguf.raw(info.name), info.type, info.shape))

    def _layer_tensor(self, gguf: GGUFFile, cfg: ModelConfig, field: str, name: str):
        info = gguf.tensors[name]
        if field not in linear_fields(cfg) or not packable(info.type) or len(info.shape) not in (2, 3):
            return super()._layer_tensor(gguf, cfg, field, name)
        rows = math.prod(info.shape[:-1])
        p = pack(gguf.raw(name).reshape(rows, -1), info.type, (rows, info.shape[-1]))
        return PackedMatrix(p) if len(info.shape) == 2 else PackedExperts(p, info.shape[0])

    def _lm_head(self, gguf: GGUFFile, token_embd):
        if "output.weight" not in gguf.tensors:  # tied: the embedding's matrix itself, where it is re-packed
            return token_embd if isinstance(token_embd, PackedMatrix) else super()._lm_head(gguf, token_embd)
        info = gguf.tensors["output.weight"]
        if not packable(info.type):
            return super()._lm_head(gguf, token_embd)
        return PackedMatrix(pack(gguf.raw(info.name), info.type, info.shape))

    # -- whole passes: the threads --------------------------------------------------------------------
    def pass_context(self) -> contextlib.AbstractContextManager:
        """Set the kernels' thread count for this thread; -> what a pass runs inside: a process-wide lock where
        numba's threading layer is its own work queue (no OpenMP or TBB found), which aborts the process when two
        threads launch parallel kernels at once, else nothing."""
        numba.set_num_threads(max(1, min(threads_in_force(), numba.config.NUMBA_NUM_THREADS)))
        return PASSES if kernels.threading_layer() == "workqueue" else contextlib.nullcontext()

    def forward_prompt(self, ids: np.ndarray, start: int):
        with self.pass_context():
            return super().forward_prompt(ids, start)

    def decode(self, token: int, pos: int):
        with self.pass_context():
            return super().decode(token, pos)

    def forward_verify(self, ids: np.ndarray, start: int):
        """A verification pass whose every row computes what a decode step at its position does (the int16
        products, one query's attention at a time), so that a speculative reply's choices are the plain reply's
        bit for bit, near-ties included."""
        with self.pass_context():
            self._rows_alike = True
            try:
                return super().forward_verify(ids, start)
            finally:
                self._rows_alike = False

    def device_name(self) -> str:
        return f"CPU ({platform.processor() or platform.machine()}, numba, {threads_in_force()} threads)"

    # -- operations ------------------------------------------------------------------------------------
    # The compiled operations raise no floating-point warnings: they need no _ieee (np.errstate costs
    # microseconds a call, dozens of calls a token).
    def matmul(self, x: np.ndarray, w, bias: np.ndarray | None = None) -> np.ndarray:
        if type(w) is not PackedMatrix:  # a float32 matrix (F32, F16, BF16 files): the reference's product
            product = super().matmul
            if self._rows_alike and x.shape[0] > 1:  # (row by row: BLAS rounds a matrix product otherwise)
                return np.concatenate([product(x[i : i + 1], w, bias) for i in range(x.shape[0])])
            return product(x, w, bias)
        y = w.product(x, self._rows_alike)
        return y if bias is None else self.add(y, bias)

    def add(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        if x.dtype != np.float32 or y.dtype != np.float32 or x.shape != y.shape:
            return super().add(x, y)
        out = np.empty_like(x)
        kernels.add(np.ascontiguousarray(x), np.ascontiguousarray(y), out)
        return out

    def rms_norm(self, x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        w = np.ones(x.shape[-1], np.float32) if weight is None else np.ascontiguousarray(weight, dtype=np.float32)
        kernels.rms_norm(flat, w, float(eps), out)
        return out.reshape(x.shape)

    def rope(self, x: np.ndarray, pos: np.ndarray, local: bool = False) -> np.ndarray:
        cos, sin = self._cos_sin(pos, local)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
        rot = self.cfg.local_rope_dim if local else self.cfg.rope_dim
        kernels.rope(x, cos, sin, self.cfg.rope_type == ROPE_NEOX, rot, out)
        return out

    def _cos_sin(self, pos: np.ndarray, local: bool) -> tuple[np.ndarray, np.ndarray]:
        """rope.cos_sin for these positions (the last answer kept: every layer's q and k of a step share it)."""
        key = (local, pos.tobytes())
        last = getattr(self, "_last_cos_sin", None)
        if last is not None and last[0] == key:
            return last[1]
        theta, attn = (self.theta_local, 1.0) if local else (self.theta, self.cfg.rope_attn_factor)
        value = rope_tables.cos_sin(theta, pos, attn)
        self._last_cos_sin = (key, value)
        return value

    def geglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        gate, up = (np.ascontiguousarray(a, dtype=np.float32) for a in (gate, up))
        out = np.empty_like(gate)
        kernels.geglu(gate, up, out)
        return out

    def _attend(self, op: Attention, q: np.ndarray, k: np.ndarray | None, v: np.ndarray | None,
                pos: np.ndarray) -> np.ndarray:
        """q [T, Hq, Dh]; k, v [T, Hkv, Dh] (None on a shared-KV layer, op.store False: the queries read the cache
        another layer wrote)."""
        if q.shape[0] != 1 and not self._rows_alike:  # a prompt: the reference's (its products are BLAS's)
            return super()._attend(op, q, k, v, pos)
        kc, vc = self.k_cache[op.layer], self.v_cache[op.layer]  # [rows, Hkv, Dh]: the layer's own
        if op.store:  # every row's K/V first (a verification's rows: within a ring's span, attention.py's split)
            k_type, v_type = self.cache_types
            kc[pos % kc.shape[0]] = q8_0_roundtrip(k) if k_type == "q8_0" else k
            vc[pos % vc.shape[0]] = q8_0_roundtrip(v) if v_type == "q8_0" else v
        hkv, dh = kc.shape[1], kc.shape[2]
        sinks = (self.weights.layers[op.layer].attn_sinks.reshape(hkv, -1).astype(np.float32) if op.sinks
                 else _NO_SINKS)
        q = np.ascontiguousarray(q, dtype=np.float32)
        out = np.empty((q.shape[0], q.shape[1] * dh), np.float32)
        for i, p in enumerate(pos.tolist()):  # one query at a time, as a decode step
            lo = max(0, p - op.window + 1) if op.window else 0
            n = p - lo + 1
            qg = q[i].reshape(hkv, -1, dh)  # query heads grouped by KV head
            att = np.empty_like(qg)
            attend = (kernels.attend_one_threads if n * qg.shape[1] * hkv * dh >= ATTENTION_THREADS_FROM
                      else kernels.attend_one)
            attend(qg, kc, vc, lo, n, np.float32(self.cfg.query_scale), np.float32(op.softcap), sinks, att)
            out[i] = att.reshape(-1)
        return out


def weight_bytes(gguf: GGUFFile, cfg: ModelConfig) -> int:
    """Bytes CpuBackend.load keeps the weights in: re-packed matrices at their layouts' sizes (token_embd
    once, the LM head too when tied), float32 for the rest (as NumpyBackend), the embedding tables it keeps in their
    GGUF layout (per_layer_token_embd; token_embd of a type without a layout) at their file's size."""
    fields = linear_fields(cfg)
    linear = {name for i in range(cfg.n_layer) for field, name in layer_tensor_names(cfg, i).items() if field in fields}
    linear |= {"token_embd.weight", "output.weight"}
    tables = ("token_embd.weight", "per_layer_token_embd.weight")
    total = 0
    for spec in model_specs(cfg):
        info = gguf.tensors.get(spec.name)
        if info is None:
            continue
        if spec.name in linear and packable(info.type) and len(info.shape) in (2, 3):
            total += packed_bytes(info.type, info.n_elements)
        elif spec.name in tables:
            total += info.n_bytes
        else:
            total += 4 * info.n_elements
    emb = gguf.tensors.get("token_embd.weight")
    if cfg.tied_embeddings and emb is not None and not packable(emb.type):  # the reference's float32 LM head
        total += 4 * emb.n_elements
    return total
