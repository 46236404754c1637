"""The whole model on the CUDA backend against the NumPy reference: random models of every weight type
and every architecture (llamacli/models/arch/: q/k norms, NoPE layers, YaRN, partial rotary, a head dim other
than n_embd / n_head), and SmolLM2-135M. Needs a GPU (marker gpu)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

cp = pytest.importorskip("cupy")

from gpu_checks import case_id, rel_l2  # noqa: E402

from llamacli.backends.cuda import RUNNABLE, CudaBackend, cuda_available  # noqa: E402
from llamacli.backends.numpy_backend import NumpyBackend  # noqa: E402
from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.models.block import run as forward  # noqa: E402
from llamacli.models.config import ModelConfig  # noqa: E402
from llamacli.models.weights import check_tensors  # noqa: E402
from llamacli.testing import variant  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu


def loaded(path, backend, ctx=256, cache_types=("f16", "f16")):
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    check_tensors(g, cfg, backend.runnable_types)
    backend.load(g, cfg, ctx, cache_types=cache_types)
    return g, cfg, backend


def greedy_run(be, cfg, prompt, steps, fused=False):
    """Prefill through block.run, then `steps` greedy tokens (forward + device argmax, or the fused
    graph-replayed decode step)."""
    from llamacli.sampling.sampling import SamplingParams

    params = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    logits = forward(be, cfg, be.token_ids(np.asarray(prompt)), be.positions(0, len(prompt)))
    first = be.to_host(logits)[-1]
    tok = be.sample(logits, params, rng, [])
    out = [tok]
    for i in range(steps - 1):
        pos = len(prompt) + i
        if fused:
            tok = be.decode_greedy(tok, pos)
        else:
            logits = forward(be, cfg, be.token_ids(np.asarray([tok])), be.positions(pos, 1))
            tok = be.sample(logits, params, rng, [])
        out.append(tok)
    return first, out


# The architectures' plans beyond Llama's, at shapes the fast kernels take (head dims 64/128) and not (16, 24).
QWEN3_D64 = variant("tiny-qwen3", n_embd=128, n_head=4, n_head_kv=2, head_dim=64, name="qwen3-dh64")  # Hq Dh != D
QWEN3_YARN = variant("tiny-qwen3", rope_scaling="yarn", rope_factor=4.0, context_length=1024, name="qwen3-yarn")
PHI3_PARTIAL = variant("small-phi3", rope_dim=96, name="phi3-rope96")  # Phi-4-mini: 96 of 128 dims rotate
GEMMA3_D128 = variant("tiny-gemma3", head_dim=128, name="gemma3-dh128")  # gemma with the 128-dim kernels
# Mixtures of experts: gpt-oss at its real head dim (64: the tensor-core kernels with sinks and windows), the
# window past a prefill chunk; qwen3moe with more experts and slots than the tiny one.
GPTOSS_D64 = variant("tiny-gpt-oss", n_embd=128, head_dim=64, window=100, name="gpt-oss-dh64")
QWEN3MOE_WIDE = variant("tiny-qwen3moe", n_expert=40, n_expert_used=8, name="qwen3moe-40x8")
# ... and wide enough that the decode step's down projection spans two row ranges of 256 rows
# (mv1_moe_<t>_sum's last block of each adds the weighted sum)
QWEN3MOE_D512 = variant("tiny-qwen3moe", n_embd=512, n_ff_exp=256, name="qwen3moe-d512")
ARCH_CASES = [("tiny-qwen3", QT.F32), ("tiny-qwen3", "Q4_K_M"), (QWEN3_D64, QT.Q8_0), (QWEN3_YARN, QT.Q6_K),
              ("tiny-smollm3", QT.Q8_0), (PHI3_PARTIAL, QT.Q4_K), ("tiny-gemma3", QT.F32), ("tiny-gemma3", QT.Q8_0),
              (GEMMA3_D128, QT.Q6_K), ("tiny-gemma2", QT.Q8_0), ("tiny-qwen3moe", QT.F32), ("tiny-qwen3moe", "Q4_K_M"),
              (QWEN3MOE_WIDE, QT.Q8_0), (QWEN3MOE_D512, "Q4_K_M"), ("tiny-gpt-oss", "MXFP4_MOE"),
              (GPTOSS_D64, "MXFP4_MOE"), (GPTOSS_D64, QT.Q5_0)]

CASES = ARCH_CASES + [("small-llama", t) for t in RUNNABLE] + [
    ("tiny-llama", QT.F32), ("tiny-qwen2", QT.Q8_0), ("tiny-phi3", QT.F16),
    ("small-qwen2", QT.Q4_K), ("small-phi3", QT.Q6_K), ("small-llama", "Q4_K_M"), ("small-qwen2", QT.Q5_0),
]


@pytest.mark.parametrize("shape,qtype", CASES, ids=case_id)
def test_forward_and_greedy_match_numpy(random_model, shape, qtype) -> None:
    path = random_model(shape, qtype)
    _, cfg, ref = loaded(path, NumpyBackend())
    _, _, be = loaded(path, CudaBackend())
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, size=13)]

    # Last-position logits (prefill) and all-position logits.
    want = ref.to_host(forward(ref, cfg, ref.token_ids(np.asarray(prompt)), ref.positions(0, len(prompt)), True))
    got = be.to_host(forward(be, cfg, be.token_ids(np.asarray(prompt)), be.positions(0, len(prompt)), True))
    assert np.isfinite(got).all()
    assert rel_l2(got[-1], want[-1]) <= 1e-2
    assert rel_l2(got, want) <= 1e-2

    # 32 greedy steps: op-by-op decode, and the fused graph-replayed decode step.
    _, want_toks = greedy_run(ref, cfg, prompt, 32)
    _, got_toks = greedy_run(be, cfg, prompt, 32)
    assert got_toks == want_toks
    _, fused_toks = greedy_run(be, cfg, prompt, 32, fused=True)
    assert fused_toks == want_toks


@pytest.mark.parametrize("shape,qtype", [("small-qwen2", QT.Q4_K), ("tiny-gemma3", "Q4_K_M"), (GEMMA3_D128, QT.Q6_K)],
                         ids=["qwen2", "gemma3-mixed", "gemma3-dh128"])
def test_fused_decode_logits_match_forward(random_model, shape, qtype) -> None:
    """The fused step (graph and plain) against the op-by-op forward pass at the same position (gemma: the
    post-norms folded into the next matvec against rms_norm_add, the q/k norm inside the attention kernel)."""
    path = random_model(shape, qtype)
    _, cfg, be = loaded(path, CudaBackend())
    prompt = [5, 9, 11, 3]
    forward(be, cfg, be.token_ids(np.asarray(prompt)), be.positions(0, 4))
    a = be.to_host(forward(be, cfg, be.token_ids(np.asarray([7])), be.positions(4, 1)))[-1]
    # Gemma's residual is x + RMSNorm(blk) * w in both, but the fused input may contract it into one FMA where
    # the op path rounds the product first: a last-bit difference that the int8 rounding of the next input can
    # turn into one code step of a few values (a missing or doubled post-norm would be off by O(1)).
    tol = 2e-3 if any(plan.post_norms for plan in cfg.layers) else 1e-5
    for use_graph in (False, True, True):  # graph capture, then a plain replay, at the same position
        be.use_graph = use_graph
        b = be.to_host(be.decode(7, 4))[-1]
        assert rel_l2(b, a) <= tol


@pytest.mark.parametrize("shape,qtype", [("small-llama", QT.Q8_0), ("small-qwen2", QT.Q4_K)], ids=["llama", "qwen2"])
def test_fused_decode_step_over_several_splits(random_model, shape, qtype) -> None:
    """Past 64 positions the decode attention runs in several splits; the fused step's kernel (RoPE, K/V
    store, splits and the merge by the last block of each KV head) must match the op-by-op path step after
    step (its per-head counters return to zero, or the next step would merge too early)."""
    path = random_model(shape, qtype)
    _, cfg, be = loaded(path, CudaBackend(), ctx=4096)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, cfg.vocab_size, size=2100)
    forward(be, cfg, be.token_ids(ids[:600]), be.positions(0, 600))
    for pos in (600, 601, 602, 767, 768, 2100, 2101):
        if pos == 2100:
            forward(be, cfg, be.token_ids(ids[769:]), be.positions(769, 2100 - 769))
        tok = int(rng.integers(0, cfg.vocab_size))
        fused = be.to_host(be.decode(tok, pos))[-1].copy()
        plain = be.to_host(forward(be, cfg, be.token_ids(np.asarray([tok])), be.positions(pos, 1)))[-1]
        assert np.isfinite(fused).all()
        assert rel_l2(fused, plain) <= 1e-5, pos
    assert not be.attn.counters.get().any()


@pytest.mark.parametrize("shape,qtype", [("small-qwen2", QT.Q4_K), ("small-phi3", QT.Q8_0), ("tiny-gemma3", "Q4_K_M"),
                                         (GEMMA3_D128, QT.Q6_K)], ids=["qwen2", "phi3", "gemma3-mixed", "gemma3-dh128"])
def test_decode_graph_with_programmatic_launches_equals_plain(random_model, shape, qtype) -> None:
    """The captured step launches its matvecs and attention as programmatic dependents (each may start while
    the previous kernel runs, and waits in griddepcontrol.wait before reading its inputs). Same kernels,
    same math: the logits and greedy ids must equal, bit for bit, those of the graph captured without it
    and of the un-captured launches, step after step, across attention splits (gemma: the post-norms folded
    into the next matvec's input, the residual moving between two buffers; its Q4_K_M mix: QKV and gate/up
    of mixed types, several launches sharing that input)."""
    from llamacli.backends.cuda import loader as K

    path = random_model(shape, qtype)
    _, cfg, be = loaded(path, CudaBackend(), ctx=1024)
    rng = np.random.default_rng(11)
    forward(be, cfg, be.token_ids(rng.integers(0, cfg.vocab_size, size=250)), be.positions(0, 250))
    steps = [(int(rng.integers(0, cfg.vocab_size)), 250 + i) for i in range(24)]  # crosses a 64-key tile at 256

    def run(pdl: bool, use_graph: bool) -> tuple[list[np.ndarray], list[int]]:
        be.drop_graphs()
        be.pdl, be.use_graph = pdl, use_graph
        logits = [be.to_host(be.decode(tok, pos))[-1].copy() for tok, pos in steps]
        ids = [be.decode_greedy(tok, pos) for tok, pos in steps]
        return logits, ids

    got_l, got_ids = run(True, True)
    assert be.pdl == K.pdl_supported()  # the capture with programmatic launches did not fall back
    for pdl, use_graph in ((False, True), (False, False)):
        want_l, want_ids = run(pdl, use_graph)
        assert got_ids == want_ids
        for a, b in zip(got_l, want_l):
            assert np.isfinite(a).all()
            np.testing.assert_array_equal(a, b)
    assert got_ids == [int(np.argmax(v)) for v in got_l]
    assert not be.attn.counters.get().any()


def test_greedy_step_queued_ahead_is_taken_only_when_it_matches(random_model) -> None:
    """decode_greedy queues the next step (its own id at pos + 1, read from the device) before it reads the
    id. The next call takes that step only if it asks for exactly it, with nothing launched in between; a
    different token, or a prefill that rewrote the cache, recomputes. Same ids as the plain launches."""
    path = random_model("small-qwen2", QT.Q4_K)
    _, cfg, be = loaded(path, CudaBackend(), ctx=256)
    rng = np.random.default_rng(5)
    p, q = rng.integers(0, cfg.vocab_size, 20), rng.integers(0, cfg.vocab_size, 21)
    x = int(rng.integers(0, cfg.vocab_size))

    def script(use_graph: bool) -> list[int]:
        be.use_graph = use_graph
        be.forward_prompt(p, 0)
        a = be.decode_greedy(3, 20)
        assert (be.queued_ahead is not None) == use_graph and (not use_graph or be.queued_ahead == (a, 21))
        b = be.decode_greedy(x if x != a else (x + 1) % cfg.vocab_size, 21)  # not the step queued
        c = be.decode_greedy(b, 22)  # the step queued
        be.forward_prompt(q, 0)  # the step queued now, (c, 23), saw the old cache
        assert be.queued_ahead is None
        d = be.decode_greedy(c, 23)
        e = be.decode_greedy(d, 24)
        return [a, b, c, d, e]

    for _ in range(2):  # the second round replays captured prefill and step graphs
        assert script(True) == script(False)


def test_memory_error_names_need_free_and_ctx(random_model) -> None:
    from llamacli.errors import DeviceMemoryError

    path = random_model("tiny-llama", QT.F32)
    with pytest.raises(DeviceMemoryError, match=r"needs .* GiB.*free.*--ctx"):
        loaded(path, CudaBackend(), ctx=1 << 30)


def _smollm2_path():
    env = os.environ.get("LLAMACLI_TEST_MODEL")
    if env:
        return env
    try:
        from llamacli.testing import data as testdata

        return str(testdata.smollm2_path())
    except Exception as exc:  # no network on the GPU machine
        pytest.skip(f"SmolLM2 not available: {exc}")


def smollm2_reference() -> dict:
    """The NumPy backend's greedy replies to a prompt set on the real SmolLM2 (tests/smollm2_greedy.json,
    checked against the NumPy backend on the CPU by tests/models/test_model_reference.py): the GPU test compares with
    them instead of running the reference on the GPU machine's CPU (minutes of device time)."""
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parents[2] / "smollm2_greedy.json").read_text())


