"""Gemma 4 (gemma4) on the NumPy backend against transformers' own Gemma4ForCausalLM, on tiny random models of 8
layers (five sliding of every six, the last global; heads of 32 on sliding layers and 64 on global ones; a window of
8) written to GGUF by llamacli.testing.hf_gemma4 as llama.cpp's converter writes them (test_gemma4_convert.py checks
that against the converter itself): an E-style one (per-layer embeddings, its last two layers reading layers 4's and
5's KV) and a MoE one (experts beside each layer's dense FFN, V = K and one KV head on its global layers). Tolerance as
test_model_reference: max |ours - ref| <= 1e-3 * max |ref| on last-position logits; greedy tokens equal. Then the
caches (shared-KV layers keep none; rings on the sliding layers, a shared layer reading one across prefill passes),
several sequences in cache slots, and broken files refused with one line."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_architectures import greedy_matches  # noqa: E402
from test_model_reference import Ours, check, hf_logits, run_lengths_and_decode  # noqa: E402

from llamacli.backends.numpy_backend import NumpyBackend, host_bytes  # noqa: E402
from llamacli.errors import CorruptFileError, MissingMetadataError, MissingTensorError  # noqa: E402
from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.models.config import ModelConfig  # noqa: E402
from llamacli.models.seq_cache import layer_caches  # noqa: E402
from llamacli.testing import SHAPES, model_metadata, tensor_shapes, variant, write_model  # noqa: E402
from llamacli.testing.hf_gemma4 import write_hf_model  # noqa: E402

VOCAB = 300
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, global_head_dim=64, sliding_window=8, max_position_embeddings=2048,
            rms_norm_eps=1e-6, final_logit_softcapping=30.0,
            layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention", "full_attention"])
KINDS = {  # the E-style model (per-layer embeddings, shared KV) and the MoE one (26B-A4B's layout)
    "e": dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2),
    "moe": dict(hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8, top_k_experts=2,
                moe_intermediate_size=32, attention_k_eq_v=True, num_global_key_value_heads=1),
}


def hf_model(kind: str, seed: int = 0, **changes):
    """A tiny transformers Gemma 4 model with weights large enough that its logits are far from ties: matrices
    N(0, 0.08), embeddings N(0, 0.5), norm weights, layer scalars and router scales near 1 (Gemma 4's norms scale by
    w)."""
    config = transformers.Gemma4TextConfig(**{**TINY, **KINDS[kind], **changes})
    torch.manual_seed(seed)
    m = transformers.Gemma4ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in [*m.named_parameters(), *m.named_buffers()]:
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("inv_freq") or "embed_scale" in name:
                continue  # (RoPE tables, the embeddings' scale: the model's own)
            else:
                p.copy_((0.5 if "embed" in name else 0.08) * torch.randn(p.shape, generator=g))
    return m


def state_of(m) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in m.state_dict().items()}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (transformers model, the GGUF file written from its weights), made once per kind."""
    root, made = tmp_path_factory.mktemp("gemma4"), {}

    def get(kind: str):
        if kind not in made:
            m = hf_model(kind)
            made[kind] = m, write_hf_model(root / f"{kind}.gguf", m.config.to_dict(), state_of(m))
        return made[kind]

    return get


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_match_transformers(pairs, kind):
    """Prompts of 1, 7 and 130 tokens (past the window of 8), then 10 decode steps (teacher-forced), each against
    transformers' full forward of the same ids."""
    m, path = pairs(kind)
    cfg = Ours(path).cfg
    assert cfg.architecture == "gemma4" and [p.window for p in cfg.layers] == [8] * 5 + [0, 8, 0]
    assert [cfg.layer_head_dim(i) for i in range(8)] == [32] * 5 + [64, 32, 64]
    worst = run_lengths_and_decode(path, VOCAB, seed=sorted(KINDS).index(kind), m=m)
    print(f"gemma4 {kind}: worst relative error {worst:.2e}")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_tokens_match_transformers_generate(pairs, kind):
    m, path = pairs(kind)
    greedy_matches(path, m, seed=10 + sorted(KINDS).index(kind))


