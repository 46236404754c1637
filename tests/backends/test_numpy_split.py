"""The NumPy backend over emulated devices (backends/numpy_split.py) against one device: the same logits within a
tolerance, the same greedy tokens, on tiny random models of several architectures (GQA; head counts the devices
do not divide; a KV head shared by two devices as vLLM does; quantized cuts; MoE by expert columns and by whole
experts; gemma2/3 with sliding windows and soft-caps; gpt-oss with sinks, biases and MXFP4 experts; phi3's fused
matrices; a hybrid with recurrent states under layer split), uneven --tensor-split shares, several cache slots and
a prompt that resumes from the cache; and the real SmolLM2 against its stored greedy replies.

Tolerance: the split sums the same float32 products in another order (a partial sum per device, then their sum),
so logits agree to max |split - one| <= 1e-4 * max |one| (observed: about 1e-6 of it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llamacli.backends import select_backend
from llamacli.backends.numpy_backend import NumpyBackend
from llamacli.backends.numpy_split import NumpySplitBackend
from llamacli.backends.split_plan import SplitOptions, parse_split_options
from llamacli.backends.step import Sampler, SeqStep
from llamacli.engine.generate import Model
from llamacli.errors import BackendError, UsageError
from llamacli.ggufio.file import open_gguf
from llamacli.models import block
from llamacli.models.config import ModelConfig
from llamacli.sampling.sampling import SamplingParams
from llamacli.testing import variant, write_model

RTOL = 1e-4  # of the largest logit (the module doc)
STEPS = 8


def close(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and float(np.abs(got - want).max()) <= RTOL * float(np.abs(want).max())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    made: dict = {}

    def make(shape, qtype="F32"):
        key = (shape if isinstance(shape, str) else shape.name, qtype)
        if key not in made:
            made[key] = write_model(root / f"{key[0]}-{qtype}.gguf", shape, qtype, std=0.08, seed=3)
        return made[key]

    return make


def pair(path, options: SplitOptions, ctx: int = 64):
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    one = NumpyBackend()
    one.load(g, cfg, ctx)
    split = NumpySplitBackend(options)
    split.load(g, cfg, ctx)
    return cfg, one, split


def agree(cfg, one, split, seed: int = 0, n: int = 11) -> list[int]:
    """Prefill logits at every position close, then STEPS greedy decode steps with equal tokens and close logits;
    -> the tokens."""
    ids = np.random.default_rng(seed).integers(3, cfg.vocab_size, size=n)
    want = block.run(one, cfg, one.token_ids(ids), one.positions(0, n), all_logits=True)
    got = split.forward(split.token_ids(ids), split.positions(0, n), all_logits=True)
    assert close(got, want), float(np.abs(got - want).max())
    tokens = []
    a, b = want[-1:], got[-1:]
    for t in range(STEPS):
        x, y = int(np.argmax(a[-1])), int(np.argmax(b[-1]))
        assert x == y, (t, x, y)
        tokens.append(x)
        a, b = one.decode(x, n + t), split.decode(y, n + t)
        assert close(b, a), (t, float(np.abs(b - a).max()))
    return tokens


ODD = variant("tiny-llama", n_head=6, n_head_kv=3, n_embd=96, name="odd-heads")  # 3 KV heads over 2 or 3 devices

CASES = [
    ("tiny-llama", "F32", "tensor", "1,1", "columns"),  # GQA, 2 KV groups
    ("tiny-llama", "Q8_0", "tensor", "3,1", "columns"),  # uneven, cut on whole Q8_0 blocks
    ("tiny-llama", "F32", "tensor", "1,1,1", "columns"),  # 2 KV heads over 3: the first shared by two devices
    (ODD, "F32", "tensor", "1,1", "columns"),  # 3 KV heads over 2: 1 and 2
    (ODD, "F32", "tensor", "1,1,1", "columns"),
    ("tiny-qwen3moe", "F32", "tensor", "1,1", "columns"),  # each expert's columns
    ("tiny-qwen3moe", "F32", "tensor", "1,1,1", "experts"),  # whole experts, 8 over 3
    ("tiny-gpt-oss", "MXFP4_MOE", "tensor", "1,1", "columns"),  # sinks, biases, window, YaRN, MXFP4 cut on blocks
    ("tiny-gpt-oss", "MXFP4_MOE", "tensor", "2,1", "experts"),
    ("tiny-gemma3", "F32", "tensor", "1,1", "columns"),  # 1 KV head on both; window, q/k norms, post-norms, GeGLU
    ("tiny-gemma2", "F32", "tensor", "1,1", "columns"),  # attention and final soft-caps
    ("tiny-phi3", "F32", "tensor", "3,1", "columns"),  # fused QKV and gate/up, partial rows of each part
    ("tiny-qwen2", "F32", "tensor", "1,1", "columns"),  # QKV biases, tied embeddings
    ("tiny-llama", "F32", "layer", "1,2", "columns"),
    ("tiny-gemma3", "F32", "layer", "1,1,1", "columns"),
    ("tiny-gpt-oss", "MXFP4_MOE", "layer", "3,1", "columns"),
    ("tiny-qwen35", "F32", "layer", "1,2,1", "columns"),  # delta-net layers' states on their devices
    ("tiny-qwen3next", "F32", "layer", "1,1", "columns"),  # and a shared expert
    ("tiny-gemma4", "F32", "layer", "3,1", "columns"),  # shared KV (the cut moved), per-layer inputs sent along
    ("tiny-gemma4-moe", "F32", "layer", "1,1,1", "columns"),  # experts beside the dense FFN, V = K
]


@pytest.mark.parametrize("shape, qtype, mode, ts, moe", CASES,
                         ids=[f"{s if isinstance(s, str) else s.name}-{q}-{m}-{t}-{e}" for s, q, m, t, e in CASES])
def test_split_equals_one_device(models, shape, qtype, mode, ts, moe):
    cfg, one, split = pair(models(shape, qtype), parse_split_options(mode, ts, moe=moe))
    assert split.plan.n == len(ts.split(","))
    agree(cfg, one, split)


def test_each_device_holds_only_its_shard(models):
    """The emulated devices hold their slices (the local config's heads and widths) and the cache of their KV
    heads; under layer split, the weights and cache of their layers only."""
    cfg, _, split = pair(models("tiny-llama"), parse_split_options("tensor", "1,1"))
    for rank in split.ranks:
        dev = rank.device
        assert dev.cfg.n_head == 2 and dev.cfg.n_head_kv == 1
        assert dev.weights.layers[0].attn_q.shape == (32, 64) and dev.weights.layers[0].ffn_down.shape == (64, 64)
        assert dev.k_cache[0].shape == (64, 1, 16) and dev.weights.output.shape[0] in (136, 137)
    assert split.ranks[1].device.weights.layers[0].attn_output_bias is None
    cfg, _, split = pair(models("tiny-qwen35"), parse_split_options("layer", "1,1"))
    first, second = (r.device for r in split.ranks)
    assert [w.attn_norm is not None for w in first.weights.layers] == [True] * 5 + [False] * 3
    assert [k.shape[0] for k in second.k_cache] == [0, 0, 0, 0, 0, 0, 0, 64]  # layer 7: its only attention
    assert first.recurrent_layers == [0, 1, 2, 4] and second.recurrent_layers == [5, 6]
    assert first.weights.output is None and second.weights.token_embd is None


def test_slots_and_a_resumed_prompt(models):
    """Two sequences in two cache slots, stepped in turns, and a prompt that resumes from what a slot's cache
    holds (a hybrid model: from its stored recurrent state), give the one device's tokens."""
    path = models("tiny-qwen35")
    runs = []
    for options in (None, parse_split_options("layer", "1,2")):
        m = Model(path, backend="numpy", ctx=128, split=options, slots=2)
        be = m.backend
        samplers = [Sampler(SamplingParams(temperature=0.0), np.random.default_rng(0), []) for _ in range(2)]
        prompts = [[5, 9, 14, 20, 7], [11, 3, 8]]
        out = [[s.id] for s in be.step([SeqStep(p, 0, s, slot) for slot, (p, s) in
                                        enumerate(zip(prompts, samplers))])]
        for t in range(6):
            steps = [SeqStep([out[k][-1]], len(prompts[k]) + t, samplers[k], k) for k in range(2)]
            for k, o in enumerate(be.step(steps)):
                out[k].append(o.id)
        first = m.complete([5, 9, 14, 20, 7], max_tokens=4, temperature=0.0)
        again = m.complete([5, 9, 14, 20, 7, *first.tokens, 30, 31], max_tokens=6, temperature=0.0)
        assert again.timings.prompt_tokens < 5 + 4 + 2  # (the cache's prefix was reused)
        runs.append((out, first.tokens, again.tokens))
    assert runs[0] == runs[1]


def test_the_prefix_cache_on_emulated_devices(models):
    """The prefix cache's pool on a split: each device keeps the rows of its layers (layer split) or of its KV heads
    (tensor split); a prompt that comes back after its slot held another takes its blocks from the cache and gives
    the one device's tokens."""
    from llamacli.engine.generate import Completion

    path = models("tiny-gemma3")
    first, other = list(range(5, 45)), list(range(50, 70))
    want = Model(path, backend="numpy", ctx=128).complete(first + [3, 4], max_tokens=6, temperature=0.0).tokens
    for options in (parse_split_options("tensor", "1,1"), parse_split_options("layer", "1,2")):
        m = Model(path, backend="numpy", ctx=128, split=options)
        m.enable_prefix_cache()
        assert m.backend.kv_row_bytes() >= NumpyBackend.kv_row_bytes(m.backend.ranks[0].device)
        for prompt in (first, other):
            m.complete(prompt, max_tokens=2, temperature=0.0)
        c = Completion()
        for _ in m.run(first + [3, 4], completion=c, max_tokens=6, temperature=0.0):
            pass
        assert c.timings.prefix_cached_tokens == 32 and c.tokens == want, options


def test_the_engine_and_the_cli_path(models):
    """Model(..., split=...) runs the split end to end (the step contract, the sampler on the host): tensor and
    layer split give one device's greedy tokens, and sampled ones for a seed."""
    path = models("tiny-gemma3")
    ids = [4, 8, 15, 16, 23, 42]
    want = Model(path, backend="numpy", ctx=64).complete(ids, max_tokens=10, temperature=0.0).tokens
    drawn = Model(path, backend="numpy", ctx=64).complete(ids, max_tokens=10, temperature=0.9, seed=5).tokens
    for options in (parse_split_options("tensor", "1,1"), parse_split_options("layer", "2,1")):
        m = Model(path, backend="numpy", ctx=64, split=options)
        assert isinstance(m.backend, NumpySplitBackend) and m.backend.name == "numpy"
        assert m.complete(ids, max_tokens=10, temperature=0.0).tokens == want
        assert m.complete(ids, max_tokens=10, temperature=0.9, seed=5).tokens == drawn
        assert "emulated devices" in m.backend.device_name()


def test_a_split_the_model_cannot_take_is_one_line(models):
    with pytest.raises(UsageError, match="does not cut Gated DeltaNet layers"):
        Model(models("tiny-qwen35"), backend="numpy", ctx=64, split=parse_split_options("tensor", "1,1"))
    with pytest.raises(UsageError, match="leaves device 0 no attention head"):
        Model(models("tiny-gemma2"), backend="numpy", ctx=64, split=parse_split_options("tensor", "1,2"))
    with pytest.raises(UsageError, match="--tensor-split 1,1 for two"):
        Model(models("tiny-llama"), backend="numpy", ctx=64, split=parse_split_options("layer"))


def test_backend_selection_with_split_options(monkeypatch):
    """--backend numpy with a split emulates it; -dev none takes the CPU backend; a backend whose split_modes lack
    the mode (CUDA until its split lands) says so, and a GPU other than the first is refused with the way to it."""
    import llamacli.backends as backends

    assert type(select_backend("numpy", split=parse_split_options("tensor", "1,1"))) is NumpySplitBackend
    said: list[str] = []
    assert type(select_backend("numpy", said.append, split=parse_split_options(main_gpu=1))) is NumpyBackend
    assert said == ["--main-gpu and -dev choose a GPU: the NumPy backend runs on the CPU"]
    said.clear()
    assert select_backend("auto", said.append, split=parse_split_options(device="none")).name == "cpu"
    assert said == ["-dev none: running on the CPU (the CPU backend)"]

    with pytest.raises(UsageError, match="-dev none runs on no GPU"):
        select_backend("cuda", split=parse_split_options(device="none"))

    class OneGpu(NumpyBackend):  # a stand-in for the CUDA backend's split_modes
        name = "cuda"

    with pytest.raises(BackendError, match="--split-mode tensor over several is on its way.*--backend numpy"):
        backends.takes_split(OneGpu(), parse_split_options("tensor", "1,1"))
    with pytest.raises(BackendError, match="to run on GPU 2, set CUDA_VISIBLE_DEVICES=2"):
        backends.takes_split(OneGpu(), parse_split_options("none", None, 1, "CUDA0,CUDA2"))
    be = backends.takes_split(OneGpu(), parse_split_options(device="CUDA0"))
    assert be.split == parse_split_options(device="CUDA0")


def test_smollm2_split_gives_the_stored_greedy_reply(smollm2):
    """The real SmolLM2 (30 layers, 9 heads over 3 KV heads: 1 and 2 KV heads on two devices) split by tensor
    gives the NumPy backend's stored greedy reply (tests/smollm2_greedy.json)."""
    data = json.loads((Path(__file__).parents[1] / "smollm2_greedy.json").read_text())
    prompt = "The capital of France is"
    m = Model(smollm2, backend="numpy", ctx=data["ctx"], split=parse_split_options("tensor", "1,1"))
    assert m.complete(prompt, max_tokens=24, temperature=0.0).tokens == data["replies"][prompt][:24]