def test_smollm2_greedy_64_tokens_identical() -> None:
    import hashlib

    from llamacli.engine.generate import load

    path = _smollm2_path()
    data = smollm2_reference()
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == data["model_sha256"]
    gpu = load(path, backend="cuda", ctx=data["ctx"])
    for prompt, want in data["replies"].items():
        got = gpu.complete(prompt, max_tokens=data["max_tokens"], temperature=0.0)
        assert got.tokens == want, prompt
        # and the fused, graph-replayed decode step
        ids = gpu.prompt_ids(prompt)
        gpu.seq.clear()
        be, cfg = gpu.backend, gpu.cfg
        _, fused = greedy_run(be, cfg, ids, len(want))
        _, fused2 = greedy_run(be, cfg, ids, len(want), fused=True)
        assert fused == fused2
        n = len(want)
        assert fused2[:n] == want[:n], prompt


def gemma2_2b_shape_check(tmp_path, backend: str) -> None:
    """A random model at Gemma-2-2B's shape (26 layers, 2304, 8/4 heads, head dim 256, window 4096 on every
    other layer, soft-caps 50 / 30, vocabulary 256,000; Q4_K_M) gives the stored NumPy run's greedy ids and
    top-5 logprobs (tests/gemma2_2b_shape.json: the NumPy forward takes a minute and 14 GB, too heavy for the
    suite; checked against it by hand on the CPU when stored). The file is written again and must be the same
    file. The logprobs sit near log(1 / 256000) (a random model): a set of five may differ in its tail."""
    import hashlib
    import json
    from pathlib import Path

    from llamacli.engine.generate import load
    from llamacli.testing import write_model

    ref = json.loads((Path(__file__).parents[2] / "gemma2_2b_shape.json").read_text())
    path = write_model(tmp_path / "gemma2-2b.gguf", "gemma2-2b", "Q4_K_M")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    assert digest.hexdigest() == ref["model_sha256"]
    m = load(path, backend=backend, ctx=256)
    assert m.prompt_ids(ref["prompt"], raw=True) == ref["prompt_tokens"]
    c = m.complete(ref["prompt_tokens"], max_tokens=len(ref["tokens"]), temperature=0.0, logprobs=5)
    assert c.tokens == ref["tokens"]
    for step, (got, want) in enumerate(zip(c.logprobs, ref["top_logprobs"])):
        g = {t["id"]: t["logprob"] for t in got["top_logprobs"]}
        shared = [t for t in want if t["id"] in g]
        assert len(shared) >= 3 and want[0]["id"] in g, (step, g, want)
        for t in shared:
            assert abs(g[t["id"]] - t["logprob"]) < 0.02, (step, t, g[t["id"]])


