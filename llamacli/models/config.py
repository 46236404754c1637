"""ModelConfig: the one place GGUF metadata keys are read (after llama.cpp's llama-model.cpp key names).

The keys every architecture shares are read here; what differs between architectures (RoPE pairing, the
per-layer plan: biases, fused matrices, q/k norms, RoPE-less layers) comes from its module in
llamacli/models/arch/, and lands in `ModelConfig.layers`, one plan per layer, which every forward path reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import CorruptFileError, MissingMetadataError
from ..ggufio.metadata import array_length
from .arch import ROPE_NEOX, ROPE_NORMAL, LayerPlan, architecture
from .kv_cache import DEFAULT as DEFAULT_CACHE, cache_row_bytes, ring_rows

__all__ = ["ROPE_NEOX", "ROPE_NORMAL", "ModelConfig", "config_from_metadata"]
ROPE_SCALINGS = ("none", "linear", "llama3", "proportional", "longrope", "yarn")
FREQ_FACTORS = ("llama3", "proportional")  # scalings that divide by the rope_freqs tensor


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    vocab_size: int
    context_length: int
    rope_type: str  # ROPE_NORMAL | ROPE_NEOX
    rope_dim: int  # dims of each head that rotate (<= head_dim: Phi-4-mini rotates 96 of 128)
    rope_freq_base: float
    # RoPE scaling: "none", "linear" (positions / factor), "llama3" (per-frequency factors in the
    # rope_freqs tensor; "proportional": gemma4's, factors 1 and 1e30 so that only the first pairs rotate),
    # "longrope" (phi3: rope_factors_long/short tensors and an attention factor), "yarn" (frequencies blended
    # between interpolated and original by a ramp; rope.py).
    rope_scaling: str
    rope_scaling_factor: float
    rope_original_context: int
    rope_attn_factor: float  # multiplies cos/sin (phi3 longrope, YaRN's magnitude scale); 1.0 otherwise
    rms_eps: float
    tied_embeddings: bool  # no output.weight: the LM head is token_embd
    bos_token_id: int | None
    eos_token_id: int | None
    # What each block does (models/base.py LayerPlan), one per layer; empty: every layer the plain Llama block.
    layers: tuple[LayerPlan, ...] = ()
    rope_yarn_beta_fast: float = 32.0  # YaRN's ramp: dims turning fewer than beta_slow times over the
    rope_yarn_beta_slow: float = 1.0  # original context are interpolated, more than beta_fast kept
    rope_local_base: float = 10000.0  # the base of the local RoPE table (layers whose plan has rope_local)
    attn_scale: float = 0.0  # the query scale; 0: 1/sqrt(head_dim)
    embd_scale: float = 1.0  # token embeddings are multiplied by it (gemma: sqrt(n_embd))
    final_softcap: float = 0.0  # logits -> c tanh(logits / c) (gemma2: 30); 0: none
    n_expert: int = 0  # mixture of experts (layers whose plan has moe): experts per layer,
    n_expert_used: int = 0  # experts chosen per token,
    n_ff_exp: int = 0  # an expert's FFN width,
    expert_weights_norm: bool = False  # "softmax" gating: the chosen weights renormalised to sum 1
    n_ff_shexp: int = 0  # the shared expert's FFN width (layers whose plan has shared_expert)
    # Gated DeltaNet layers (plans whose mixer is "delta_net"; llama.cpp's ssm.* keys): the causal convolution's
    # width K, the key and value head dims (state_size: d_k = d_v), the key heads Hk (group_count), the value
    # heads Hv (time_step_rank: one decay and one beta per value head) and Hv d_v (inner_size).
    ssm_conv_kernel: int = 0
    ssm_state_size: int = 0
    ssm_group_count: int = 0
    ssm_time_step_rank: int = 0
    ssm_inner_size: int = 0
    # Multi-section RoPE (qwen35's "imrope", rope.dimension_sections: pairs of the rotated dims interleaved over
    # time/height/width sections; for text every section takes the token's position, and the pairs that fall in
    # the fourth section, none in released files, position 0: rope.py); empty: plain RoPE
    rope_sections: tuple[int, ...] = ()
    # Gemma 4: the rotated dims of the local table's layers (rope.dimension_count_swa; 0: rope_dim), and the width P
    # of each layer's per-layer token embedding (embedding_length_per_layer_input; 0: none): per_layer_token_embd
    # [V, L P], per_layer_model_proj [L P, D], per_layer_proj_norm [P] (block.per_layer_inputs)
    rope_local_dim: int = 0
    n_embd_per_layer: int = 0
    # Not from the file: a row per position on sliding-window layers too (--swa-full, as llama.cpp's), so that
    # any cached prefix can be reused; else rings (kv_cache.py)
    swa_full: bool = False

    @property
    def query_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def __post_init__(self) -> None:
        if not self.layers:
            object.__setattr__(self, "layers", (LayerPlan(),) * self.n_layer)
        if len(self.layers) != self.n_layer:
            raise ValueError(f"{len(self.layers)} layer plans for {self.n_layer} layers")

    # -- derived -------------------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def n_group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_head // self.n_head_kv

    # Per layer (LayerPlan head_dim, n_head_kv, n_ff override the config's: gemma4's sliding and global layers differ)
    def layer_head_dim(self, i: int) -> int:
        return self.layers[i].head_dim or self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.layers[i].n_head_kv or self.n_head_kv

    def layer_n_ff(self, i: int) -> int:
        return self.layers[i].n_ff or self.n_ff

    @property
    def head_dims(self) -> frozenset[int]:
        """Every attention layer's head size (one, but for models whose layers differ: gemma4)."""
        return frozenset(self.layer_head_dim(i) for i, p in enumerate(self.layers) if not p.recurrent)

    @property
    def local_rope_dim(self) -> int:
        """The rotated dims of the layers that rotate with the local table."""
        return self.rope_local_dim or self.rope_dim

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of a delta-net layer's convolution: its q, k [Hk d_k each] and v [Hv d_v] side by side."""
        return 2 * self.ssm_group_count * self.ssm_state_size + self.ssm_inner_size

    def recurrent_state_bytes(self) -> int:
        """One sequence's recurrent state, float32: per delta-net layer the convolution's window of the last K - 1
        inputs [K - 1, conv_dim] and the delta rule's state [Hv, d_k, d_v]. It does not grow with the context."""
        per_layer = (self.ssm_conv_kernel - 1) * self.ssm_conv_dim + self.ssm_time_step_rank * self.ssm_state_size ** 2
        return 4 * per_layer * sum(plan.recurrent for plan in self.layers)

    def cache_rows(self, ctx: int) -> list[int]:
        """Rows of each layer's K/V cache at `ctx` positions: ctx, or a ring on a sliding-window layer
        (kv_cache.ring_rows) unless swa_full; none on a layer with a recurrent state instead, nor on a layer that
        reads another layer's cache (shared KV)."""
        return [0 if plan.recurrent or plan.shares_kv else ctx if self.swa_full else ring_rows(plan.window, ctx)
                for plan in self.layers]

    def kv_values(self, ctx: int) -> int:
        """Values of K (or of V) in every layer's cache at `ctx` positions: rows x KV heads x head size, per layer."""
        return sum(n * self.layer_kv_heads(i) * self.layer_head_dim(i) for i, n in enumerate(self.cache_rows(ctx)))

    def kv_cache_bytes(self, ctx: int, cache_types: tuple[str, str] = DEFAULT_CACHE) -> int:
        """K and V of every layer at `ctx` positions (sliding-window layers: their rings; shared-KV layers: none),
        each of its cache type (kv_cache.CACHE_TYPES: fp16 by default; q8_0 rows of whole 32-value blocks per
        head)."""
        return int(sum(n * self.layer_kv_heads(i) * sum(cache_row_bytes(t, self.layer_head_dim(i)) for t in cache_types)
                       for i, n in enumerate(self.cache_rows(ctx))))

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_names: set[str] | None = None) -> "ModelConfig":
        return config_from_metadata(metadata, tensor_names or set())


