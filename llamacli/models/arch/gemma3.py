"""gemma3: Gemma 3 (270M-27B) text models (llama.cpp's src/models/gemma3.cpp; transformers' Gemma3).

Per block: q/k RMSNorm per head before NEOX RoPE; post_attention_norm and post_ffw_norm on the attention and
FFN outputs before each residual add; GeGLU (gelu, tanh approximation). Sliding-window attention
(`attention.sliding_window`, 512 for the 270M) on five of every six layers (layer il is local when
il % 6 < 5; `attention.sliding_window_pattern` may say another period or list the layers), and those local
layers rotate with base `rope.freq_base_swa` (10,000) and no scaling; the global layers with the file's base
and its linear scaling. Embeddings scaled by sqrt(n_embd); query scale 1/sqrt(head_dim), or
1/sqrt(n_embd / n_head) for the 27B (62 layers); norm weights used as stored (the converter folded Gemma's
"1 +" into them); tied output. `final_logit_softcapping` if the file sets it.

Tensors per layer: attn_norm [D], attn_q [Hq Dh, D], attn_k / attn_v [Hkv Dh, D], attn_q_norm / attn_k_norm
[Dh], attn_output [D, Hq Dh], post_attention_norm [D], ffn_norm [D], ffn_gate / ffn_up [F, D], ffn_down
[D, F], post_ffw_norm [D].
"""

import math
from typing import Any, Callable

from ...errors import CorruptFileError
from ..base import ROPE_NEOX, Architecture, LayerInfo, LayerPlan


def local_layers(get: Callable[..., Any], n_layer: int, period: int) -> tuple[bool, ...]:
    """Which layers use the sliding window, as llama.cpp's load_swa_pattern reads it: a per-layer list in
    attention.sliding_window_pattern, or a period p there (default `period`): layer il is local when
    il % p < p - 1 (p = 0: every layer)."""
    pattern = get("attention.sliding_window_pattern", None)
    if isinstance(pattern, list):
        flags = tuple(bool(x) for x in pattern[:n_layer])
        return flags + (False,) * (n_layer - len(flags))
    p = pattern if type(pattern) is int and pattern >= 0 else period
    return tuple(p == 0 or i % p < p - 1 for i in range(n_layer))


def checked(name: str, value: Any, low: float, high: float) -> Any:
    """A setting within [low, high], else the file is corrupt."""
    if not low <= value <= high:
        raise CorruptFileError(f"{name} {value!r} is out of range")
    return value


def _settings(get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    window = checked("sliding window", get("attention.sliding_window", int, 0), 0, 1 << 24)
    n_layer, n_embd, n_head = common["n_layer"], common["n_embd"], common["n_head"]
    big = n_layer == 62  # the 27B scales queries by the embedding per head, not the head dim
    return {
        "window": window,
        "local": local_layers(get, n_layer, 6) if window > 0 else (False,) * n_layer,
        "rope_local_base": checked("local RoPE base", get("rope.freq_base_swa", float, 10000.0), 1.0 + 1e-9, 1e12),
        "attn_scale": 1.0 / math.sqrt(n_embd / n_head) if big else 1.0 / math.sqrt(common["head_dim"]),
        "embd_scale": math.sqrt(n_embd),
        "final_softcap": checked("final soft-cap", get("final_logit_softcapping", float, 0.0), 0.0, 1e6),
    }


def _layer(info: LayerInfo) -> LayerPlan:
    local = info.settings["local"][info.index]
    return LayerPlan(qk_norm=True, post_norms=True, activation="gelu_tanh",
                     window=info.settings["window"] if local else 0, rope_local=local)


ARCH = Architecture(name="gemma3", rope_type=ROPE_NEOX, layer=_layer, settings=_settings)