def test_gemma2_2b_shape_matches_the_stored_numpy_run(tmp_path) -> None:
    gemma2_2b_shape_check(tmp_path, "cuda")


NEAR_TIE = 0.05  # logits; CUDA's last logits differ from NumPy's by ~3e-4 relative (~0.01 at Gemma's scale)


def test_gemma3_270m_greedy_64_tokens_match_numpy() -> None:
    """The real Gemma 3 270M Q4_K_M (LLAMACLI_TEST_GEMMA): CUDA's greedy 64 tokens (prefill, then the captured
    decode step) equal the NumPy reference's, except that they may part where the reference itself is within
    NEAR_TIE of a tie between the two tokens (int8 activations in the K-quant matvecs, as llama.cpp's MMVQ,
    against float32: measured on "The capital of France is", step 11, a margin of 0.014)."""
    from llamacli.engine.generate import load

    path = os.environ.get("LLAMACLI_TEST_GEMMA")
    if not path:
        pytest.skip("LLAMACLI_TEST_GEMMA is not set")
    ref = load(path, backend="numpy", ctx=512)
    gpu = load(path, backend="cuda", ctx=512)
    for prompt in smollm2_reference()["replies"]:  # (the prompt set; the replies are SmolLM2's)
        greedy_matches_up_to_near_ties(ref, gpu, prompt, 64)