def test_the_layouts_read_from_the_file(pairs):
    """The E-style file: layers 6 (sliding) and 7 (global) read layers 4's and 5's caches and keep none; per-layer
    embeddings of 16. The MoE file: experts beside the dense FFN on every layer, V = K and one KV head on the global
    layers, 2 KV heads on the sliding ones."""
    e = Ours(pairs("e")[1]).cfg
    assert [p.kv_from for p in e.layers] == [-1] * 6 + [4, 5] and e.n_embd_per_layer == 16
    assert e.cache_rows(512) == [512] * 6 + [0, 0] and e.rope_scaling == "proportional"
    assert all(p.per_layer_input and p.out_scale and p.v_norm and not p.moe for p in e.layers)
    moe = Ours(pairs("moe")[1]).cfg
    assert all(p.moe and p.moe_dense and p.router_norm and p.gate_up_exps for p in moe.layers)
    assert [p.v_from_k for p in moe.layers] == [False] * 5 + [True, False, True]
    assert [moe.layer_kv_heads(i) for i in range(8)] == [2] * 5 + [1, 2, 1] and moe.n_head_kv == 1


@pytest.mark.parametrize("kind,changes", [
    ("e", dict(use_double_wide_mlp=True)),  # E2B: the shared-KV layers' FFN twice as wide (feed_forward_length per layer)
    ("e", dict(num_kv_shared_layers=0, tie_word_embeddings=False)),  # no sharing; an LM head of its own
    ("moe", dict(attention_k_eq_v=False, num_global_key_value_heads=None)),  # attn_v everywhere, one KV head count
])
def test_other_layouts(tmp_path, kind, changes):
    """Variants the released files take: a 40-token prompt and 3 decode steps against transformers."""
    m = hf_model(kind, seed=3, **changes)
    path = write_hf_model(tmp_path / f"{kind}.gguf", m.config.to_dict(), state_of(m))
    ours, ids = Ours(path), np.random.default_rng(6).integers(0, VOCAB, size=43).tolist()
    check(ours.prefill(ids[:40]), hf_logits(m, ids[:40])[-1])
    for n in range(40, 43):
        check(ours.decode(ids[n], n), hf_logits(m, ids[: n + 1])[-1])


def test_rings_and_a_shared_layer_reading_one_across_prefill_passes(pairs):
    """At a context of 2048 the sliding layers keep rings of 640 rows; a 700-token prompt goes in passes of at most
    633 (the ring's span), so that the shared sliding layer finds the window before each pass in the ring it reads;
    the logits of the prompt and of 3 decode steps after it match transformers'."""
    m, path = pairs("e")
    ours = Ours(path, ctx=2048)
    be, cfg = ours.be, ours.cfg
    assert [k.shape for k in be.k_cache] == [(640, 2, 32)] * 5 + [(2048, 2, 64), (0, 2, 32), (0, 2, 64)]
    assert be.prefill_chunk == 640 - 8 + 1
    from llamacli.models.block import prefill

    ids = np.random.default_rng(4).integers(0, VOCAB, size=703).tolist()
    check(prefill(be, cfg, ids[:700], 0)[-1], hf_logits(m, ids[:700])[-1])
    for n in range(700, 703):
        check(ours.decode(ids[n], n), hf_logits(m, ids[: n + 1])[-1])


def test_shared_kv_layers_allocate_nothing(pairs):
    """The KV cache's size counts the layers that keep one: per layer rows x KV heads x head size, K and V; the
    NumPy backend's memory check and the engine's view of each slot's layers (seq_cache) count the same."""
    cfg = Ours(pairs("e")[1]).cfg
    rows = 5 * 640 * 2 * 32 + 2048 * 2 * 64  # the rings of the 5 sliding layers, the global layer
    assert cfg.kv_cache_bytes(2048) == 2 * 2 * rows  # fp16 K and V
    assert host_bytes(cfg, 2048)[1] == 2 * 4 * rows  # float32 on the NumPy backend
    assert [c.kind for c in layer_caches(cfg, 2048)] == ["kv"] * 6 + ["shared"] * 2


