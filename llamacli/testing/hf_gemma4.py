"""GGUF files from transformers checkpoints of Gemma 4 text models (Gemma4ForCausalLM, `gemma4_text` configs), written
as llama.cpp's convert_hf_to_gguf.py writes them (its conversion/gemma.py Gemma4Model, with what it inherits from
Gemma3Model and TextModel): the same tensor names, layouts and types (vectors and the router F32, matrices in the
type asked for) and the same `gemma4.*` keys. With it a test compares llamacli with transformers' forward on a tiny
random model (made with transformers' own classes) without the converter, a script of the llama.cpp source tree that
needs torch; tests/models/test_gemma4_convert.py checks that this writer's file and the converter's agree where the
converter is at hand.

`write_hf_model(path, config, state)`: config is the checkpoint's config.json as a dict (transformers'
`model.config.to_dict()`), state its tensors as float32 NumPy arrays by their checkpoint names.

What the converter does to the checkpoint, and so this writer:
- names mapped (gguf-py's tensor_mapping; `layer_scalar` and the experts' tensors get a ".weight"); the router's
  `scale` becomes ffn_gate_inp.scale and `per_expert_scale` ffn_down_exps.scale; the experts' gate_up_proj
  [E, 2 F, D] is kept whole as ffn_gate_up_exps; a tied lm_head is not written;
- norm weights as they are (Gemma 4's RMSNorm scales by w: no "+ 1" as for Gemma 3);
- rope_freqs [Dh/2] added for the global layers' proportional RoPE: 1 for the first partial_rotary_factor Dh / 2
  pairs, 1e30 (no rotation) for the rest, with rope.dimension_count the whole global head;
- the keys: the global layers' head size as attention.key_length, the sliding ones' as key_length_swa,
  attention.head_count_kv one per layer where the global layers' KV heads differ, feed_forward_length one per layer
  with use_double_wide_mlp (twice as wide on the shared-KV layers), the sliding pattern, shared_kv_layers and the
  per-layer embeddings' width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFWriter

from .quants import tensor_type

ARCH = "gemma4"

_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
# checkpoint name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
}


def _global(config: dict[str, Any], key: str) -> Any:
    """A global (full-attention) layer's override of `key` in per_layer_config (head_dim, num_key_value_heads), as
    the converter looks it up; None where none says."""
    types = config["layer_types"]
    for index, layer in (config.get("per_layer_config") or {}).items():
        if int(index) < len(types) and types[int(index)] == "full_attention" and key in layer:
            return layer[key]
    return None


def hf_metadata(config: dict[str, Any]) -> dict[str, Any]:
    """The `gemma4.*` keys the converter writes for this checkpoint config (without general.* and tokenizer.*)."""
    c, a = config, ARCH
    n_layer = c["num_hidden_layers"]
    rope = c["rope_parameters"]
    local = [t == "sliding_attention" for t in c["layer_types"]]
    head_full = c.get("global_head_dim") or _global(c, "head_dim")
    head_swa = c["head_dim"]
    shared = c.get("num_kv_shared_layers", 0)
    kv: dict[str, Any] = {
        f"{a}.block_count": n_layer,
        f"{a}.context_length": c["max_position_embeddings"],
        f"{a}.embedding_length": c["hidden_size"],
        f"{a}.feed_forward_length": c["intermediate_size"],
        f"{a}.attention.head_count": c["num_attention_heads"],
        f"{a}.attention.head_count_kv": c["num_key_value_heads"],
        f"{a}.rope.freq_base": float(rope["full_attention"]["rope_theta"]),
        f"{a}.rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]),
        f"{a}.attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        f"{a}.attention.key_length": head_full,
        f"{a}.attention.value_length": head_full,
        f"{a}.attention.sliding_window": c["sliding_window"],
        f"{a}.attention.shared_kv_layers": shared,
        f"{a}.embedding_length_per_layer_input": c.get("hidden_size_per_layer_input") or 0,
        f"{a}.attention.sliding_window_pattern": local,
        f"{a}.attention.key_length_swa": head_swa,
        f"{a}.attention.value_length_swa": head_swa,
        f"{a}.rope.dimension_count": head_full,
        f"{a}.rope.dimension_count_swa": int(head_swa * rope["sliding_attention"].get("partial_rotary_factor", 1.0)),
    }
    if c.get("final_logit_softcapping"):
        kv[f"{a}.final_logit_softcapping"] = float(c["final_logit_softcapping"])
    if c.get("num_experts"):
        kv[f"{a}.expert_count"] = c["num_experts"]
        kv[f"{a}.expert_used_count"] = c["top_k_experts"]
        kv[f"{a}.expert_feed_forward_length"] = c["moe_intermediate_size"]
    if c.get("use_double_wide_mlp"):
        n_ff = c["intermediate_size"]
        kv[f"{a}.feed_forward_length"] = [n_ff * (2 if i >= n_layer - shared else 1) for i in range(n_layer)]
    kv_full = c.get("num_global_key_value_heads") or _global(c, "num_key_value_heads")
    if kv_full is not None:
        kv[f"{a}.attention.head_count_kv"] = [c["num_key_value_heads"] if s else kv_full for s in local]
    return kv


def rope_freqs(config: dict[str, Any]) -> np.ndarray:
    """The global layers' proportional RoPE as frequency factors [Dh / 2] (Gemma4Model.generate_extra_tensors)."""
    head_full = config.get("global_head_dim") or _global(config, "head_dim")
    full = config["rope_parameters"]["full_attention"]
    n_rot = int(head_full * full.get("partial_rotary_factor", 1.0) / 2)
    return np.array([1.0] * n_rot + [1e30] * (head_full // 2 - n_rot), dtype=np.float32)


def hf_tensors(config: dict[str, Any], state: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in GGUF's row-major shape) for every checkpoint tensor, as the converter writes it."""
    yield "rope_freqs.weight", rope_freqs(config)
    for hf_name, x in state.items():
        x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings", True):
            continue  # tied: the LM head is token_embd
        if hf_name in _TOP_NAMES:
            yield _TOP_NAMES[hf_name], x
            continue
        if not hf_name.startswith("model.layers."):
            raise ValueError(f"no GGUF name for the checkpoint tensor {hf_name!r}")
        _, _, index, rest = hf_name.split(".", 3)  # model.layers.N.<rest>
        if rest not in _LAYER_NAMES:
            raise ValueError(f"no GGUF name for the checkpoint tensor {hf_name!r}")
        yield f"blk.{int(index)}.{_LAYER_NAMES[rest]}", x


def write_hf_model(path: str | Path, config: dict[str, Any], state: dict[str, np.ndarray], qtype: QT | str = QT.F32,
                   vocab: dict[str, Any] | None = None, name: str = "hf") -> Path:
    """Write the checkpoint (config, state) of a Gemma 4 text model as the converter would (with `vocab`, default the
    tiny byte-level one padded to the checkpoint's vocab_size), its matrices F32 or F16 (the converter's --outtype f32
    / f16; what it keeps F32 stays F32)."""
    from . import _pad_vocab, add_metadata, tiny_vocab

    qtype = QT[qtype] if isinstance(qtype, str) else qtype
    tensors = list(hf_tensors(config, state))
    vocab = _pad_vocab(vocab or tiny_vocab(), config["vocab_size"])
    path = Path(path)
    w = GGUFWriter(str(path), ARCH)
    w.add_name(name)
    for key, value in {**hf_metadata(config), "general.file_type": 0 if qtype == QT.F32 else 1, **vocab}.items():
        add_metadata(w, key, value)
    n_layer = config["num_hidden_layers"]
    tied = "output.weight" not in {n for n, _ in tensors}
    data = []
    for gguf_name, x in tensors:
        t = tensor_type(gguf_name, x.shape, qtype, n_layer, tied)
        if t not in (QT.F32, QT.F16):
            raise ValueError(f"write_hf_model writes F32 and F16 tensors, not {t.name}")
        x = x.astype(np.float32 if t == QT.F32 else np.float16)
        w.add_tensor_info(gguf_name, x.shape, x.dtype, x.nbytes)
        data.append(x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for x in data:
        w.write_tensor_data(x)
    w.close()
    return path


__all__ = ["hf_metadata", "hf_tensors", "rope_freqs", "write_hf_model"]
