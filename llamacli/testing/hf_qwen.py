"""GGUF files from transformers checkpoints of the hybrid Qwen models (qwen35, qwen35moe, qwen3next), written as
llama.cpp's convert_hf_to_gguf.py writes them (its conversion/qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase,
Qwen3_5TextModel, Qwen3_5MoeTextModel, and the TextModel keys they inherit): the same tensor names, layouts and
types (vectors, the convolutions and the routers F32; matrices in the type asked for) and the metadata keys a
reader needs. With it a test compares llamacli with transformers' forward on a tiny random model (made with
transformers' own classes) without the converter, which is a script of the llama.cpp source tree that needs torch;
tests/models/test_hybrid_convert.py checks that this writer's file and the converter's agree where the converter is
at hand.

`write_hf_model(path, arch, config, state)`: config is the checkpoint's config.json as a dict (transformers'
`model.config.to_dict()`), state its tensors as float32 NumPy arrays by their checkpoint names (the MTP block's
`mtp.*` included, if any).

What the converter does to the checkpoint, and so this writer:
- RMSNorm weights (every tensor whose name ends "norm.weight" once the MTP block's are renamed, but the delta net's
  own linear_attn.norm) become 1 + w: Qwen3.5's norms scale by 1 + w, llama.cpp's by w;
- A_log becomes ssm_a = -exp(A_log); dt_bias is named ssm_dt.bias; conv1d [C, 1, K] is squeezed to [C, K];
- qwen3next's in_proj_qkvz (per key head [q, k, v, z]) is split into attn_qkv [q all; k all; v all] and
  attn_gate [z]; its in_proj_ba is kept as ssm_ba;
- qwen35 / qwen35moe with more value heads than key heads: every value-head axis reordered from grouped by key head
  to tiled (_LinearAttentionVReorderBase), so that value head j reads key head j % Hk;
- the experts' gate_up_proj [E, 2F, D] is split into ffn_gate_exps / ffn_up_exps;
- the MTP block (mtp.fc, mtp.pre_fc_norm_*, mtp.norm, mtp.layers.0.*) becomes block n_layer's nextn.* tensors and
  an attention block, and block_count counts it (nextn_predict_layers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT, GGUFWriter

from .quants import tensor_type

ARCHS = ("qwen35", "qwen35moe", "qwen3next")
DEFAULT_SECTIONS = [11, 11, 10, 0]  # the converter's default rope.dimension_sections (_Qwen35MRopeMixin)

# checkpoint name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    # the MTP block's own (the converter's remapper: mtp.fc -> eh_proj, ...)
    "fc.weight": "nextn.eh_proj.weight",
    "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "norm.weight": "nextn.shared_head_norm.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def hf_metadata(arch: str, config: dict[str, Any], n_mtp: int = 0) -> dict[str, Any]:
    """The `<arch>.*` keys the converter writes for this checkpoint config (without general.* and tokenizer.*)."""
    c, a = config, arch
    n_layer = c["num_hidden_layers"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = c.get("rope_parameters") or {}
    kv: dict[str, Any] = {
        f"{a}.block_count": n_layer + n_mtp,
        f"{a}.context_length": c["max_position_embeddings"],
        f"{a}.embedding_length": c["hidden_size"],
        f"{a}.attention.head_count": c["num_attention_heads"],
        f"{a}.attention.head_count_kv": c["num_key_value_heads"],
        f"{a}.rope.freq_base": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        f"{a}.attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        f"{a}.attention.key_length": head_dim,
        f"{a}.attention.value_length": head_dim,
    }
    if c.get("intermediate_size"):  # (qwen35moe checkpoints have none)
        kv[f"{a}.feed_forward_length"] = c["intermediate_size"]
    if c.get("num_experts"):
        kv[f"{a}.expert_count"] = c["num_experts"]
        kv[f"{a}.expert_used_count"] = c["num_experts_per_tok"]
        kv[f"{a}.expert_feed_forward_length"] = c["moe_intermediate_size"]
        kv[f"{a}.expert_shared_feed_forward_length"] = c["shared_expert_intermediate_size"]
    if n_mtp:
        kv[f"{a}.nextn_predict_layers"] = n_mtp
    kv.update({
        f"{a}.ssm.conv_kernel": c["linear_conv_kernel_dim"],
        f"{a}.ssm.state_size": c["linear_key_head_dim"],
        f"{a}.ssm.group_count": c["linear_num_key_heads"],
        f"{a}.ssm.time_step_rank": c["linear_num_value_heads"],
        f"{a}.ssm.inner_size": c["linear_value_head_dim"] * c["linear_num_value_heads"],
        f"{a}.attention.recurrent_layers": [t == "linear_attention" for t in c["layer_types"]] + [False] * n_mtp,
        f"{a}.full_attention_interval": c.get("full_attention_interval", 4),
        f"{a}.rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 0.25)),
    })
    if arch != "qwen3next":
        kv[f"{a}.rope.dimension_sections"] = list(rope.get("mrope_section", DEFAULT_SECTIONS))[:4]
    return kv


def hf_tensors(arch: str, config: dict[str, Any], state: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in GGUF's row-major shape) for every checkpoint tensor, as the converter writes it."""
    c = config
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    tiled = arch != "qwen3next" and hv != hk  # _LinearAttentionVReorderBase
    n_layer = c["num_hidden_layers"]

    def tile(x: np.ndarray, d: int, axis: int = 0) -> np.ndarray:  # value heads [Hk, Hv/Hk, d] -> [Hv/Hk, Hk, d]
        if not tiled:
            return x
        y = np.moveaxis(x, axis, 0)
        y = y.reshape(hk, hv // hk, d, *y.shape[1:]).swapaxes(0, 1).reshape(y.shape)
        return np.moveaxis(y, 0, axis)

    for hf_name, x in state.items():
        x = np.asarray(x, dtype=np.float32)
        if hf_name in _TOP_NAMES:
            if hf_name == "model.norm.weight":
                x = x + 1
            yield _TOP_NAMES[hf_name], x
            continue
        if hf_name.startswith("mtp."):  # the MTP block, after the trunk's
            rest = hf_name[4:]
            layer, rest = (n_layer + int(rest.split(".")[1]), rest.split(".", 2)[2]) if rest.startswith("layers.") \
                else (n_layer, rest)
        else:
            _, _, index, rest = hf_name.split(".", 3)  # model.layers.N.<rest>
            layer = int(index)
        blk = f"blk.{layer}."
        if _LAYER_NAMES.get(rest, "").endswith("norm.weight") and rest != "linear_attn.norm.weight":
            x = x + 1  # Qwen3.5's RMSNorm scales by 1 + w (the MTP block's enorm / hnorm / shared_head_norm too)
        if rest == "linear_attn.in_proj_qkvz.weight":  # qwen3next: per key head [q, k, v, z] -> [q; k; v], z
            r = hv // hk
            groups = x.reshape(hk, 2 * dk + 2 * r * dv, -1)
            q, k = groups[:, :dk], groups[:, dk : 2 * dk]
            v, z = groups[:, 2 * dk : 2 * dk + r * dv], groups[:, 2 * dk + r * dv :]
            d = x.shape[-1]
            yield blk + "attn_qkv.weight", np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
            yield blk + "attn_gate.weight", z.reshape(-1, d).copy()
            continue
        if rest == "mlp.experts.gate_up_proj":  # [E, 2F, D]: gate rows first
            f = x.shape[1] // 2
            yield blk + "ffn_gate_exps.weight", x[:, :f].copy()
            yield blk + "ffn_up_exps.weight", x[:, f:].copy()
            continue
        if rest == "linear_attn.in_proj_qkv.weight":
            x = np.concatenate([x[: 2 * hk * dk], tile(x[2 * hk * dk :], dv)])
        elif rest == "linear_attn.in_proj_z.weight":
            x = tile(x, dv)
        elif rest in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias"):
            x = tile(x, 1)
        elif rest == "linear_attn.A_log":
            x = -np.exp(tile(x, 1))
        elif rest == "linear_attn.conv1d.weight":
            x = x.reshape(x.shape[0], -1)  # [C, 1, K] -> [C, K]
            x = np.concatenate([x[: 2 * hk * dk], tile(x[2 * hk * dk :], dv)])
        elif rest == "linear_attn.out_proj.weight":
            x = tile(x, dv, axis=1)
        if rest not in _LAYER_NAMES:
            raise ValueError(f"no GGUF name for the checkpoint tensor {hf_name!r}")
        yield blk + _LAYER_NAMES[rest], np.ascontiguousarray(x)


def write_hf_model(path: str | Path, arch: str, config: dict[str, Any], state: dict[str, np.ndarray],
                   qtype: QT | str = QT.F32, vocab: dict[str, Any] | None = None, name: str = "hf") -> Path:
    """Write the checkpoint (config, state) of a qwen35 / qwen35moe / qwen3next model as the converter would (with
    `vocab`, default the tiny byte-level one padded to the checkpoint's vocab_size), its matrices F32 or F16 (the
    converter's --outtype f32 / f16; what it keeps F32 stays F32)."""
    from . import _pad_vocab, add_metadata, tiny_vocab

    if arch not in ARCHS:
        raise ValueError(f"write_hf_model writes {', '.join(ARCHS)}, not {arch!r}")
    qtype = QT[qtype] if isinstance(qtype, str) else qtype
    n_mtp = 1 + max((int(k.split(".")[2]) for k in state if k.startswith("mtp.layers.")), default=-1)
    tensors = list(hf_tensors(arch, config, state))
    vocab = _pad_vocab(vocab or tiny_vocab(), config["vocab_size"])
    path = Path(path)
    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    for key, value in {**hf_metadata(arch, config, n_mtp), "general.file_type": 0 if qtype == QT.F32 else 1,
                       **vocab}.items():
        add_metadata(w, key, value)
    n_layer = config["num_hidden_layers"] + n_mtp
    tied = "output.weight" not in {n for n, _ in tensors}
    data = []
    for gguf_name, x in tensors:
        t = QT.F32 if "ssm_conv1d" in gguf_name else tensor_type(gguf_name, x.shape, qtype, n_layer, tied)
        if t in (QT.F32, QT.F16):
            x = x.astype(np.float32 if t == QT.F32 else np.float16)
            w.add_tensor_info(gguf_name, x.shape, x.dtype, x.nbytes)
            data.append(x)
        else:
            raise ValueError(f"write_hf_model writes F32 and F16 tensors, not {t.name}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for x in data:
        w.write_tensor_data(x)
    w.close()
    return path


__all__ = ["ARCHS", "hf_metadata", "hf_tensors", "write_hf_model"]