def greedy_matches_up_to_near_ties(ref, gpu, prompt, n_tokens: int) -> None:
    """Greedy n_tokens of `prompt` on both models: equal, or parting only where the reference's logits are
    within NEAR_TIE of a tie between the two ids."""
    from llamacli.models.block import prefill

    want = ref.complete(prompt, max_tokens=n_tokens, temperature=0.0, raw=True).tokens
    got = gpu.complete(prompt, max_tokens=n_tokens, temperature=0.0, raw=True).tokens
    n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if n is None:
        assert len(got) == len(want), prompt
        return
    ids = ref.tokenize(prompt) + want[:n]
    ref.seq.clear()
    logits = ref.backend.to_host(prefill(ref.backend, ref.cfg, ids, 0))[-1]
    assert logits[want[n]] - logits[got[n]] < NEAR_TIE, (prompt, n, logits[want[n]] - logits[got[n]])


def test_gemma3_270m_long_prompt_through_the_rings_matches_numpy() -> None:
    """The real Gemma 3 270M at ctx 4096: its 15 sliding-window layers keep rings of 1,024 rows (models/kv_cache.py);
    a prompt of about 1,700 tokens (the README's opening) wraps them during the prefill and 32 greedy
    steps read across the wrap, as NumPy's rings do; and a second prompt sharing the first 1,000 tokens
    is prefilled whole (the rings no longer hold the window before them: kv_cache.ring_keeps)."""
    from llamacli.engine.generate import load

    path = os.environ.get("LLAMACLI_TEST_GEMMA")
    if not path:
        pytest.skip("LLAMACLI_TEST_GEMMA is not set")
    ref = load(path, backend="numpy", ctx=4096)
    gpu = load(path, backend="cuda", ctx=4096)
    assert sorted({k.shape[0] for k in gpu.backend.kv.k_cache}) == [1024, 4096]
    from pathlib import Path

    text = (Path(__file__).parents[3] / "README.md").read_text(encoding="utf-8")[:5000]
    assert 1100 < len(gpu.tokenize(text)) < 3000
    greedy_matches_up_to_near_ties(ref, gpu, text, 32)
    ids = gpu.tokenize(text)[:1000] + gpu.tokenize(" And now something else entirely:")
    for m in (ref, gpu):
        c = m.complete(ids, max_tokens=1, temperature=0.0)
        assert c.timings.prompt_tokens == len(ids)
    greedy_matches_up_to_near_ties(ref, gpu, text[: len(text) // 3], 16)


def test_long_prefill_of_a_1b_shape_model_is_finite_and_matches_decode(tmp_path) -> None:
    """Random Llama-3.2-1B-shape weights drive the residual stream into the thousands, and a 512-token
    prefill once overflowed fp16 GEMM outputs (NaN logits). The prefill (cuBLAS) must agree with the same
    tokens fed one at a time through the decode step (matvec kernels, fp32 throughout)."""
    from llamacli.testing import write_model

    path = write_model(tmp_path / "l1b.gguf", "llama-3.2-1b", "Q4_K_M")
    _, cfg, be = loaded(path, CudaBackend(), ctx=520)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=512).astype(np.int32)
    prefill = be.to_host(forward(be, cfg, be.token_ids(ids), be.positions(0, len(ids))))[-1]
    assert np.isfinite(prefill).all()
    fused = be.to_host(be.forward_prompt(ids, 0))[-1]  # fp16 activations with row scales between GEMMs
    assert np.isfinite(fused).all()
    assert rel_l2(fused, prefill) <= 1e-2
    for pos, tok in enumerate(ids):
        step = be.decode(int(tok), pos)
    stepwise = be.to_host(step)[-1]
    assert np.isfinite(stepwise).all()
    assert rel_l2(prefill, stepwise) <= 1e-2


PREFILL_CASES = ARCH_CASES + [
    ("small-llama", "Q4_K_M"), ("small-llama", QT.Q4_1), ("small-llama", QT.F16), ("small-llama", QT.IQ4_XS),
    ("small-qwen2", QT.Q8_0), ("small-phi3", QT.F16), ("small-phi3", QT.Q5_K), ("tiny-llama", QT.F32),
]


@pytest.mark.parametrize("shape,qtype", PREFILL_CASES, ids=case_id)
def test_fused_prefill_matches_numpy(random_model, shape, qtype) -> None:
    """forward_prompt (fp16 activations with row scales, fused epilogues, graph replay from the second
    sighting of a length) against the NumPy reference: the last logits, and the cache it leaves (a decode
    step after it). Lengths: 9 (CUDA-core attention), 16, 77, and 700 in chunks of 512 + 188. The
    buffers start poisoned with NaN, so a read of anything not written shows."""
    from llamacli.models.block import prefill

    path = random_model(shape, qtype)
    _, cfg, ref = loaded(path, NumpyBackend(), ctx=1024)
    _, _, be = loaded(path, CudaBackend(), ctx=1024)
    b = be.prefill_pass().buffers()
    for buf in (b.x, b.h16, b.att16, b.qkv, b.gu, b.y, be.linear.dq, b.logits):
        buf.fill(np.nan)
    rng = np.random.default_rng(1)
    for t in (9, 16, 77, 700):
        ids = rng.integers(0, cfg.vocab_size, size=t)
        want = ref.to_host(prefill(ref, cfg, ids, 0))[-1]
        runs = [be.to_host(prefill(be, cfg, ids, 0))[-1].copy() for _ in range(3)]  # direct, capture, replay
        assert np.isfinite(runs[0]).all(), t
        assert rel_l2(runs[0], want) <= 1e-2, t
        for r in runs[1:]:
            assert rel_l2(r, runs[0]) <= 1e-6, t
        tok = int(rng.integers(0, cfg.vocab_size))
        step_ref = ref.to_host(forward(ref, cfg, ref.token_ids(np.asarray([tok])), ref.positions(t, 1)))[-1]
        step = be.to_host(be.decode(tok, t))[-1]
        assert rel_l2(step, step_ref) <= 1e-2, t
    assert be.prefill_graph_lengths >= {16, 77, 512}


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
@pytest.mark.parametrize("shape,qtype", [("tiny-gemma3", "Q4_K_M"), ("tiny-gemma2", QT.Q8_0), (GPTOSS_D64, "MXFP4_MOE")],
                         ids=["gemma3", "gemma2", "gpt-oss-dh64"])
def test_greedy_through_the_ring_wrap_matches_numpy(random_model, shape, qtype, cache) -> None:
    """At ctx 1024 the sliding-window layers keep rings of 640 rows (models/kv_cache.py): a 700-token prompt (fused
    chunks of 512 and 188, the second wrapping the ring), 48 greedy steps of the captured decode step past the
    wrap, then the logits of one more step: the NumPy reference's ids and logits (which keeps the same rings);
    with fp16 caches and with 8-bit ones on both backends (-ctk/-ctv q8_0)."""
    from llamacli.models.block import prefill

    path = random_model(shape, qtype)
    _, cfg, ref = loaded(path, NumpyBackend(), ctx=1024, cache_types=(cache, cache))
    _, _, be = loaded(path, CudaBackend(), ctx=1024, cache_types=(cache, cache))
    assert {k.shape[0] for k, p in zip(be.kv.k_cache, cfg.layers) if p.window} == {640}
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=700)
    want_first, got_first = ref.to_host(prefill(ref, cfg, ids, 0))[-1], be.to_host(prefill(be, cfg, ids, 0))[-1]
    assert rel_l2(got_first, want_first) <= 1e-2
    want, got = [int(np.argmax(want_first))], [int(np.argmax(want_first))]
    for pos in range(700, 748):
        want.append(int(np.argmax(ref.to_host(forward(ref, cfg, ref.token_ids(np.asarray([want[-1]])),
                                                      ref.positions(pos, 1)))[-1])))
        got.append(be.decode_greedy(got[-1], pos))
    assert got == want
    step_ref = ref.to_host(forward(ref, cfg, ref.token_ids(np.asarray([want[-1]])), ref.positions(748, 1)))[-1]
    assert rel_l2(be.to_host(be.decode(got[-1], 748))[-1], step_ref) <= 1e-2


