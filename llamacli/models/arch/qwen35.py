"""qwen35: Qwen3.5 / Qwen3.6 dense models (0.8B-27B; llama.cpp's src/models/qwen35.cpp, transformers'
Qwen3_5ForCausalLM and the text part of Qwen3_5ForConditionalGeneration). The helpers here serve qwen35moe.py and
qwen3next.py too.

A hybrid of two layer kinds (attention.recurrent_layers says which, else every full_attention_interval-th layer,
default 4, is attention and the others linear):
- Gated DeltaNet layers (linear attention, block.py Conv / DeltaRule / GatedNorm): x -> attn_qkv -> a causal
  depthwise convolution of width K over the last K tokens' q/k/v, then SiLU; q and k L2-normalised per head;
  per value head a d_k x d_v state S updated token by token by the gated delta rule with a decay
  exp(ssm_a softplus(alpha + ssm_dt)) and a rate sigmoid(beta); the output S^T q RMS-normalised per head
  (ssm_norm) times SiLU(z), z = attn_gate x; then ssm_out. Their memory per sequence is that state and the
  convolution's window, whatever the context.
- gated full attention layers: attn_q gives per head [q; gate] (2 Dh rows a head), q and k RMS-normalised per
  head, RoPE on the first rope.dimension_count dims (64 of 256: partial rotary), causal GQA, the output times
  sigmoid(gate), then attn_output.
Each block: attn_norm, the mixer, a residual add; post_attention_norm (the FFN's pre-norm, named so by the
converter), the FFN (SwiGLU here; experts and a shared expert in qwen35moe / qwen3next), a residual add.
RoPE: NEOX pairing with "imrope" sections (rope.dimension_sections, required as llama.cpp requires it): for text
every section rotates at the token's position (config.py rope_sections, rope.py).

What the converter (convert_hf_to_gguf.py, conversion/qwen.py) changed from the checkpoint, and so what we read:
the RMSNorm weights are stored as 1 + w (the checkpoint's norms scale by 1 + w) except the delta net's output
norm (ssm_norm, as is); A_log as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; conv1d [C, 1, K] as ssm_conv1d
[C, K]; and where Hv > Hk the value heads (the v rows of attn_qkv and v channels of ssm_conv1d, the rows of
attn_gate, ssm_beta, ssm_alpha, ssm_a, ssm_dt, the columns of ssm_out) reordered from grouped by key head to
tiled, so that value head j reads key head j % Hk. The multi-token-prediction block (blk.<n_layer>.nextn.* and its
attention / FFN tensors, nextn_predict_layers) is read past (config.py).

Keys: ssm.conv_kernel (K), ssm.state_size (d_k = d_v), ssm.group_count (Hk), ssm.time_step_rank (Hv),
ssm.inner_size (Hv d_v), attention.recurrent_layers / full_attention_interval, rope.dimension_sections.
Tensors per delta-net layer: attn_norm [D], attn_qkv [2 Hk d_k + Hv d_v, D], attn_gate [Hv d_v, D],
ssm_beta / ssm_alpha [Hv, D], ssm_conv1d [2 Hk d_k + Hv d_v, K], ssm_dt.bias [Hv], ssm_a [Hv], ssm_norm [d_v],
ssm_out [D, Hv d_v]; per attention layer: attn_norm [D], attn_q [2 Hq Dh, D], attn_k / attn_v [Hkv Dh, D],
attn_q_norm / attn_k_norm [Dh], attn_output [D, Hq Dh]; every layer: post_attention_norm [D], ffn_gate /
ffn_up [F, D], ffn_down [D, F].
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import CorruptFileError, MissingMetadataError
from ..base import ROPE_NEOX, Architecture, LayerInfo, LayerPlan

MAX_CONV_KERNEL = 256  # llama.cpp sets no bound; real files have 4
MAX_STATE_SIZE = 1024  # d_k = d_v (128 in real files)
MAX_HEADS = 4096  # Hk, Hv (at most 64 in real files)
FFN_NORM = {"ffn_norm": "post_attention_norm.weight"}  # the FFN's pre-norm, as the converter names it


def hybrid_settings(get: Callable[..., Any], common: dict[str, Any], arch: str, sections: bool) -> dict[str, Any]:
    """The delta net's sizes (ModelConfig ssm_*), which layers are recurrent ("recurrent": a flag per layer) and,
    when `sections` (qwen35's imrope; qwen3next rotates without), the RoPE sections, required as llama.cpp requires
    them. Each checked: one line for a file that contradicts itself."""

    def need(key: str, low: int, high: int, what: str) -> int:
        value = get(key, int)
        if value is None:
            raise MissingMetadataError(f"missing metadata key '{arch}.{key}' ({what})")
        if not low <= value <= high:
            raise CorruptFileError(f"metadata key '{arch}.{key}' has an impossible value {value} ({what})")
        return value

    conv = need("ssm.conv_kernel", 1, MAX_CONV_KERNEL, "the delta net's convolution width")
    d_k = need("ssm.state_size", 1, MAX_STATE_SIZE, "the delta net's key head size")
    h_k = need("ssm.group_count", 1, MAX_HEADS, "the delta net's key heads")
    h_v = need("ssm.time_step_rank", 1, MAX_HEADS, "the delta net's value heads")
    inner = need("ssm.inner_size", 1, MAX_HEADS * MAX_STATE_SIZE, "the delta net's value width")
    if h_v % h_k:
        raise CorruptFileError(f"the delta net's {h_v} value heads (ssm.time_step_rank) cannot share its {h_k} key "
                               f"heads (ssm.group_count)")
    if inner != h_v * d_k:  # llama.cpp's state is [d_k, d_v] per value head with d_v = d_k
        raise CorruptFileError(f"the delta net's state shapes disagree: ssm.inner_size {inner} is not "
                               f"ssm.time_step_rank {h_v} x ssm.state_size {d_k}")
    out = {"ssm_conv_kernel": conv, "ssm_state_size": d_k, "ssm_group_count": h_k, "ssm_time_step_rank": h_v,
           "ssm_inner_size": inner, "recurrent": recurrent_layers(get, common, arch)}
    if sections:
        secs = get("rope.dimension_sections", list)
        if secs is None:
            raise MissingMetadataError(f"missing metadata key '{arch}.rope.dimension_sections'")
        out["rope_sections"] = rope_sections(secs, arch)
    return out


def recurrent_layers(get: Callable[..., Any], common: dict[str, Any], arch: str) -> tuple[bool, ...]:
    """Which of the n_layer blocks are delta-net layers, as llama.cpp reads it: attention.recurrent_layers (a flag
    per block, the MTP blocks' included), else every full_attention_interval-th layer (il + 1) % interval == 0
    (default 4) is attention and the others recurrent."""
    n_layer = common["n_layer"]
    flags = get("attention.recurrent_layers", list)
    if flags is not None:
        if not isinstance(flags, list) or not n_layer <= len(flags) <= common["n_blocks"] or \
                any(type(f) not in (bool, int) or f not in (0, 1) for f in flags):
            raise CorruptFileError(f"metadata key '{arch}.attention.recurrent_layers' should hold a flag for each "
                                   f"of the {common['n_blocks']} blocks")
        return tuple(bool(f) for f in flags[:n_layer])
    interval = get("full_attention_interval", int, 4)
    if not 1 <= interval <= 4096:
        raise CorruptFileError(f"metadata key '{arch}.full_attention_interval' has an impossible value {interval}")
    return tuple((i + 1) % interval != 0 for i in range(n_layer))


def rope_sections(value: Any, arch: str) -> tuple[int, ...]:
    """rope.dimension_sections: up to four non-negative counts of rotated pairs (time, height, width, extra; ggml's
    rope_multi), not all zero; padded to four."""
    if not isinstance(value, list) or not 0 < len(value) <= 4 or \
            any(type(v) is not int or not 0 <= v <= 1 << 16 for v in value) or not sum(value):
        raise CorruptFileError(f"metadata key '{arch}.rope.dimension_sections' should be up to four non-negative "
                               f"section sizes, not all zero (got {value!r:.80})")
    return tuple(value) + (0,) * (4 - len(value))


def shared_expert_width(get: Callable[..., Any], common: dict[str, Any], arch: str) -> int:
    """expert_shared_feed_forward_length, else feed_forward_length (llama.cpp's fallback)."""
    width = get("expert_shared_feed_forward_length", int)
    if width is None:
        width = common["n_ff"]
    if width is None:
        raise MissingMetadataError(f"missing metadata key '{arch}.expert_shared_feed_forward_length'")
    if not 0 < width <= 1 << 22:
        raise CorruptFileError(f"metadata key '{arch}.expert_shared_feed_forward_length' has an impossible value {width}")
    return width


def hybrid_layer(info: LayerInfo, ssm_heads: str = "tiled", ssm_ba: bool = False, **ffn: Any) -> LayerPlan:
    """A delta-net layer or a gated attention layer (q/k norm, output gate), as info.settings["recurrent"] says,
    with the FFN fields `ffn` (moe, shared_expert, ...)."""
    if info.settings["recurrent"][info.index]:
        return LayerPlan(mixer="delta_net", ssm_heads=ssm_heads, ssm_ba=ssm_ba, **ffn)
    return LayerPlan(qk_norm=True, attn_gate=True, **ffn)


def _settings(get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    return hybrid_settings(get, common, "qwen35", sections=True)


ARCH = Architecture(name="qwen35", rope_type=ROPE_NEOX, layer=hybrid_layer, settings=_settings, tensor_names=FFN_NORM)