def test_several_sequences_in_slots(pairs):
    """The scheduler runs 5 requests on 3 cache slots of the E-style model, each slot with its own caches (rings,
    shared layers reading their slot's): each request gets what it gets alone."""
    from test_scheduler import concurrently, same

    from llamacli.engine.generate import Completion, Model
    from llamacli.engine.scheduler import Scheduler

    _, path = pairs("e")
    rng = np.random.default_rng(8)
    jobs = [(rng.integers(3, VOCAB, size=n).tolist(), dict(max_tokens=k, temperature=t, seed=5))
            for n, k, t in ((5, 6, 0.0), (40, 4, 0.8), (1, 8, 0.0), (70, 3, 0.0), (12, 7, 1.0))]

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
    finally:
        sched.close()


@pytest.mark.parametrize("shape", ["tiny-gemma4", "tiny-gemma4-moe",
                                   variant("tiny-gemma4", n_layer=1, n_kv_shared=0, name="one-layer")])
def test_random_files_of_each_shape_run(random_model, shape):
    """llamacli.testing's tiny shapes (Q8_0, its fallbacks for odd rows; and a model of one layer) load and give
    finite logits; a prompt run whole and the same prompt in two steps agree."""
    path = random_model(shape, "Q8_0", std=0.08)
    ours = Ours(path)
    ids = list(range(5, 45))
    whole = ours.prefill(ids)
    assert np.isfinite(whole).all()
    ours.prefill(ids[:25])
    got = ours.prefill(ids[25:], 25)
    assert float(np.abs(got - whole).max()) <= 1e-5 * float(np.abs(whole).max())


def test_real_shapes():
    """The speed-run shapes' configs: E4B's 18 shared-KV layers read layers 22 (sliding) and 23 (global) and keep
    no cache; the 26B-A4B's global layers have 2 KV heads and V = K; the 31B's 4."""
    def config(shape):
        spec = SHAPES[shape]
        return ModelConfig.from_gguf(model_metadata(spec, spec.vocab_size), {n for n, _ in tensor_shapes(spec, spec.vocab_size)})

    e4b = config("gemma4-e4b")
    assert [p.kv_from for p in e4b.layers[24:]] == [23 if (i + 1) % 6 == 0 else 22 for i in range(24, 42)]
    assert e4b.cache_rows(4096)[24:] == [0] * 18 and e4b.n_embd_per_layer == 256
    moe = config("gemma4-26b-a4b")
    assert moe.layer_kv_heads(5) == 2 and moe.layer_kv_heads(0) == 8 and moe.layers[5].v_from_k
    assert moe.n_expert == 128 and all(p.moe_dense for p in moe.layers)
    dense = config("gemma4-31b")
    assert dense.layer_kv_heads(59) == 4 and dense.layer_head_dim(59) == 512 and dense.layer_head_dim(0) == 256
    from llamacli.testing import tensor_type

    for shape in ("gemma4-e4b", "gemma4-26b-a4b", "gemma4-31b"):  # every tensor has a type in a Q4_K_M file
        spec = SHAPES[shape]
        names = [(n, s) for n, s in tensor_shapes(spec, spec.vocab_size)]
        types = {tensor_type(n, s, "Q4_K_M", spec.n_layer, spec.tied).name for n, s in names}
        assert "Q4_K" in types and "Q6_K" in types, types
    assert ("per_layer_token_embd.weight", (262144, 42 * 256)) in tensor_shapes(SHAPES["gemma4-e4b"], 262144)


# -- broken files -----------------------------------------------------------------------------------------------


def config_with(shape: str, **keys):
    spec = SHAPES[shape]
    md = model_metadata(spec, VOCAB)
    for k, v in keys.items():
        key = f"gemma4.{k.replace('__', '.')}"
        if v is None:
            md.pop(key, None)
        else:
            md[key] = v
    return ModelConfig.from_gguf(md, {n for n, _ in tensor_shapes(spec, VOCAB)})


