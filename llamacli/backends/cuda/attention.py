"""Attention on the CUDA backend: the launchers of the four kernel families and the sizes they mirror.

- kernels/attention_simt.cu: attention_npl<N> (CUDA cores: short prefill chunks, head dims without a
  tensor-core kernel, decode where attention_split does not fit: G > 16, other head dims, or its shared
  memory past the GPU's), attention_combine (merges those decode splits), kv_store;
- kernels/attention_split.cu: attention_split_d<D> (decode on tensor cores, split over the keys) and its
  fused-step form attention_split_step_<mode>_d<D> (q/k norm + RoPE + K/V store + splits + merge), with the
  window, soft-cap and sinks as arguments;
- kernels/attention_mma.cu: attention_tc*_d<D> (prefill on tensor cores, mma.sync);
- the _w / tcx forms of the others (attention_w_npl<N>, attention_combine_w, attention_tcx*_d<D>): the same with
  a layer's sliding window and attention soft-cap (gemma) and attention sinks (gpt-oss), launched only on the
  layers whose Attention operation has one of them (models/block.py: window, softcap, sinks);
- kernels/attention_wgmma.cu: attention_wg*_d<D> (prefill on Hopper's wgmma; built for sm_90a).

Every kernel that reads or writes a cache [rows, Hkv, Dh] takes `ring`, its rows: position k lives at row k mod
ring, ctx rows for a full cache and fewer for a sliding-window layer's ring (models/kv_cache.py; those layers always
take the _w / tcx / split kernels, never attention_wg or the plain npl/tc forms).

An 8-bit cache (-ctk/-ctv q8_0; kv.KVCache) is written by kv_store_q8 (and the fused step's _q8
form), read by attention_split's _q8 forms in decode, and converted to fp16 for every other reader (readable).

Decode splits the keys (flash-decoding) over a grid fixed when the step is captured, so one graph serves every
position: attention_split takes as many splits as the GPU holds blocks of it (decode_splits) and computes
each split's key range from the position; the CUDA-core fallback (head shapes attention_split lacks) takes
ctx / decode_chunk(ctx) splits of decode_chunk keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...models.block import Attention
from ...models.config import ROPE_NEOX
from ...models.kv_cache import ring_span
from . import loader as K
from .constants import (
    ATT_RPW,
    ATT_WARPS,
    SP_BK,
    SP_STAGES,
    SP_WARPS,
    TC_BC,
    TC_STAGES,
    TC_WARPS,
    WG_BC,
    WG_ONES,
    WG_STAGES,
)
from .fusion import AttentionBranch
from .kv import KVCache

ATT_ROWS = ATT_WARPS * ATT_RPW  # attention_simt.cu: query rows per block
ATT_TC_ROWS, ATT_TC_KEYS = 16 * TC_WARPS, TC_BC  # attention_tc_d*: query rows per block (TC_BR), keys per tile
ATT_TC_DIMS = (64, 80, 96, 112, 128, 256)  # head dims with a tensor-core prefill kernel
ATT_WG_DIMS = (64, 128)  # of those, with a Hopper (wgmma, sm_90a) kernel: attention_wg*_d*
ATT_TC_MIN_T = 16  # shorter prefill chunks stay on the fp32 CUDA-core kernel
SPLIT_KEYS = SP_BK  # attention_split: keys per tile (a split takes whole tiles)
# attention_split: partial values (splits x G x D) the last block of a KV head merges, at most (splits: at least 16).
# On Qwen3-30B-A3B (G 8, D 128) at depth 4096 the 32 splits of this cap measured faster than 66 or 16
# (docs/perf-log.md).
SPLIT_MERGE_MAX = 1 << 15
SPLIT_MAX_G = 16  # attention_split: query heads per KV head (the rows of one MMA tile)
SPLIT_Q8_DIMS = (64, 96, 128, 256)  # head dims with an attention_split_q8 kernel (an 8-bit cache)
SPLIT_STATIC_SMEM = 1024  # attention_split's static shared memory (592 bytes), rounded up
# attention_split's merge: bytes of its group sums (SP_WARPS x 32 float4s) in the stages, beside its (m, l)
# pairs (2 x splits x G floats, rounded up to a whole float4: 12 bytes at most, 16 here).
SPLIT_MERGE_SUMS = SP_WARPS * 32 * 16 + 16


def split_stage_bytes(dh: int, q8: bool = False) -> int:
    """attention_split*_d<dh>'s K and V stages: SP_STAGES(dh) (2 past head dim 128, else 3) x 64 keys x
    (dh + 8) halves each; the _q8 forms': one converted fp16 K and V tile, then the stages of codes (dh bytes
    a key) and scales (dh / 32 halves a key)."""
    stages = SP_STAGES(dh)
    if q8:
        return 2 * SPLIT_KEYS * (dh + 8) * 2 + 2 * stages * SPLIT_KEYS * (dh + dh // 16)
    return 2 * stages * SPLIT_KEYS * (dh + 8) * 2


def split_smem(dh: int, group: int, q8: bool = False) -> int:
    """attention_split*_d<dh>'s dynamic shared memory at `group` query heads per KV head: the K/V stages (of an
    8-bit cache: `q8`), 16 fp16 q rows and group + 1 f32 rows."""
    return split_stage_bytes(dh, q8) + 16 * (dh + 8) * 2 + (group + 1) * dh * 4


def tc_smem(dh: int) -> int:
    """attention_tc*_d<dh>'s dynamic shared memory: K and V tiles of ATT_TC_KEYS rows of dh + 8 halves per
    stage (TC_STAGES: 3 up to head dim 64, else 2), 16 bytes of ints, and past head dim 128 the Q rows of
    the 4 warps (16 rows of dh + 8 halves each)."""
    q = TC_WARPS * 16 * (dh + 8) * 2 if dh > 128 else 0
    return TC_STAGES(dh) * 2 * ATT_TC_KEYS * (dh + 8) * 2 + 16 + q


def wg_smem(dh: int) -> int:
    """attention_wg*_d<dh>'s dynamic shared memory: 1024 for alignment, WG_STAGES(D) (3 up to head dim 64,
    else 2) K and V tiles of 64 keys x dh halves, WG_ONES(D) bytes of ones (2048 up to head dim 64, else
    256), one int (8 bytes with padding) and an 8-byte mbarrier per stage."""
    stages = WG_STAGES(dh)
    return 1024 + stages * 2 * WG_BC * dh * 2 + WG_ONES(dh) + 8 + 8 * stages


def simt_smem(dh: int) -> int:
    """attention_*_npl<N>'s dynamic shared memory (kernels/attention_simt.cu): the block's q rows, a K tile (rows
    of dh/2 + 1 words) and a V tile in fp16."""
    return ATT_ROWS * dh * 4 + 32 * (dh // 2 + 1) * 4 + 32 * dh * 2


def tc_qscale(dh: int, scale: float = 0.0) -> float:
    """The factor attention_tc*_d* expects q multiplied by: log2(e) times the query scale (its softmax is
    base 2); the scale 1/sqrt(dh) unless `scale` (ModelConfig.attn_scale) says otherwise."""
    return math.log2(math.e) * scale if scale else math.log2(math.e) / math.sqrt(dh)


def layer_ext(op: Attention | None) -> bool:
    """Whether an attention needs the _w / tcx kernels: a sliding window, a soft-cap or sinks."""
    return op is not None and bool(op.window or op.softcap or op.sinks)


def values_per_lane(dh: int) -> int:
    """N of attention_npl<N>: output dims per lane, the smallest of 1, 2, 3, 4, 8, 16 with 32 N >= dh (16: only
    attention_npl16 / attention_w_npl16, gemma4's global heads of 512, op by op)."""
    return next(n for n in (1, 2, 3, 4, 8, 16) if 32 * n >= dh)


@dataclass(frozen=True)
class Heads:
    """One layer's attention geometry, read as a ModelConfig's (n_head, n_head_kv, head_dim and what follows from
    them): the config's own on every model but gemma4, whose sliding and global layers differ (the op-by-op path
    takes it from the layer's cache: AttentionKernels.attention)."""

    n_head: int
    n_head_kv: int
    head_dim: int

    @property
    def n_group(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def split_fits(gpu: Any, cfg: Any, q8: bool) -> bool:
    """attention_split serves the head shape: up to 16 query heads per KV head, a head dim with a kernel (of an
    8-bit cache: `q8`), and its shared memory within the GPU's per-block limit."""
    dims = SPLIT_Q8_DIMS if q8 else ATT_TC_DIMS
    return (cfg.n_group <= SPLIT_MAX_G and cfg.head_dim in dims
            and split_smem(cfg.head_dim, cfg.n_group, q8) + SPLIT_STATIC_SMEM <= gpu.smem_block)


def decode_chunk(ctx: int) -> int:
    """Keys per split of the CUDA-core decode fallback (attention_npl + attention_combine; head shapes
    attention_split lacks): 32-key tiles, at most 256 splits."""
    return max(32, K.cdiv(K.cdiv(ctx, 256), 32) * 32)


def decode_splits(gpu: Any, cfg: Any, ctx: int, q8: bool) -> int:
    """Splits of decode attention over a cache of ctx positions. attention_split: as many as the GPU holds
    blocks of it at once (SMs x blocks per SM by shared memory, at most 4), shared among the KV heads,
    at most one per 64-key tile of the cache, as many as the merge's (m, l) pairs fit the stages beside its
    group sums (SPLIT_MERGE_SUMS), and no more than keep the last block's merge within SPLIT_MERGE_MAX
    partial values (at least 16). The CUDA-core fallback: ctx / decode_chunk(ctx)."""
    if not split_fits(gpu, cfg, q8):
        return K.cdiv(ctx, decode_chunk(ctx))
    smem = split_smem(cfg.head_dim, cfg.n_group, q8)
    per_sm = max(1, min(4, gpu.smem_sm // (smem + SPLIT_STATIC_SMEM + 1024)))  # (+ 1 KB each: the driver's)
    n = K.cdiv(gpu.n_sms * per_sm, cfg.n_head_kv)
    merge = max(16, SPLIT_MERGE_MAX // (cfg.n_group * cfg.head_dim))
    return max(1, min(n, K.cdiv(ctx, SPLIT_KEYS), merge,
                      (split_stage_bytes(cfg.head_dim, q8) - SPLIT_MERGE_SUMS) // (8 * cfg.n_group)))


class AttentionKernels:
    """The attention launchers over one model's KV cache (kv.KVCache): prefill (CUDA cores, mma.sync, wgmma),
    decode splits, and the fused decode step's attention. Owns attention_split's counters (finished splits per
    KV head, zero between launches)."""

    def __init__(self, gpu: Any, options: Any, model: Any, kv: Any):
        self.gpu, self.options, self.model, self.kv = gpu, options, model, kv
        self.cp, self.cfg, self.ctx = gpu.cp, model.cfg, model.ctx
        # (one per KV head of the layer with the most: gemma4's layers have their own counts)
        most = max([self.cfg.n_head_kv] + [KVCache.heads(kc)[0] for kc in (kv.k_cache if kv is not None else [])])
        self.counters = self.cp.zeros(most, self.cp.uint32)

    def batch_split(self) -> tuple[int, int]:
        """(n_split, chunk) of attention_batch_*: enough splits of the context for about two blocks per SM with one
        sequence, each a whole number of 32-key tiles; the same for any number of sequences, so that a row's
        arithmetic does not depend on the others (the splits past a row's position end at once)."""
        cfg = self.cfg
        want = max(1, min(K.cdiv(2 * self.gpu.n_sms, cfg.n_head_kv * K.cdiv(cfg.n_group, ATT_ROWS)),
                          K.cdiv(self.ctx, 64)))
        chunk = K.cdiv(K.cdiv(self.ctx, want), 32) * 32
        return K.cdiv(self.ctx, chunk), chunk

    def attend_batch(self, op: Attention, q: Any, q_stride: int, pos: Any, slots: Any, b: int, out: Any = None) -> Any:
        """Each of b rows' attention over its own cache slot (q rows `q_stride` floats apart; slots [b], pos [b];
        their K/V already stored): attention_batch_npl*, partials merged by attention_combine_batch -> out [b,
        q_dim] f32 (a new array where None)."""
        cp, cfg = self.cp, self.cfg
        hq, hkv, dh = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        ring = self.kv.k_cache[op.layer].shape[0]
        kt, vt = self.kv.tables(op.layer)
        n_split, chunk = self.batch_split()
        if out is None:
            out = cp.empty((b, cfg.q_dim), dtype=cp.float32)
        part_o = cp.empty((b, n_split, hq, dh), dtype=cp.float32) if n_split > 1 else None
        part_ml = cp.empty((b, n_split, hq, 2), dtype=cp.float32) if n_split > 1 else None
        sinks = self.model.sinks(op)
        smem = simt_smem(dh)
        npl = values_per_lane(dh)
        K.launch("attention_simt", f"attention_batch_npl{npl}",
                 (b * K.cdiv(cfg.n_group, ATT_ROWS), hkv, n_split), (256,), shared=smem, q=q, q_stride=q_stride,
                 kt=kt, vt=vt, slot=slots, pos=pos, B=b, Hq=hq, Hkv=hkv, Dh=dh, scale=cfg.query_scale, chunk=chunk,
                 out=out, out_stride=cfg.q_dim, part_o=part_o, part_ml=part_ml, n_split=n_split, window=op.window,
                 softcap=op.softcap, sinks=sinks, ring=ring)
        if n_split > 1:
            K.launch("attention_simt", "attention_combine_batch", (b * hq,), (max(32, K.cdiv(dh, 32) * 32),),
                     part_o=part_o, part_ml=part_ml, pos=pos, B=b, Hq=hq, Dh=dh, n_split=n_split, chunk=chunk, out=out,
                     out_stride=cfg.q_dim, window=op.window, sinks=sinks)
        return out

    def layer_heads(self, kc: Any) -> Heads:
        """The geometry of the layer whose cache is kc (its KV heads and head dim: kv.KVCache.heads)."""
        hkv, dh = self.kv.heads(kc)
        return Heads(self.cfg.n_head, hkv, dh)

    def attention(self, op: Attention, q: Any, k: Any, v: Any, pos: Any) -> Any:
        """Backend.attention: k, v into layer op.layer's cache at pos, then attention of q over it, with that layer's
        head geometry (layer_heads; gemma4's layers differ). A shared-KV layer (op.store False, k and v None) writes
        nothing and reads op.layer's cache as the layer that wrote it left it in this pass (block.prefill's passes
        are at most PREFILL_CHUNK = RING_CHUNK positions, within a ring's span)."""
        cp = self.cp
        f32 = self.gpu.f32
        q = f32(q)
        t = q.shape[0]
        kc, vc = self.kv.k_cache[op.layer], self.kv.v_cache[op.layer]
        g = self.layer_heads(kc)
        if op.store:
            k, v = f32(k), f32(v)
            span = ring_span(op.window, kc.shape[0], self.ctx)
            if t > span:  # a ring takes a long chunk in passes of at most `span` positions (models/kv_cache.py)
                return cp.concatenate([self.attention(op, q[s : s + span], k[s : s + span], v[s : s + span],
                                                      pos[s : s + span]) for s in range(0, t, span)])
            self.kv.store(kc, vc, k.data.ptr, v.data.ptr, g.kv_dim, pos, t)
        out = cp.empty((t, g.q_dim), dtype=cp.float32)
        if t == 1:
            n_split, chunk = self.decode_splits(self.ctx, g), self.decode_chunk(self.ctx)  # (chunk: CUDA-core form)
            part_o = cp.empty((n_split, g.n_head, g.head_dim), dtype=cp.float32)
            part_ml = cp.empty((n_split, g.n_head, 2), dtype=cp.float32)
            self.attend(q, g.q_dim, kc, vc, pos, 1, out, n_split, chunk, part_o, part_ml, op=op, heads=g)
        else:
            self.attend(q, g.q_dim, kc, vc, pos, t, out, 1, self.ctx, None, None, op=op, heads=g)
        return out

    def attend(self, q: Any, q_stride: int, kc: Any, vc: Any, pos: Any, t: int, out: Any, n_split: int,
               chunk: int, part_o: Any, part_ml: Any, op: Attention | None = None, heads: Heads | None = None) -> None:
        """Causal attention of q [t, Hq*Dh] f32 (rows q_stride apart) over one layer's cache kc, vc up to each
        row's position -> out [t, q_dim] f32: tensor cores for prefill chunks (attend_tc), attention_split for one
        token in n_split splits (partials in part_o, part_ml), else attention_npl in n_split splits of `chunk`
        keys.
        `op`: the layer's attention, whose window, soft-cap and sinks apply (the _w kernels); None: none. `heads`:
        the layer's geometry (None: the config's)."""
        cfg, g = self.cfg, heads or self.cfg
        hq, hkv, dh = g.n_head, g.n_head_kv, g.head_dim
        ext = layer_ext(op)
        # the _w kernels' extra arguments
        wx = dict(window=op.window, softcap=op.softcap, sinks=self.model.sinks(op), ring=kc.shape[0]) if ext else {}
        w_ = "_w" if ext else ""
        if n_split == 1 and t >= ATT_TC_MIN_T and dh in ATT_TC_DIMS and self.options.attention_tc:
            # Prefill on tensor cores: q as the kernel reads it (fp16, times log2(e) x the query scale), as
            # the fused prefill's RoPE epilogue writes it.
            q32 = q.reshape(t, q_stride)[:, : hq * dh]
            q16 = (q32 * np.float32(tc_qscale(dh, cfg.attn_scale))).astype(self.cp.float16)
            self.attend_tc(q16, hq * dh, kc, vc, pos, t, out, op, heads)
            return
        if t == 1 and self.split_fits(heads):  # decode on tensor cores, n_split splits from the position
            self.attend_split(op, q, kc, vc, pos, out, n_split, part_o, part_ml, heads)
            return
        kc, vc = self.kv.readable(kc, vc, pos, t)
        npl = values_per_lane(dh)
        smem = simt_smem(dh)
        grid = (K.cdiv(t * g.n_group, ATT_ROWS), hkv, n_split)
        K.launch("attention_simt", f"attention{w_}_npl{npl}", grid, (256,), shared=smem, q=q, q_stride=q_stride,
                 kc=kc, vc=vc, pos=pos, T=t, Hq=hq, Hkv=hkv, Dh=dh, scale=cfg.query_scale, chunk=chunk, out=out,
                 out_stride=g.q_dim, part_o=part_o, part_ml=part_ml, n_split=n_split, **wx)
        if n_split > 1:
            cx = {k: wx[k] for k in ("window", "sinks")} if ext else {}
            K.launch("attention_simt", f"attention_combine{w_}", (t * hq,), (max(32, K.cdiv(dh, 32) * 32),),
                     part_o=part_o, part_ml=part_ml, pos=pos, T=t, Hq=hq, Dh=dh, n_split=n_split, chunk=chunk,
                     out=out, out_stride=g.q_dim, **cx)

    def attend_tc(self, q16: Any, q16_stride: int, kc: Any, vc: Any, pos: Any, t: int, out: Any,
                  op: Attention | None = None, heads: Heads | None = None) -> None:
        """Causal prefill attention on tensor cores: q16 [t, Hq*dh] fp16 rows q16_stride apart, already times
        tc_qscale; out [t, q_dim] f32, or fp16 (the O-projection GEMM's input). attention_wg*_d* (Hopper,
        K/V through TMA descriptors of the caches) where it serves, else attention_tc*_d* (mma.sync); a
        layer whose attention (`op`) has a sliding window, soft-cap or sinks: attention_tcx*_d* (mma.sync).
        `heads`: the layer's geometry (None: the config's)."""
        g = heads or self.cfg
        hq, hkv, dh = g.n_head, g.n_head_kv, g.head_dim
        if kc.dtype == self.cp.uint8:  # an 8-bit cache: its fp16 pair
            kc, vc = self.kv.readable(kc, vc, pos, t)
        f16 = "16" if out.dtype == self.cp.float16 else ""
        rows = dict(q=q16, q_stride=q16_stride, pos=pos, T=t, Hq=hq, Hkv=hkv, out=out, out_stride=g.q_dim)
        if layer_ext(op):  # the soft-cap in the kernel's base-2 units: c log2(e)
            K.launch("attention_mma", f"attention_tcx{f16}_d{dh}", (K.cdiv(t * g.n_group, ATT_TC_ROWS), hkv),
                     (128,), shared=tc_smem(dh), kc=kc, vc=vc, window=op.window,
                     cap2=op.softcap * math.log2(math.e), sinks=self.model.sinks(op), ring=kc.shape[0], **rows)
            return
        if self.options.attention_wg and dh in ATT_WG_DIMS:  # 64 query rows per block, one warpgroup
            # K and V by the tensor copy engine: each cache a [rows, hkv * dh] matrix in [64 x 64] boxes.
            n_rows = kc.size // (hkv * dh)
            kmap, vmap = (K.tensor_map_2d(x.data.ptr, n_rows, hkv * dh, 64, 64) for x in (kc, vc))
            K.launch("attention_wgmma", f"attention_wg{f16}_d{dh}", (K.cdiv(t * g.n_group, 64), hkv), (128,),
                     shared=wg_smem(dh), kmap=kmap, vmap=vmap, **rows)
            return
        K.launch("attention_mma", f"attention_tc{f16}_d{dh}", (K.cdiv(t * g.n_group, ATT_TC_ROWS), hkv), (128,),
                 shared=tc_smem(dh), kc=kc, vc=vc, **rows)

    def split_args(self, op: Attention | None, pos: Any, n_split: int, part_o: Any, part_ml: Any,
                   kc: Any, vc: Any, heads: Heads | None = None) -> dict[str, Any]:
        """attention_split*'s arguments from kc to counters (op's window, soft-cap and sinks; none without;
        `heads`: the layer's geometry, None: the config's)."""
        cfg, g = self.cfg, heads or self.cfg
        window = op.window if op is not None else 0
        cap2 = op.softcap * math.log2(math.e) if op is not None else 0.0
        return dict(kc=kc, vc=vc, ring=kc.shape[0], pos=pos, Hq=g.n_head, Hkv=g.n_head_kv,
                    qscale=tc_qscale(g.head_dim, cfg.attn_scale), window=window, cap2=cap2, sinks=self.model.sinks(op),
                    part_o=part_o, part_ml=part_ml, counters=self.counters)

    def attend_split(self, op: Attention | None, q: Any, kc: Any, vc: Any, pos: Any, out: Any, n_split: int,
                     part_o: Any, part_ml: Any, heads: Heads | None = None) -> None:
        """Decode attention of one rotated query q [1, q_dim] f32 over the cache up to pos[0] (its K/V already
        stored) in n_split splits (attention_split_d<D>, partials in part_o [n_split, Hq, D] and part_ml
        [n_split, Hq, 2]) -> out [1, q_dim] f32 (`heads`: the layer's geometry, None: the config's)."""
        g = heads or self.cfg
        q8 = kc.dtype == self.cp.uint8  # an 8-bit cache (kv.KVCache)
        K.launch("attention_split", f"attention_split{'_q8' if q8 else ''}_d{g.head_dim}", (g.n_head_kv, n_split),
                 (128,), shared=split_smem(g.head_dim, g.n_group, q8), q=q, out=out,
                 **self.split_args(op, pos, n_split, part_o, part_ml, kc, vc, heads))

    def attend_step(self, branch: AttentionBranch, qkv: Any, att: Any, pos: Any, part_o: Any, part_ml: Any,
                    early: bool) -> None:
        """The fused decode step's attention of one layer's attention branch (fusion.py; attention_split_step_
        <mode>_d<D>): the q/k norms where the branch has them, its RoPE of q and k from the QKV matvec's
        output qkv [1, q_dim + 2 kv_dim] at pos[0], K/V into the cache, the splits (partials in part_o
        [splits, Hq, D] and part_ml [splits, Hq, 2]) and their merge by the last block of each KV head
        (`counters`) -> att [1, q_dim]. `early` as in linear.Linear.matvec."""
        cfg, op = self.cfg, branch.attention
        layer = op.layer
        mode = "neox" if cfg.rope_type == ROPE_NEOX else "normal"
        n_split = self.decode_splits(self.ctx)
        dims, inv_freq, attn = self.model.rope_args(branch.rope)
        qn = kn = None
        if branch.head_norms is not None:
            L = self.model.weights.layers[layer]
            qn, kn = (getattr(L, n.weight) for n in branch.head_norms)
        kc, vc = self.kv.k_cache[layer], self.kv.v_cache[layer]
        q8 = kc.dtype == self.cp.uint8
        K.launch("attention_split", f"attention_split_step{'_q8' if q8 else ''}_{mode}_d{cfg.head_dim}",
                 (cfg.n_head_kv, n_split), (128,), shared=split_smem(cfg.head_dim, cfg.n_group, q8), qkv=qkv,
                 out=att, rope_dim=dims, inv_freq=inv_freq, attn=attn, qn=qn, kn=kn, eps=cfg.rms_eps, early=early,
                 **self.split_args(op, pos, n_split, part_o, part_ml, kc, vc))

    def split_fits(self, heads: Heads | None = None) -> bool:
        """attention_split serves this model's head shape (`heads`: a layer's own) and cache (split_fits)."""
        return split_fits(self.gpu, heads or self.cfg, self.kv.q8)

    def decode_chunk(self, ctx: int) -> int:
        return decode_chunk(ctx)

    def decode_splits(self, ctx: int, heads: Heads | None = None) -> int:
        """decode_splits for this model's head shape (`heads`: a layer's own) and cache."""
        return decode_splits(self.gpu, heads or self.cfg, ctx, self.kv.q8)
