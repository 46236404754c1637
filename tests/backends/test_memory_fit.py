"""The message for a model that does not fit the GPU: needs and has, a --ctx that fits, a smaller
quantization that fits, and the multi-GPU engines for a model larger than one GPU. Sizes are worked by hand
from the real shapes of Llama-3-8B and Llama-3-70B."""

from __future__ import annotations

import re

from llamacli.backends.memory_fit import largest_ctx, not_enough_memory, parameter_count, split_fits
from llamacli.backends.split_plan import DeviceMemory
from llamacli.models.config import config_from_metadata

GiB = 2**30


def llama(n_layer=32, n_embd=4096, n_head=32, n_ff=14336):
    md = {"general.architecture": "llama", "llama.block_count": n_layer, "llama.embedding_length": n_embd,
          "llama.attention.head_count": n_head, "llama.attention.head_count_kv": 8, "llama.feed_forward_length": n_ff,
          "llama.context_length": 8192, "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 128256}
    return config_from_metadata(md, {"token_embd.weight", "output.weight"})


L8B, L70B = llama(), llama(n_layer=80, n_embd=8192, n_head=64, n_ff=28672)


def message(cfg, ctx, bits, free, total, scratch=GiB // 2):
    weights = int(parameter_count(cfg) * bits / 8)
    return not_enough_memory(cfg, ctx, weights=weights, kv=cfg.kv_cache_bytes(ctx), scratch=scratch, free=free,
                             total=total)


def test_parameter_count_of_known_shapes():
    assert round(parameter_count(L8B) / 1e9, 2) == 8.03
    assert round(parameter_count(L70B) / 1e9, 1) == 70.6


def test_says_what_it_needs_and_has_and_which_ctx_fits():
    # Llama-3-8B Q8_0 (7.95 GiB) at --ctx 8192 (KV 1 GiB, 128 KiB a position) with 8.75 GiB free.
    msg = message(L8B, 8192, 8.5, free=int(8.75 * GiB), total=12 * GiB)
    assert msg.startswith("not enough GPU memory: the model needs 9.45 GiB at --ctx 8192")
    assert "weights 7.95 GiB, KV cache 1.00 GiB, scratch 512.00 MiB" in msg
    assert "8.75 GiB free of 12.00 GiB" in msg
    # room = 8.75 - 7.95 - 0.5 = 0.30 GiB = 2457 positions -> 2304 (a multiple of 256)
    assert "--ctx 2304 fits" in msg
    assert "\n" not in msg and "vLLM" not in msg  # the model is smaller than the GPU


def test_largest_ctx_is_the_largest_step_that_fits():
    per = L8B.kv_cache_bytes(1)
    assert largest_ctx(L8B, per * 1000) == 768
    assert largest_ctx(L8B, per * 255) == 0 and largest_ctx(L8B, -5) == 0
    assert largest_ctx(L8B, per * 10**6) == 8192  # never past the trained length


def test_suggests_the_best_smaller_quantization_that_fits():
    # Llama-3-8B F16 (14.96 GiB) on a 12 GiB GPU: Q8_0 (7.95 GiB) fits with the full context.
    msg = message(L8B, 8192, 16, free=12 * GiB, total=12 * GiB)
    assert "a Q8_0 file (weights about 7.95 GiB) fits at --ctx 8192" in msg
    assert "--ctx 2304 fits" not in msg and not re.search(r"; --ctx \d+ fits", msg)  # no context holds F16 here
    # The weights alone exceed this GPU: the engines that split a model are named.
    assert "larger than this GPU" in msg and "--split-mode layer or tensor" in msg and "vLLM" in msg


def test_quantization_that_fits_only_with_a_smaller_context():
    # Llama-3-8B Q8_0 with 7 GiB free: Q6_K (6.14 GiB) leaves 0.36 GiB, short of the 1 GiB KV cache at 8192;
    # Q5_K_M (5.33 GiB) leaves 1.17 GiB: it is the best that keeps the whole context.
    assert "a Q5_K_M file (weights about 5.33 GiB) fits at --ctx 8192" in message(L8B, 8192, 8.5, 7 * GiB, 8 * GiB)
    # With 3.97 GiB free none keeps 8192; Q2_K (2.963 GiB) leaves 0.507 GiB: 4149 positions, 4096 in steps.
    msg = message(L8B, 8192, 8.5, free=int(3.97 * GiB), total=4 * GiB)
    assert "a Q2_K file (weights about 2.96 GiB) fits at --ctx 4096" in msg


def test_no_smaller_quantization_below_the_smallest():
    msg = message(L8B, 8192, 3.2, free=2 * GiB, total=4 * GiB)
    assert " file (weights about" not in msg
    assert "nothing fits this GPU: on a host with several GPUs, --split-mode layer or tensor" in msg
    assert "vLLM" in msg  # nothing fits one GPU: several, or the engines that split across hosts


def test_a_70b_model_on_one_80gb_gpu():
    # Llama-3-70B F16 (131 GiB) on an H100: larger than the GPU; Q8_0 (69.8 GiB) fits.
    msg = message(L70B, 8192, 16, free=79 * GiB, total=80 * GiB, scratch=GiB)
    assert "weights 131.4" in msg and "79.00 GiB free of 80.00 GiB" in msg
    assert "a Q8_0 file (weights about 69.8" in msg and "fits at --ctx 8192" in msg
    assert "the weights alone are larger than this GPU" in msg
    assert "--split-mode layer or tensor splits it over them" in msg and "--tensor-parallel-size" in msg
    assert "llama-server -m FILE --rpc HOST:PORT" in msg


def test_the_8bit_cache_is_suggested_and_counted():
    """An fp16 cache that does not fit where the 8-bit one (-ctk/-ctv q8_0: 68 KiB a position for Llama-3-8B,
    plus CUDA's fp16 pair of one layer, 32 KiB a position) would: the message says so; with the 8-bit cache
    chosen, the --ctx that fits counts its bytes."""
    weights = int(parameter_count(L8B) * 8.5 / 8)
    msg = not_enough_memory(L8B, 8192, weights=weights, kv=L8B.kv_cache_bytes(8192), scratch=GiB // 2,
                            free=int(9.2 * GiB), total=12 * GiB)
    assert "`-ctk q8_0 -ctv q8_0` fits --ctx 8192 (KV cache 544.00 MiB)" in msg
    q8 = ("q8_0", "q8_0")
    msg = not_enough_memory(L8B, 8192, weights=weights, kv=L8B.kv_cache_bytes(8192, q8), scratch=GiB // 2,
                            free=int(8.75 * GiB), total=12 * GiB, cache_types=q8)
    assert "q8_0" not in msg and "KV cache 544.00 MiB" in msg
    assert "--ctx 4608 fits" in msg  # 0.30 GiB / 68 KiB = 4626 positions
    assert largest_ctx(L8B, 1000 * L8B.kv_cache_bytes(1, q8), q8) == 768


def test_several_gpus_propose_the_split_modes_that_fit():
    """Llama-3-70B at Q4_K (37 GiB) with 8192 positions on a 24 GiB GPU of a host with two: both
    splits fit over the two (the planner's shares by free memory), and the message says so first; on a host of
    two 12 GiB GPUs none does, and for F16 (131 GiB) the host's GPUs together are too small: the engines that
    split across hosts are named."""
    infos = q4_k_tensors(L70B)
    weights = sum(info.n_bytes for info in infos.values())
    gpus = [DeviceMemory(0, 23 * GiB, 24 * GiB), DeviceMemory(1, 24 * GiB, 24 * GiB)]
    assert split_fits(L70B, infos, 8192, ("f16", "f16"), GiB // 2, gpus) == ["layer", "tensor"]
    assert split_fits(L70B, None, 8192, ("f16", "f16"), GiB // 2, gpus) == []  # (no file: float32 weights)
    msg = not_enough_memory(L70B, 8192, weights=weights, kv=L70B.kv_cache_bytes(8192), scratch=GiB // 2,
                            free=23 * GiB, total=24 * GiB, gpus=gpus, tensors=infos)
    assert "; `--split-mode layer` or `--split-mode tensor` fits it over the 2 GPUs here" in msg
    assert "vLLM" not in msg
    small = [DeviceMemory(0, 12 * GiB, 12 * GiB), DeviceMemory(1, 12 * GiB, 12 * GiB)]
    msg = not_enough_memory(L70B, 8192, weights=weights, kv=L70B.kv_cache_bytes(8192), scratch=GiB // 2,
                            free=12 * GiB, total=12 * GiB, gpus=small, tensors=infos)
    assert "--split-mode" not in msg and "the weights alone are larger than the 2 GPUs of this host together" in msg
    assert "vllm serve MODEL --tensor-parallel-size T --pipeline-parallel-size P" in msg and "--rpc" in msg


def q4_k_tensors(cfg):
    """TensorInfo-likes of cfg's tensors: matrices Q4_K (4.5 bits), vectors F32."""
    import math

    from llamacli.ggufio.ggml_types import GGMLQuantizationType as QT
    from llamacli.models.weights import model_specs

    class Info:
        def __init__(self, t, n):
            self.type, self.n_bytes = t, n

    return {s.name: Info(QT.F32, 4 * math.prod(s.shape)) if s.vector else Info(QT.Q4_K, math.prod(s.shape) // 256 * 144)
            for s in model_specs(cfg)}