@pytest.mark.parametrize("shape,keys,error,words", [
    ("tiny-gemma4", {"attention__shared_kv_layers": 7}, CorruptFileError, "at most 6 of the 8 layers"),
    ("tiny-gemma4", {"attention__shared_kv_layers": 3}, CorruptFileError,
     "disagree: shared-KV layer 5 .global. would read the cache of layer 4, a sliding layer"),
    ("tiny-gemma4", {"attention__sliding_window_pattern": [True] * 4 + [False, True, True, False]}, CorruptFileError,
     "shared-KV layer 6 .sliding. would read the cache of layer 4, a global layer"),
    ("tiny-gemma4", {"attention__sliding_window_pattern": [True, False]}, CorruptFileError, "a flag for each"),
    ("tiny-gemma4", {"attention__sliding_window_pattern": None}, MissingMetadataError, "sliding_window_pattern"),
    ("tiny-gemma4", {"attention__key_length_swa": None}, MissingMetadataError, "key_length_swa"),
    ("tiny-gemma4", {"attention__key_length_swa": 0}, CorruptFileError, "key_length_swa"),
    ("tiny-gemma4", {"attention__value_length_swa": 16}, CorruptFileError, "value length"),
    ("tiny-gemma4", {"rope__dimension_count_swa": 48}, CorruptFileError, "dimension_count_swa"),
    ("tiny-gemma4", {"embedding_length_per_layer_input": None}, MissingMetadataError, "per-layer embeddings"),
    ("tiny-gemma4", {"attention__head_count_kv": [2, 2, 2]}, CorruptFileError, "one for each of the 8 layers"),
    ("tiny-gemma4", {"attention__head_count_kv": [2] * 7 + [3]}, CorruptFileError, "cannot be shared by 3 KV heads"),
    ("tiny-gemma4", {"feed_forward_length": [96] * 7 + [0]}, CorruptFileError, "feed_forward_length"),
    ("tiny-gemma4", {"attention__sliding_window": None}, MissingMetadataError, "sliding_window"),
    ("tiny-gemma4-moe", {"expert_count": None, "expert_used_count": None}, MissingMetadataError, "expert_count"),
    ("tiny-gemma4-moe", {"expert_used_count": 9}, CorruptFileError, "expert_used_count"),
])
def test_broken_metadata_is_refused_by_name(shape, keys, error, words):
    with pytest.raises(error, match=words):
        config_with(shape, **keys)


@pytest.mark.parametrize("shape,missing", [
    ("tiny-gemma4", "per_layer_token_embd.weight"),
    ("tiny-gemma4", "per_layer_model_proj.weight"),
    ("tiny-gemma4", "blk.3.inp_gate.weight"),
    ("tiny-gemma4", "blk.7.proj.weight"),
    ("tiny-gemma4", "blk.4.attn_k.weight"),  # a layer whose cache a shared layer reads
    ("tiny-gemma4", "blk.6.attn_q_norm.weight"),
    ("tiny-gemma4", "rope_freqs.weight"),
    ("tiny-gemma4-moe", "blk.2.ffn_gate_inp.scale"),
    ("tiny-gemma4-moe", "blk.2.ffn_down_exps.scale"),
    ("tiny-gemma4-moe", "blk.0.pre_ffw_norm_2.weight"),
    ("tiny-gemma4-moe", "blk.1.ffn_gate.weight"),  # the dense FFN beside the experts
])
def test_a_file_without_a_tensor_is_refused(tmp_path, shape, missing):
    from llamacli.engine.generate import Model

    path = write_model(tmp_path / "broken.gguf", shape, "F32", drop_tensors=(missing,))
    with pytest.raises(MissingTensorError, match=missing.replace(".", r"\.")):
        Model(path, backend="numpy")


def test_a_backend_loads_what_the_plans_name(pairs):
    """The NumPy backend's weights: no K/V tensors on shared-KV layers, the per-layer table kept quantized (rows
    gathered), the fused experts as [E, 2 F_exp, D]."""
    g = open_gguf(pairs("e")[1])
    be = NumpyBackend()
    be.load(g, ModelConfig.from_gguf(g.metadata, set(g.tensors)), 256)
    assert be.weights.layers[6].attn_k is None and be.weights.layers[6].attn_q.shape == (128, 64)
    assert be.weights.per_layer_token_embd.rows(np.array([3])).shape == (1, 8 * 16)
    g = open_gguf(pairs("moe")[1])
    be.load(g, ModelConfig.from_gguf(g.metadata, set(g.tensors)), 256)
    assert be.weights.layers[0].ffn_gate_up_exps.shape == (8, 64, 64) and be.weights.layers[5].attn_v is None


