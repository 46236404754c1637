"""The mixture-of-experts FFN on the CUDA backend (kernels/moe.cu): qwen3moe and gpt-oss.

Expert tensors stay in their GGUF layout: one DeviceMatrix of E * rows rows per tensor, expert e's rows at
e * expert_bytes; the kernels add that offset themselves from the expert ids in device memory, so nothing
crosses to the host and the decode step stays one captured graph.

- Many tokens (`moe`, the Backend operation, and the fused prefill): the router's logits (a GEMM),
  moe_route_f32 (ids and weights, llamacli.models.moe.route's semantics), moe_group (the (token, slot) pairs sorted by
  expert and cut into tiles of up to MG_BM), the gate/up and down GEMMs over those tiles on tensor cores
  (moe_gemm_<t>: grid y = an upper bound of the tiles; the blocks past the real count return at once; the
  weights decoded from their GGUF blocks into shared memory), moe_combine_f32 (the weighted sum). About ten
  launches per layer whatever the number of experts, and no host round trip: the pass can be captured.
  Up to MATVEC_TMAX tokens take matvec_moe_<t> (float activations, tiles of up to 8 pairs) instead.
- One token (`Experts.step`, inside the captured decode step): router matvec (+ RMSNorm) and routing in one
  launch (mv1_route_<t>; other router types: mv1 then moe_route_f32) | mv1_moe gate/up (+ RMSNorm,
  activation; grid y = the k slots) | mv1_moe down whose last block of each row range adds the weighted sum
  into the residual (mv1_moe_<t>_sum: moe_combine_f32's sums without its launch, a measurable share of a
  Qwen3-30B-A3B step, found by leaving the combine out: docs/perf-log.md).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

from ...errors import BackendError
from ...ggufio.ggml_types import GGMLQuantizationType as QT
from ...models.block import Moe
from . import loader as K
from .constants import MG_BM, MG_BN, MOE_EMAX, MOE_KMAX
from .fusion import FfnBranch
from .linear import MATVEC_TMAX, MV1_ACT8, MV1_WARPS, DeviceMatrix, _lpr, mv1_smem, qname

_GATING = {"softmax": 0, "topk_softmax": 1}
_ACT = {"silu": "swiglu", "swiglu_oai": "oai", "gelu_tanh": "geglu"}  # (geglu: the op-by-op forms only, gemma4)


ROUTE_FUSED = frozenset({QT.F32, QT.F16, QT.BF16})  # router types with mv1_route_<t> (real files: F32)


def expert_groups(qtype: QT) -> int:
    """mv1 row groups per block of the decode step's expert matvecs: x is staged (and normalised) once per
    block, and an expert's matrix is small, so the int8-activation types share one staging between 2 groups.
    Measured at depth 512 (docs/perf-log.md): on Qwen3-30B-A3B Q4_K_M, 2 groups for gate/up and down clearly
    beat 1, and 4 gained nothing more; gpt-oss-20b's MXFP4, then staged as float x, was fastest with 1."""
    return 2 if qtype in MV1_ACT8 else 1


