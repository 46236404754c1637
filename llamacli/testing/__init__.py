"""Random GGUF models for tests and benchmarks (in the package so the GPU machine can use it too).

- `write_model(path, spec, qtype)`: a whole model of any supported architecture (llama, qwen2, phi3, qwen3,
  smollm3, gemma2/3, the mixtures of experts qwen3moe and gpt-oss, the hybrids qwen35, qwen35moe and qwen3next
  with the converter's names and layouts, an MTP block included with `n_mtp`, gemma4 with its shared KV,
  per-layer embeddings and experts beside a dense FFN as the converter writes them) at any shape, streamed tensor by
  tensor (an 8B-shape F16 model never sits in RAM), with a tiny byte-level BPE vocabulary or a real one
  copied from llama.cpp's vocabulary-only GGUFs (`vocab_file=`). Models past FAST_PARAMS parameters are
  written the fast way (quants.random_quant_rows(fast=True)): for speed runs, not for accuracy.
- `SHAPES`: tiny test shapes and real ones (Qwen2.5-0.5B, Llama-3.2-1B, Llama-3-8B, SmolLM2-135M, Qwen3-8B,
  Qwen3-30B-A3B, gpt-oss-20b, Qwen3.5-9B, Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B, Gemma 4 E4B, 26B-A4B, 31B).
- hf_qwen.py, hf_gemma4.py: the hybrid Qwen models and Gemma 4 written from a transformers checkpoint, as llama.cpp's
  converter writes them.

The random weight blocks and the int8-activation helpers are in quants.py (re-exported here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFWriter

from ..ggufio.file import open_gguf
from .quants import MIXES, WEIGHT_TYPES, act8, act8_bound, random_quant_rows, tensor_type

__all__ = [
    "SHAPES", "WEIGHT_TYPES", "ModelSpec", "act8", "act8_bound", "add_metadata", "model_metadata",
    "random_quant_rows", "tensor_shapes", "tensor_type", "tiny_vocab", "variant", "vocab_from_file", "write_model",
]

# -- model shapes --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    vocab_size: int = 0  # 0: the vocabulary's own size
    context_length: int = 256
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    tied: bool = False
    rope_scaling: str = "none"  # none | linear | llama3 | longrope | yarn
    rope_factor: float = 1.0
    name: str = "random"
    head_dim: int = 0  # attention.key_length; 0: n_embd / n_head
    rope_dim: int = 0  # rope.dimension_count; 0: the head dim (partial rotary when smaller)
    window: int = 0  # attention.sliding_window (gemma2/gemma3, gpt-oss); 0: not written
    n_expert: int = 0  # expert_count (qwen3moe, gpt-oss); 0: a dense model
    n_expert_used: int = 0  # expert_used_count
    n_ff_exp: int = 0  # expert_feed_forward_length
    rope_original: int = 0  # rope.scaling.original_context_length (yarn, longrope); 0: context_length // 4
    # Hybrid models (qwen35, qwen35moe, qwen3next): the Gated DeltaNet layers' sizes (ssm.*: key head size =
    # value head size, key heads, value heads, convolution width), every full_attention_interval-th layer attention,
    # a shared expert's width, and n_mtp multi-token-prediction blocks after the trunk (nextn_predict_layers)
    ssm_state_size: int = 0
    ssm_group_count: int = 0
    ssm_time_step_rank: int = 0
    ssm_conv_kernel: int = 4
    full_attention_interval: int = 4
    n_ff_shexp: int = 0
    n_mtp: int = 0
    # Gemma 4: head_dim is the global layers' head size, head_dim_swa the sliding layers' (attention.key_length_swa);
    # the global layers' KV heads (0: n_head_kv); the last n_kv_shared layers read earlier layers' KV; the per-layer
    # embeddings' width P (0: none); which layers slide (empty: five of every six, the last one global, as
    # transformers' default layer_types); no attn_v on global layers (V = K); the shared-KV layers' FFN twice as wide
    # (E2B); the final soft-cap
    head_dim_swa: int = 0
    n_head_kv_global: int = 0
    n_kv_shared: int = 0
    n_embd_per_layer: int = 0
    swa_layers: tuple[bool, ...] = ()
    k_eq_v: bool = False
    double_wide: bool = False
    final_softcap: float = 0.0

    @property
    def dh(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def sliding(self) -> tuple[bool, ...]:
        """gemma4: which layers slide."""
        if self.swa_layers:
            return self.swa_layers
        return tuple(i % 6 < 5 and i < self.n_layer - 1 for i in range(self.n_layer))


SHAPES: dict[str, ModelSpec] = {
    "tiny-llama": ModelSpec("llama", 2, 64, 4, 2, 128, name="tiny-llama"),
    "tiny-qwen2": ModelSpec("qwen2", 2, 64, 4, 1, 96, rope_base=1e6, tied=True, name="tiny-qwen2"),
    "tiny-phi3": ModelSpec("phi3", 2, 96, 4, 4, 160, name="tiny-phi3"),
    # Rows of 256-multiples, so the K- and IQ-types are used as such rather than their fallbacks.
    "small-llama": ModelSpec("llama", 2, 256, 4, 2, 512, name="small-llama"),
    "small-qwen2": ModelSpec("qwen2", 2, 256, 4, 1, 768, rope_base=1e6, tied=True, name="small-qwen2"),
    "small-phi3": ModelSpec("phi3", 2, 256, 2, 2, 512, name="small-phi3"),
    "smollm2-135m": ModelSpec("llama", 30, 576, 9, 3, 1536, 49152, 8192, 1e5, 1e-5, True, name="SmolLM2-135M-shape"),
    "qwen2.5-0.5b": ModelSpec("qwen2", 24, 896, 14, 2, 4864, 151936, 32768, 1e6, 1e-6, True, name="Qwen2.5-0.5B-shape"),
    "llama-3.2-1b": ModelSpec(
        "llama", 16, 2048, 32, 8, 8192, 128256, 131072, 500000.0, 1e-5, True, "llama3", 32.0, "Llama-3.2-1B-shape"
    ),
    "llama-3-8b": ModelSpec("llama", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0, 1e-5, False, name="Llama-3-8B-shape"),
    # transformers' GGUF loader takes Qwen3's head dim as 128 whatever the file says: tiny ones keep it so.
    "tiny-qwen3": ModelSpec("qwen3", 2, 256, 2, 1, 256, rope_base=1e6, rms_eps=1e-6, tied=True, name="tiny-qwen3"),
    "tiny-smollm3": ModelSpec("smollm3", 4, 64, 4, 2, 128, rope_base=5e6, name="tiny-smollm3"),
    "qwen3-8b": ModelSpec("qwen3", 36, 4096, 32, 8, 12288, 151936, 40960, 1e6, 1e-6, False, name="Qwen3-8B-shape"),
    # Gemma: head dim 256 (what transformers' query_pre_attn_scalar defaults to), a window shorter than the
    # tests' prompts; gemma3's sixth layer is global, gemma2's odd layers.
    "tiny-gemma3": ModelSpec("gemma3", 6, 128, 2, 1, 256, rope_base=1e6, rms_eps=1e-6, tied=True, name="tiny-gemma3",
                             head_dim=256, window=8),
    "tiny-gemma2": ModelSpec("gemma2", 4, 128, 2, 1, 256, rope_base=1e4, rms_eps=1e-6, tied=True, name="tiny-gemma2",
                             head_dim=256, window=8),
    "gemma3-270m": ModelSpec("gemma3", 18, 640, 4, 1, 2048, 262144, 32768, 1e6, 1e-6, True, name="Gemma-3-270M-shape",
                             head_dim=256, window=512),
    "gemma3-4b": ModelSpec("gemma3", 34, 2560, 8, 4, 10240, 262208, 131072, 1e6, 1e-6, True, "linear", 8.0,
                           "Gemma-3-4B-shape", head_dim=256, window=1024),
    "gemma2-2b": ModelSpec("gemma2", 26, 2304, 8, 4, 9216, 256000, 8192, 1e4, 1e-6, True, name="Gemma-2-2B-shape",
                           head_dim=256, window=4096),
    # Mixtures of experts: 8 experts, 2 per token; head dims apart from n_embd / n_head as in the real ones.
    # gpt-oss: a window of 8 on layers 0 and 2, YaRN x4 over 64 positions, experts in MXFP4 (32-value rows).
    "tiny-qwen3moe": ModelSpec("qwen3moe", 3, 64, 4, 2, 96, rope_base=1e6, rms_eps=1e-6, name="tiny-qwen3moe",
                               head_dim=32, n_expert=8, n_expert_used=2, n_ff_exp=32),
    "tiny-gpt-oss": ModelSpec("gpt-oss", 4, 64, 4, 2, 64, rope_base=150000.0, rope_scaling="yarn", rope_factor=4.0,
                              name="tiny-gpt-oss", head_dim=32, window=8, n_expert=8, n_expert_used=2, n_ff_exp=64),
    # Real shapes for speed runs (Qwen3-30B-A3B: config.json of Qwen/Qwen3-30B-A3B; gpt-oss-20b: openai's).
    "qwen3-30b-a3b": ModelSpec("qwen3moe", 48, 2048, 32, 4, 6144, 151936, 40960, 1e6, 1e-6, False,
                               name="Qwen3-30B-A3B-shape", head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768),
    "gpt-oss-20b": ModelSpec("gpt-oss", 24, 2880, 64, 8, 2880, 201088, 131072, 150000.0, 1e-5, False, "yarn", 32.0,
                             "gpt-oss-20b-shape", head_dim=64, window=128, n_expert=32, n_expert_used=4,
                             n_ff_exp=2880, rope_original=4096),
    # Hybrids (Gated DeltaNet + gated attention): 8 layers, 6 linear and 2 attention; 4 value heads over 2 key
    # heads (so the converter's value-head order matters); a quarter of the head dim rotates, as in the real ones.
    "tiny-qwen35": ModelSpec("qwen35", 8, 64, 4, 2, 96, rope_base=1e7, rms_eps=1e-6, name="tiny-qwen35", head_dim=32,
                             rope_dim=8, ssm_state_size=16, ssm_group_count=2, ssm_time_step_rank=4),
    "tiny-qwen35moe": ModelSpec("qwen35moe", 8, 64, 4, 2, 0, rope_base=1e7, rms_eps=1e-6, name="tiny-qwen35moe",
                                head_dim=32, rope_dim=8, n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=48,
                                ssm_state_size=16, ssm_group_count=2, ssm_time_step_rank=4),
    "tiny-qwen3next": ModelSpec("qwen3next", 8, 64, 4, 2, 96, rope_base=1e7, rms_eps=1e-6, name="tiny-qwen3next",
                                head_dim=32, rope_dim=8, n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=48,
                                ssm_state_size=16, ssm_group_count=2, ssm_time_step_rank=4),
    # Real shapes for speed runs: transformers' default Qwen3_5TextConfig / Qwen3_5MoeTextConfig (the 9B and the
    # 35B-A3B) with the released files' RoPE base and context; Qwen3-Next-80B-A3B's config.json.
    "qwen3.5-9b": ModelSpec("qwen35", 32, 4096, 16, 4, 12288, 248320, 262144, 1e7, 1e-6, False,
                            name="Qwen3.5-9B-shape", head_dim=256, rope_dim=64, ssm_state_size=128, ssm_group_count=16,
                            ssm_time_step_rank=32),
    "qwen3.5-35b-a3b": ModelSpec("qwen35moe", 40, 2048, 16, 2, 0, 248320, 262144, 1e7, 1e-6, False,
                                 name="Qwen3.5-35B-A3B-shape", head_dim=256, rope_dim=64, n_expert=256,
                                 n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, ssm_state_size=128,
                                 ssm_group_count=16, ssm_time_step_rank=32),
    "qwen3-next-80b-a3b": ModelSpec("qwen3next", 48, 2048, 16, 2, 5120, 151936, 262144, 1e7, 1e-6, False,
                                    name="Qwen3-Next-80B-A3B-shape", head_dim=256, rope_dim=64, n_expert=512,
                                    n_expert_used=10, n_ff_exp=512, n_ff_shexp=512, ssm_state_size=128,
                                    ssm_group_count=16, ssm_time_step_rank=32),
    # Gemma 4: 8 layers (layers 5 and 7 global), heads of 32 on sliding layers and 64 on global ones, a window of 8;
    # E-style: the last 2 layers read layers 4's and 5's KV, per-layer embeddings of 16; the MoE one: 8 experts (2 a
    # token) beside each layer's dense FFN, 1 KV head and V = K on its global layers.
    "tiny-gemma4": ModelSpec("gemma4", 8, 64, 4, 2, 96, rope_base=1e6, rms_eps=1e-6, tied=True, name="tiny-gemma4",
                             head_dim=64, head_dim_swa=32, window=8, n_kv_shared=2, n_embd_per_layer=16,
                             final_softcap=30.0),
    "tiny-gemma4-moe": ModelSpec("gemma4", 8, 64, 4, 2, 96, rope_base=1e6, rms_eps=1e-6, tied=True,
                                 name="tiny-gemma4-moe", head_dim=64, head_dim_swa=32, n_head_kv_global=1, window=8,
                                 n_expert=8, n_expert_used=2, n_ff_exp=32, k_eq_v=True, final_softcap=30.0),
    # Real shapes for speed runs (transformers' Gemma4TextConfig of google/gemma-4-E4B-it, -26B-A4B-it, -31B-it):
    # five sliding layers (window 512 / 1024, heads of 256) to one global (heads of 512, proportional RoPE).
    "gemma4-e4b": ModelSpec("gemma4", 42, 2560, 8, 2, 10240, 262144, 131072, 1e6, 1e-6, True, name="Gemma-4-E4B-shape",
                            head_dim=512, head_dim_swa=256, window=512, n_kv_shared=18, n_embd_per_layer=256,
                            final_softcap=30.0),
    "gemma4-26b-a4b": ModelSpec("gemma4", 30, 2816, 16, 8, 2112, 262144, 262144, 1e6, 1e-6, True,
                                name="Gemma-4-26B-A4B-shape", head_dim=512, head_dim_swa=256, n_head_kv_global=2,
                                window=1024, n_expert=128, n_expert_used=8, n_ff_exp=704, k_eq_v=True,
                                final_softcap=30.0),
    "gemma4-31b": ModelSpec("gemma4", 60, 5376, 32, 16, 21504, 262144, 262144, 1e6, 1e-6, True, name="Gemma-4-31B-shape",
                            head_dim=512, head_dim_swa=256, n_head_kv_global=4, window=1024, k_eq_v=True,
                            final_softcap=30.0),
}
HYBRIDS = ("qwen35", "qwen35moe", "qwen3next")
NUMPY_ONLY = (*HYBRIDS, "gemma4")  # architectures without the fused CUDA paths (they run op by op there)


def tensor_shapes(spec: ModelSpec, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, row-major shape) for every tensor of the model, in file order: what the architecture's plan
    needs (weights.model_specs reads the config these keys make)."""
    from ..models.config import config_from_metadata
    from ..models.weights import model_specs

    present = {"token_embd.weight", "blk.0.attn_qkv.weight"}
    if not spec.tied:
        present.add("output.weight")
    if spec.rope_scaling == "llama3":
        present.add("rope_freqs.weight")
    if spec.rope_scaling == "longrope":
        present.add("rope_factors_long.weight")
    if spec.arch == "gemma4":  # its layout is read from the tensors present (models/arch/gemma4.py)
        present |= _gemma4_layout(spec)
    cfg = config_from_metadata(model_metadata(spec, vocab), present)
    specs = model_specs(cfg)
    first = [s for s in specs if s.name == "token_embd.weight" or s.name.startswith("rope_")]
    return [(s.name, s.shape) for s in first + [s for s in specs if s not in first]] + _mtp_shapes(cfg, spec.n_mtp)


