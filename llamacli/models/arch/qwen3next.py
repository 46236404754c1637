"""qwen3next: Qwen3-Next-80B-A3B and Qwen3-Coder-Next (llama.cpp's src/models/qwen3next.cpp, transformers'
Qwen3NextForCausalLM).

The hybrid blocks of qwen35.py (Gated DeltaNet layers and gated attention layers; every fourth layer attention
by default) with qwen35moe's FFN (experts, softmax routing renormalised, a shared expert gated by a sigmoid), and
three differences in the file:
- beta and alpha come from one matrix ssm_ba [2 Hv, D] whose rows go per key head: [beta of its Hv/Hk value
  heads; alpha of them] (the checkpoint's in_proj_ba, kept as it is);
- the value heads stay grouped by key head (the converter splits in_proj_qkvz into attn_qkv and attn_gate but
  does not reorder them): value head j reads key head j // (Hv / Hk);
- plain NEOX RoPE on the first rope.dimension_count dims (no sections).
A layer whose file has a dense FFN (ffn_gate / ffn_up / ffn_down, as the checkpoint's mlp_only_layers make) runs
it, as llama.cpp does; the others have experts. Early conversions with one fused ssm_in [q; k; v; z] matrix are
refused by name.

Tensors per delta-net layer: attn_norm, attn_qkv, attn_gate, ssm_ba [2 Hv, D], ssm_conv1d, ssm_dt.bias, ssm_a,
ssm_norm, ssm_out (shapes as qwen35.py); per attention layer and FFN as qwen35.py / qwen35moe.py.
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import UnknownArchitectureError
from ..base import ROPE_NEOX, Architecture, LayerInfo, LayerPlan
from .qwen3moe import check_experts, expert_settings
from .qwen35 import FFN_NORM, hybrid_layer, hybrid_settings, shared_expert_width

NAME = "qwen3next"


def _settings(get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    return {**hybrid_settings(get, common, NAME, sections=False),
            **expert_settings(get, NAME, common["n_ff"], norm_default=True),
            "n_ff_shexp": shared_expert_width(get, common, NAME)}


def _layer(info: LayerInfo) -> LayerPlan:
    dense = f"blk.{info.index}.ffn_up.weight" in info.tensors and f"blk.{info.index}.ffn_gate_inp.weight" not in info.tensors
    ffn: dict[str, Any] = {} if dense else {"moe": True, "moe_gating": "softmax", "shared_expert": True}
    return hybrid_layer(info, ssm_heads="grouped", ssm_ba=True, **ffn)


def _check(metadata: Any, tensors: frozenset[str]) -> None:
    check_experts(NAME, tensors, shared=True)
    if any(name.endswith(".ssm_in.weight") for name in tensors):
        raise UnknownArchitectureError(f"this {NAME} file has the fused ssm_in matrix of early conversions, which "
                                       "llamacli does not run: convert the model again with a current "
                                       "convert_hf_to_gguf.py (it writes attn_qkv and attn_gate)")


ARCH = Architecture(name=NAME, rope_type=ROPE_NEOX, layer=_layer, settings=_settings, tensor_names=FFN_NORM,
                    check=_check)
