"""qwen3moe: Qwen3 mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B and their 2507 updates;
llama.cpp's src/models/qwen3moe.cpp, transformers' Qwen3MoeForCausalLM).

Qwen3's attention (per-head q/k RMSNorm before NEOX RoPE, no biases, head dim attention.key_length) and, in
every layer, a mixture of `expert_count` SwiGLU experts of width `expert_feed_forward_length` (llama.cpp's
default when absent: feed_forward_length / expert_used_count) in place of the dense FFN. No shared expert and
no dense layers: the GGUF carries no decoder_sparse_step / mlp_only_layers (both trivial in the released
models), and llama.cpp builds every layer as MoE. Router (moe.py "softmax"): softmax over all experts, the
top `expert_used_count`, renormalised to sum 1 (llama.cpp passes norm_w = true whatever the file says, and
transformers' GGUF loader defaults norm_topk_prob to true; we read `expert_weights_norm`, default true).

Tensors per layer: attn_norm [D], attn_q [Hq Dh, D], attn_k / attn_v [Hkv Dh, D], attn_q_norm / attn_k_norm
[Dh], attn_output [D, Hq Dh], ffn_norm [D], ffn_gate_inp [E, D] (F32 in real files), ffn_gate_exps /
ffn_up_exps [E, F_exp, D], ffn_down_exps [E, D, F_exp].
"""

from typing import Any, Callable

from ...errors import CorruptFileError, MissingMetadataError, UnknownArchitectureError
from ..base import ROPE_NEOX, Architecture, LayerInfo, LayerPlan

MAX_EXPERTS = 4096  # llama.cpp's LLAMA_MAX_EXPERTS is 512; anything near this bound is a hostile file


def expert_settings(get: Callable[..., Any], arch: str, n_ff: int | None, norm_default: bool) -> dict[str, Any]:
    """n_expert, n_expert_used, n_ff_exp, expert_weights_norm from `<arch>.expert_*`, checked: 1 <= used <= count
    <= MAX_EXPERTS, 0 < n_ff_exp <= 2^20. `n_ff`: the fallback width feed_forward_length / used when the file
    has no expert_feed_forward_length (llama.cpp's qwen3moe); None makes the key required (gpt-oss)."""

    def need(key: str) -> int:
        value = get(key, int)
        if value is None:
            raise MissingMetadataError(f"missing metadata key '{arch}.{key}'")
        return value

    n_expert, used = need("expert_count"), need("expert_used_count")
    if not 0 < n_expert <= MAX_EXPERTS:
        raise CorruptFileError(f"metadata key '{arch}.expert_count' has an impossible value {n_expert}")
    if not 0 < used <= n_expert:
        raise CorruptFileError(f"metadata key '{arch}.expert_used_count' is {used}, not between 1 and the "
                               f"{n_expert} experts")
    ff_exp = get("expert_feed_forward_length", int) if n_ff is not None else need("expert_feed_forward_length")
    if ff_exp is None:
        ff_exp = n_ff // used  # type: ignore[operator]
    if not 0 < ff_exp <= 1 << 20:
        raise CorruptFileError(f"metadata key '{arch}.expert_feed_forward_length' has an impossible value {ff_exp}")
    norm = get("expert_weights_norm", bool, norm_default)
    if type(norm) is not bool:
        raise CorruptFileError(f"metadata key '{arch}.expert_weights_norm' should be a boolean, got {norm!r}")
    scale = get("expert_weights_scale", float, None)
    if scale not in (None, 0.0, 1.0):
        raise UnknownArchitectureError(f"this {arch} file scales its expert weights by {scale:g} "
                                       f"(expert_weights_scale), which llamacli does not run")
    return {"n_expert": n_expert, "n_expert_used": used, "n_ff_exp": ff_exp, "expert_weights_norm": norm}


def check_experts(arch: str, tensors: frozenset[str], shared: bool = False) -> None:
    """Refuse expert layouts no plan describes, by name, before check_tensors reports a missing tensor. `shared`:
    the architecture has a shared expert (qwen35moe, qwen3next), else one is refused."""
    if any(name.endswith(".ffn_gate_up_exps.weight") for name in tensors):
        raise UnknownArchitectureError(f"this {arch} file stores its experts' gate and up matrices fused "
                                       "(ffn_gate_up_exps), which llamacli does not run yet")
    if not shared and ("blk.0.ffn_gate_shexp.weight" in tensors or "blk.0.ffn_up_shexp.weight" in tensors):
        raise UnknownArchitectureError(f"this {arch} file has a shared expert, which {arch} does not define")


def _settings(get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    n_ff = get("feed_forward_length", int)
    return expert_settings(get, "qwen3moe", n_ff if isinstance(n_ff, int) else 0, norm_default=True)


def _layer(info: LayerInfo) -> LayerPlan:
    return LayerPlan(qk_norm=True, moe=True, moe_gating="softmax")


ARCH = Architecture(name="qwen3moe", rope_type=ROPE_NEOX, layer=_layer, settings=_settings,
                    check=lambda metadata, tensors: check_experts("qwen3moe", tensors))