def _gemma4_layout(spec: ModelSpec) -> set[str]:
    """The tensors that decide a gemma4 file's layout, as the converter writes them: rope_freqs, each layer's
    layer_output_scale, attn_v where the layer has its own (not on global layers with V = K, nor on shared-KV
    layers), the router and the fused experts where there are experts."""
    names = {"rope_freqs.weight"}
    first_shared = spec.n_layer - spec.n_kv_shared
    for i, local in enumerate(spec.sliding):
        names.add(f"blk.{i}.layer_output_scale.weight")
        if i < first_shared and (local or not spec.k_eq_v):
            names.add(f"blk.{i}.attn_v.weight")
        if spec.n_expert:
            names |= {f"blk.{i}.ffn_gate_inp.weight", f"blk.{i}.ffn_gate_up_exps.weight"}
    return names


def _mtp_shapes(cfg: Any, n_mtp: int) -> list[tuple[str, tuple[int, ...]]]:
    """The multi-token-prediction blocks as the converter writes Qwen3.5's (blk.<n_layer + i>): an attention block
    (a gated attention layer's tensors, the model's FFN) and its nextn.eh_proj [D, 2 D], enorm, hnorm,
    shared_head_norm [D]. A forward pass reads past them."""
    from ..models.weights import layer_specs

    out: list[tuple[str, tuple[int, ...]]] = []
    attention = next((p for p in cfg.layers if not p.recurrent), None)
    for i in range(cfg.n_layer, cfg.n_layer + n_mtp):
        extended = replace(cfg, n_layer=i + 1, layers=cfg.layers + (attention,) * (i + 1 - cfg.n_layer))
        d = cfg.n_embd
        out += [(f"blk.{i}.nextn.eh_proj.weight", (d, 2 * d))]
        out += [(s.name, s.shape) for s in layer_specs(extended, i)]
        out += [(f"blk.{i}.nextn.{n}.weight", (d,)) for n in ("enorm", "hnorm", "shared_head_norm")]
    return out


