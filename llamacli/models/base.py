"""What an architecture is: the per-layer plan every forward path reads, and the tensors it implies.

An architecture module (arch/llama.py, arch/qwen3.py, ...) builds one `Architecture`: its RoPE pairing and a
function from a layer's place in the model to a `LayerPlan`. block.py turns each plan into the program of
operations that every executor runs (the NumPy forward, the fused CUDA prefill and the captured CUDA decode
step), and `weights.py` derives the tensors a layer needs from its plan, so a new architecture that only combines
existing operations is one new module in arch/ plus its tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

ROPE_NORMAL = "normal"  # dims (2i, 2i+1) rotate together (llama; the converter permuted Q/K for it)
ROPE_NEOX = "neox"  # dims (i, i + rope_dim/2) rotate together (qwen2, phi3, qwen3)


@dataclass(frozen=True)
class LayerPlan:
    """What one transformer block does, beyond the pre-norm attention + SwiGLU skeleton every block has."""

    fused_qkv: bool = False  # one attn_qkv [(Hq + 2 Hkv) Dh, D] with rows [q; k; v] (phi3)
    qkv_bias: bool = False  # attn_{q,k,v}.bias (qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE: attn_q_norm / attn_k_norm [Dh] (qwen3)
    rope: bool = True  # rotate q and k (smollm3 leaves every fourth layer unrotated)
    rope_local: bool = False  # rotate with the local table: base cfg.rope_local_base, no scaling (gemma's
    #                           sliding-window layers)
    window: int = 0  # sliding-window attention: query at p sees keys at p - window < k <= p; 0: all keys
    attn_softcap: float = 0.0  # scores s -> c tanh(s / c) after the query scale (gemma2: 50); 0: none
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs before each residual add:
    #                           post_attention_norm / post_ffw_norm [D] (gemma2, gemma3)
    fused_gate_up: bool = False  # ffn_up [2F, D] holds rows [gate; up] (phi3)
    activation: str = "silu"  # the gated FFN's activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU, gemma) or
    #                           "swiglu_oai" (gpt-oss: g = min(gate, 7), u = clip(up, -7, 7), g sigmoid(1.702 g) (u + 1))
    o_bias: bool = False  # attn_output.bias [D] (gpt-oss)
    sinks: bool = False  # attn_sinks [Hq]: a learned logit per head added to each softmax denominator (gpt-oss)
    # Mixture of experts (qwen3moe, gpt-oss): the FFN is the weighted sum of cfg.n_expert_used of cfg.n_expert
    # experts chosen per token by the router ffn_gate_inp [E, D] (llamacli/models/moe.py route()); experts are the 3-D
    # ffn_gate_exps / ffn_up_exps [E, F_exp, D] and ffn_down_exps [E, D, F_exp] (F_exp = cfg.n_ff_exp).
    moe: bool = False
    moe_gating: str = "softmax"  # "softmax": softmax over all experts, then the top k (renormalised to sum 1
    #                              when cfg.expert_weights_norm; qwen3moe); "topk_softmax": the top k logits,
    #                              then a softmax over those k (gpt-oss)
    moe_bias: bool = False  # ffn_gate_inp.bias [E] and ffn_{gate,up}_exps.bias [E, F_exp], ffn_down_exps.bias
    #                         [E, D] (gpt-oss)
    shared_expert: bool = False  # moe: plus a shared expert, a SwiGLU FFN of width cfg.n_ff_shexp
    #                              (ffn_{gate,up,down}_shexp) whose output is scaled by sigmoid(h . ffn_gate_inp_shexp)
    #                              (qwen35moe, qwen3next)
    # Hybrid models (qwen35, qwen35moe, qwen3next): the layer's token mixer. "attention" is the causal attention
    # above; "delta_net" a Gated DeltaNet linear-attention layer that keeps a recurrent state per sequence instead of
    # K/V rows (block.py Conv, DeltaRule, GatedNorm: a short causal convolution over the projected q/k/v, then per
    # value head a d_k x d_v state updated by the gated delta rule, its output normalised and gated by z).
    mixer: str = "attention"
    attn_gate: bool = False  # attention with an output gate: attn_q [2 Hq Dh, D] holds per head [q; gate], and the
    #                          attention's output is multiplied by sigmoid(gate) before attn_output (qwen35, qwen3next)
    ssm_ba: bool = False  # delta_net: beta and alpha from one ssm_ba [2 Hv, D] whose rows come per key head as
    #                       [beta of its Hv/Hk value heads; alpha of them] (qwen3next); else ssm_beta / ssm_alpha [Hv, D]
    ssm_heads: str = "tiled"  # delta_net: which key head value head j reads: "tiled" j % Hk (qwen35 files: the
    #                           converter reorders the value heads so), "grouped" j // (Hv / Hk) (qwen3next)
    # Gemma 4 (models/arch/gemma4.py): a layer's own attention geometry, K/V shared with an earlier layer, V
    # normalised, per-layer token embeddings, a dense FFN beside the experts, an output scale.
    head_dim: int = 0  # this layer's head size (0: cfg.head_dim; gemma4's sliding layers: attention.key_length_swa)
    n_head_kv: int = 0  # its KV heads (0: cfg.n_head_kv; gemma4: attention.head_count_kv may hold one per layer)
    n_ff: int = 0  # its dense FFN's width (0: cfg.n_ff; feed_forward_length per layer: gemma4 E2B's double-wide FFN)
    kv_from: int = -1  # a shared-KV layer: no K/V projections and no cache of its own, its queries attend over the
    #                    cache of layer kv_from (an earlier layer of its kind; gemma4's attention.shared_kv_layers);
    #                    -1: the layer keeps its own
    v_norm: bool = False  # V RMS-normalised per head without a weight, before attention (gemma4)
    v_from_k: bool = False  # no attn_v: V is K's projection, taken before K's norm and RoPE (gemma4's global layers
    #                         in the 26B-A4B and 31B: attention_k_eq_v)
    moe_dense: bool = False  # moe: a dense GeGLU FFN beside the experts (ffn_gate / ffn_up / ffn_down on ffn_norm's
    #                          output, then post_ffw_norm_1), the experts reading pre_ffw_norm_2's output (their sum
    #                          then post_ffw_norm_2), the two added (gemma4 26B-A4B)
    router_norm: bool = False  # moe: the router reads rms_norm(x) * ffn_gate_inp.scale [D] / sqrt(D) (x: the residual
    #                            stream), and each chosen expert's weight is multiplied by ffn_down_exps.scale [E]
    gate_up_exps: bool = False  # moe: each expert's gate and up rows in one ffn_gate_up_exps [E, 2 F_exp, D] (rows
    #                             [gate; up]), as convert_hf_to_gguf.py writes gemma4's experts
    per_layer_input: bool = False  # after the FFN: x += post_norm(proj(gelu(inp_gate x) * e_i)), e_i [T, P] the
    #                                layer's per-layer input (block.per_layer_inputs; gemma4 E2B / E4B)
    out_scale: bool = False  # the block's output (the residual stream) times layer_output_scale [1] (gemma4)

    @property
    def recurrent(self) -> bool:
        """The layer keeps a recurrent state per sequence (no K/V rows)."""
        return self.mixer == "delta_net"

    @property
    def shares_kv(self) -> bool:
        """The layer reads another layer's K/V cache and keeps none of its own (kv_from)."""
        return self.kv_from >= 0


