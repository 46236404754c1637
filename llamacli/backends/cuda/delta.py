"""The hybrid models' Gated DeltaNet layers on the CUDA backend (kernels/delta.cu): the launchers of models/block.py's
Conv, DeltaRule, GatedNorm and Gate, and each cache slot's recurrent states.

These models run op by op (models/block.run: fusion.op_by_op routes them) for now: the delta rule token by token, a
block per DR_COLS state columns of a value head (a first correct form; the chunked form of numpy_delta.py is the way
to a fast prefill). The reference is the NumPy backend's conv, delta_rule, gated_norm and sigmoid_gate.

The recurrent state of a slot (models/seq_cache.py's `RecurrentSlot`, the NumPy backend's record too): per delta-net
layer the convolution's window [K - 1, C] and the rule's state [Hv, d_k, d_v], float32 device arrays each with the
position it stands at, and the stored states (at the end of each prompt, after the latest step, at multiples of
SNAPSHOT_EVERY; MAX_SNAPSHOTS at most). The bookkeeping is the record's own, with one difference: NumPy's arrays are
replaced, never written in place, so it stores a state by reference; here the kernels move the live arrays on in
place, so a stored state is a copy made as a pass passes its position (the rule's launches end there), and `resume`
copies one back.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ...errors import BackendError
from ...models.block import Conv, DeltaRule
from ...models.seq_cache import LayerState, RecurrentSlot, snapshot_positions
from . import loader as K
from .constants import DR_COLS, DR_THREADS

CONV_THREADS = 256  # conv_silu_f32 / conv_window_f32: channels per block
GRID_Y_MAX = 65535  # conv_silu_f32's tokens per launch in grid y (more are grid-strided)


def conv_into(x: Any, w: Any, win: Any, out: Any) -> None:
    """out [T, C] = silu of the causal depthwise convolution of x [T, C] (contiguous) with taps w [C, K] after the
    window win [K - 1, C] (kernels/delta.cu conv_silu_f32)."""
    t, c = x.shape
    K.launch("delta", "conv_silu_f32", (K.cdiv(c, CONV_THREADS), min(t, GRID_Y_MAX)), (CONV_THREADS,), x=x,
             x_stride=c, w=w, win=win, out=out, T=t, C=c, K=w.shape[1])


def conv_window(x: Any, win: Any, dst: Any, at: int) -> None:
    """dst [K - 1, C] = the window after `at` (1 <= at <= T) tokens of x [T, C] following win (dst may be win: the
    window moved on in place)."""
    c = x.shape[1]
    K.launch("delta", "conv_window_f32", (K.cdiv(c, CONV_THREADS),), (CONV_THREADS,), x=x, x_stride=c, win=win,
             dst=dst, C=c, K=win.shape[0] + 1, at=at)


def delta_qk(cp: Any, qkv: Any, hk: int, dk: int, eps: float) -> tuple[Any, Any, Any]:
    """q and k of each key head from qkv [T, C] (contiguous) L2-normalised, q times 1 / sqrt(dk) -> (qn, kn [T, Hk,
    dk], their dots kq [T, Hk]) (delta_qk_f32)."""
    t = qkv.shape[0]
    qn, kn = cp.empty((t, hk, dk), cp.float32), cp.empty((t, hk, dk), cp.float32)
    kq = cp.empty((t, hk), cp.float32)
    K.launch("delta", "delta_qk_f32", (t, hk), (128,), qkv=qkv, stride=qkv.shape[1], Hk=hk, dk=dk, eps=eps,
             qscale=1.0 / math.sqrt(dk), qn=qn, kn=kn, kq=kq)
    return qn, kn, kq


def delta_rule_into(qn: Any, kn: Any, kq: Any, qkv: Any, a: Any, b: Any, ssm_a: Any, dt: Any, s: Any, out: Any,
                    grouped: bool) -> None:
    """The gated delta rule over the T tokens of qkv [T, C] (its v from column 2 Hk dk on; qn, kn, kq from delta_qk),
    alpha and beta a, b [T, Hv], from the state s [Hv, dk, dv] (moved on in place) -> out [T, Hv dv]
    (delta_rule_f32; `grouped`: value head h reads key head h / (Hv / Hk), else h % Hk)."""
    t, hk, dk = qn.shape
    hv, _, dv = s.shape
    K.launch("delta", "delta_rule_f32", (K.cdiv(dv, DR_COLS), hv), (DR_THREADS,), shared=rule_smem(dk), qn=qn, kn=kn,
             kq=kq, qkv=qkv, stride=qkv.shape[1], v_off=2 * hk * dk, a=a, b=b, ssm_a=ssm_a, dt=dt, S=s, out=out, T=t,
             Hk=hk, Hv=hv, dk=dk, dv=dv, grouped=grouped)


def rule_smem(dk: int) -> int:
    """delta_rule_f32's dynamic shared memory: the block's [dk, DR_COLS] tile of the state, and q and k [dk]."""
    return 4 * (dk * DR_COLS + 2 * dk)


def gated_norm_into(x: Any, gate: Any, w: Any, out: Any, eps: float) -> None:
    """out = rms_norm(x) * w * silu(gate) over the last axis of x, gate [..., d] (contiguous), w [d]
    (gated_norm_f32)."""
    d = x.shape[-1]
    if gate.shape != x.shape or w.shape != (d,) or w.dtype != x.dtype:
        raise BackendError(f"a gated norm of x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(w.shape)} "
                           f"{w.dtype}: the gate must match x, the weight one float32 value per column")
    K.launch("delta", "gated_norm_f32", (x.size // d,), (128,), x=x, g=gate, w=w, y=out, d=d, eps=eps)


def sigmoid_gate_into(x: Any, gate: Any, out: Any) -> None:
    """out = x * sigmoid(gate), x [..., N] and gate [..., N] or [..., 1] (contiguous; sigmoid_gate_f32)."""
    n, cols, gn = x.size, x.shape[-1], gate.shape[-1]
    if gn not in (1, cols) or gate.size * cols != n * gn:
        raise BackendError(f"a sigmoid gate of shape {tuple(gate.shape)} does not fit values of shape {tuple(x.shape)}")
    K.launch("delta", "sigmoid_gate_f32", (max(1, min(K.cdiv(n, 256), 4096)),), (256,), x=x, g=gate, y=out, n=n,
             N=cols, gn=gn)


class DeltaNet:
    """The delta-net layers of one model: the Conv and DeltaRule operations over the current cache slot's recurrent
    states, which it owns (one RecurrentSlot per slot), with their snapshots, resumption and the rollback after a
    verification of drafts, as the NumPy backend does them. `start_of(pos)`: the first position of a backend
    positions array, on the host."""

    def __init__(self, gpu: Any, model: Any, start_of: Callable[[Any], int]):
        self.gpu, self.model, self.start_of = gpu, model, start_of
        self.cp, self.cfg = gpu.cp, model.cfg
        self.layers = [i for i, plan in enumerate(self.cfg.layers) if plan.recurrent]
        self.slots = [RecurrentSlot()]
        self.slot = self.slots[0]

    # -- cache slots ----------------------------------------------------------------------------------------------
    def set_slots(self, n: int) -> None:
        """Hold the states of n slots: slot 0's (and the first n held) stay, the others start empty; slot 0 current."""
        while len(self.slots) < n:
            self.slots.append(RecurrentSlot())
        del self.slots[n:]
        self.use(0)

    def use(self, slot: int) -> None:
        self.slot = self.slots[slot]

    @property
    def state_bytes(self) -> int:
        """Device bytes of the states held now: live and stored, every slot."""
        total = 0
        for rec in self.slots:
            arrays = [x for st in rec.states.values() for x in (st.conv, st.ssm)]
            arrays += [x for layers in rec.stored.values() for parts in layers.values() for x in parts if x is not None]
            total += sum(int(x.nbytes) for x in arrays)
        return total

    # -- the operations -------------------------------------------------------------------------------------------
    def conv(self, op: Conv, x: Any, pos: Any) -> Any:
        """Backend.conv: silu of block op.layer's causal convolution of x [T, C] -> [T, C]; the window stored where
        snapshot_positions says (copies), then moved on in place past the last token."""
        cp = self.cp
        x = self.gpu.f32(x)
        w = self.model.weights.layers[op.layer].ssm_conv1d  # [C, K] float32
        t, c = x.shape
        start = self.start_of(pos)
        win = self._part(op.layer, start, "conv")  # [K - 1, C]
        out = cp.empty((t, c), cp.float32)
        conv_into(x, w, win, out)
        for p in snapshot_positions(start, t):  # the window after position p - 1 (before the live one moves on)
            dst = cp.empty_like(win)
            if win.shape[0]:
                conv_window(x, win, dst, p - start)
            self._store(p, op.layer, 0, dst)
        if win.shape[0]:
            conv_window(x, win, win, t)
        self.slot.states[op.layer].conv_pos = start + t
        return out

    def delta_rule(self, op: DeltaRule, qkv: Any, a: Any, b: Any, pos: Any) -> Any:
        """Backend.delta_rule: block op.layer's gated delta rule over qkv [T, C], alpha and beta [T, Hv] -> [T, Hv
        d_v]; the state moved on in place, a copy stored at each position snapshot_positions names (the launches end
        there)."""
        cp, cfg = self.cp, self.cfg
        f32 = self.gpu.f32
        L = self.model.weights.layers[op.layer]
        qkv, a, b = f32(qkv), f32(a), f32(b)
        hk, dk = cfg.ssm_group_count, cfg.ssm_state_size
        t, start = qkv.shape[0], self.start_of(pos)
        s = self._part(op.layer, start, "ssm")  # [Hv, d_k, d_v]
        qn, kn, kq = delta_qk(cp, qkv, hk, dk, cfg.rms_eps)
        out = cp.empty((t, s.shape[0] * s.shape[2]), cp.float32)
        c0 = 0
        for p in snapshot_positions(start, t):  # (a decode step: [start + 1])
            c1 = p - start
            delta_rule_into(qn[c0:c1], kn[c0:c1], kq[c0:c1], qkv[c0:c1], a[c0:c1], b[c0:c1], L.ssm_a, L.ssm_dt, s,
                            out[c0:c1], op.heads == "grouped")
            self._store(p, op.layer, 1, s.copy())
            c0 = c1
        self.slot.states[op.layer].ssm_pos = start + t
        if op.layer == self.layers[-1]:  # the pass has stored every layer's part
            self.slot.trim(len(self.layers))
        return out

    def _part(self, layer: int, start: int, part: str) -> Any:
        """The live state `part` ("conv", "ssm") of `layer` before position `start`: zeroed at 0 (a new sequence),
        else the live one, which must stand there (numpy_backend._part)."""
        rec = self.slot
        if start == 0:
            state = rec.states.get(layer)
            if state is None:
                state = rec.states[layer] = self._zeros()
            getattr(state, part).fill(0)
            setattr(state, f"{part}_pos", 0)
        state = rec.states.get(layer)
        at = -1 if state is None else getattr(state, f"{part}_pos")
        if at != start:
            raise BackendError(f"layer {layer}'s recurrent state stands at position {at}, not {start}: a sequence "
                               "continues where its last step ended, or resumes from a stored state (Backend.resume)")
        return getattr(state, part)

    def _zeros(self) -> LayerState:
        cp, cfg = self.cp, self.cfg
        dv = cfg.ssm_inner_size // cfg.ssm_time_step_rank
        return LayerState(cp.zeros((cfg.ssm_conv_kernel - 1, cfg.ssm_conv_dim), cp.float32), 0,
                          cp.zeros((cfg.ssm_time_step_rank, cfg.ssm_state_size, dv), cp.float32), 0)

    def _store(self, pos: int, layer: int, part: int, value: Any) -> None:
        self.slot.stored.setdefault(pos, {}).setdefault(layer, [None, None])[part] = value

    # -- the states between steps (Backend.resume, snapshots, forward_verify, rollback) -------------------------------
    def resume(self, slot: int, pos: int) -> None:
        """Backend.resume: slot `slot`'s live states copied from those stored at pos (nothing at 0: each layer's
        first pass starts from zeros); those stored past pos forgotten."""
        rec = self.slots[slot]
        stored = rec.resume_at(pos, len(self.layers))
        for layer, (conv, ssm) in (stored or {}).items():
            state = rec.states.get(layer)
            if state is None:
                state = rec.states[layer] = self._zeros()
            state.conv[...] = conv
            state.ssm[...] = ssm
            state.conv_pos = state.ssm_pos = pos

    def snapshots(self, slot: int, prompt_end: int | None = None) -> frozenset[int]:
        """Backend.snapshots: the positions whose states slot `slot` holds (`prompt_end` kept)."""
        return self.slots[slot].snapshots(len(self.layers), prompt_end)

    def begin_verify(self, ids: np.ndarray, start: int) -> None:
        """Before a verification pass of ids from `start` in the current slot: the state stored at start (by the step
        before) kept through it for rollback."""
        self.slot.begin_verify(ids, start)

    def rollback(self, slot: int, pos: int) -> tuple[int, np.ndarray] | None:
        """Backend.rollback's first half: after a verification whose drafts were rejected from `pos` on, the state
        stored at its first position restored in slot `slot` -> (that position, the ids it kept there: positions
        start .. pos - 1), which the caller runs again; None where nothing is to be done."""
        kept = self.slots[slot].take_verified(pos)
        if kept is not None:
            self.resume(slot, kept[0])
        return kept
