"""Which tensors a model needs, with their shapes: checked once against the file before any backend loads.

Names are GGUF's (llama.cpp's tensor_mapping): token_embd, blk.N.attn_q, ..., output_norm, output.
Shapes are row-major [out_features, in_features] (GGUF lists dims fastest-first; ggufio/file.py reverses them);
experts are 3-D [E, out, in], one [out, in] matrix per expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import MissingTensorError, ShapeMismatchError, UnsupportedTensorTypeError
from ..ggufio.file import GGUFFile
from ..ggufio.ggml_types import GGMLQuantizationType
from .arch import ARCHITECTURES, LayerPlan
from .config import FREQ_FACTORS, ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    required: bool = True
    field: str = ""  # the LayerWeights field that holds it ("" outside the blocks)

    @property
    def vector(self) -> bool:
        """Norms, biases (an expert bias [E, F] too), sinks, RoPE factors: F32/F16/BF16 in the file, float32
        on every backend. Everything else is a matrix in the backend's weight types ([E, rows, cols] for
        experts)."""
        return len(self.shape) == 1 or self.name.endswith(".bias")


# LayerWeights field -> GGUF name after "blk.N." (llama.cpp's tensor names, gguf-py constants.py); an
# architecture overrides a name where its files differ (models/base.py Architecture.tensor_names).
TENSOR_NAMES = {
    "attn_norm": "attn_norm.weight",
    "attn_q": "attn_q.weight",
    "attn_k": "attn_k.weight",
    "attn_v": "attn_v.weight",
    "attn_qkv": "attn_qkv.weight",
    "attn_q_bias": "attn_q.bias",
    "attn_k_bias": "attn_k.bias",
    "attn_v_bias": "attn_v.bias",
    "attn_q_norm": "attn_q_norm.weight",
    "attn_k_norm": "attn_k_norm.weight",
    "attn_output": "attn_output.weight",
    "attn_output_bias": "attn_output.bias",
    "attn_sinks": "attn_sinks.weight",
    "attn_post_norm": "post_attention_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight",
    "ffn_down": "ffn_down.weight",
    "ffn_post_norm": "post_ffw_norm.weight",
    "ffn_gate_inp": "ffn_gate_inp.weight",
    "ffn_gate_inp_bias": "ffn_gate_inp.bias",
    "ffn_gate_exps": "ffn_gate_exps.weight",
    "ffn_up_exps": "ffn_up_exps.weight",
    "ffn_down_exps": "ffn_down_exps.weight",
    "ffn_gate_exps_bias": "ffn_gate_exps.bias",
    "ffn_up_exps_bias": "ffn_up_exps.bias",
    "ffn_down_exps_bias": "ffn_down_exps.bias",
    "ffn_gate_inp_shexp": "ffn_gate_inp_shexp.weight",
    "ffn_gate_shexp": "ffn_gate_shexp.weight",
    "ffn_up_shexp": "ffn_up_shexp.weight",
    "ffn_down_shexp": "ffn_down_shexp.weight",
    # Gated DeltaNet layers (llama.cpp's LLM_TENSOR_SSM_*; attn_qkv is the delta net's q/k/v there)
    "attn_gate": "attn_gate.weight",
    "ssm_beta": "ssm_beta.weight",
    "ssm_alpha": "ssm_alpha.weight",
    "ssm_ba": "ssm_ba.weight",
    "ssm_conv1d": "ssm_conv1d.weight",
    "ssm_dt": "ssm_dt.bias",
    "ssm_a": "ssm_a",  # (no ".weight": llama.cpp's SSM_A_NOSCAN name)
    "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
    # Gemma 4: the experts' fused gate/up, the router's input scale and the experts' output scales (router_norm), the
    # norms around the dense FFN and the experts (moe_dense), the per-layer embedding's gate, projection and norm, the
    # block's output scale
    "ffn_gate_up_exps": "ffn_gate_up_exps.weight",
    "ffn_gate_inp_scale": "ffn_gate_inp.scale",
    "ffn_down_exps_scale": "ffn_down_exps.scale",
    "ffn_post_norm_1": "post_ffw_norm_1.weight",
    "ffn_pre_norm_2": "pre_ffw_norm_2.weight",
    "ffn_post_norm_2": "post_ffw_norm_2.weight",
    "per_layer_inp_gate": "inp_gate.weight",
    "per_layer_proj": "proj.weight",
    "per_layer_post_norm": "post_norm.weight",
    "layer_output_scale": "layer_output_scale.weight",
}
PER_LAYER_TABLES = ("per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight")


def layer_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    """The tensors block i needs, as its plan (cfg.layers[i]) implies, each with its LayerWeights field."""
    d, ff, e, fe = cfg.n_embd, cfg.layer_n_ff(i), cfg.n_expert, cfg.n_ff_exp
    plan = cfg.layers[i]
    arch = ARCHITECTURES.get(cfg.architecture)
    names = {**TENSOR_NAMES, **(arch.tensor_names if arch else {})}
    specs: list[TensorSpec] = []

    def add(field: str, *shape: int) -> None:
        specs.append(TensorSpec(f"blk.{i}.{names[field]}", shape, field=field))

    add("attn_norm", d)
    if plan.recurrent:
        _delta_net_specs(cfg, plan, add)
    else:
        _attention_specs(cfg, i, add)
    add("ffn_norm", d)
    if plan.moe:  # the router and the experts, [E, rows, cols] (GGUF dims {cols, rows, E})
        add("ffn_gate_inp", e, d)
        if plan.gate_up_exps:  # rows [gate; up] of each expert
            add("ffn_gate_up_exps", e, 2 * fe, d)
        else:
            add("ffn_gate_exps", e, fe, d)
            add("ffn_up_exps", e, fe, d)
        add("ffn_down_exps", e, d, fe)
        if plan.moe_bias:
            add("ffn_gate_inp_bias", e)
            add("ffn_gate_exps_bias", e, fe)
            add("ffn_up_exps_bias", e, fe)
            add("ffn_down_exps_bias", e, d)
        if plan.router_norm:  # the router input's scale, the experts' output scales
            add("ffn_gate_inp_scale", d)
            add("ffn_down_exps_scale", e)
    if plan.fused_gate_up:
        add("ffn_up", 2 * ff, d)  # [gate; up] rows
        add("ffn_down", d, ff)
    elif not plan.moe or plan.moe_dense:  # the dense FFN (gemma4's 26B-A4B: beside the experts)
        add("ffn_gate", ff, d)
        add("ffn_up", ff, d)
        add("ffn_down", d, ff)
    if plan.moe_dense:  # the norms of the two branches
        add("ffn_post_norm_1", d)
        add("ffn_pre_norm_2", d)
        add("ffn_post_norm_2", d)
    if plan.shared_expert:  # its gate: one row [1, D] (the checkpoint's Linear(D, 1), kept 2-D by the converter)
        add("ffn_gate_inp_shexp", 1, d)
        add("ffn_gate_shexp", cfg.n_ff_shexp, d)
        add("ffn_up_shexp", cfg.n_ff_shexp, d)
        add("ffn_down_shexp", d, cfg.n_ff_shexp)
    if plan.post_norms:
        add("ffn_post_norm", d)
    if plan.per_layer_input:  # P = cfg.n_embd_per_layer
        add("per_layer_inp_gate", cfg.n_embd_per_layer, d)
        add("per_layer_proj", d, cfg.n_embd_per_layer)
        add("per_layer_post_norm", d)
    if plan.out_scale:
        add("layer_output_scale", 1)
    return specs


def _attention_specs(cfg: ModelConfig, i: int, add: Callable[..., None]) -> None:
    """Attention layer i's tensors, its pre-norm aside (its own head size and KV heads: cfg.layer_head_dim /
    layer_kv_heads)."""
    plan = cfg.layers[i]
    d, dh = cfg.n_embd, cfg.layer_head_dim(i)
    q, kv = cfg.n_head * dh, cfg.layer_kv_heads(i) * dh
    if plan.attn_gate:  # rows per head [q; gate]
        add("attn_q", 2 * q, d)
        add("attn_k", kv, d)
        add("attn_v", kv, d)
    elif plan.fused_qkv:
        add("attn_qkv", q + 2 * kv, d)  # [q; k; v] rows
    else:
        add("attn_q", q, d)
        if not plan.shares_kv:  # (a shared-KV layer computes queries only)
            add("attn_k", kv, d)
            if not plan.v_from_k:
                add("attn_v", kv, d)
    if plan.qkv_bias:
        add("attn_q_bias", q)
        add("attn_k_bias", kv)
        add("attn_v_bias", kv)
    if plan.qk_norm:  # one weight per head dim, shared by every head
        add("attn_q_norm", dh)
        if not plan.shares_kv:
            add("attn_k_norm", dh)
    if plan.sinks:  # gpt-oss: one logit per query head
        add("attn_sinks", cfg.n_head)
    add("attn_output", d, q)
    if plan.o_bias:
        add("attn_output_bias", d)
    if plan.post_norms:  # gemma: RMSNorm of the attention output before its residual add
        add("attn_post_norm", d)


def _delta_net_specs(cfg: ModelConfig, plan: LayerPlan, add: Callable[..., None]) -> None:
    """A Gated DeltaNet layer's tensors (models/arch/qwen35.py): C = 2 Hk d_k + Hv d_v channels."""
    d, c, hv, dv, inner = cfg.n_embd, cfg.ssm_conv_dim, cfg.ssm_time_step_rank, cfg.ssm_state_size, cfg.ssm_inner_size
    add("attn_qkv", c, d)  # rows [q (Hk d_k); k (Hk d_k); v (Hv d_v)]
    add("attn_gate", inner, d)  # z, the output norm's gate
    if plan.ssm_ba:  # qwen3next: rows per key head [beta; alpha] of its value heads
        add("ssm_ba", 2 * hv, d)
    else:
        add("ssm_beta", hv, d)
        add("ssm_alpha", hv, d)
    add("ssm_conv1d", c, cfg.ssm_conv_kernel)  # the taps of each channel, oldest input first
    add("ssm_dt", hv)
    add("ssm_a", hv)  # -exp(A_log)
    add("ssm_norm", dv)
    add("ssm_out", d, inner)