@dataclass(frozen=True)
class LayerInfo:
    """What a layer's plan may depend on."""

    index: int
    n_layer: int
    tensors: frozenset[str]  # every tensor name in the file (empty when only metadata is known)
    metadata: Any = None  # the file's metadata mapping (for architectures with per-layer keys)
    settings: Any = None  # what the architecture's `settings` read (a dict)


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    rope_type: str  # ROPE_NORMAL | ROPE_NEOX
    layer: Callable[[LayerInfo], LayerPlan] = field(default=lambda info: LayerPlan())
    # Raises UnknownArchitectureError for a file of this architecture that needs what no plan describes.
    check: Callable[[Any, frozenset[str]], None] = field(default=lambda metadata, tensors: None)
    # (get, common) -> the architecture's own keys: ModelConfig fields (embd_scale, attn_scale, final_softcap,
    # rope_local_base) and whatever its layer plans need. `get(key, kind, default)` reads "<arch>.<key>"
    # checked as config.py checks every key; `common` holds n_layer (the blocks a forward pass runs), n_blocks
    # (block_count: with the multi-token-prediction blocks), n_embd, n_head, head_dim, rope_freq_base, rope_dim,
    # n_ff (feed_forward_length, checked; None when the file has none).
    settings: Callable[[Callable[..., Any], dict[str, Any]], dict[str, Any]] = field(
        default=lambda get, common: {})
    # LayerWeights field -> GGUF tensor name (after "blk.N.") where this architecture's files differ from
    # weights.py's defaults (gpt-oss: the FFN pre-norm ffn_norm is "post_attention_norm.weight").
    tensor_names: dict[str, str] = field(default_factory=dict)
    # Metadata keys (after "<arch>.") that may hold one value per layer, which the layer plans then carry (gemma4:
    # attention.head_count_kv, feed_forward_length): config.py keeps the first layer's as the config's own unless
    # `settings` returns another ("n_head_kv"), and refuses a per-layer array of any other key.
    per_layer_keys: tuple[str, ...] = ()
    # What a rope_freqs tensor is in this architecture's files: "llama3" factors, or gemma4's "proportional" RoPE
    # (written as factors); models/rope.py divides by them either way.
    rope_freqs_scaling: str = "llama3"

    def plans(self, n_layer: int, tensors: set[str] | frozenset[str], metadata: Any = None,
              settings: dict[str, Any] | None = None) -> tuple[LayerPlan, ...]:
        names = frozenset(tensors)
        self.check(metadata, names)
        return tuple(self.layer(LayerInfo(i, n_layer, names, metadata, settings or {})) for i in range(n_layer))