def config_from_metadata(md: Mapping[str, Any], tensors: set[str]) -> ModelConfig:
    arch = md.get("general.architecture")
    if not isinstance(arch, str):
        raise MissingMetadataError("missing metadata key 'general.architecture'")
    model = architecture(arch)

    def get(key: str, kind: type, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        value = md.get(full, default)
        if value is None:
            if required:
                raise MissingMetadataError(f"missing metadata key {full!r}")
            return None
        if kind is int:
            if type(value) is bool or not isinstance(value, int):
                raise CorruptFileError(f"metadata key {full!r} should be an integer, got {value!r}")
        elif kind is float:
            if type(value) is bool or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise CorruptFileError(f"metadata key {full!r} should be a finite number, got {value!r}")
            value = float(value)
        return value

    def positive(key: str, value: int, limit: int = 1 << 24) -> int:
        if not 0 < value <= limit:
            raise CorruptFileError(f"metadata key '{arch}.{key}' has an impossible value {value}")
        return value

    n_blocks = positive("block_count", get("block_count", int), 4096)
    # Multi-token prediction (Qwen3.5, Qwen3-Next): the file's last nextn_predict_layers blocks are the MTP
    # head's (blk.N.nextn.*), which a plain forward pass does not run; their tensors are read past.
    nextn = get("nextn_predict_layers", int, default=0, required=False)
    if not 0 <= nextn < n_blocks:
        raise CorruptFileError(f"metadata key '{arch}.nextn_predict_layers' is {nextn}, not between 0 and the "
                               f"{n_blocks} blocks less one")
    n_layer = n_blocks - nextn
    n_embd = positive("embedding_length", get("embedding_length", int), 1 << 20)
    n_head = positive("attention.head_count", _scalar(get("attention.head_count", (int,)), arch, "attention.head_count"), 4096)
    varies = model.per_layer_keys  # keys whose per-layer arrays the architecture reads itself
    n_head_kv_raw = get("attention.head_count_kv", (int,), default=n_head, required=False)
    n_head_kv = positive("attention.head_count_kv", _scalar(n_head_kv_raw, arch, "attention.head_count_kv", varies), 4096)
    if n_head % n_head_kv:
        raise CorruptFileError(f"{n_head} attention heads cannot be shared by {n_head_kv} KV heads")
    # Optional where every layer has experts (qwen35moe files carry none); a dense layer needs it (checked below).
    n_ff_raw = get("feed_forward_length", (int,), required=False)
    n_ff = 0 if n_ff_raw is None else positive("feed_forward_length", _scalar(n_ff_raw, arch, "feed_forward_length",
                                                                               varies), 1 << 22)
    head_dim = get("attention.key_length", int, required=False)
    if head_dim is None:
        if n_embd % n_head:
            raise CorruptFileError(f"embedding size {n_embd} is not a multiple of {n_head} heads")
        head_dim = n_embd // n_head
    head_dim = positive("attention.key_length", head_dim, 1024)
    value_dim = get("attention.value_length", int, default=head_dim, required=False)
    if value_dim != head_dim:
        raise CorruptFileError(f"key length {head_dim} != value length {value_dim} is not supported")
    if head_dim % 2:
        raise CorruptFileError(f"head dimension {head_dim} must be even for RoPE")
    rope_dim = positive("rope.dimension_count", get("rope.dimension_count", int, default=head_dim, required=False), head_dim)
    if rope_dim % 2:
        raise CorruptFileError(f"RoPE dimension {rope_dim} must be even")
    context_length = positive("context_length", get("context_length", int), 1 << 24)
    rope_base = get("rope.freq_base", float, default=10000.0, required=False)
    if rope_base <= 1.0:
        raise CorruptFileError(f"RoPE base {rope_base} must be greater than 1")
    rms_eps = get("attention.layer_norm_rms_epsilon", float)
    if not 0.0 < rms_eps < 1.0:
        raise CorruptFileError(f"RMS norm epsilon {rms_eps} is out of range")

    vocab = get("vocab_size", int, default=array_length(md, "tokenizer.ggml.tokens"), required=False)
    if vocab is None:
        raise MissingMetadataError(f"missing metadata key '{arch}.vocab_size' (and no tokenizer.ggml.tokens)")
    vocab = positive("vocab_size", vocab, 1 << 22)

    # RoPE scaling.
    # As llama.cpp: the type defaults to linear; the factor may sit under the pre-2023 key rope.scale_linear;
    # a factor of 0 or 1 means no scaling.
    scaling = get("rope.scaling.type", str, default="linear", required=False)
    factor = get("rope.scaling.factor", float, required=False)
    if factor is None:
        factor = get("rope.scale_linear", float, default=1.0, required=False)
    factor = 1.0 if factor == 0.0 else factor
    original = positive(
        "rope.scaling.original_context_length",
        get("rope.scaling.original_context_length", int, default=context_length, required=False),
        1 << 24,
    )
    attn_factor = get("rope.scaling.attn_factor", float, default=1.0, required=False)
    beta_fast = get("rope.scaling.yarn_beta_fast", float, default=32.0, required=False)
    beta_slow = get("rope.scaling.yarn_beta_slow", float, default=1.0, required=False)
    if "rope_freqs.weight" in tensors:
        scaling = model.rope_freqs_scaling
    elif "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        scaling = "longrope"
        if "rope.scaling.attn_factor" not in {k.split(f"{arch}.", 1)[-1] for k in md}:
            # llama.cpp: attn_factor = sqrt(1 + ln(ctx/orig)/ln(orig)) when the file does not say
            ratio = context_length / original
            attn_factor = math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 and original > 1 else 1.0
    elif scaling == "yarn":
        if not factor > 0:
            raise CorruptFileError(f"YaRN scaling factor {factor} must be positive")
        if not 0 < beta_slow < beta_fast:
            raise CorruptFileError(f"YaRN betas fast {beta_fast} / slow {beta_slow} must satisfy 0 < slow < fast")
        log_mul = get("rope.scaling.yarn_log_multiplier", float, default=0.0, required=False)
        attn_factor *= _yarn_magnitude(factor, log_mul)
    elif scaling in ("none", "", "linear") and factor == 1.0:
        scaling = "none"
    elif scaling in ("none", "", "linear"):  # llama.cpp applies the factor whatever the type says here
        scaling = "linear"
        if not factor > 0:
            raise CorruptFileError(f"RoPE linear scaling factor {factor} must be positive")
    else:
        raise CorruptFileError(f"RoPE scaling {scaling!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")
    tok = lambda key: md.get(f"tokenizer.ggml.{key}")  # noqa: E731
    common = dict(n_layer=n_layer, n_blocks=n_blocks, n_embd=n_embd, n_head=n_head, head_dim=head_dim,
                  rope_freq_base=rope_base, rope_dim=rope_dim, n_ff=n_ff if n_ff_raw is not None else None)
    settings = model.settings(lambda key, kind, default=None: get(key, kind, default, required=False), common)
    own = {k: v for k, v in settings.items() if k in _ARCH_FIELDS}
    n_head_kv = settings.get("n_head_kv", n_head_kv)  # (gemma4: its global layers', beside its head_dim)
    layers = model.plans(n_layer, tensors, md, settings)
    if n_ff == 0 and any(not p.moe for p in layers):
        raise MissingMetadataError(f"missing metadata key '{arch}.feed_forward_length'")
    return ModelConfig(
        architecture=arch,
        name=str(md.get("general.name") or md.get("general.basename") or arch),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=n_ff,
        vocab_size=vocab,
        context_length=context_length,
        rope_type=model.rope_type,
        rope_dim=rope_dim,
        rope_freq_base=rope_base,
        rope_scaling=scaling,
        rope_scaling_factor=factor,
        rope_original_context=original,
        rope_attn_factor=attn_factor,
        rms_eps=rms_eps,
        tied_embeddings=bool(tensors) and "output.weight" not in tensors,
        bos_token_id=_token_id(tok("bos_token_id"), vocab),
        eos_token_id=_token_id(tok("eos_token_id"), vocab),
        layers=layers,
        rope_yarn_beta_fast=beta_fast,
        rope_yarn_beta_slow=beta_slow,
        **own,
    )


_ARCH_FIELDS = ("rope_local_base", "attn_scale", "embd_scale", "final_softcap", "n_expert", "n_expert_used",
                "n_ff_exp", "expert_weights_norm", "n_ff_shexp", "ssm_conv_kernel", "ssm_state_size", "ssm_group_count",
                "ssm_time_step_rank", "ssm_inner_size", "rope_sections", "rope_local_dim",
                "n_embd_per_layer")  # set by a model's settings


def _yarn_magnitude(factor: float, log_mul: float) -> float:
    """YaRN's multiplier on cos/sin: 0.1 ln(s) + 1 for a context stretched s times (transformers'
    get_mscale); with rope.scaling.yarn_log_multiplier m (DeepSeek-style files) the ratio
    mscale(s, 1) / mscale(s, m), as llama.cpp's llama-context.cpp computes it."""

    def mscale(s: float, m: float) -> float:
        return 1.0 if s <= 1.0 else 0.1 * m * math.log(s) + 1.0

    return mscale(factor, 1.0) / mscale(factor, log_mul) if log_mul else mscale(factor, 1.0)


def _scalar(value: Any, arch: str, key: str, varies: tuple[str, ...] = ()) -> int:
    """Some converters store per-layer arrays (head_count_kv, feed_forward_length); all layers must agree, unless
    the architecture reads the key per layer (`varies`: then the first layer's value, the architecture checks each)."""
    if isinstance(value, list):
        if not value or (len(set(map(repr, value))) != 1 and key not in varies):
            raise CorruptFileError(f"metadata key '{arch}.{key}' varies by layer ({value[:8]}...), not supported")
        value = value[0]
    if type(value) is bool or not isinstance(value, int):
        raise CorruptFileError(f"metadata key '{arch}.{key}' should be an integer, got {value!r}")
    return value


def _token_id(value: Any, vocab: int) -> int | None:
    if type(value) is int and 0 <= value < vocab:
        return value
    return None
