"""gemma4: Gemma 4 text models (E2B, E4B, 26B-A4B, 31B; llama.cpp's src/models/gemma4.cpp, transformers'
Gemma4ForCausalLM and the text model of Gemma4ForConditionalGeneration).

Gemma 3's block (pre- and post-norms around attention and FFN, q/k RMSNorm per head, GeGLU, embeddings scaled by
sqrt(n_embd), sliding-window layers as `attention.sliding_window_pattern` says), with:
- two attention geometries: sliding layers have heads of `attention.key_length_swa` (256) and rotate all
  `rope.dimension_count_swa` dims with base `rope.freq_base_swa` (10,000); global layers have heads of
  `attention.key_length` (512) and "proportional" RoPE: base `rope.freq_base`, exponents over the whole head, the
  pairs past the first quarter not rotating (the converter writes them as rope_freqs factors 1e30, which llama.cpp
  and rope.py divide by); `attention.head_count_kv` may hold one count per layer (the big models' global layers
  have fewer KV heads);
- no query scale (1.0; the q/k norms set the scores' size), and V RMS-normalised per head without a weight; the
  global layers of the 26B-A4B and 31B have no attn_v (V is K's projection, before K's norm);
- shared KV (`attention.shared_kv_layers` = n): the last n layers compute only queries and attend over the cache of
  the last earlier layer of their kind (transformers' kv_sharing_modes): the sliding ones layer L - n - 2's, the
  global ones layer L - n - 1's (llama.cpp's rule, which needs those two to be a sliding then a global layer); they
  keep no cache of their own;
- per-layer embeddings (`embedding_length_per_layer_input` = P > 0: E2B, E4B): block.per_layer_inputs mixes a
  per-layer token embedding (per_layer_token_embd [V, L P]) with a projection of the embedded input, and after its
  FFN each layer adds post_norm(proj(gelu(inp_gate x) * its slice)) to the residual stream;
- the 26B-A4B's layers run a mixture of experts (a router ffn_gate_inp on rms_norm(x) * ffn_gate_inp.scale /
  sqrt(D); softmax, top `expert_used_count`, renormalised, each weight times ffn_down_exps.scale) beside the dense
  GeGLU FFN, each branch with its own norms, the two added;
- each block's output times layer_output_scale; the final logits soft-capped by `final_logit_softcapping` (30).
Norm weights are used as stored (Gemma 4's RMSNorm scales by w, not 1 + w: the converter adds nothing).

Tensors per layer: attn_norm [D], attn_q [Hq Dh, D], attn_q_norm [Dh], attn_output [D, Hq Dh], post_attention_norm
[D]; a layer that keeps its own KV: attn_k [Hkv Dh, D], attn_k_norm [Dh], attn_v [Hkv Dh, D] (unless V = K);
ffn_norm [D], ffn_gate / ffn_up [F, D], ffn_down [D, F], post_ffw_norm [D]; experts: ffn_gate_inp [E, D],
ffn_gate_inp.scale [D], ffn_gate_up_exps [E, 2 F_exp, D] (or ffn_gate_exps / ffn_up_exps [E, F_exp, D]),
ffn_down_exps [E, D, F_exp], ffn_down_exps.scale [E], post_ffw_norm_1, pre_ffw_norm_2, post_ffw_norm_2 [D];
per-layer embeddings: inp_gate [P, D], proj [D, P], post_norm [D]; layer_output_scale [1]. Whole model: token_embd,
output_norm, rope_freqs [Dh / 2], per_layer_token_embd, per_layer_model_proj, per_layer_proj_norm.

A file with image or audio encoders keeps them in a separate mmproj GGUF (the converter's Gemma4VisionAudioModel):
the text model's file has none, and tensors outside the plan's are read past.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ...errors import CorruptFileError, MissingMetadataError, MissingTensorError
from ..base import ROPE_NEOX, Architecture, LayerInfo, LayerPlan
from .gemma3 import checked
from .qwen3moe import expert_settings

NAME = "gemma4"
MAX_HEADS = 4096


def _need(get: Callable[..., Any], key: str, kind: type, what: str) -> Any:
    value = get(key, kind)
    if value is None:
        raise MissingMetadataError(f"missing metadata key '{NAME}.{key}' ({what})")
    return value


def per_layer(get: Callable[..., Any], key: str, n_layer: int, low: int, high: int, default: int) -> tuple[int, ...]:
    """A key that holds one integer, or one per layer (llama.cpp's get_key_or_arr), as a value per layer, each within
    [low, high]."""
    value = get(key, list)
    value = default if value is None else value
    values = value if isinstance(value, list) else [value] * n_layer
    if len(values) != n_layer or any(type(v) is not int or not low <= v <= high for v in values):
        raise CorruptFileError(f"metadata key '{NAME}.{key}' should hold an integer between {low} and {high}, or one "
                               f"for each of the {n_layer} layers (got {value!r:.80})")
    return tuple(values)


def sharing(local: tuple[bool, ...], shared: int) -> tuple[int, ...]:
    """For each layer, the layer whose K/V cache it reads: itself (-1), or for the last `shared` layers the last
    earlier layer of their kind that keeps its own, which llama.cpp takes to be layer L - shared - 2 for a sliding
    layer and L - shared - 1 for a global one. A file where the two disagree, or that leaves fewer than two layers
    their own KV, is refused."""
    n_layer = len(local)
    first = n_layer - shared
    if shared and shared > n_layer - 2:
        raise CorruptFileError(f"metadata key '{NAME}.attention.shared_kv_layers' is {shared}: at most {n_layer - 2} "
                               f"of the {n_layer} layers may share another layer's KV cache")
    out = []
    kind = lambda i: "sliding" if local[i] else "global"  # noqa: E731
    for i in range(n_layer):
        if i < first:
            out.append(-1)
            continue
        src = first - 2 if local[i] else first - 1  # llama.cpp's reuse rule (llama-model.cpp)
        if local[src] != local[i]:
            raise CorruptFileError(f"metadata keys '{NAME}.attention.shared_kv_layers' ({shared}) and "
                                   f"'{NAME}.attention.sliding_window_pattern' disagree: shared-KV layer {i} ("
                                   f"{kind(i)}) would read the cache of layer {src}, a {kind(src)} layer")
        out.append(src)
    return tuple(out)


def _settings(get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
    n_layer, n_head, n_embd = common["n_layer"], common["n_head"], common["n_embd"]
    pattern = _need(get, "attention.sliding_window_pattern", list, "which layers are sliding-window ones")
    if not isinstance(pattern, list) or len(pattern) != n_layer or \
            any(type(f) not in (bool, int) or f not in (0, 1) for f in pattern):
        raise CorruptFileError(f"metadata key '{NAME}.attention.sliding_window_pattern' should hold a flag for each "
                               f"of the {n_layer} layers (got {pattern!r:.80})")
    local = tuple(bool(f) for f in pattern)
    window = checked("sliding window", _need(get, "attention.sliding_window", int, "the sliding window"), 1, 1 << 24)
    head_swa = _need(get, "attention.key_length_swa", int, "the sliding layers' head size")
    if not 0 < head_swa <= 1024 or head_swa % 2:
        raise CorruptFileError(f"metadata key '{NAME}.attention.key_length_swa' has an impossible value {head_swa}")
    if get("attention.value_length_swa", int, head_swa) != head_swa:
        raise CorruptFileError(f"the sliding layers' key length {head_swa} != value length "
                               f"{get('attention.value_length_swa', int)} is not supported")
    rope_swa = get("rope.dimension_count_swa", int, head_swa)
    if not 0 < rope_swa <= head_swa or rope_swa % 2:
        raise CorruptFileError(f"metadata key '{NAME}.rope.dimension_count_swa' is {rope_swa}: it should be even and "
                               f"at most the sliding layers' head size {head_swa}")
    kv_heads = per_layer(get, "attention.head_count_kv", n_layer, 1, MAX_HEADS, n_head)
    for n in set(kv_heads):
        if n_head % n:
            raise CorruptFileError(f"{n_head} attention heads cannot be shared by {n} KV heads")
    if common["n_ff"] is None:  # every layer has the dense FFN, the 26B-A4B's beside its experts
        raise MissingMetadataError(f"missing metadata key '{NAME}.feed_forward_length'")
    ffn = per_layer(get, "feed_forward_length", n_layer, 1, 1 << 22, common["n_ff"])
    shared = get("attention.shared_kv_layers", int, 0)
    if type(shared) is not int or shared < 0:
        raise CorruptFileError(f"metadata key '{NAME}.attention.shared_kv_layers' has an impossible value {shared!r}")
    per_layer_width = _need(get, "embedding_length_per_layer_input", int, "the per-layer embeddings' width, 0 for none")
    if not 0 <= per_layer_width <= 1 << 16:
        raise CorruptFileError(f"metadata key '{NAME}.embedding_length_per_layer_input' has an impossible value "
                               f"{per_layer_width}")
    experts = expert_settings(get, NAME, None, norm_default=True) if get("expert_count", int) is not None else {}
    if experts:  # llama.cpp renormalises the chosen weights whatever the file says, as transformers' router does
        experts["expert_weights_norm"] = True
    globals_ = [i for i in range(n_layer) if not local[i]]
    return {
        **experts,
        "local": local,
        "window": window,
        "head_dim_swa": head_swa,
        "head_dim_full": common["head_dim"],
        "kv_heads": kv_heads,
        "ffn": ffn,
        "kv_from": sharing(local, shared),
        "n_head_kv": kv_heads[globals_[-1]] if globals_ else kv_heads[0],  # the config's, beside its head_dim
        "rope_local_dim": rope_swa,
        "rope_local_base": checked("local RoPE base", get("rope.freq_base_swa", float, 10000.0), 1.0 + 1e-9, 1e12),
        "attn_scale": 1.0,  # (the q and k norms set the scores' size: no 1/sqrt(head_dim))
        "embd_scale": math.sqrt(n_embd),
        "final_softcap": checked("final soft-cap", get("final_logit_softcapping", float, 0.0), 0.0, 1e6),
        "n_embd_per_layer": per_layer_width,
    }


def _layer(info: LayerInfo) -> LayerPlan:
    s, i = info.settings, info.index
    local = s["local"][i]
    known = bool(info.tensors)  # (without the file's tensor names: the layout the converter writes)
    has = lambda name: f"blk.{i}.{name}" in info.tensors  # noqa: E731
    moe = has("ffn_gate_inp.weight") if known else "n_expert" in s
    if moe and "n_expert" not in s:  # llama.cpp: a layer with a router has experts, which the keys must describe
        raise MissingMetadataError(f"missing metadata key '{NAME}.expert_count' (blk.{i} has experts)")
    kv_from = s["kv_from"][i]
    return LayerPlan(
        qk_norm=True, post_norms=True, activation="gelu_tanh", rope_local=local, window=s["window"] if local else 0,
        head_dim=s["head_dim_swa"] if local else s["head_dim_full"], n_head_kv=s["kv_heads"][i],
        n_ff=s["ffn"][i], kv_from=kv_from, v_norm=True,
        v_from_k=kv_from < 0 and known and not has("attn_v.weight"),
        moe=moe, moe_gating="softmax", moe_dense=moe, router_norm=moe,
        gate_up_exps=moe and (has("ffn_gate_up_exps.weight") if known else True),
        per_layer_input=s["n_embd_per_layer"] > 0, out_scale=has("layer_output_scale.weight") if known else True)


def _check(metadata: Any, tensors: frozenset[str]) -> None:
    """The global layers' RoPE is in rope_freqs (llama.cpp requires it too): without it they would rotate every
    pair. Per-layer embeddings in a file whose keys say it has none would be left out of every layer's input."""
    if tensors and "rope_freqs.weight" not in tensors:
        raise MissingTensorError("missing tensor 'rope_freqs.weight' (the global layers' proportional RoPE)")
    width = (metadata or {}).get(f"{NAME}.embedding_length_per_layer_input")
    if "per_layer_token_embd.weight" in tensors and width == 0:
        raise CorruptFileError(f"the file has per-layer embeddings (per_layer_token_embd) but metadata key "
                               f"'{NAME}.embedding_length_per_layer_input' is 0")


ARCH = Architecture(name=NAME, rope_type=ROPE_NEOX, layer=_layer, settings=_settings, check=_check,
                    per_layer_keys=("attention.head_count_kv", "feed_forward_length"), rope_freqs_scaling="proportional")
