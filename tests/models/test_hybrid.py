"""The hybrid Qwen models (qwen35, qwen35moe, qwen3next: Gated DeltaNet and gated attention layers) on the NumPy
backend, against transformers' own classes (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM) on
tiny random models of 8 layers (6 delta-net, 2 attention; 4 value heads over 2 key heads), written to GGUF by
llamacli.testing.hf_qwen as llama.cpp's converter writes them (test_hybrid_convert.py checks that against the
converter itself). Tolerance as test_model_reference: max |ours - ref| <= 1e-3 * max |ref| on last-position logits
(we reach ~5e-6); greedy tokens equal. Then the recurrent state per sequence: decode continues from it, a prompt
resumed from a stored state gives the full prefill's logits, MTP blocks are read past, and broken files are refused
with one line."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_architectures import greedy_matches  # noqa: E402
from test_model_reference import Ours, check, hf_logits, run_lengths_and_decode  # noqa: E402

from llamacli.backends.numpy_backend import NumpyBackend  # noqa: E402
from llamacli.backends.step import Sampler, SeqStep  # noqa: E402
from llamacli.errors import (  # noqa: E402
    BackendError,
    CorruptFileError,
    MissingMetadataError,
    MissingTensorError,
    UnknownArchitectureError,
)
from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.models import rope  # noqa: E402
from llamacli.models.config import ModelConfig  # noqa: E402
from llamacli.models.seq_cache import SNAPSHOT_EVERY  # noqa: E402
from llamacli.sampling.sampling import SamplingParams  # noqa: E402
from llamacli.testing import SHAPES, model_metadata, tensor_shapes, variant, write_model  # noqa: E402
from llamacli.testing.hf_qwen import write_hf_model  # noqa: E402

VOCAB = 300
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6)
EXPERTS = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
CLASSES = {  # arch: (config class, model class, the config's own fields)
    "qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=96)),
    "qwen35moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", EXPERTS),
    "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=96, **EXPERTS)),
}


def hf_model(arch: str, seed: int = 0, **changes):
    """A tiny transformers model of `arch` with weights large enough that its logits are far from ties: matrices
    N(0, 0.08), embeddings N(0, 0.5), norm weights near their identity (1 + w: w ~ 0; the delta net's own norm
    w ~ 1), decays exp(-A) with A in U(0.05, 4), dt biases N(0, 0.5), convolution taps N(0, 0.3)."""
    config_cls, model_cls, own = CLASSES[arch]
    config = getattr(transformers, config_cls)(**{**TINY, **own, **changes})
    torch.manual_seed(seed)
    m = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.05, 4.0, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_((0.5 if "embed" in name else 0.08) * torch.randn(p.shape, generator=g))
    return m


def state_of(m) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in m.state_dict().items()}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """arch -> (transformers model, the GGUF file written from its weights), made once per arch."""
    root, made = tmp_path_factory.mktemp("hybrid"), {}

    def get(arch: str):
        if arch not in made:
            m = hf_model(arch)
            made[arch] = m, write_hf_model(root / f"{arch}.gguf", arch, m.config.to_dict(), state_of(m))
        return made[arch]

    return get


ARCHS = sorted(CLASSES)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(pairs, arch):
    """Prompts of 1, 7 and 130 tokens from position 0, then 10 decode steps through the recurrent state and the KV
    cache (teacher-forced), each against transformers' full forward of the same ids."""
    m, path = pairs(arch)
    cfg = Ours(path).cfg
    assert cfg.architecture == arch and [p.recurrent for p in cfg.layers] == [True, True, True, False] * 2
    worst = run_lengths_and_decode(path, VOCAB, seed=ARCHS.index(arch), m=m)
    print(f"{arch}: worst relative error {worst:.2e}")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_generate(pairs, arch):
    m, path = pairs(arch)
    greedy_matches(path, m, seed=10 + ARCHS.index(arch))


@pytest.mark.parametrize("arch,changes", [("qwen35", dict(linear_num_value_heads=8)),
                                          ("qwen3next", dict(linear_num_value_heads=8)),
                                          ("qwen35", dict(linear_num_key_heads=4)),
                                          ("qwen3next", dict(mlp_only_layers=[1, 3]))])