def test_thinking_through_gemma4s_template(tmp_path, llama_cpp_models, monkeypatch):
    """With Gemma 4's own chat template: thinking on, the prompt asks for it (<|think|> in a system turn) and leaves
    the model's turn open, and a reply that thinks first (scripted here: a random model does not) comes apart into
    its thought block (the reasoning) and the answer, an empty block after the answer dropped; thinking off (the
    template's default) the prompt closes an empty thought block itself."""
    from llamacli.engine.generate import Completion, Model
    from llamacli.testing.tool_vocab import gemma4_vocab

    vocab = gemma4_vocab((llama_cpp_models / "templates" / "google-gemma-4-31B-it.jinja").read_text())
    model = Model(write_model(tmp_path / "chat.gguf", "tiny-gemma4", "F32", vocab=vocab), backend="numpy", ctx=256)
    ask = [{"role": "user", "content": "Why?"}]
    on, off = model.render_chat(ask, think=True), model.render_chat(ask, think=False)
    assert "<|think|>" in on and on.endswith("<|turn>model\n")
    assert off.endswith("<|turn>model\n<|channel>thought\n<channel|>") and model.render_chat(ask) == off
    reply = model.tokenizer.encode("<|channel>thought\nBecause.<channel|>So.<|channel>thought\n<channel|><turn|>",
                                   special=True, add_bos=False, add_eos=False)
    script = iter(reply)
    monkeypatch.setattr(NumpyBackend, "decode_greedy", lambda be, token, pos: (be.decode(token, pos), next(script))[1])
    monkeypatch.setattr(NumpyBackend, "sample", lambda be, logits, *a: next(script))
    c = Completion()
    text = "".join(model.run("Why?", think=True, completion=c, max_tokens=40, temperature=0.0))
    assert c.reasoning_format == "channel" and (c.reasoning, c.text) == ("Because.", "So.")
    assert "<|channel>" in text and c.finish_reason == "eos"


def test_per_layer_embeddings_the_keys_deny_are_refused(tmp_path):
    path = write_model(tmp_path / "m.gguf", "tiny-gemma4", "F32", metadata={"gemma4.embedding_length_per_layer_input": 0})
    g = open_gguf(path)
    with pytest.raises(CorruptFileError, match="has per-layer embeddings .* is 0"):
        ModelConfig.from_gguf(g.metadata, set(g.tensors))


def test_encoder_tensors_in_the_same_file_are_read_past(tmp_path, pairs):
    """A file that also holds image / audio encoder tensors (the converter writes them to a separate mmproj file;
    some tools join the two): the text model loads past them and computes what it computes without them."""
    from gguf import GGUFWriter

    from llamacli.testing import add_metadata

    _, path = pairs("e")
    g = open_gguf(path)
    joined = tmp_path / "joined.gguf"
    w = GGUFWriter(str(joined), "gemma4")
    for k, v in g.metadata.items():
        if k != "general.architecture":
            add_metadata(w, k, list(v) if isinstance(v, list) else v)
    extra = {"v.patch_embd.weight": (32, 48), "v.blk.0.attn_q.weight": (32, 32), "a.blk.0.ffn_up.weight": (64, 32),
             "mm.input_projection.weight": (64, 32), "mm.a.input_projection.weight": (64, 32)}
    arrays = [(n, g.dequantize(n)) for n in g.tensors] + [(n, np.ones(s, np.float32)) for n, s in extra.items()]
    for n, x in arrays:
        w.add_tensor_info(n, x.shape, x.dtype, x.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, x in arrays:
        w.write_tensor_data(x)
    w.close()
    ids = list(range(3, 40))
    assert np.array_equal(Ours(joined).prefill(ids), Ours(path).prefill(ids))
