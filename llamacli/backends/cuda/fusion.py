"""The CUDA backend's fusion decisions: a layer's program (models/block.py) matched against the fused forms its
prefill pass (prefill.py) and decode step (decode.py) launch.

Both run a block as two residual branches, each read here from the program once:

    attention:  Norm(x -> h) | Linear q, k, v of h (or one fused matrix + Split) | Norm q, k per head? |
                Rope q, k? | Attention | Linear att -> o | Norm o (post-norm)? | Add o
    FFN:        Norm(x -> h) | Moe, or Linear gate, up of h (or one fused matrix + Split) | Glu | Linear down |
                Norm f (post-norm)? | Add f

The decode step fuses the pre-norm into the matvec that reads it, the q/k norms, RoPE and the K/V store into
the attention kernel, the GLU into the gate/up matvec, the residual add into the down / O matvec, and a
post-norm into the next matvec's input; the prefill pass fuses fewer (its GEMMs take fp16 with row scales).
A program that does not fit these forms is refused at load (`match_layer` raises Unfused, which the backend
turns into a BackendError naming the operation): a new operation in block.py needs its fused form here and
its launches in both executors. Until then a model may run op by op (`op_by_op`: the hybrid Qwen models' Gated
DeltaNet layers, gated attention and shared experts; Gemma 4's shared KV, per-layer embeddings, V norms, output
scales, experts beside a dense FFN and layers of different shapes; the CUDA backend runs their operations one kernel
each): it takes models/block.run for prefill and decode, with no fused form at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import BackendError
from ...models.block import (
    Add,
    Attention,
    Conv,
    DeltaRule,
    Gate,
    GatedNorm,
    Glu,
    Linear,
    Moe,
    Norm,
    Op,
    Rope,
    Scale,
    Split,
    programs,
)
from ...models.config import ModelConfig

DENSE_GLU = ("silu", "gelu_tanh")  # the dense FFN's activations (kernels/matvec.cu _swiglu / _geglu forms)


class Unfused(BackendError):
    """A layer's program has an operation (or an order) that the fused CUDA paths do not run."""


@dataclass(frozen=True)
class AttentionBranch:
    norm: Norm  # x -> h
    qkv: tuple[Linear, ...]  # h -> q, k, v; or one fused matrix (then `split`)
    split: Split | None
    head_norms: tuple[Norm, Norm] | None  # q, k per head, before RoPE
    rope: Rope | None  # q and k alike
    attention: Attention
    out: Linear  # att -> o
    post: Norm | None  # o -> o before the residual add


@dataclass(frozen=True)
class FfnBranch:
    norm: Norm  # x -> h
    moe: Moe | None  # h -> f; or the dense FFN below
    gate_up: tuple[Linear, ...]  # h -> g, u; or one fused matrix (then `split`)
    split: Split | None
    glu: Glu | None
    down: Linear | None  # ff -> f
    post: Norm | None


@dataclass(frozen=True)
class FusedLayer:
    attention: AttentionBranch
    ffn: FfnBranch


class _Cursor:
    def __init__(self, ops: tuple[Op, ...]):
        self.ops, self.i = ops, 0

    def maybe(self, kind: type, **fields: object) -> Op | None:
        op = self.ops[self.i] if self.i < len(self.ops) else None
        if isinstance(op, kind) and all(getattr(op, k) == v for k, v in fields.items()):
            self.i += 1
            return op
        return None

    def take(self, kind: type, **fields: object) -> Op:
        op = self.maybe(kind, **fields)
        if op is None:
            got = self.ops[self.i] if self.i < len(self.ops) else "the end of the block"
            want = kind.__name__ + (f"({', '.join(f'{k}={v!r}' for k, v in fields.items())})" if fields else "")
            raise Unfused(f"the fused CUDA paths expect {want} here, the program has {got!r}")
        return op

    def many(self, kind: type, **fields: object) -> tuple[Op, ...]:
        out = []
        while (op := self.maybe(kind, **fields)) is not None:
            out.append(op)
        return tuple(out)


def _projections(c: _Cursor, src: str, names: tuple[str, ...]) -> tuple[tuple[Linear, ...], Split | None]:
    """Linear layers of `src` giving `names` (each its own matrix, all with a bias or none), or one matrix
    whose output is split into `names`."""
    mats = c.many(Linear, src=src)
    split = c.maybe(Split, dsts=names) if len(mats) == 1 else None
    got = split.dsts if split is not None and split.src == mats[0].dst else tuple(m.dst for m in mats)
    if got != names or (len(mats) > 1 and len({m.bias is None for m in mats}) > 1) or (split and mats[0].bias):
        raise Unfused(f"the fused CUDA paths expect the projections {', '.join(names)} of {src}, the program "
                      f"has {mats!r}{'' if split is None else f' split into {split.dsts}'}")
    return mats, split  # type: ignore[return-value]


# Gemma 4's operations (models/arch/gemma4.py) that the fused paths lack, each with what it is
_GEMMA4 = (
    (lambda op: isinstance(op, Attention) and not op.store, "shared-KV attention layers"),
    (lambda op: isinstance(op, Glu) and op.up == "ple", "per-layer embeddings"),
    (lambda op: isinstance(op, Moe) and (op.router or op.expert_scale or op.gate_up), "experts beside a dense FFN"),
    (lambda op: isinstance(op, Norm) and op.weight is None, "V norms"),
    (lambda op: isinstance(op, Scale), "layer output scales"),
    (lambda op: isinstance(op, Add) and op.dst != "x", "branches added before the residual"),
)