def test_other_head_layouts(tmp_path, arch, changes):
    """8 value heads over 2 key heads (4 a key head: tiled by the converter's reorder in qwen35, grouped in
    qwen3next), and as many key heads as value heads; 4 layers (3 delta-net, 1 attention); and Qwen3-Next with
    dense FFNs on some layers (the checkpoint's mlp_only_layers: a dense FFN where the file has one). A 40-token
    prompt and 3 decode steps against transformers."""
    m = hf_model(arch, seed=3, num_hidden_layers=4, **changes)
    path = write_hf_model(tmp_path / f"{arch}.gguf", arch, m.config.to_dict(), state_of(m))
    ours, ids = Ours(path), np.random.default_rng(6).integers(0, VOCAB, size=43).tolist()
    check(ours.prefill(ids[:40]), hf_logits(m, ids[:40])[-1])
    for n in range(40, 43):
        check(ours.decode(ids[n], n), hf_logits(m, ids[: n + 1])[-1])


def sampler(logits: bool = True) -> Sampler:
    return Sampler(SamplingParams(temperature=0.0), np.random.default_rng(0), [], logits=logits)


def loaded(path, ctx: int = 512) -> NumpyBackend:
    g = open_gguf(path)
    be = NumpyBackend()
    be.load(g, ModelConfig.from_gguf(g.metadata, set(g.tensors)), ctx)
    return be


def close(a: np.ndarray, b: np.ndarray) -> None:
    assert float(np.abs(a - b).max()) <= 1e-5 * float(np.abs(b).max()), float(np.abs(a - b).max())


def test_a_prompt_resumed_from_a_stored_state_gives_the_full_prefills_logits(pairs):
    """Through the step contract: a prompt stores its state at its end and at each multiple of SNAPSHOT_EVERY it
    passes, a decode step at its end (replacing the last decode step's); a new prompt resumes at a stored position
    (its conv window and delta-rule state, the KV rows before it) and gives the logits of the whole prompt prefilled
    from 0; states stored past the resume point are forgotten; elsewhere there is nothing to resume from."""
    _, path = pairs("qwen35")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, size=SNAPSHOT_EVERY + 44).tolist()
    be = loaded(path)
    s = sampler()
    first = be.step([SeqStep(ids[:300], 0, s)])[0]
    assert first.snapshots == {SNAPSHOT_EVERY, 300}
    out = be.step([SeqStep([7], 300, s)])[0]
    assert out.snapshots == {SNAPSHOT_EVERY, 300, 301}
    out = be.step([SeqStep([8], 301, s)])[0]
    assert out.snapshots == {SNAPSHOT_EVERY, 300, 302}  # the latest decode step's, the prompt end kept

    fresh = loaded(path)
    for start in (300, SNAPSHOT_EVERY):  # from a prompt's end; from a multiple of SNAPSHOT_EVERY inside a prompt
        rest = ids[start:] + [5, 6, 7]
        resumed = be.step([SeqStep(rest, start, sampler())])[0]
        whole = fresh.step([SeqStep(ids[:start] + rest, 0, sampler())])[0]
        close(resumed.logits, whole.logits)
        assert max(resumed.snapshots) == start + len(rest) and all(p <= start or p == start + len(rest)
                                                                     for p in resumed.snapshots)
    with pytest.raises(BackendError, match="no recurrent state is stored at position 100"):
        be.step([SeqStep([1, 2], 100, sampler())])
    with pytest.raises(BackendError, match="recurrent state stands at position"):  # decode where it does not stand
        Ours(path).decode(3, 5)


def test_a_chat_turn_prefills_only_what_the_cache_does_not_hold(pairs):
    """Through Model: a second prompt that extends the first prompt and its reply resumes from the state after the
    reply's last decode step, prefills only the rest, and answers as a fresh model given the whole prompt."""
    from llamacli.engine.generate import Model

    _, path = pairs("qwen3next")
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, VOCAB, size=20).tolist()
    m = Model(path, backend="numpy", ctx=256)
    first = m.complete(prompt, max_tokens=6, temperature=0.0)
    held = len(m.seq)
    assert held == 20 + len(first.tokens) - 1 and m.seq.snapshots == {20, held}
    turn = prompt + first.tokens + [4, 5, 6]
    second = m.complete(turn, max_tokens=8, temperature=0.0)
    assert second.timings.prompt_tokens == len(turn) - held
    assert second.tokens == Model(path, backend="numpy", ctx=256).complete(turn, max_tokens=8, temperature=0.0).tokens
    # A prompt that parts from the cache before any stored state starts again from position 0
    third = m.complete(prompt[:10] + [9, 9], max_tokens=2, temperature=0.0)
    assert third.timings.prompt_tokens == 12


