"""qwen35moe: Qwen3.5 / Qwen3.6 mixtures of experts (35B-A3B, 122B-A10B, 397B-A17B; llama.cpp's
src/models/qwen35moe.cpp, transformers' Qwen3_5MoeForCausalLM).

Qwen3.5's hybrid blocks (qwen35.py: Gated DeltaNet and gated attention layers, imrope sections), with the FFN of
every layer a mixture of `expert_count` SwiGLU experts of width `expert_feed_forward_length` (the router
ffn_gate_inp: softmax over all experts, the top `expert_used_count`, renormalised to sum 1, as llama.cpp and
transformers' Qwen3_5MoeTopKRouter compute it), plus a shared expert of width
`expert_shared_feed_forward_length` whose output is scaled by sigmoid(h . ffn_gate_inp_shexp), added to the
experts'. The files carry no feed_forward_length.

Tensors per layer beyond the mixer's (qwen35.py): post_attention_norm [D], ffn_gate_inp [E, D],
ffn_gate_exps / ffn_up_exps [E, F_exp, D], ffn_down_exps [E, D, F_exp], ffn_gate_inp_shexp [1, D],
ffn_gate_shexp / ffn_up_shexp [F_sh, D], ffn_down_shexp [D, F_sh].
"""

from __future__ import annotations

from typing import Any, Callable

from ..base import ROPE_NEOX, Architecture, LayerInfo, LayerPlan
from .qwen3moe import check_experts, expert_settings
from .qwen35 import FFN_NORM, hybrid_layer, hybrid_settings, shared_expert_width

NAME = "qwen35moe"


def _settings(get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    return {**hybrid_settings(get, common, NAME, sections=True),
            **expert_settings(get, NAME, common["n_ff"], norm_default=True),
            "n_ff_shexp": shared_expert_width(get, common, NAME)}


def _layer(info: LayerInfo) -> LayerPlan:
    return hybrid_layer(info, moe=True, moe_gating="softmax", shared_expert=True)


ARCH = Architecture(name=NAME, rope_type=ROPE_NEOX, layer=_layer, settings=_settings, tensor_names=FFN_NORM,
                    check=lambda metadata, tensors: check_experts(NAME, tensors, shared=True))