_FEATURES = (  # (plan field, shown when the layer has it (True) or lacks it (False), label): the attention's
    ("fused_qkv", True, "fused QKV"),
    ("qkv_bias", True, "QKV bias"),
    ("qk_norm", True, "q/k norm"),
    ("rope", False, "no RoPE"),
    ("rope_local", True, "local RoPE"),
    ("post_norms", True, "post-norms"),
    ("o_bias", True, "output bias"),
    ("sinks", True, "attention sinks"),
    ("attn_gate", True, "gated attention"),
    ("v_norm", True, "v norm"),
    ("v_from_k", True, "V = K"),
)
_FFN_FEATURES = (("fused_gate_up", True, "fused gate/up"), ("shared_expert", True, "shared expert"),
                 ("per_layer_input", True, "per-layer embeddings"), ("out_scale", True, "layer output scale"))


def describe(plans: tuple[LayerPlan, ...]) -> str:
    """What the layers do beyond the Llama block, for `inspect`: "q/k norm", "no RoPE on 9 of 36 layers"; a hybrid
    model's layer kinds first ("gated delta-net (linear attention) on 3 of 4 layers, attention on 1 of 4 layers
    (q/k norm, gated attention)"), the attention features counted over its attention layers."""
    attention = [p for p in plans if not p.recurrent]
    parts, own = [], []
    hybrid = len(attention) < len(plans)
    if hybrid:
        parts.append(f"gated delta-net (linear attention) on {len(plans) - len(attention)} of {len(plans)} layers")
    for name, when, label in _FEATURES:
        n = sum(getattr(p, name) == when for p in attention)
        if n:
            own.append(label if n == len(attention) else f"{label} on {n} of {len(attention)} layers")
    windows = sorted({p.window for p in attention if p.window})
    for w in windows:
        n = sum(p.window == w for p in attention)
        own.append(f"sliding window {w} on {n} of {len(attention)} layers")
    for cap in sorted({p.attn_softcap for p in attention if p.attn_softcap}):
        own.append(f"attention soft-cap {cap:g}")
    n = sum(p.shares_kv for p in attention)
    if n:
        own.append(f"KV shared on {n} of {len(attention)} layers")
    if hybrid and attention:
        parts.append(f"attention on {len(attention)} of {len(plans)} layers" + (f" ({', '.join(own)})" if own else ""))
    else:
        parts += own
    for name, when, label in _FFN_FEATURES:
        n = sum(getattr(p, name) == when for p in plans)
        if n:
            parts.append(label if n == len(plans) else f"{label} on {n} of {len(plans)} layers")
    for act in sorted({p.activation for p in plans if p.activation != "silu"}):
        parts.append({"gelu_tanh": "GeGLU", "swiglu_oai": "clamped SwiGLU"}.get(act, act))
    n = sum(p.moe for p in plans)
    for gating in sorted({p.moe_gating for p in plans if p.moe}):
        label = {"softmax": "softmax, top-k", "topk_softmax": "top-k, softmax"}.get(gating, gating)
        dense = " beside a dense FFN" if any(p.moe_dense for p in plans if p.moe) else ""
        parts.append(f"mixture of experts ({label}){dense}" + ("" if n == len(plans) else f" on {n} of {len(plans)} layers"))
    return ", ".join(parts) or "the Llama block"