def down_lpr(cols: int) -> int:
    """Lanes per row of the decode step's expert down matvec: linear._lpr, halved until each lane dots at least
    three units, so that a short row (Qwen3-30B-A3B's 768 columns: 24 units) keeps loads in flight. Measured
    greedy at depth 512 (docs/perf-log.md): Qwen3-30B-A3B's 768-column rows were fastest with 8 lanes a row
    (32 the slowest, 16 and 4 between); gpt-oss-20b's 2880-column rows the same with 32 and 16. The gate/up
    form dots two rows a lane and stays with _lpr (16 lanes there measured slower)."""
    units, lpr = -(-cols // 32), _lpr(cols)
    while lpr > 1 and units < 3 * lpr:
        lpr //= 2
    return lpr


def moe_family_needed(cfg: Any) -> bool:
    return any(p.moe for p in cfg.layers)


def check_moe(cfg: Any, gguf: Any = None) -> None:
    """BackendError for a mixture of experts the kernels do not serve (with the file: gate and up experts of
    different types or row sizes, which the expert kernels read with one decoder and one stride)."""
    if not moe_family_needed(cfg):
        return
    if not 0 < cfg.n_expert <= MOE_EMAX or not 0 < cfg.n_expert_used <= min(MOE_KMAX, cfg.n_expert):
        raise BackendError(f"the CUDA backend runs up to {MOE_EMAX} experts with up to {MOE_KMAX} per token "
                           f"(this model: {cfg.n_expert_used} of {cfg.n_expert})")
    for i, p in enumerate(cfg.layers):
        # experts beside a dense FFN (gemma4, op by op: Experts.forward) take GeGLU and their own norms; the fused
        # paths' experts neither
        fused = not p.moe_dense and (p.activation == "gelu_tanh" or p.post_norms)
        if p.moe and (p.activation not in _ACT or p.moe_gating not in _GATING or fused):
            raise BackendError(f"the CUDA backend has no expert FFN with {p.activation} / {p.moe_gating} gating")
        if p.moe and gguf is not None:
            g, u = (gguf.tensors.get(f"blk.{i}.ffn_{n}_exps.weight") for n in ("gate", "up"))
            if g is not None and u is not None and (g.type, g.row_bytes) != (u.type, u.row_bytes):
                raise BackendError(f"layer {i}: the CUDA backend needs the gate and up experts in one type "
                                   f"(this file: {g.type.name} and {u.type.name})")
    if cfg.n_embd % 32 or cfg.n_ff_exp % 32:
        raise BackendError("the CUDA backend's expert GEMMs need n_embd and the expert FFN width in multiples of 32")


def dense_ff(cfg: Any) -> int:
    """The dense FFN width the prefill and decode buffers need: n_ff, or 0 when every layer has experts
    (Qwen3-MoE files still carry a feed_forward_length that no layer uses)."""
    return cfg.n_ff if any(not p.moe for p in cfg.layers) else 0


def moe_scratch_bytes(cfg: Any, t: int) -> int:
    """The MoE FFN's working set for t tokens, as Experts.buffers allocates it."""
    if not moe_family_needed(cfg):
        return 0
    p, f, e = t * cfg.n_expert_used, cfg.n_ff_exp, cfg.n_expert
    items = K.cdiv(p, MATVEC_TMAX) + min(e, p)
    return (4 * t * e + 4 * p * 3 + 4 * 3 * items + 4  # logits; ids, weights, pairs; the tiles and their count
            + 4 * p * f + 2 * p * f + 4 * p + 4 * p * cfg.n_embd)  # ff, ff16, its row scales; y


def _expert(m: DeviceMatrix, n_expert: int) -> tuple[int, int]:
    """(rows of one expert, bytes of one expert) of an expert tensor held as E * rows rows."""
    rows = m.rows // n_expert
    return rows, rows * m.row_bytes


def gate_up(L: Any, n_expert: int) -> tuple[int, int, int, int]:
    """(gate matrix address, up matrix address, rows F of each, bytes of one expert) of a layer's experts: two
    tensors ffn_gate_exps / ffn_up_exps [E, F, D] (expert e at e * bytes in each), or one ffn_gate_up_exps
    [E, 2 F, D] (gemma4: expert e's F gate rows then its F up rows, at e * bytes; up F rows past gate)."""
    if L.ffn_gate_up_exps is not None:
        m = L.ffn_gate_up_exps
        rows, eb = _expert(m, n_expert)
        f = rows // 2
        return m.ptr, m.ptr + f * m.row_bytes, f, eb
    f, eb = _expert(L.ffn_gate_exps, n_expert)
    return L.ffn_gate_exps.ptr, L.ffn_up_exps.ptr, f, eb


class Experts:
    """The mixture-of-experts FFN of one model: its launchers and what they own, the working set of a pass
    (buffers) and the decode step's buffers (logits, ids, weights, the k experts' activations and outputs,
    the fused kernels' block counters), made at construction for a model with experts."""

    def __init__(self, gpu: Any, model: Any, linear: Any):
        self.gpu, self.model, self.linear = gpu, model, linear
        self.cp, self.cfg = gpu.cp, model.cfg
        self.buf: SimpleNamespace | None = None
        if model.weights is not None and moe_family_needed(self.cfg):
            self.alloc_step()

    def forward(self, op: Moe, h: Any, router_in: Any = None) -> Any:
        """Backend.moe: the experts' weighted sum of h [t, D] -> [t, D] f32. `router_in` [t, D] (gemma4): the
        router's input, else h; op.expert_scale: each chosen weight times ffn_down_exps_scale of its expert."""
        h = self.gpu.f32(h)
        t = h.shape[0]
        out = self.cp.zeros((t, self.cfg.n_embd), self.cp.float32)
        logits = None
        if router_in is not None:  # the router's logits of its own input (a GEMM or matvec, as any Linear)
            L = self.model.weights.layers[op.layer]
            logits = self.linear.matmul(self.gpu.f32(router_in), L.ffn_gate_inp, L.ffn_gate_inp_bias)
        if t <= MATVEC_TMAX:
            self._matvec(h, t, op, out, logits)
        else:
            h16, sc = self.linear.to_f16_scaled(h)
            self.gemm(h16.data.ptr, sc, t, op, out, logits)
        return out

    def _scale_weights(self, op: Moe, b: SimpleNamespace, p: int) -> None:
        """op.expert_scale (gemma4): the p chosen weights times ffn_down_exps_scale [E] of their experts (the
        reference's float32 product)."""
        if op.expert_scale:
            scale = self.model.weights.layers[op.layer].ffn_down_exps_scale
            b.wts[:p] *= scale[b.ids[:p]]

    def buffers(self, t: int) -> SimpleNamespace:
        """The MoE FFN's working set for up to t tokens (kept, grown when a pass needs more; prefill allocates
        it at its chunk size before any capture)."""
        b = self.buf
        if b is not None and b.t >= t:
            return b
        cp, cfg = self.cp, self.cfg
        p, f = t * cfg.n_expert_used, cfg.n_ff_exp
        items = K.cdiv(p, MATVEC_TMAX) + min(cfg.n_expert, p)  # the most tiles of either size
        b = self.buf = SimpleNamespace(
            t=t, logits=cp.empty((t, cfg.n_expert), cp.float32), ids=cp.empty(p, cp.int32),
            wts=cp.empty(p, cp.float32), pairs=cp.empty(p, cp.int32), items=cp.empty(3 * items, cp.int32),
            n_items=cp.empty(1, cp.int32), ff=cp.empty((p, f), cp.float32), ff16=cp.empty((p, f), cp.float16),
            sc=cp.empty(p, cp.float32), y=cp.empty((p, cfg.n_embd), cp.float32))
        return b

    def group(self, b: SimpleNamespace, p: int, tile: int) -> int:
        """Group the p pairs of b.ids by expert into tiles of up to `tile` -> the grid's bound on the tiles."""
        e_n = self.cfg.n_expert
        K.launch("moe", "moe_group", (1,), (1024,), ids=b.ids, P=p, E=e_n, tile=tile, list=b.pairs, items=b.items,
                 n_items=b.n_items)
        return K.cdiv(p, tile) + min(e_n, p)

    def _matvec(self, h: Any, t: int, op: Moe, out: Any, logits: Any = None) -> None:
        """out += the MoE FFN `op` of h [t, D] f32, t <= MATVEC_TMAX: matvec_moe over tiles of up to 8 pairs
        (`logits` [t, E]: the router's, computed already; else of h)."""
        cfg = self.cfg
        L = self.model.weights.layers[op.layer]
        d, k = cfg.n_embd, cfg.n_expert_used
        wg, wu, f, eb = gate_up(L, cfg.n_expert)
        _, eb_down = _expert(L.ffn_down_exps, cfg.n_expert)
        b = self.buffers(t)
        if logits is None:
            logits = b.logits
            self.linear.matvec((L.ffn_gate_inp,), h, t, logits, bias=L.ffn_gate_inp_bias)
        self.route(logits, t, b.ids, b.wts, op.gating)
        self._scale_weights(op, b, t * k)
        grid_y = self.group(b, t * k, MATVEC_TMAX)
        g, dn = L.ffn_gate_up_exps if L.ffn_gate_up_exps is not None else L.ffn_gate_exps, L.ffn_down_exps
        lpr = _lpr(d)
        K.launch("moe", f"matvec_moe_{qname(g.qtype)}_{_ACT[op.activation]}", (K.cdiv(f, 4 * (32 // lpr)), grid_y),
                 (128,), wg=wg, wu=wu, eb=eb, list=b.pairs, items=b.items, n_items=b.n_items, k=k, N=f, K=d,
                 x=h, y=b.ff, bg=L.ffn_gate_exps_bias, bu=L.ffn_up_exps_bias, lpr=lpr)
        lpr = _lpr(f)
        K.launch("moe", f"matvec_moe_{qname(dn.qtype)}", (K.cdiv(d, 4 * (32 // lpr)), grid_y), (128,), w=dn.ptr,
                 eb=eb_down, list=b.pairs, items=b.items, n_items=b.n_items, k=k, N=d, K=f, x=b.ff, x_per_pair=1,
                 y=b.y, bias=L.ffn_down_exps_bias, lpr=lpr)
        self.combine(b.y, b.wts, out, t)

    def gemm(self, h16: int, sc: Any, t: int, op: Moe, out: Any, logits: Any = None) -> None:
        """out [t, D] f32 += the MoE FFN of the fp16 rows at h16 [t, D] times their row scales sc [t] (the fused
        prefill's normalised input): the router GEMM, routing, grouping into tiles of MG_BM pairs, the experts'
        GEMMs on tensor cores (moe_gemm_*), the weighted sum (the FFN `op`; `logits` [t, E]: the router's,
        computed already)."""
        cfg = self.cfg
        L = self.model.weights.layers[op.layer]
        d, k, e_n = cfg.n_embd, cfg.n_expert_used, cfg.n_expert
        wg, wu, f, eb = gate_up(L, e_n)
        _, eb_down = _expert(L.ffn_down_exps, e_n)
        self.linear.dequant_scratch()  # (the fused prefill's buffers() made it, and these at its chunk size)
        b = self.buffers(t)
        if logits is None:
            logits = b.logits
            self.linear.gemm_weights(h16, t, [L.ffn_gate_inp], b.logits.data.ptr, e_n)
            n = t * e_n
            K.launch("elementwise", "rowscale_bias_f32", (min(K.cdiv(n, 256), 4096),), (256,), y=b.logits, scale=sc,
                     b=L.ffn_gate_inp_bias, n=n, N=e_n)
        self.route(logits, t, b.ids, b.wts, op.gating)
        p = t * k
        self._scale_weights(op, b, p)
        grid_y = self.group(b, p, MG_BM)
        g, dn = L.ffn_gate_up_exps if L.ffn_gate_up_exps is not None else L.ffn_gate_exps, L.ffn_down_exps
        K.launch("moe", f"moe_gemm_{qname(g.qtype)}_{_ACT[op.activation]}", (K.cdiv(f, MG_BN // 2), grid_y), (128,),
                 wg=wg, wu=wu, eb=eb, list=b.pairs, items=b.items, n_items=b.n_items, k=k, N=f, K=d, x16=h16,
                 xsc=sc, y=b.ff, bg=L.ffn_gate_exps_bias, bu=L.ffn_up_exps_bias)
        K.launch("elementwise", "to_f16_rowscale_f32", (p,), (256,), x=b.ff, x16=b.ff16, scale=b.sc, k=f)
        K.launch("moe", f"moe_gemm_{qname(dn.qtype)}", (K.cdiv(d, MG_BN), grid_y), (128,), w=dn.ptr, eb=eb_down,
                 list=b.pairs, items=b.items, n_items=b.n_items, k=k, N=d, K=f, x16=b.ff16, xsc=b.sc, x_per_pair=1,
                 y=b.y, bias=L.ffn_down_exps_bias)
        self.combine(b.y, b.wts, out, t)

    def route(self, logits: Any, t: int, ids: Any, wts: Any, gating: str) -> None:
        cfg = self.cfg
        K.launch("moe", "moe_route_f32", (t,), (32,), logits=logits, T=t, E=cfg.n_expert, k=cfg.n_expert_used,
                 gating=_GATING[gating], norm=int(cfg.expert_weights_norm), ids=ids, wts=wts)

    def combine(self, y: Any, wts: Any, x: Any, t: int) -> None:
        d = self.cfg.n_embd
        K.launch("moe", "moe_combine_f32", (K.cdiv(d, 256), t), (256,), y=y, wts=wts, x=x, T=t, N=d,
                 k=self.cfg.n_expert_used)

    # -- the decode step -------------------------------------------------------------------------------------
    def alloc_step(self) -> None:
        """The decode step's MoE buffers (router logits, ids, weights, the k experts' activations and outputs)."""
        cp, cfg = self.cp, self.cfg
        k = cfg.n_expert_used
        layers = self.model.weights.layers
        f = max(gate_up(L, cfg.n_expert)[2] for L, p in zip(layers, cfg.layers) if p.moe)
        self.step_logits = cp.empty((1, cfg.n_expert), cp.float32)
        self.step_ids = cp.zeros(k, cp.int32)
        self.step_wts = cp.zeros(k, cp.float32)
        self.step_ff = cp.empty((k, f), cp.float32)
        self.step_y = cp.empty((k, cfg.n_embd), cp.float32)
        self.step_done = cp.zeros(1, cp.uint32)  # mv1_route's finished blocks (zero between steps)
        self.step_sum_cnt = cp.zeros(cfg.n_embd, cp.uint32)  # mv1_moe_<t>_sum's finished blocks per row range

    def step(self, branch: FfnBranch, x: Any, add: Callable[[str, int, Callable[[bool], None]], None]) -> None:
        """Queue an FFN branch's experts (fusion.py: its pre-norm, then its Moe) on the decode step's residual
        x [1, D] (x += the experts' weighted sum) through add(section, weight bytes read, launch(early))."""
        cfg, op = self.cfg, branch.moe
        L = self.model.weights.layers[op.layer]
        norm = getattr(L, branch.norm.weight)
        e_n, k, d = cfg.n_expert, cfg.n_expert_used, cfg.n_embd
        f, eb = _expert(L.ffn_gate_exps, e_n)
        _, eb_down = _expert(L.ffn_down_exps, e_n)
        r = L.ffn_gate_inp
        if r.qtype in ROUTE_FUSED:  # one launch: the router's matvec, then its last block routes

            def router(early: bool) -> None:  # one warp a router row
                K.launch("moe", f"mv1_route_{qname(r.qtype)}", (K.cdiv(e_n, MV1_WARPS),), (32 * MV1_WARPS,),
                         shared=mv1_smem(r.qtype, d), w=r.ptr, E=e_n, K=d, x=x, logits=self.step_logits,
                         bias=L.ffn_gate_inp_bias, norm_w=norm, eps=cfg.rms_eps, k=k, gating=_GATING[op.gating],
                         norm=int(cfg.expert_weights_norm), done=self.step_done, ids=self.step_ids, wts=self.step_wts)

            add("norm+router", r.nbytes, router)
        else:
            add("norm+router", r.nbytes, lambda early: self.linear.matvec(
                (r,), x, 1, self.step_logits, bias=L.ffn_gate_inp_bias, norm=norm, early=early))
            add("router", 0, lambda early: self.route(self.step_logits, 1, self.step_ids, self.step_wts,
                                                            op.gating))
        g, u, dn = L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps
        act = _ACT[op.activation]

        def gate_up(early: bool) -> None:
            lpr, groups = _lpr(d), expert_groups(g.qtype)
            K.launch("moe", f"mv1_moe_{qname(g.qtype)}_{act}", (K.cdiv(f, MV1_WARPS * (32 // lpr) * groups), k),
                     (32 * MV1_WARPS,), shared=mv1_smem(g.qtype, d), wg=g.ptr, wu=u.ptr, eb=eb, ids=self.step_ids,
                     N=f, K=d, x=x, y=self.step_ff, norm_w=norm, eps=cfg.rms_eps, lpr=lpr, groups=groups,
                     bg=L.ffn_gate_exps_bias, bu=L.ffn_up_exps_bias, early=early)

        def down(early: bool) -> None:  # and x += the weighted sum of the k rows (the last block of each range)
            lpr, groups = down_lpr(f), expert_groups(dn.qtype)
            K.launch("moe", f"mv1_moe_{qname(dn.qtype)}_sum", (K.cdiv(d, MV1_WARPS * (32 // lpr) * groups), k),
                     (32 * MV1_WARPS,), shared=mv1_smem(dn.qtype, f), w=dn.ptr, eb=eb_down, ids=self.step_ids, N=d,
                     K=f, x=self.step_ff, y=self.step_y, bias=L.ffn_down_exps_bias, lpr=lpr, groups=groups,
                     early=early, wts=self.step_wts, out=x, cnt=self.step_sum_cnt)

        add("experts", k * 2 * eb, gate_up)
        add("experts", k * eb_down, down)