def test_fused_prefill_chunk_after_cached_prefix(random_model) -> None:
    """A second prompt chunk at a later start (chat turn 2: the prefix is in the cache) attends to the
    earlier positions; the graph captured for that length serves any start."""
    from llamacli.models.block import prefill

    path = random_model("small-llama", "Q4_K_M")
    _, cfg, ref = loaded(path, NumpyBackend(), ctx=512)
    _, _, be = loaded(path, CudaBackend(), ctx=512)
    rng = np.random.default_rng(2)
    first, second = rng.integers(0, cfg.vocab_size, size=40), rng.integers(0, cfg.vocab_size, size=33)
    for attempt in range(2):  # 33 tokens at 40 twice: direct, then captured; each after the same first turn
        prefill(ref, cfg, first, 0)
        prefill(be, cfg, first, 0)
        want = ref.to_host(prefill(ref, cfg, second, 40))[-1]
        got = be.to_host(prefill(be, cfg, second, 40))[-1]
        assert rel_l2(got, want) <= 1e-2, attempt
    assert 33 in be.prefill_graph_lengths


def test_mixed_kv_cache_types_are_refused_on_cuda(random_model) -> None:
    """K and V caches of two types: the CUDA backend says so before allocating anything (as llama.cpp's CUDA
    flash attention, it takes one type for both)."""
    from llamacli.engine.generate import Model
    from llamacli.errors import UsageError

    with pytest.raises(UsageError, match="K and V caches of one type"):
        Model(random_model("small-llama", "Q8_0"), backend="cuda", ctx=64, cache_types=("q8_0", "f16"))


