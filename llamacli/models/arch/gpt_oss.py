"""gpt-oss: OpenAI's gpt-oss-20b / gpt-oss-120b (GGUF architecture "gpt-oss"; llama.cpp's LLM_ARCH_OPENAI_MOE,
src/models/openai-moe-iswa.cpp; transformers' GptOssForCausalLM).

Per block:
- attention with biases on q, k, v and the output projection; NEOX RoPE with YaRN scaling (factor 32 over
  4096 positions in the released files, read by models/config.py) on every layer, the same table everywhere;
  queries scaled by 1/sqrt(head_dim) (64; Hq Dh = 4096 != D = 2880);
- attention sinks: a learned logit per query head joins each softmax denominator (attn_sinks [Hq]);
- sliding-window attention (`attention.sliding_window`, 128) on alternate layers: layer il is local when
  il % 2 == 0 (llama.cpp's set_swa_pattern(2), or as attention.sliding_window_pattern says; transformers'
  layer_types: "sliding_attention" for even il);
- the FFN pre-norm is stored as post_attention_norm (the name the converter's mapping gives HF's
  post_attention_layernorm here), then a mixture of `expert_count` experts: router logits plus bias, the top
  `expert_used_count`, softmax over those (moe.py "topk_softmax"); each expert's gate and up with biases,
  the clamped SwiGLU (gate = min(gate, 7), up = clip(up, -7, 7), gate sigmoid(1.702 gate) (up + 1)), down
  with its bias.
YaRN as llama.cpp computes it: the ramp's ends rounded (floor/ceil), where the released config.json says
"truncate": false (transformers then keeps them unrounded, a small difference: ends 8 / 18 instead of 8.09 /
17.40); we follow llama.cpp, and the test against transformers builds it with truncate=True.
No tied embeddings. Real files keep the experts in MXFP4, the other matrices in Q8_0, the router, norms,
biases and sinks in F32 (file type 38, MXFP4_MOE).

Tensors per layer: attn_norm [D], attn_q [Hq Dh, D] + bias, attn_k / attn_v [Hkv Dh, D] + biases,
attn_output [D, Hq Dh] + bias [D], attn_sinks [Hq], post_attention_norm [D], ffn_gate_inp [E, D] + bias [E],
ffn_gate_exps / ffn_up_exps [E, F_exp, D] + biases [E, F_exp], ffn_down_exps [E, D, F_exp] + bias [E, D].
"""

from typing import Any, Callable

from ...errors import MissingMetadataError, UnknownArchitectureError
from ..base import ROPE_NEOX, Architecture, LayerInfo, LayerPlan
from .gemma3 import checked, local_layers
from .qwen3moe import check_experts, expert_settings

NAME = "gpt-oss"


def _settings(get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    window = get("attention.sliding_window", int)
    if window is None:  # llama.cpp requires it too
        raise MissingMetadataError(f"missing metadata key '{NAME}.attention.sliding_window'")
    swa_base = get("rope.freq_base_swa", float, None)
    if swa_base is not None and swa_base != common["rope_freq_base"]:
        raise UnknownArchitectureError(f"this {NAME} file rotates its sliding-window layers with another RoPE "
                                       f"base ({swa_base:g}), which llamacli does not run yet")
    return {
        **expert_settings(get, NAME, None, norm_default=False),
        "window": checked("sliding window", window, 1, 1 << 24),
        "local": local_layers(get, common["n_layer"], 2),
    }


def _layer(info: LayerInfo) -> LayerPlan:
    s = info.settings
    return LayerPlan(qkv_bias=True, o_bias=True, sinks=True, window=s["window"] if s["local"][info.index] else 0,
                     moe=True, moe_gating="topk_softmax", moe_bias=True, activation="swiglu_oai")


ARCH = Architecture(name=NAME, rope_type=ROPE_NEOX, layer=_layer, settings=_settings,
                    check=lambda metadata, tensors: check_experts(NAME, tensors),
                    tensor_names={"ffn_norm": "post_attention_norm.weight"})
