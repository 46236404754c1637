"""The split planner (backends/split_plan.py), pure: llama.cpp's options and their one-line refusals, the cuts of
layer and tensor split (llama.cpp's rules, the quantization blocks' grain, vLLM's shared KV heads where there are
fewer KV heads than devices), each tensor's slice on the file's layout, each device's memory; and the host
collectives (backends/collective.py) the emulation meets at."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import pytest

from llamacli.backends.collective import HostGroup, set_nccl_environment
from llamacli.backends.split_plan import (
    DeviceMemory,
    Shard,
    SplitOptions,
    cuts,
    emulated_devices,
    parse_split_options,
    plan_split,
    shard_bytes,
    take,
)
from llamacli.errors import UsageError
from llamacli.ggufio.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from llamacli.ggufio.quants import dequantize
from llamacli.models.config import ModelConfig
from llamacli.models.weights import model_specs
from llamacli.testing import SHAPES, model_metadata, random_quant_rows, tensor_shapes, variant

GiB = 2**30


def config(shape, vocab: int = 300) -> ModelConfig:
    spec = SHAPES[shape] if isinstance(shape, str) else shape
    vocab = spec.vocab_size or vocab
    return ModelConfig.from_gguf(model_metadata(spec, vocab), {n for n, _ in tensor_shapes(spec, vocab)})


@dataclass(frozen=True)
class Info:  # what the planner reads of a TensorInfo
    type: QT
    n_bytes: int


def tensors(cfg: ModelConfig, qtype: QT = QT.F32, **types: QT) -> dict[str, Info]:
    """Fake TensorInfos of `cfg`'s tensors: matrices of `qtype` (names ending in a key of `types` of that type),
    vectors F32."""
    out = {}
    for spec in model_specs(cfg):
        t = QT.F32 if spec.vector else next((v for k, v in types.items() if spec.name.endswith(k + ".weight")), qtype)
        block, size = GGML_QUANT_SIZES[t]
        out[spec.name] = Info(t, math.prod(spec.shape) // block * size)
    return out


def tensor(mode: str, ts: str, **kw) -> SplitOptions:
    return parse_split_options(mode, ts, **kw)


# -- the options ---------------------------------------------------------------------------------------------


def test_options_as_llama_cpp_reads_them():
    assert parse_split_options() == SplitOptions()
    assert parse_split_options(tensor_split="3,1").mode == "layer"  # llama.cpp's default mode with several
    assert parse_split_options(tensor_split="3/1").proportions == (3.0, 1.0)  # ("," and "/", as llama.cpp)
    assert parse_split_options(device="CUDA0,cuda2").devices == (0, 2) and \
        parse_split_options(device="CUDA0,CUDA2").mode == "layer"
    assert parse_split_options(device="CUDA1") == SplitOptions(devices=(1,))  # one device: none, on it
    assert parse_split_options(device="none").devices == ()
    assert parse_split_options("TENSOR", "1,1", 1).main_gpu == 1
    assert parse_split_options("layer", "1,0,1").proportions == (1.0, 0.0, 1.0)
    opts = parse_split_options("tensor", "2,1", 0, "1,0")
    assert SplitOptions.from_json(opts.as_json()) == opts


@pytest.mark.parametrize("args, words", [
    (("foo",), "--split-mode takes none, layer or tensor, got 'foo'"),
    (("row",), "is --split-mode tensor here"),
    ((None, "1,x"), "--tensor-split takes proportions such as 3,1"),
    ((None, ""), "--tensor-split takes proportions"),
    ((None, "1,,1"), "--tensor-split takes proportions"),
    ((None, "-1,2"), "finite and not negative, got '-1'"),
    ((None, "inf,1"), "finite and not negative"),
    ((None, "nan"), "finite and not negative"),
    ((None, "0,0"), "needs a positive proportion"),
    ((None, "1e308,1e308"), "a finite sum"),
    ((None, ",".join(["1"] * 17)), "at most 16 devices"),
    ((None, "1" * 5000), "5000 characters long"),
    (("none", "1,1"), "give --split-mode layer or tensor with it"),
    ((None, None, -1), "--main-gpu takes a GPU index from 0 to 15, got -1"),
    ((None, None, 16), "got 16"),
    ((None, None, 10**40), "--main-gpu takes a GPU index"),
    ((None, None, 2, "CUDA0,CUDA1"), "--main-gpu 2 indexes the 2 devices -dev names"),
    ((None, None, None, "CUDA0,CUDA0"), "-dev names a device twice"),
    ((None, None, None, "gpu0"), "-dev takes devices such as CUDA0,CUDA1 (or none), got 'gpu0'"),
    ((None, None, None, "\x1b[31m"), "got '\\x1b[31m'"),
    ((None, None, None, ""), "-dev takes devices"),
    ((None, None, None, "0," * 600), "-dev is 1200 characters long"),
    ((None, None, None, ",".join(map(str, range(17)))), "-dev names 17 devices: at most 16"),
    (("layer", None, None, "none"), "-dev none runs on no GPU"),
    (("layer", "1,1,1", None, "CUDA0,CUDA1"), "3 proportions for the 2 devices"),
])
def test_hostile_options_are_one_line(args, words):
    with pytest.raises(UsageError) as exc:
        parse_split_options(*args)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_the_emulation_counts_the_devices_it_is_given():
    assert emulated_devices(SplitOptions()) == 1
    assert emulated_devices(tensor("tensor", "1,1,1")) == 3
    assert emulated_devices(parse_split_options("layer", None, None, "0,1")) == 2
    with pytest.raises(UsageError, match="--split-mode tensor --tensor-split 1,1 for two"):
        emulated_devices(parse_split_options("tensor"))


def test_split_options_from_json_refuse_what_json_can_hold():
    good = tensor("tensor", "1,1").as_json()
    for bad in (None, [], {**good, "extra": 1}, {**good, "mode": "row"}, {**good, "proportions": [float("nan")]},
                {**good, "proportions": ["1"]}, {**good, "devices": [-1]}, {**good, "main_gpu": True},
                {**good, "moe": "rows"}, {**good, "proportions": [1] * 17}, {**good, "proportions": [0, 0]},
                {**good, "proportions": [1e308, 1e308]}):
        with pytest.raises(ValueError):
            SplitOptions.from_json(bad)


# -- layer split -------------------------------------------------------------------------------------------


def test_layer_split_is_llama_cpps():
    """32 layers + the LM head as a 33rd unit, first device whose cumulative share exceeds i / 33: 1,1 gives the
    first device 17 layers (0-16), the second 15 and the head; 3,1 gives 25 / 7 + head."""
    cfg = config("llama-3-8b")
    plan = plan_split(cfg, None, tensor("layer", "1,1"), ctx=4096, devices=2)
    assert [s.layers for s in plan.shares] == [(0, 17), (17, 32)]
    assert [(s.embeddings, s.head) for s in plan.shares] == [(True, False), (False, True)]
    assert plan.main == 1  # the LM head's device samples
    assert [s.layers for s in plan_split(cfg, None, tensor("layer", "3,1"), ctx=4096, devices=2).shares] == \
        [(0, 25), (25, 32)]
    # a 0 leaves a device out; -dev picks and orders them
    plan = plan_split(cfg, None, parse_split_options("layer", "1,0,1"), ctx=4096, devices=3)
    assert [s.device for s in plan.shares] == [0, 2] and [s.rank for s in plan.shares] == [0, 1]
    plan = plan_split(cfg, None, parse_split_options("layer", None, None, "CUDA2,CUDA0"), ctx=4096, devices=3)
    assert [s.device for s in plan.shares] == [2, 0]
    with pytest.raises(UsageError, match="-dev names device 3, but only 2 are here"):
        plan_split(cfg, None, parse_split_options("layer", None, None, "0,3"), ctx=4096, devices=2)
    with pytest.raises(UsageError, match="gives 3 proportions, for 2 devices"):
        plan_split(cfg, None, tensor("layer", "1,1,1"), ctx=4096, devices=2)


def test_layer_split_refuses_a_device_left_without_layers():
    with pytest.raises(UsageError, match="leaves device 3 none of the model's 2 layers and LM head"):
        plan_split(config("tiny-llama"), None, tensor("layer", "1,1,1,1"), ctx=64, devices=4)


def test_layer_split_by_free_memory_by_default():
    cfg = config("llama-3-8b")
    devices = [DeviceMemory(0, 30 * GiB, 40 * GiB), DeviceMemory(1, 10 * GiB, 40 * GiB)]
    plan = plan_split(cfg, None, parse_split_options("layer"), ctx=4096, devices=devices)
    assert [s.layers for s in plan.shares] == [(0, 25), (25, 32)]  # as -ts 3,1


def test_none_runs_on_the_main_gpu():
    cfg = config("tiny-llama")
    plan = plan_split(cfg, None, parse_split_options(main_gpu=1), ctx=64, devices=2)
    assert [s.device for s in plan.shares] == [1] and plan.shares[0].layers == (0, 2)
    plan = plan_split(cfg, None, parse_split_options("none", None, 1, "CUDA2,CUDA0"), ctx=64, devices=3)
    assert plan.shares[0].device == 0  # --main-gpu indexes -dev's list
    with pytest.raises(UsageError, match="--main-gpu 3: there are 2 devices"):
        plan_split(cfg, None, parse_split_options(main_gpu=3), ctx=64, devices=2)


# -- tensor split ------------------------------------------------------------------------------------------


def test_cuts_floor_each_boundary_to_the_unit_as_llama_cpp():
    assert cuts(8, [0.5, 1.0], 1) == [(0, 4), (4, 8)]
    assert cuts(3, [0.5, 1.0], 1) == [(0, 1), (1, 3)]  # the last takes the rest
    assert cuts(7, [0.25, 0.5, 0.75, 1.0], 1) == [(0, 1), (1, 3), (3, 5), (5, 7)]
    assert cuts(512, [0.75, 1.0], 256) == [(0, 256), (256, 512)]  # 384 rounded down to a block
    assert cuts(100, [0.0001, 1.0], 1) == [(0, 0), (0, 100)]  # (an empty range: the planner refuses it)


def test_tensor_split_whole_kv_groups_uneven_and_odd_heads():
    cfg = config("llama-3-8b")  # 32 query heads in 8 KV groups of 4, FFN 14336
    plan = plan_split(cfg, None, tensor("tensor", "1,1"), ctx=4096, devices=2)
    a, b = plan.shares
    assert (a.q_heads, a.kv_heads, b.q_heads, b.kv_heads) == ((0, 16), (0, 4), (16, 32), (4, 8))
    assert (a.ff, b.ff, a.vocab, b.vocab) == ((0, 7168), (7168, 14336), (0, 64128), (64128, 128256))
    local = plan.local_config(cfg, 1)
    assert (local.n_head, local.n_head_kv, local.n_group, local.n_ff) == (16, 4, 4, 7168)
    plan = plan_split(cfg, None, tensor("tensor", "3,1"), ctx=4096, devices=2)
    assert [s.kv_heads for s in plan.shares] == [(0, 6), (6, 8)]
    # 3 KV heads (SmolLM2: 9 query heads) over 2: floor(1.5) = 1 group, the rest to the last
    smol = config("smollm2-135m")
    plan = plan_split(smol, None, tensor("tensor", "1,1"), ctx=512, devices=2)
    assert [s.q_heads for s in plan.shares] == [(0, 3), (3, 9)] and [s.kv_heads for s in plan.shares] == \
        [(0, 1), (1, 3)]
    odd = config(variant("tiny-llama", n_head=6, n_head_kv=3, n_embd=96))
    assert [s.kv_heads for s in plan_split(odd, None, tensor("tensor", "1,1,1"), ctx=64, devices=3).shares] == \
        [(0, 1), (1, 2), (2, 3)]


def test_fewer_kv_heads_than_devices_share_them_as_vllm():
    """Gemma 3 270M: 4 query heads, 1 KV head. Cut in query heads, each device holds the KV head its heads read
    (its K/V rows and cache on both)."""
    cfg = config("gemma3-270m")
    plan = plan_split(cfg, None, tensor("tensor", "1,1"), ctx=4096, devices=2)
    assert [(s.q_heads, s.kv_heads) for s in plan.shares] == [((0, 2), (0, 1)), ((2, 4), (0, 1))]
    local = plan.local_config(cfg, 0)
    assert (local.n_head, local.n_head_kv) == (2, 1)
    assert plan.shares[0].kv == plan.shares[1].kv == cfg.kv_cache_bytes(4096)  # the KV head held twice
    # a cut that would split a group between two KV heads' halves is impossible: refused
    two = config(variant("tiny-llama", n_head=8, n_head_kv=2, n_embd=128))
    with pytest.raises(UsageError, match="leaves device 0 no attention head"):
        plan_split(two, None, tensor("tensor", "1,2,2,2,2"), ctx=64, devices=5)
    with pytest.raises(UsageError, match="leaves device 0 no attention head: the model has 4 query heads over 2"):
        plan_split(config("tiny-llama"), None, tensor("tensor", "0.001,1"), ctx=64, devices=2)


def test_the_quantization_blocks_set_the_grain():
    """A cut along a row-parallel matrix's columns falls on its blocks: attn_output Q4_K (256 values) of
    head groups of 128 columns (SmolLM2-shaped heads 64 x 2) moves in pairs of groups; a file whose
    attn_output has one block a row cannot be cut, and says why."""
    cfg = config(variant("tiny-llama", n_embd=512, n_head=8, n_head_kv=4, n_ff=1024))  # dh 64, G 2
    plan = plan_split(cfg, tensors(cfg, QT.Q4_K), tensor("tensor", "3,1"), ctx=64, devices=2)
    assert plan.units == {"q_heads": 4, "ff": 256, "vocab": 1}
    assert [s.q_heads for s in plan.shares] == [(0, 4), (4, 8)]  # 6 heads rounded down to 4
    assert [s.ff for s in plan.shares] == [(0, 768), (768, 1024)]
    small = config("small-llama")  # attn_output [256, 256]: one Q4_K block per row
    with pytest.raises(UsageError, match="cut in groups of 4 query heads"):
        plan_split(small, tensors(small, QT.Q4_K), tensor("tensor", "1,1"), ctx=64, devices=2)
    assert plan_split(small, tensors(small, QT.Q8_0), tensor("tensor", "1,1"), ctx=64, devices=2).units["q_heads"] == 2


def test_moe_split_by_columns_or_experts():
    cfg = config("tiny-gpt-oss")  # 8 experts of 64 columns, MXFP4 (32 values a block)
    infos = tensors(cfg, QT.Q8_0, ffn_gate_exps=QT.MXFP4, ffn_up_exps=QT.MXFP4, ffn_down_exps=QT.MXFP4)
    plan = plan_split(cfg, infos, tensor("tensor", "1,1"), ctx=64, devices=2)
    assert [s.ff_exp for s in plan.shares] == [(0, 32), (32, 64)] and "experts" not in plan.units
    plan = plan_split(cfg, infos, tensor("tensor", "1,1", moe="experts"), ctx=64, devices=2)
    assert [s.experts for s in plan.shares] == [(0, 4), (4, 8)] and "ff_exp" not in plan.units
    with pytest.raises(UsageError, match="the MoE split is columns or experts"):
        parse_split_options("tensor", "1,1", moe="rows")


def test_a_shared_kv_layer_goes_with_the_layer_it_reads():
    """Gemma 4 E-style: layers 6 and 7 read the caches of layers 4 and 5. 3,1 would cut after layer 6 (llama.cpp's
    rule); the cut moves before layer 4, so that each reader is on its source's device. Tensor split does not cut
    layers whose head sizes differ (gemma4's sliding and global layers)."""
    cfg = config("tiny-gemma4")
    assert [(i, p.kv_from) for i, p in enumerate(cfg.layers) if p.shares_kv] == [(6, 4), (7, 5)]
    assert [s.layers for s in plan_split(cfg, None, tensor("layer", "3,1"), ctx=64, devices=2).shares] == \
        [(0, 4), (4, 8)]
    assert [s.layers for s in plan_split(cfg, None, tensor("layer", "1,1"), ctx=64, devices=2).shares] == \
        [(0, 4), (4, 8)]
    with pytest.raises(UsageError, match="leaves device 2 none of the model's 8 layers"):
        plan_split(cfg, None, tensor("layer", "1,1,1,1"), ctx=64, devices=4)
    with pytest.raises(UsageError, match="does not cut layers whose heads or widths differ.*gemma4"):
        plan_split(cfg, None, tensor("tensor", "1,1"), ctx=64, devices=2)


def test_delta_net_layers_are_not_cut():
    with pytest.raises(UsageError, match="does not cut Gated DeltaNet layers.*--split-mode layer"):
        plan_split(config("tiny-qwen35"), None, tensor("tensor", "1,1"), ctx=64, devices=2)
    plan = plan_split(config("tiny-qwen35"), None, tensor("layer", "1,1"), ctx=64, devices=2)
    assert [s.layers for s in plan.shares] == [(0, 5), (5, 8)]


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-phi3", "tiny-qwen3moe", "tiny-gpt-oss", "tiny-gemma3",
                                   "tiny-qwen2"])