def model_metadata(spec: ModelSpec, n_vocab: int) -> dict[str, Any]:
    """The architecture keys of a model of this shape (no tokenizer, no file type)."""
    arch = spec.arch
    kv: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.block_count": spec.n_layer,
        f"{arch}.context_length": spec.context_length,
        f"{arch}.embedding_length": spec.n_embd,
        f"{arch}.feed_forward_length": spec.n_ff,
        f"{arch}.attention.head_count": spec.n_head,
        f"{arch}.attention.head_count_kv": spec.n_head_kv,
        f"{arch}.rope.freq_base": float(spec.rope_base),
        f"{arch}.attention.layer_norm_rms_epsilon": float(spec.rms_eps),
        f"{arch}.rope.dimension_count": spec.rope_dim or spec.dh,
        f"{arch}.vocab_size": n_vocab,
    }
    if spec.head_dim:
        kv[f"{arch}.attention.key_length"] = kv[f"{arch}.attention.value_length"] = spec.head_dim
    if spec.rope_scaling in ("linear", "yarn"):
        kv[f"{arch}.rope.scaling.type"] = spec.rope_scaling
        kv[f"{arch}.rope.scaling.factor"] = float(spec.rope_factor)
    if spec.rope_scaling in ("yarn", "longrope"):
        kv[f"{arch}.rope.scaling.original_context_length"] = spec.rope_original or spec.context_length // 4
    if spec.rope_scaling == "longrope":
        kv[f"{arch}.rope.scaling.attn_factor"] = 1.19
    if spec.window:
        kv[f"{arch}.attention.sliding_window"] = spec.window
    if spec.n_expert:
        kv[f"{arch}.expert_count"] = spec.n_expert
        kv[f"{arch}.expert_used_count"] = spec.n_expert_used
        kv[f"{arch}.expert_feed_forward_length"] = spec.n_ff_exp
    if arch == "gemma2":  # as the converter writes them (llama.cpp's defaults too)
        kv[f"{arch}.attn_logit_softcapping"] = 50.0
        kv[f"{arch}.final_logit_softcapping"] = 30.0
    if arch == "gemma4":  # the keys convert_hf_to_gguf.py writes (conversion/gemma.py Gemma4Model)
        kv.update(_gemma4_metadata(spec))
    if arch in HYBRIDS:  # the keys convert_hf_to_gguf.py writes for them (hf_qwen.hf_metadata)
        if not spec.n_ff:
            del kv[f"{arch}.feed_forward_length"]  # (qwen35moe files have none)
        if spec.n_ff_shexp:
            kv[f"{arch}.expert_shared_feed_forward_length"] = spec.n_ff_shexp
        if spec.n_mtp:
            kv[f"{arch}.block_count"] = spec.n_layer + spec.n_mtp
            kv[f"{arch}.nextn_predict_layers"] = spec.n_mtp
        every = spec.full_attention_interval
        kv.update({
            f"{arch}.ssm.conv_kernel": spec.ssm_conv_kernel,
            f"{arch}.ssm.state_size": spec.ssm_state_size,
            f"{arch}.ssm.group_count": spec.ssm_group_count,
            f"{arch}.ssm.time_step_rank": spec.ssm_time_step_rank,
            f"{arch}.ssm.inner_size": spec.ssm_time_step_rank * spec.ssm_state_size,
            f"{arch}.attention.recurrent_layers": [(i + 1) % every != 0 for i in range(spec.n_layer)] + [False] * spec.n_mtp,
            f"{arch}.full_attention_interval": every,
        })
        if arch != "qwen3next":
            kv[f"{arch}.rope.dimension_sections"] = [11, 11, 10, 0]
    return kv