# An 8-bit cache on the paths a model takes: head dim 64 (small-llama), q/k norms at 128 (tiny-qwen3), sliding
# windows at 256 (tiny-gemma3), and head dim 32 (tiny-gpt-oss: sinks, windows, no attention_split kernel: the
# CUDA-core decode on the fp16 conversion). At ctx 512 no layer keeps a ring; the rings wrap in
# test_greedy_through_the_ring_wrap_matches_numpy.
Q8_CASES = [("small-llama", QT.Q4_K), ("tiny-qwen3", "Q4_K_M"), ("tiny-gemma3", QT.Q8_0), ("tiny-gpt-oss", "MXFP4_MOE")]


@pytest.mark.parametrize("shape,qtype", Q8_CASES, ids=case_id)
def test_q8_0_kv_cache_matches_numpy(random_model, shape, qtype) -> None:
    """-ctk/-ctv q8_0 on the CUDA backend against the NumPy backend's q8_0 cache: the fused prefill of a
    40-token prompt (K and V quantized from the rotated f32 rows, the prefill attention on the fp16
    conversion), then a 13-token chunk on top of it (the CUDA-core prefill attention), then 24 greedy tokens
    through the fused graph step; the logits within 1e-2 and the tokens identical."""
    from llamacli.models.block import prefill

    q8 = ("q8_0", "q8_0")
    path = random_model(shape, qtype)
    _, cfg, ref = loaded(path, NumpyBackend(), ctx=512, cache_types=q8)
    _, _, be = loaded(path, CudaBackend(), ctx=512, cache_types=q8)
    assert be.kv.k_cache[0].dtype == cp.uint8 and be.kv.pair is not None
    rng = np.random.default_rng(4)
    first, second = rng.integers(0, cfg.vocab_size, size=40), rng.integers(0, cfg.vocab_size, size=13)
    for ids, start in ((first, 0), (second, 40)):
        want = ref.to_host(prefill(ref, cfg, ids, start))[-1]
        got = be.to_host(prefill(be, cfg, ids, start))[-1]
        assert rel_l2(got, want) <= 1e-2, start
    tok, want_toks, got_toks = int(np.argmax(want)), [], []
    cur = tok
    for pos in range(53, 53 + 24):
        logits = ref.to_host(forward(ref, cfg, ref.token_ids(np.asarray([cur])), ref.positions(pos, 1)))
        cur = int(np.argmax(logits[-1]))
        want_toks.append(cur)
    cur = tok
    for pos in range(53, 53 + 24):
        cur = be.decode_greedy(cur, pos)
        got_toks.append(cur)
    assert got_toks == want_toks