def test_the_shards_cover_every_tensor_once(shape):
    """Over the devices, each sharded tensor's pieces cover it exactly once (a whole tensor on each device that
    holds it, a first-only bias on the first); the shards' shapes are the local config's."""
    cfg = config(shape)
    for moe in ("columns", "experts") if cfg.n_expert else ("columns",):
        plan = plan_split(cfg, None, tensor("tensor", "2,1", moe=moe), ctx=64, devices=2)
        for spec in model_specs(cfg):
            shards = [plan.shard(r, spec, cfg) for r in range(2)]
            held = [s for s in shards if s is not None]
            if not held or all(s.axis is None for s in held):
                continue
            axis = held[0].axis
            counts = np.zeros(spec.shape[axis], int)
            for shard in held:
                for a, b in shard.pieces:
                    counts[a:b] += 1
            shared_kv = spec.field in ("attn_k", "attn_v", "attn_k_bias", "attn_v_bias", "attn_qkv") and cfg.n_head_kv < 2
            assert counts.min() >= 1 and (counts.max() == 1 or shared_kv), spec.name  # (KV rows: vLLM's copies)
            for r, shard in enumerate(shards):
                if shard is not None and spec.field in ("attn_q", "ffn_down", "attn_output"):
                    local = plan.local_config(cfg, r)
                    want = {"attn_q": local.q_dim, "ffn_down": local.n_ff, "attn_output": local.q_dim}[spec.field]
                    assert shard.shape(spec.shape)[axis] == want, spec.name