def _gemma4_metadata(spec: ModelSpec) -> dict[str, Any]:
    a, local = "gemma4", spec.sliding
    first_shared = spec.n_layer - spec.n_kv_shared
    kv: dict[str, Any] = {
        f"{a}.rope.freq_base_swa": 10000.0,
        f"{a}.attention.shared_kv_layers": spec.n_kv_shared,
        f"{a}.embedding_length_per_layer_input": spec.n_embd_per_layer,
        f"{a}.attention.sliding_window_pattern": list(local),
        f"{a}.attention.key_length_swa": spec.head_dim_swa,
        f"{a}.attention.value_length_swa": spec.head_dim_swa,
        f"{a}.rope.dimension_count": spec.head_dim,
        f"{a}.rope.dimension_count_swa": spec.head_dim_swa,
    }
    if spec.n_head_kv_global:
        kv[f"{a}.attention.head_count_kv"] = [spec.n_head_kv if s else spec.n_head_kv_global for s in local]
    if spec.double_wide:
        kv[f"{a}.feed_forward_length"] = [spec.n_ff * (1 + (i >= first_shared)) for i in range(spec.n_layer)]
    if spec.final_softcap:
        kv[f"{a}.final_logit_softcapping"] = spec.final_softcap
    return kv


# -- vocabularies ----------------------------------------------------------------------------------------------