def test_mtp_blocks_are_read_past(tmp_path):
    """A file with a multi-token-prediction block (blk.<n_layer>.nextn.* and its attention and FFN tensors,
    nextn_predict_layers 1, block_count n_layer + 1, a recurrent-layer flag for it) runs its trunk: the same logits
    as the file without it. Both as the converter writes a checkpoint's mtp.* tensors and as write_model does."""
    m = hf_model("qwen35", seed=4)
    state = state_of(m)
    plain = write_hf_model(tmp_path / "plain.gguf", "qwen35", m.config.to_dict(), state)
    d, last = 64, "model.layers.7."
    mtp = {"mtp.fc.weight": np.ones((d, 2 * d), np.float32), **{f"mtp.{n}.weight": np.zeros(d, np.float32) for n in
                                                                ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    mtp.update({"mtp.layers.0." + k[len(last):]: v for k, v in state.items() if k.startswith(last)})
    with_mtp = write_hf_model(tmp_path / "mtp.gguf", "qwen35", m.config.to_dict(), {**state, **mtp})
    g = open_gguf(with_mtp)
    assert g.metadata["qwen35.block_count"] == 9 and "blk.8.nextn.eh_proj.weight" in g.tensors
    ids = list(range(3, 40))
    assert np.array_equal(Ours(with_mtp).prefill(ids), Ours(plain).prefill(ids))
    spec = SHAPES["tiny-qwen35moe"]
    a = write_model(tmp_path / "a.gguf", spec, "F32")
    b = write_model(tmp_path / "b.gguf", variant(spec, n_mtp=1), "F32")
    assert "blk.8.nextn.enorm.weight" in open_gguf(b).tensors
    assert np.array_equal(Ours(a).prefill(ids), Ours(b).prefill(ids))


@pytest.mark.parametrize("shape", ["tiny-qwen35", "tiny-qwen35moe", "tiny-qwen3next"])
def test_random_files_of_each_shape_run(random_model, shape):
    """llamacli.testing's tiny shapes (Q8_0, its fallbacks for odd rows; F32 convolutions) load and give finite
    logits; a prompt run whole and the same prompt in two steps agree."""
    path = random_model(shape, "Q8_0", std=0.08)
    ours = Ours(path)
    ids = list(range(5, 45))
    whole = ours.prefill(ids)
    assert np.isfinite(whole).all()
    ours.prefill(ids[:25])
    close(ours.prefill(ids[25:], 25), whole)


def test_imrope_sections_rotate_text_like_plain_rope():
    """For text every section takes the token's position: the released sections [11, 11, 10, 0] cover all 32 pairs
    of the 64 rotated dims (and any rope_dim within them); pairs past the first three sections (ggml's fourth
    stream, position 0 for text) do not rotate."""
    assert rope.text_pairs((11, 11, 10, 0), 32).all() and rope.text_pairs((11, 11, 10, 0), 4).all()
    mask = rope.text_pairs((2, 1, 1, 4), 8)  # sectors 0..7: t, h, w, t?, -, -, ... as ggml assigns them
    assert mask.tolist() == [True, True, True, True, False, False, False, False]
    cfg = ModelConfig.from_gguf(model_metadata(variant("tiny-qwen35", rope_dim=16), VOCAB),
                                {n for n, _ in tensor_shapes(SHAPES["tiny-qwen35"], VOCAB)})
    assert cfg.rope_sections == (11, 11, 10, 0)
    plain = rope.inv_freq(replace(cfg, rope_sections=()), None, 512)
    assert np.array_equal(rope.inv_freq(cfg, None, 512), plain)


# -- broken files -----------------------------------------------------------------------------------------------


def config_with(shape: str, **keys):
    spec = SHAPES[shape]
    md = model_metadata(spec, VOCAB)
    for k, v in keys.items():
        key = f"{spec.arch}.{k.replace('__', '.')}"
        if v is None:
            md.pop(key, None)
        else:
            md[key] = v
    return ModelConfig.from_gguf(md, {n for n, _ in tensor_shapes(spec, VOCAB)})


@pytest.mark.parametrize("keys,error,words", [
    ({"ssm__conv_kernel": 0}, CorruptFileError, "convolution width"),
    ({"ssm__conv_kernel": None}, MissingMetadataError, "ssm.conv_kernel"),
    ({"ssm__inner_size": 100}, CorruptFileError, "state shapes disagree"),
    ({"ssm__state_size": 0}, CorruptFileError, "key head size"),
    ({"ssm__state_size": None}, MissingMetadataError, "ssm.state_size"),
    ({"ssm__time_step_rank": 3, "ssm__inner_size": 48}, CorruptFileError, "cannot share"),
    ({"ssm__group_count": 1 << 20}, CorruptFileError, "key heads"),
    ({"attention__recurrent_layers": [True, False]}, CorruptFileError, "a flag for each"),
    ({"attention__recurrent_layers": ["x"] * 8}, CorruptFileError, "a flag for each"),
    ({"attention__recurrent_layers": None, "full_attention_interval": 0}, CorruptFileError, "full_attention_interval"),
    ({"rope__dimension_sections": None}, MissingMetadataError, "rope.dimension_sections"),
    ({"rope__dimension_sections": [0, 0, 0, 0]}, CorruptFileError, "dimension_sections"),
    ({"rope__dimension_sections": [1, 2, 3, 4, 5]}, CorruptFileError, "dimension_sections"),
    ({"nextn_predict_layers": 8}, CorruptFileError, "nextn_predict_layers"),
    ({"feed_forward_length": None}, MissingMetadataError, "feed_forward_length"),
])
def test_broken_metadata_is_refused_by_name(keys, error, words):
    with pytest.raises(error, match=words):
        config_with("tiny-qwen35", **keys)


def test_layer_kinds_from_the_interval_and_the_moe_widths():
    cfg = config_with("tiny-qwen35", attention__recurrent_layers=None, full_attention_interval=2)
    assert [p.recurrent for p in cfg.layers] == [True, False] * 4
    moe = config_with("tiny-qwen35moe")  # no feed_forward_length: every layer has experts
    assert moe.n_ff == 0 and moe.n_ff_shexp == 48 and all(p.moe and p.shared_expert for p in moe.layers)
    with pytest.raises(MissingMetadataError, match="expert_shared_feed_forward_length"):
        config_with("tiny-qwen35moe", expert_shared_feed_forward_length=None)
    nxt = config_with("tiny-qwen3next", expert_shared_feed_forward_length=None)  # falls back to feed_forward_length
    assert nxt.n_ff_shexp == 96 and nxt.rope_sections == ()


def test_unsupported_layouts_are_refused_by_name():
    spec = SHAPES["tiny-qwen3next"]
    names = {n for n, _ in tensor_shapes(spec, VOCAB)}
    with pytest.raises(UnknownArchitectureError, match="fused ssm_in matrix of early conversions"):
        ModelConfig.from_gguf(model_metadata(spec, VOCAB), names | {"blk.0.ssm_in.weight"})
    with pytest.raises(UnknownArchitectureError, match="ffn_gate_up_exps"):
        ModelConfig.from_gguf(model_metadata(spec, VOCAB), names | {"blk.3.ffn_gate_up_exps.weight"})


@pytest.mark.parametrize("missing", ["blk.0.attn_gate.weight", "blk.1.ssm_beta.weight", "blk.2.ssm_alpha.weight",
                                     "blk.0.ssm_conv1d.weight", "blk.5.ssm_a", "blk.3.attn_q_norm.weight",
                                     "blk.3.ffn_gate_inp_shexp.weight"])
def test_a_file_without_a_gate_or_state_tensor_is_refused(tmp_path, missing):
    from llamacli.engine.generate import Model

    path = write_model(tmp_path / "broken.gguf", "tiny-qwen35moe", "F32", drop_tensors=(missing,))
    with pytest.raises(MissingTensorError, match=missing.replace(".", r"\.")):
        Model(path, backend="numpy")


def test_sequences_in_several_slots_keep_their_own_states(pairs):
    """The scheduler (engine/scheduler.py) runs 6 requests on 3 cache slots, each slot with its own delta-net
    states and stored snapshots: each request gets what it gets alone (within 1e-5 on logprobs where a slot's
    stored state gave the prefix); a slot's stored state then serves a prompt that extends a finished reply."""
    from test_scheduler import concurrently, same

    from llamacli.engine.generate import Completion, Model
    from llamacli.engine.scheduler import Scheduler

    _, path = pairs("qwen35moe")
    rng = np.random.default_rng(8)
    jobs = [(rng.integers(3, VOCAB, size=n).tolist(), dict(max_tokens=m, temperature=t, seed=5))
            for n, m, t in ((5, 6, 0.0), (40, 4, 0.8), (1, 8, 0.0), (70, 3, 0.0), (12, 7, 1.0), (3, 5, 0.0))]

    def alone(ids, kw):
        c = Completion()
        list(Model(path, backend="numpy", ctx=256).run(ids, completion=c, **kw))
        return c

    want = [alone(ids, kw) for ids, kw in jobs]
    model = Model(path, backend="numpy", ctx=256, slots=3)
    sched = Scheduler(model)
    try:
        for got, w in zip(concurrently(model, sched, jobs), want):
            same(got, w, tol=1e-5)
        ids, kw = jobs[3]
        first = Completion()
        list(model.run(ids, completion=first, scheduler=sched, **kw))
        c = Completion()
        list(model.run(ids + first.tokens + [7, 8], completion=c, scheduler=sched, **kw))
        assert c.timings.prompt_tokens == 3  # from the state after the reply's last decode step
    finally:
        sched.close()