def test_take_cuts_the_files_layout_as_the_values():
    """A shard taken from the raw blocks (what a GPU uploads) dequantizes to the same values as the shard of the
    dequantized matrix: rows, and whole blocks of columns; a cut inside a block is refused."""
    rng = np.random.default_rng(0)
    for qtype in (QT.Q8_0, QT.Q4_K, QT.MXFP4, QT.F16, QT.F32):
        block, size = GGML_QUANT_SIZES[qtype]
        raw = random_quant_rows(qtype, 40, 1024, rng, 0.1)  # [rows, row bytes] (plain types: the values)
        full = dequantize(raw, qtype).reshape(40, 1024)
        columns = (block, 3 * block) if block > 1 else (64, 200)
        for shard in (Shard(1, (columns,)), Shard(1, ((0, 512), (768, 1024))), Shard(0, ((3, 17),)),
                      Shard(0, ((0, 10), (30, 40))), Shard()):
            part = take(raw, shard, block, size if block > 1 else 0)
            want = take(full, shard)
            assert want.shape == shard.shape((40, 1024))
            assert np.array_equal(dequantize(part, qtype).reshape(want.shape), want), (qtype, shard)
            bytes_ = raw.reshape(-1).view(np.uint8)
            ranges = shard_bytes((40, 1024), raw.nbytes // 40, shard, block, size if block > 1 else 0)
            assert np.array_equal(np.concatenate([bytes_[a:b] for a, b in ranges]),
                                  np.ascontiguousarray(part).reshape(-1).view(np.uint8)), (qtype, shard)
        if block > 1:
            with pytest.raises(ValueError, match="splits a"):
                take(raw, Shard(1, ((0, block // 2),)), block, size)
    # experts [E, F, D]: a cut of F (gate/up, axis 1) is a range per expert; of E, one range
    raw = random_quant_rows(QT.Q8_0, 4 * 64, 64, rng, 0.1).reshape(4, 64, -1)
    for shard, runs in ((Shard(1, ((16, 48),)), 4), (Shard(0, ((1, 3),)), 1)):
        ranges = shard_bytes((4, 64, 64), raw.shape[-1], shard, 32, 34)
        assert len(ranges) == runs
        got = np.concatenate([raw.reshape(-1)[a:b] for a, b in ranges])
        assert np.array_equal(got, np.ascontiguousarray(take(raw, shard, 32, 34)).reshape(-1))


def test_memory_per_device():
    """Llama-3-70B at Q4_K (weights about 37 GiB) and its fp16 KV cache at 8192 (2.5 GiB): on 2 x 24 GiB GPUs layer
    split puts 41 and 39 layers, tensor half of everything on each; the sum of the shares is the model, the
    replicated norms once per device aside."""
    cfg = config("llama-3-8b")
    cfg70 = config(variant("llama-3-8b", n_layer=80, n_embd=8192, n_head=64, n_ff=28672))
    infos = tensors(cfg70, QT.Q4_K)
    whole = sum(4 * math.prod(s.shape) if s.vector else infos[s.name].n_bytes for s in model_specs(cfg70))
    gpus = [DeviceMemory(0, 24 * GiB, 24 * GiB), DeviceMemory(1, 24 * GiB, 24 * GiB)]
    layer = plan_split(cfg70, infos, parse_split_options("layer"), ctx=8192, devices=gpus, scratch=GiB // 2)
    assert sum(s.weights for s in layer.shares) == whole
    assert sum(s.kv for s in layer.shares) == cfg70.kv_cache_bytes(8192)
    assert [s.layers for s in layer.shares] == [(0, 41), (41, 80)]
    assert layer.fits and all(s.scratch == GiB // 2 for s in layer.shares)
    tp = plan_split(cfg70, infos, parse_split_options("tensor"), ctx=8192, devices=gpus)
    norms = sum(4 * math.prod(s.shape) for s in model_specs(cfg70) if s.field in (
        "attn_norm", "ffn_norm") or s.name == "output_norm.weight")
    assert sum(s.weights for s in tp.shares) == whole + norms
    assert [s.kv for s in tp.shares] == [cfg70.kv_cache_bytes(8192) // 2] * 2
    # one 24 GiB GPU does not hold it; -sm none says so per device
    one = plan_split(cfg70, infos, SplitOptions(), ctx=8192, devices=gpus[:1])
    assert not one.fits and "does not fit" in one.lines()[0]
    # slots multiply the cache
    assert plan_split(cfg, None, SplitOptions(), ctx=1024, devices=1, slots=4).shares[0].kv == \
        4 * cfg.kv_cache_bytes(1024)


def test_plan_lines_and_json():
    cfg = config("tiny-qwen3moe")
    plan = plan_split(cfg, None, tensor("tensor", "1,1"), ctx=64, devices=[DeviceMemory(0, GiB, GiB),
                                                                          DeviceMemory(1, 1000, GiB)])
    lines = plan.lines()
    assert lines[0].startswith("device 0: query heads 0-1 of 4 (KV heads 0-0 of 2), expert columns 0-15")
    assert lines[1].endswith("of 1000 B free: does not fit") and not plan.fits
    info = plan.as_json()
    assert info["mode"] == "tensor" and info["devices"][1]["fits"] is False and info["fits"] is False
    layer = plan_split(cfg, None, tensor("layer", "1,2"), ctx=64, devices=2)
    assert layer.lines()[0].startswith("device 0: layers 0-1 + the embeddings;")


# -- collectives ----------------------------------------------------------------------------------------------


def test_host_group_sums_gathers_and_passes_in_rank_order():
    group = HostGroup(3)
    parts = [np.full((2, 3), r + 1, np.float32) for r in range(3)]

    def work(r):
        me = group.member(r)
        total = me.all_reduce(parts[r])
        joined = me.all_gather(parts[r][:, :1] * 10, axis=-1)
        if r < 2:
            me.send(total + r, r + 1)
        got = me.recv(r - 1, (2, 3)) if r > 0 else None
        return total, joined, got

    out = group.run(work)
    for total, joined, _ in out:
        assert np.array_equal(total, np.full((2, 3), 6, np.float32))
        assert np.array_equal(joined, np.array([[10, 20, 30]] * 2, np.float32))
    assert np.array_equal(out[1][2], np.full((2, 3), 6)) and np.array_equal(out[2][2], np.full((2, 3), 7))


def test_a_failing_rank_stops_the_others_and_is_raised():
    """A rank that fails never leaves the others waiting at a collective: the group is aborted, the failure raised
    once every rank has stopped, and the group works again afterwards."""
    group = HostGroup(3)
    seen = []

    def work(r):
        if r == 1:
            raise ValueError("rank 1 broke")
        try:
            return group.member(r).all_reduce(np.ones(2)) if r == 0 else group.member(r).recv(1, (2,))
        except Exception as exc:
            seen.append(type(exc).__name__)
            raise

    with pytest.raises(ValueError, match="rank 1 broke"):
        group.run(work)
    assert sorted(seen) == ["GroupAborted", "GroupAborted"]
    assert [x.tolist() for x in group.run(lambda r: group.member(r).all_reduce(np.ones(2)))] == [[3.0, 3.0]] * 3
    assert threading.active_count() < 10


def test_nccl_environment_turns_nvlink_multicast_off():
    env: dict[str, str] = {"NCCL_NVLS_ENABLE": "1"}
    set_nccl_environment(env)
    assert env == {"NCCL_NVLS_ENABLE": "0"}