def _byte_unicode() -> list[str]:
    """GPT-2's byte -> printable character map (bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab() -> dict[str, Any]:
    """A small byte-level BPE vocabulary (GPT-2 style): 3 specials, 256 bytes, a few merges; ChatML template."""
    byte_chars = _byte_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r", "o n", "Ġ s", "r e", "a t", "e n", "Ġ o", "Ġ w", "i s"]
    tokens = specials + byte_chars + ["".join(m.split()) for m in merges]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": template,
    }


def _pad_vocab(vocab: dict[str, Any], n: int) -> dict[str, Any]:
    """Grow a vocabulary to n tokens with unused pad tokens (as converters pad Qwen's to 151936), so that the
    token list matches the embedding rows."""
    tokens = vocab["tokenizer.ggml.tokens"]
    extra = n - len(tokens)
    if extra <= 0:
        return vocab
    out = dict(vocab)
    out["tokenizer.ggml.tokens"] = tokens + [f"<|llamacli_pad_{i}|>" for i in range(extra)]
    if "tokenizer.ggml.token_type" in vocab:
        out["tokenizer.ggml.token_type"] = vocab["tokenizer.ggml.token_type"] + [5] * extra  # UNUSED
    if "tokenizer.ggml.scores" in vocab:
        out["tokenizer.ggml.scores"] = vocab["tokenizer.ggml.scores"] + [-1e9] * extra
    return out


def vocab_from_file(path: str | Path) -> dict[str, Any]:
    """Every tokenizer.* key of a GGUF file (e.g. llama.cpp's ggml-vocab-qwen2.gguf)."""
    with open_gguf(path) as g:
        return {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}


# -- the writer --------------------------------------------------------------------------------------------------


def add_metadata(w: GGUFWriter, key: str, value: Any) -> None:
    """One metadata key with the GGUF type its Python value implies (int: uint32, else int64)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if 0 <= value < 2**32 else w.add_int64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)
    else:
        raise TypeError(f"{key}: {type(value)}")


def write_model(
    path: str | Path,
    spec: ModelSpec | str = "tiny-llama",
    qtype: QT | str = QT.F32,
    *,
    seed: int = 0,
    vocab: dict[str, Any] | None = None,
    vocab_file: str | Path | None = None,
    std: float = 0.02,
    metadata: dict[str, Any] | None = None,
    drop_tensors: tuple[str, ...] = (),
    tensor_types: dict[str, QT] | None = None,
    fast: bool | None = None,
) -> Path:
    """Write a random model to `path` and return it. `qtype`: a ggml type (or its name) for the matrices,
    or a mix: "Q4_K_M" (llama.cpp's), "MXFP4_MOE" (gpt-oss's: MXFP4 experts, Q8_0 elsewhere). Tensors are
    generated and written one at a time.
    `fast` (default: models of more than FAST_PARAMS parameters) writes every block type as random valid
    blocks drawn 8 bytes at a time instead of quantized Gaussians (far faster; docs/perf-log.md): the
    real-shape files for speed runs, "qwen3-30b-a3b" at "Q4_K_M" (18.6 GB) and "gpt-oss-20b" at "MXFP4_MOE"
    (12.1 GB), take about a minute each. Their weights are noise of about the right size: for timing only.
    For broken-file tests: `metadata` overrides keys (None deletes one), `drop_tensors` leaves tensors
    out, `tensor_types` forces the type of named tensors."""
    spec = SHAPES[spec] if isinstance(spec, str) else spec
    if vocab is None:
        vocab = vocab_from_file(vocab_file) if vocab_file else tiny_vocab()
    n_vocab = spec.vocab_size or len(vocab["tokenizer.ggml.tokens"])
    if n_vocab < len(vocab["tokenizer.ggml.tokens"]):
        raise ValueError("vocab_size smaller than the vocabulary")
    vocab = _pad_vocab(vocab, n_vocab)
    rng = np.random.default_rng(seed)
    path = Path(path)
    arch = spec.arch
    w = GGUFWriter(str(path), arch)
    w.add_name(spec.name)
    kv = model_metadata(spec, n_vocab)
    del kv["general.architecture"]  # GGUFWriter writes it
    if isinstance(qtype, str) and qtype not in MIXES:
        qtype = QT[qtype]
    file_type = {QT.F32: 0, QT.F16: 1, QT.Q4_0: 2, QT.Q4_1: 3, QT.Q8_0: 7, QT.Q5_0: 8, QT.Q5_1: 9, **MIXES}
    kv["general.file_type"] = file_type.get(qtype, 0)  # type: ignore[arg-type]
    for key, value in {**kv, **vocab, **(metadata or {})}.items():
        if value is not None:
            add_metadata(w, key, value)

    shapes = [(n, s) for n, s in tensor_shapes(spec, n_vocab) if n not in drop_tensors]
    if fast is None:
        fast = sum(math.prod(s) for _, s in shapes) > FAST_PARAMS
    forced = tensor_types or {}
    plan = [(n, s, forced.get(n) or tensor_type(n, s, qtype, spec.n_layer, spec.tied)) for n, s in shapes]
    for name, shape, t in plan:
        block, size = GGML_QUANT_SIZES[t]
        n_bytes = math.prod(shape) // block * size
        if t in _NUMPY_TYPES:
            w.add_tensor_info(name, shape, np.dtype(_NUMPY_TYPES[t]), n_bytes)
        else:  # block types are described by their byte shape [..., row_bytes]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), n_bytes, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, t in plan:
        w.write_tensor_data(_random_tensor(name, shape, t, rng, std, spec, fast))
    w.close()
    return path


FAST_PARAMS = 1 << 30  # write_model's fast path from here (the 1B-8B speed-run shapes and beyond)
_NUMPY_TYPES = {QT.F32: np.float32, QT.F16: np.float16, QT.I32: np.int32, QT.I8: np.int8, QT.F64: np.float64}


def _random_tensor(name: str, shape: tuple[int, ...], t: QT, rng: np.random.Generator, std: float, spec: ModelSpec,
                   fast: bool = False) -> np.ndarray:
    if name.endswith(".ssm_a"):  # -exp(A_log) (transformers draws A from U(0.01, 16)): decays within (0, 1)
        return -rng.uniform(0.05, 4.0, size=shape).astype(np.float32)
    if name.endswith("ssm_conv1d.weight"):  # a few taps per channel, of the size of a default Conv1d's
        return (0.3 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("attn_sinks.weight"):  # logits of the order of the scores, so that sinks matter
        return rng.standard_normal(shape).astype(np.float32)
    if name == "rope_freqs.weight" and spec.arch == "gemma4":  # proportional RoPE: a quarter of the pairs rotate
        n = shape[0] // 4
        return np.array([1.0] * n + [1e30] * (shape[0] - n), dtype=np.float32)
    if name.startswith("rope_"):
        # Frequency divisors >= 1 (llama3's factors run from 1 for high frequencies up to the factor).
        return np.linspace(1.0, max(spec.rope_factor, 2.0), shape[0], dtype=np.float32)
    if name.endswith((".scale", "layer_output_scale.weight")):  # gemma4's scales: near 1, as norm weights
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    if t in (QT.I32, QT.I8, QT.F64):  # only for tests of types we refuse to run
        return rng.integers(-8, 8, size=shape).astype(_NUMPY_TYPES[t])
    if name == "token_embd.weight":
        std = max(std, 0.5)  # embeddings carry the signal: keep them larger than matrices
    # Generate in slices so that a 128k x 4096 embedding does not need a float32 copy at once; fast random
    # blocks come in one piece (a few hundred MB at most, and faster than slices joined).
    step = rows if fast and t not in _NUMPY_TYPES and t != QT.BF16 else max(1, (1 << 24) // cols)
    parts = [random_quant_rows(t, min(step, rows - r), cols, rng, std, fast) for r in range(0, rows, step)]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def variant(spec: ModelSpec | str, **changes: Any) -> ModelSpec:
    spec = SHAPES[spec] if isinstance(spec, str) else spec
    return replace(spec, **changes)