def layer_tensor_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """LayerWeights field -> GGUF tensor name for every tensor block i needs: what both loaders (the NumPy
    backend's and CUDA's) build LayerWeights from, so that names live here only."""
    return {s.field: s.name for s in layer_specs(cfg, i)}


def active_share(cfg: ModelConfig, name: str) -> float:
    """The share of tensor `name` one token reads: n_expert_used / n_expert of an expert tensor
    (blk.N.ffn_{gate,up,down}_exps, weights and biases), one row of an untied token_embd (tied, it is the LM
    head, read whole) and of gemma4's per_layer_token_embd, all of anything else. Inspect's active parameters, bench's bytes per token."""
    if cfg.n_expert and "_exps." in name:
        return cfg.n_expert_used / cfg.n_expert
    if (name == "token_embd.weight" and not cfg.tied_embeddings) or name == "per_layer_token_embd.weight":
        return 1 / cfg.vocab_size
    return 1.0


def model_specs(cfg: ModelConfig) -> list[TensorSpec]:
    specs = [TensorSpec("token_embd.weight", (cfg.vocab_size, cfg.n_embd))]
    for i in range(cfg.n_layer):
        specs += layer_specs(cfg, i)
    specs.append(TensorSpec("output_norm.weight", (cfg.n_embd,)))
    if cfg.n_embd_per_layer:  # gemma4's per-layer token embeddings (block.per_layer_inputs)
        width = cfg.n_layer * cfg.n_embd_per_layer
        specs += [TensorSpec(PER_LAYER_TABLES[0], (cfg.vocab_size, width)),
                  TensorSpec(PER_LAYER_TABLES[1], (width, cfg.n_embd)),
                  TensorSpec(PER_LAYER_TABLES[2], (cfg.n_embd_per_layer,))]
    if not cfg.tied_embeddings:
        specs.append(TensorSpec("output.weight", (cfg.vocab_size, cfg.n_embd)))
    half = cfg.rope_dim // 2
    if cfg.rope_scaling in FREQ_FACTORS:
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
        ok = info.type in _VECTOR_TYPES if spec.vector else info.type in runnable
        if not ok:
            raise UnsupportedTensorTypeError(
                f"tensor {spec.name!r} has type {info.type.name}, which this backend cannot run"
            )
