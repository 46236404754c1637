"""What to tell a user whose model does not fit the GPU: what it needs and what the GPU has, then what would
fit (a smaller --ctx, a smaller quantization, the host's GPUs together with --split-mode layer or tensor, as
split_plan.py plans them) and, for a model larger than the host, the engines that split one across hosts. Pure
arithmetic on sizes, so it is tested without a GPU; the CUDA backend's memory check raises
DeviceMemoryError(not_enough_memory(...)).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..errors import UsageError
from ..models.config import ModelConfig
from ..models.kv_cache import DEFAULT as DEFAULT_CACHE, cache_type_fits
from ..units import human_bytes
from .split_plan import DeviceMemory, SplitOptions, plan_split

# Bits per weight of llama.cpp's common quantizations, best quality first: the file sizes its quantize tool
# lists for Llama-3-8B (8.03B parameters), as bits per parameter. A file of another model lands near these.
QUANT_BITS = (("Q8_0", 8.50), ("Q6_K", 6.57), ("Q5_K_M", 5.70), ("Q4_K_M", 4.90), ("Q3_K_M", 4.00), ("Q2_K", 3.17))

CTX_STEP = 256  # suggested contexts are multiples of this
# Beyond one host: engines that split a model over several (llamacli splits one over the GPUs of one host).
ACROSS_HOSTS = ("across hosts, vLLM splits it (`vllm serve MODEL --tensor-parallel-size T --pipeline-parallel-size "
                "P`, tensor and pipeline parallel), and so does llama.cpp's RPC (`rpc-server` on each host, then "
                "`llama-server -m FILE --rpc HOST:PORT,...`)")


def not_enough_memory(cfg: ModelConfig, ctx: int, *, weights: int, kv: int, scratch: int, free: int, total: int,
                      n_params: int | None = None, cache_types: tuple[str, str] = DEFAULT_CACHE,
                      tensors: Mapping[str, Any] | None = None, gpus: Sequence[DeviceMemory] = ()) -> str:
    """The message for a model that needs weights + kv + scratch bytes at `ctx` and finds `free` of `total`.

    The largest context that fits is the one whose KV cache (cfg.kv_cache_bytes of `cache_types`) fits the
    room left after the weights and scratch; with an fp16 cache, the 8-bit one (-ctk/-ctv q8_0) where it
    would hold `ctx` (its fp16 pair of one layer's rows counted: CUDA's kv.KVCache). `n_params` defaults
    to the count the config implies (the matrices of every layer and the embeddings). `gpus`: every GPU of
    the host (this one among them) where there are several: the split modes whose plan (split_plan.plan_split
    over them, by their free memory, `tensors` the file's) fits are proposed; the engines that split a model
    across hosts are named for a model larger than the host's GPUs together."""
    need = weights + kv + scratch
    head = (f"not enough GPU memory: the model needs {human_bytes(need)} at --ctx {ctx} (weights "
            f"{human_bytes(weights)}, KV cache {human_bytes(kv)}, scratch {human_bytes(scratch)}); the GPU has "
            f"{human_bytes(free)} free of {human_bytes(total)}")
    hints = []
    q8 = ("q8_0", "q8_0")
    if cache_types != q8 and cache_type_fits(cfg.head_dim, "q8_0"):
        kv8 = cfg.kv_cache_bytes(ctx, q8)
        if weights + scratch + kv8 + q8_pair_bytes(cfg, ctx) <= free:
            hints.append(f"`-ctk q8_0 -ctv q8_0` fits --ctx {ctx} (KV cache {human_bytes(kv8)})")
    fit = largest_ctx(cfg, free - weights - scratch, cache_types)
    if fit:
        hints.append(f"--ctx {fit} fits (KV cache {human_bytes(cfg.kv_cache_bytes(fit, cache_types))})")
    quant = smaller_quant(cfg, ctx, weights, kv, scratch, free, n_params or parameter_count(cfg), cache_types)
    if quant:
        hints.append(quant)
    several = len(gpus) > 1
    if several:
        modes = split_fits(cfg, tensors, ctx, cache_types, scratch, gpus)
        if modes:
            hints.insert(0, f"{' or '.join(f'`--split-mode {m}`' for m in modes)} fits it over the {len(gpus)} "
                            "GPUs here")
        host = sum(g.total or 0 for g in gpus)
        if weights + scratch * len(gpus) > host:
            hints.append(f"the weights alone are larger than the {len(gpus)} GPUs of this host together: "
                         + ACROSS_HOSTS)
        elif not hints:
            hints.append(f"nothing fits the {len(gpus)} GPUs of this host at --ctx {ctx}: " + ACROSS_HOSTS)
    elif weights + scratch > total or not hints:
        what = "the weights alone are larger than this GPU" if weights + scratch > total else "nothing fits this GPU"
        hints.append(f"{what}: on a host with several GPUs, --split-mode layer or tensor splits it over them; "
                     + ACROSS_HOSTS)
    return head + "; " + "; ".join(hints)


def split_fits(cfg: ModelConfig, tensors: Mapping[str, Any] | None, ctx: int, cache_types: tuple[str, str],
               scratch: int, gpus: Sequence[DeviceMemory]) -> list[str]:
    """The split modes (layer, tensor) whose plan over `gpus`, by their free memory as llama.cpp shares them,
    fits every GPU at `ctx` with `scratch` bytes on each; a mode that cannot cut this model is left out."""
    fits = []
    for mode in ("layer", "tensor"):
        try:
            plan = plan_split(cfg, tensors, SplitOptions(mode), ctx=ctx, devices=gpus, cache_types=cache_types,
                              scratch=scratch)
        except UsageError:
            continue
        if plan.fits:
            fits.append(mode)
    return fits


def q8_pair_bytes(cfg: ModelConfig, ctx: int) -> int:
    """The fp16 K and V pair of one layer's rows that the CUDA backend keeps beside an 8-bit cache (its
    prefill readers' form: cuda/kv.py KVCache): as many values as the largest layer's K (or V) rows hold (each layer's
    own KV heads and head dim: gemma4's differ; every other model's are the config's)."""
    return 2 * 2 * max(n * cfg.layer_kv_heads(i) * cfg.layer_head_dim(i) for i, n in enumerate(cfg.cache_rows(ctx)))


def largest_ctx(cfg: ModelConfig, room: int, cache_types: tuple[str, str] = DEFAULT_CACHE) -> int:
    """The largest multiple of CTX_STEP positions (up to the trained length) whose KV cache of `cache_types`
    fits in `room` bytes, 0 when none does. The cache grows with the context, linearly until sliding-window
    layers reach their rings' size (config.kv_cache_bytes), so a bisection over the steps."""
    lo, hi = 0, cfg.context_length // CTX_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cfg.kv_cache_bytes(mid * CTX_STEP, cache_types) <= room else (lo, mid - 1)
    return lo * CTX_STEP


def smaller_quant(cfg: ModelConfig, ctx: int, weights: int, kv: int, scratch: int, free: int, n_params: int,
                  cache_types: tuple[str, str] = DEFAULT_CACHE) -> str:
    """The best-quality common quantization smaller than this file's that fits, at `ctx` if it can, else at
    the largest context it leaves room for; "" when none is smaller or none fits."""
    if n_params <= 0:
        return ""
    bits_now = weights * 8 / n_params
    smaller = [(name, int(n_params * bits / 8)) for name, bits in QUANT_BITS if bits <= 0.9 * bits_now]
    for name, size in smaller:
        if size + kv + scratch <= free:
            return f"a {name} file (weights about {human_bytes(size)}) fits at --ctx {ctx}"
    for name, size in smaller:
        fit = largest_ctx(cfg, free - size - scratch, cache_types)
        if fit:
            return f"a {name} file (weights about {human_bytes(size)}) fits at --ctx {fit}"
    return ""


def parameter_count(cfg: ModelConfig) -> int:
    """Weights of the matrices (attention, feed-forward, embeddings, LM head unless tied); norms are noise."""
    attention = cfg.n_embd * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * cfg.n_embd
    feed_forward = 3 * cfg.n_embd * cfg.n_ff
    embeddings = cfg.vocab_size * cfg.n_embd * (1 if cfg.tied_embeddings else 2)
    return cfg.n_layer * (attention + feed_forward) + embeddings