def _hybrid(op: Op) -> bool:
    """An operation of the hybrid models (qwen35, qwen35moe, qwen3next) that only the op-by-op path runs: the Gated
    DeltaNet layers' (Conv, DeltaRule, GatedNorm), an output or shared-expert gate, a Split per head group (gated
    attention's [q; gate] rows, qwen3next's [beta; alpha])."""
    return isinstance(op, (Conv, DeltaRule, GatedNorm, Gate)) or (isinstance(op, Split) and bool(op.groups))


def _gemma4(op: Op) -> str | None:
    """What a Gemma 4 operation the fused paths lack is (_GEMMA4), or None."""
    return next((what for test, what in _GEMMA4 if test(op)), None)


def uneven_layers(cfg: ModelConfig) -> str | None:
    """What a model needs beyond its layers' programs that the fused paths lack (one KV cache shape, one FFN width,
    the token embedding as the only input), or None: Gemma 4's per-layer embeddings, attention geometries (head
    size, KV heads) or feed-forward widths that differ between layers."""
    if cfg.n_embd_per_layer:
        return "per-layer embeddings"
    if any(p.head_dim or p.n_head_kv for p in cfg.layers) and \
            len({(cfg.layer_head_dim(i), cfg.layer_kv_heads(i)) for i in range(cfg.n_layer)}) > 1:
        return "attention layers of different head sizes"
    if len({cfg.layer_n_ff(i) for i in range(cfg.n_layer)}) > 1:
        return "feed-forward layers of different widths"
    return None


def op_by_op(cfg: ModelConfig) -> bool:
    """Whether the model runs op by op on CUDA (models/block.run for prefill and decode; no fused prefill pass,
    decode step or batched step): a program with an operation of the hybrid models (_hybrid) or of Gemma 4
    (_GEMMA4), or layers the fused paths cannot hold side by side (uneven_layers: Gemma 4's)."""
    return any(_hybrid(op) or _gemma4(op) for ops in programs(cfg) for op in ops) or uneven_layers(cfg) is not None


def match_layer(ops: tuple[Op, ...], layer: int | None = None) -> FusedLayer:
    """The two branches of one layer's program, or Unfused naming the first operation that does not fit.
    `layer`: the index the executors hold the program at (its Attention and Moe must name the same layer)."""
    hybrid = next((op for op in ops if _hybrid(op)), None)
    if hybrid is not None:  # (such a model runs op by op: device.fused_layers does not match its layers)
        raise Unfused(f"the fused CUDA paths have no {type(hybrid).__name__} operation (a model with one runs op by op)")
    gemma4 = next((what for what in map(_gemma4, ops) if what), None)
    if gemma4 is not None:  # (likewise: Gemma 4 runs op by op)
        raise Unfused(f"the fused CUDA paths have no Gemma 4 layers ({gemma4}; a model with one runs op by op)")
    c = _Cursor(ops)
    norm = c.take(Norm, src="x", heads=False)
    qkv, split = _projections(c, norm.dst, ("q", "k", "v"))
    qn = c.maybe(Norm, src="q", dst="q", heads=True)
    head_norms = (qn, c.take(Norm, src="k", dst="k", heads=True)) if qn is not None else None
    rope = c.maybe(Rope, src="q")
    if rope is not None:  # k rotates as q does
        c.take(Rope, src="k", local=rope.local)
    att = c.take(Attention, q="q", k="k", v="v")
    out = c.take(Linear, src=att.dst)
    post = c.maybe(Norm, src=out.dst, dst=out.dst, heads=False)
    if post is not None and out.bias is not None:
        raise Unfused("the fused CUDA paths have no bias on an output projection followed by a post-norm")
    c.take(Add, src=out.dst)
    attention = AttentionBranch(norm, qkv, split, head_norms, rope, att, out, post)  # type: ignore[arg-type]

    norm = c.take(Norm, src="x", heads=False)
    moe = c.maybe(Moe, src=norm.dst)
    gate_up: tuple[Linear, ...] = ()
    split = glu = down = None
    if moe is None:
        gate_up, split = _projections(c, norm.dst, ("g", "u"))
        glu = c.take(Glu, gate="g", up="u")
        if glu.activation not in DENSE_GLU:
            raise Unfused(f"the fused CUDA paths have no dense FFN with the {glu.activation} activation")
        down = c.take(Linear, src=glu.dst)
        if down.bias is not None:
            raise Unfused("the fused CUDA paths have no bias on the FFN's down matrix")
    f = moe.dst if moe is not None else down.dst  # type: ignore[union-attr]
    post = c.maybe(Norm, src=f, dst=f, heads=False)
    if post is not None and moe is not None:
        raise Unfused("the fused CUDA paths have no post-norm after a mixture of experts")
    c.take(Add, src=f)
    if c.i != len(ops):
        raise Unfused(f"the fused CUDA paths run two branches a block, the program goes on with {ops[c.i]!r}")
    if any(g.bias for g in gate_up):
        raise Unfused("the fused CUDA paths have no bias on the FFN's gate / up matrices")
    if layer is not None and any(op.layer != layer for op in (att, moe) if op is not None):
        raise Unfused(f"layer {layer}'s program names another layer's cache or experts")
    return FusedLayer(attention, FfnBranch(norm, moe, gate_up, split, glu, down, post))  # type: ignore[arg-type]
