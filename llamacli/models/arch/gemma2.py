"""gemma2: Gemma 2 (2B, 9B, 27B) (llama.cpp's src/models/gemma2.cpp; transformers' Gemma2).

Gemma 3's block without the q/k norms: post_attention_norm and post_ffw_norm, GeGLU, embeddings scaled by
sqrt(n_embd), NEOX RoPE; sliding-window attention (`attention.sliding_window`, default 4096) on every other
layer (layer il is local when il % 2 == 0, or as attention.sliding_window_pattern says), the same RoPE on
every layer (unless the file gives rope.freq_base_swa); attention logits soft-capped, s -> c tanh(s / c)
with c = attn_logit_softcapping (default 50), after the query scale (1/sqrt(head_dim); the 27B, 46 layers:
1/sqrt(n_embd / n_head)); final logits soft-capped by final_logit_softcapping (default 30); tied output.
"""

import math
from typing import Any, Callable

from ..base import ROPE_NEOX, Architecture, LayerInfo, LayerPlan
from .gemma3 import checked, local_layers


def _settings(get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    n_layer, n_embd, n_head = common["n_layer"], common["n_embd"], common["n_head"]
    swa_base = get("rope.freq_base_swa", float, None)
    return {
        "window": checked("sliding window", get("attention.sliding_window", int, 4096), 1, 1 << 24),
        "local": local_layers(get, n_layer, 2),
        "local_rope": swa_base is not None,
        "rope_local_base": checked("local RoPE base", swa_base or common["rope_freq_base"], 1.0 + 1e-9, 1e12),
        "softcap": checked("attention soft-cap", get("attn_logit_softcapping", float, 50.0), 0.0, 1e6),
        "attn_scale": 1.0 / math.sqrt(n_embd / n_head) if n_layer == 46 else 1.0 / math.sqrt(common["head_dim"]),
        "embd_scale": math.sqrt(n_embd),
        "final_softcap": checked("final soft-cap", get("final_logit_softcapping", float, 30.0), 0.0, 1e6),
    }


def _layer(info: LayerInfo) -> LayerPlan:
    s = info.settings
    local = s["local"][info.index]
    return LayerPlan(post_norms=True, activation="gelu_tanh", window=s["window"] if local else 0,
                     rope_local=local and s["local_rope"], attn_softcap=s["softcap"])


ARCH = Architecture(name="gemma2", rope_type=ROPE_NEOX, layer=_layer, settings=_settings)
