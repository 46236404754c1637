"""Which tensors a model needs, with their shapes: checked once against the file before any backend loads.

Names are GGUF's (llama.cpp's tensor_mapping): token_embd, blk.N.attn_q, ..., output_norm, output.
Shapes are row-major [out_features, in_features] (GGUF lists dims fastest-first; gguf_file reverses them).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from .config import ModelConfig
from .errors import MissingTensorError, ShapeMismatchError, UnsupportedTensorTypeError
from .gguf_file import GGUFFile


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    required: bool = True


def layer_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    """The tensors block i needs, as its plan (cfg.layers[i]) implies."""
    d, q, kv, ff, dh = cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.n_ff, cfg.head_dim
    plan = cfg.layers[i]
    p = f"blk.{i}."
    specs = [TensorSpec(p + "attn_norm.weight", (d,))]
    if plan.fused_qkv:
        specs.append(TensorSpec(p + "attn_qkv.weight", (q + 2 * kv, d)))  # [q; k; v] rows
    else:
        specs += [
            TensorSpec(p + "attn_q.weight", (q, d)),
            TensorSpec(p + "attn_k.weight", (kv, d)),
            TensorSpec(p + "attn_v.weight", (kv, d)),
        ]
    if plan.qkv_bias:
        specs += [
            TensorSpec(p + "attn_q.bias", (q,)),
            TensorSpec(p + "attn_k.bias", (kv,)),
            TensorSpec(p + "attn_v.bias", (kv,)),
        ]
    if plan.qk_norm:  # one weight per head dim, shared by every head
        specs += [TensorSpec(p + "attn_q_norm.weight", (dh,)), TensorSpec(p + "attn_k_norm.weight", (dh,))]
    specs.append(TensorSpec(p + "attn_output.weight", (d, q)))
    if plan.post_norms:  # gemma: RMSNorm of the attention output before its residual add
        specs.append(TensorSpec(p + "post_attention_norm.weight", (d,)))
    specs.append(TensorSpec(p + "ffn_norm.weight", (d,)))
    if plan.fused_gate_up:
        specs.append(TensorSpec(p + "ffn_up.weight", (2 * ff, d)))  # [gate; up] rows
    else:
        specs += [TensorSpec(p + "ffn_gate.weight", (ff, d)), TensorSpec(p + "ffn_up.weight", (ff, d))]
    specs.append(TensorSpec(p + "ffn_down.weight", (d, ff)))
    if plan.post_norms:
        specs.append(TensorSpec(p + "post_ffw_norm.weight", (d,)))
    return specs


def model_specs(cfg: ModelConfig) -> list[TensorSpec]:
    specs = [TensorSpec("token_embd.weight", (cfg.vocab_size, cfg.n_embd))]
    for i in range(cfg.n_layer):
        specs += layer_specs(cfg, i)
    specs.append(TensorSpec("output_norm.weight", (cfg.n_embd,)))
    if not cfg.tied_embeddings:
        specs.append(TensorSpec("output.weight", (cfg.vocab_size, cfg.n_embd)))
    half = cfg.rope_dim // 2
    if cfg.rope_scaling == "llama3":
        specs.append(TensorSpec("rope_freqs.weight", (half,)))
    if cfg.rope_scaling == "longrope":
        specs += [TensorSpec("rope_factors_long.weight", (half,)), TensorSpec("rope_factors_short.weight", (half,))]
    return specs


# Small vectors (norms, biases, rope factors) are always read as float32 on the host first.
_VECTOR_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def check_tensors(gguf: GGUFFile, cfg: ModelConfig, runnable: frozenset[GGMLQuantizationType]) -> None:
    """Every needed tensor present, with the config's shape and a type the backend runs."""
    for spec in model_specs(cfg):
        info = gguf.tensors.get(spec.name)
        if info is None:
            if spec.required:
                raise MissingTensorError(f"missing tensor {spec.name!r}")
            continue
        if info.shape != spec.shape:
            raise ShapeMismatchError(
                f"tensor {spec.name!r} has shape {list(info.shape)}, the config implies {list(spec.shape)}"
            )
        ok = info.type in _VECTOR_TYPES if len(spec.shape) == 1 else info.type in runnable
        if not ok:
            raise UnsupportedTensorTypeError(
                f"tensor {spec.name!r} has type {info.type.name}, which this backend cannot run"
            )
