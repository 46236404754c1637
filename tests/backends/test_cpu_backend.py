"""The CPU backend (llamacli/backends/cpu/) against the NumPy reference: the re-packed weights are the file's values
bit for bit, each product is the int8-activation product it claims to be, and whole models of every architecture
and packed type give the reference's logits within the int8 activations' error and its greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from gguf import quants as gq  # noqa: E402

from llamacli import backends  # noqa: E402
from llamacli.backends.cpu import backend as cpu_backend, layouts  # noqa: E402
from llamacli.backends.cpu.backend import DEQUANT_ROWS, CpuBackend, PackedMatrix  # noqa: E402
from llamacli.backends.numpy_backend import NumpyBackend  # noqa: E402
from llamacli.errors import BackendError  # noqa: E402
from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.ggufio.ggml_types import GGMLQuantizationType as QT  # noqa: E402
from llamacli.models.block import prefill  # noqa: E402
from llamacli.models.config import ModelConfig  # noqa: E402
from llamacli.testing import random_quant_rows  # noqa: E402

PACKED = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL,
          QT.IQ4_XS, QT.MXFP4]
K_TYPES = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_XS}


def act16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [K] quantized per 32 values as kernels.quantize does (float32: q = rint(x * (32767 / amax))) -> (the values
    they stand for, q * xd, float64 [K]; xd [K / 32])."""
    u = x.reshape(-1, 32)
    amax = np.abs(u).max(axis=1)
    inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.rint(u * inv.astype(np.float32)[:, None])
    xd = amax / np.float32(32767)
    return (q.astype(np.float64) * xd.astype(np.float64)[:, None]).reshape(-1), xd


def _weights(qtype: QT, rows: int, seed: int = 0, any_scale: bool = False) -> tuple[np.ndarray, int]:
    """Random blocks of `qtype` [rows, row_bytes] and their row length: 3 super-blocks of the K-types, 5 blocks of
    the others (an odd count: the kernels' pairs of blocks end on a single one). Random bytes (scales set finite
    and of about the size of real weights) reach every bit pattern of the values; `any_scale`: MXFP4's exponent
    byte too (0 and 1 are subnormal scales, the largest 2^126)."""
    cols = 3 * 256 if qtype in K_TYPES else 5 * 32
    rng = np.random.default_rng(seed)
    if qtype == QT.MXFP4 and any_scale:
        return rng.integers(0, 256, (rows, cols // 32 * 17), dtype=np.uint8), cols
    return random_quant_rows(qtype, rows, cols, rng, std=0.5, fast=True), cols


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_repacking_keeps_the_files_values_bit_for_bit(qtype):
    raw, cols = _weights(qtype, 7, any_scale=True)
    ref = gq.dequantize(raw, qtype).reshape(7, cols)
    p = layouts.pack(raw, qtype, (7, cols))
    assert np.array_equal(layouts.dequantize(p), ref)
    m = PackedMatrix(p)  # the compiled dequantizers (embedding rows, long prompts' products)
    assert np.array_equal(m.rows(None), ref)
    assert np.array_equal(m.rows(np.array([6, 0, 6])), ref[[6, 0, 6]])
    assert p.nbytes == layouts.packed_bytes(qtype, 7 * cols)
    with pytest.raises(IndexError):
        m.rows(np.array([7]))


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3])
def test_products_are_the_int16_activation_products(qtype, tokens):
    """The kernel computes sum_b d_b dot(q_b, xq_b) + m_b sum(x_b) (xq: x quantized per 32 values as the kernels do,
    act16; the min's term with x itself): within float32 rounding of that sum in float64, and so within half a step
    of each value's scale of the float product (the reference's)."""
    rows = 9
    raw, cols = _weights(qtype, rows, seed=1)
    w = gq.dequantize(raw, qtype).reshape(rows, cols).astype(np.float64)
    p = layouts.pack(raw, qtype, (rows, cols))
    nb = cols // p.block
    scaled = w if p.m is None else w - np.repeat(p.m.astype(np.float64), p.block, axis=1)  # d q
    x = np.random.default_rng(2).standard_normal((tokens, cols)).astype(np.float32)
    x[0, 5] = 40.0  # one large value: its block's scale, not the others', grows
    out = PackedMatrix(p).product(x)
    for t in range(tokens):
        xq, xd = act16(x[t])
        exact = scaled @ xq
        if p.m is not None:
            exact += p.m.astype(np.float64) @ x[t].astype(np.float64).reshape(nb, p.block).sum(axis=1)
        rounding = 1e-5 * (np.abs(w) @ np.abs(x[t]))
        assert np.all(np.abs(out[t] - exact) <= rounding), np.max(np.abs(out[t] - exact) / rounding)
        step = np.abs(scaled) @ np.repeat(xd.astype(np.float64) / 2, 32)
        assert np.all(np.abs(out[t] - w @ x[t]) <= step + rounding)


def test_long_products_are_the_references_float_product(monkeypatch):
    """From DEQUANT_ROWS tokens a product is the reference's: the dequantized matrix (the file's values) times x, in
    one piece, or DEQUANT_BYTES of rows at a time (here a row or two: the same products, column by column)."""
    raw, cols = _weights(QT.Q4_K, 5)
    x = np.random.default_rng(3).standard_normal((DEQUANT_ROWS, cols)).astype(np.float32)
    w = gq.dequantize(raw, QT.Q4_K).reshape(5, cols)
    m = PackedMatrix(layouts.pack(raw, QT.Q4_K, (5, cols)))
    assert np.array_equal(m.product(x), x @ w.T)
    monkeypatch.setattr(cpu_backend, "DEQUANT_BYTES", 2 * 4 * cols)
    pieces = m.product(x)
    assert np.allclose(pieces, x @ w.T, rtol=1e-6, atol=1e-6 * np.abs(x @ w.T).max())


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_activation_gives_non_finite_outputs(bad):
    """A NaN or inf in x makes the token's outputs NaN (as the float product's would not be finite either), and
    leaves the other tokens' alone."""
    raw, cols = _weights(QT.Q8_0, 4)
    x = np.ones((2, cols), np.float32)
    x[1, 7] = bad
    out = PackedMatrix(layouts.pack(raw, QT.Q8_0, (4, cols))).product(x)
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1]))


# -- whole models against the reference ----------------------------------------------------------------------

# (shape, type): every packed layout and block size, the dense fallback (F16), odd block counts (tiny-phi3's 96
# columns: three blocks), and the architectures' own operations: GQA, fused QKV (phi3), q/k norms, sliding windows
# as rings and GeGLU (gemma3), soft-caps (gemma2), experts (qwen3moe), sinks and MXFP4 experts (gpt-oss), delta-net
# layers and gated attention (qwen35), layers of their own head sizes, shared KV, per-layer embeddings and fused
# gate/up experts (gemma4).
MODELS = [
    ("tiny-llama", "Q4_0"), ("tiny-llama", "Q4_1"), ("tiny-llama", "Q5_0"), ("tiny-llama", "Q5_1"),
    ("tiny-llama", "Q8_0"), ("tiny-llama", "IQ4_NL"), ("small-llama", "Q2_K"), ("small-llama", "Q3_K"),
    ("small-llama", "Q4_K"), ("small-llama", "Q5_K"), ("small-llama", "Q6_K"), ("small-llama", "IQ4_XS"),
    ("tiny-phi3", "Q4_0"), ("tiny-phi3", "F16"), ("tiny-gemma3", "Q4_K_M"), ("tiny-gemma2", "Q8_0"),
    ("tiny-qwen3moe", "Q8_0"), ("tiny-gpt-oss", "MXFP4_MOE"), ("tiny-qwen35", "Q4_0"), ("tiny-gemma4", "Q8_0"),
    ("tiny-gemma4-moe", "Q5_0"),
]
# The logits' difference from the reference, over the largest logit. Each product's int16 activations move it by at
# most half a step of each value's scale, amax / 65534 of its block's largest value (and the float32 sums' order
# by about 1e-7); through these few-layer random models the logits move by 2e-6 to 6e-5 of the largest (measured
# over MODELS). 1e-3 leaves that room sixteen times over, while a wrong operation moves them by tens of percent.
LOGITS_RTOL = 1e-3


def _pair(path, ctx: int = 64) -> tuple[NumpyBackend, CpuBackend, ModelConfig]:
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    ref, fast = NumpyBackend(), CpuBackend()
    ref.load(g, cfg, ctx)
    fast.load(g, cfg, ctx)
    g.close()
    return ref, fast, cfg


@pytest.mark.parametrize("shape,qtype", MODELS, ids=[f"{s}-{q}" for s, q in MODELS])
def test_models_match_the_reference(random_model, shape, qtype):
    """A prompt of 12 tokens (past gemma's and gpt-oss's windows of 8), then 10 greedy decode steps on each backend
    alone: the same tokens, and logits within LOGITS_RTOL of the reference's at every step."""
    ref, fast, cfg = _pair(random_model(shape, qtype, seed=3))
    ids = [int(i) for i in np.random.default_rng(4).integers(3, cfg.vocab_size, 12)]
    a, b = prefill(ref, cfg, ids, 0)[-1], prefill(fast, cfg, ids, 0)[-1]
    tokens: tuple[list[int], list[int]] = ([], [])
    for pos in range(len(ids), len(ids) + 10):
        scale = np.abs(a).max()
        assert np.abs(a - b).max() <= LOGITS_RTOL * scale, (pos, np.abs(a - b).max() / scale)
        tokens[0].append(int(np.argmax(a)))
        tokens[1].append(int(np.argmax(b)))
        a, b = ref.decode(tokens[0][-1], pos)[-1], fast.decode(tokens[1][-1], pos)[-1]
    assert tokens[0] == tokens[1]


def test_decode_attention_across_threads_and_rings(random_model, monkeypatch):
    """A decode step's attention split across threads (forced on for a short context) is the single thread's:
    gemma3's ring layers wrap (positions past the window of 8)."""
    path = random_model("tiny-gemma3", "Q8_0", seed=5)
    ref, fast, cfg = _pair(path)
    _, split, _ = _pair(path)
    monkeypatch.setattr(cpu_backend, "ATTENTION_THREADS_FROM", 0)
    ids = list(range(3, 23))
    for be in (ref, fast, split):
        prefill(be, cfg, ids[:2], 0)
    for pos in range(2, 20):
        a, b, c = (be.decode(ids[pos], pos)[-1] for be in (ref, fast, split))
        assert np.abs(a - b).max() <= LOGITS_RTOL * np.abs(a).max()
        assert np.allclose(b, c, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_weights_are_held_at_their_layouts_sizes(random_model):
    """What load keeps is what weight_bytes (the host-memory check's count) says: the packed matrices at their
    layouts' sizes (a tied LM head is token_embd itself), float32 vectors."""
    path = random_model("tiny-qwen2", "Q4_K_M")  # tied, a mix of types
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    be = CpuBackend()
    be.load(g, cfg, 16)
    w = be.weights
    assert w.output is w.token_embd and isinstance(w.output, PackedMatrix)
    held = [w.token_embd, w.output_norm] + [a for L in w.layers for a in vars(L).values() if a is not None]
    assert cpu_backend.weight_bytes(g, cfg) == sum(a.nbytes for a in held)
    assert cpu_backend.weight_bytes(g, cfg) < sum(4 * t.n_elements for t in g.tensors.values()) / 3


def test_threads_follow_the_count_in_force(random_model, monkeypatch):
    """The kernels run on -t's count (cpu_threads.threads_in_force), set for the thread that runs a pass."""
    import numba

    ref, fast, cfg = _pair(random_model("tiny-llama", "Q8_0"))
    monkeypatch.setattr(cpu_backend, "threads_in_force", lambda: 1)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    prefill(fast, cfg, [3, 4], 0)
    assert numba.get_num_threads() == 1
    assert "1 threads" in fast.device_name()


# -- choosing it ---------------------------------------------------------------------------------------------


def test_cpu_is_chosen_by_name_and_by_auto_without_a_gpu():
    said: list[str] = []
    assert backends.select_backend("cpu").name == "cpu"
    be = backends.select_backend("auto", said.append, early=lambda: (False, "no GPU"))
    assert be.name == "cpu" and said == ["using the CPU backend (no GPU)"]
    assert backends.select_backend("numpy").name == "numpy"  # the reference stays selectable


def test_without_numba_auto_takes_the_reference_and_cpu_says_why(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    said: list[str] = []
    be = backends.select_backend("auto", said.append, early=lambda: (False, "no GPU"))
    assert be.name == "numpy" and len(said) == 1 and "numba" in said[0]
    with pytest.raises(BackendError, match="CPU backend is unavailable.*numba"):
        backends.select_backend("cpu")


# -- compiling -----------------------------------------------------------------------------------------------


def test_kernels_compile_without_a_cache_where_numba_has_nowhere_to_keep_one(monkeypatch):
    """numba raises at decoration when it finds no writable place for its cache (a read-only install and home):
    the kernel is compiled in memory instead."""
    from llamacli.backends.cpu import kernels

    real = kernels.njit

    def no_cache(**options):
        if options.get("cache"):
            raise RuntimeError("cannot cache function: no locator available")
        return real(**options)

    monkeypatch.setattr(kernels, "njit", no_cache)
    add = kernels.jit()(kernels.add.py_func)
    out = np.empty(3, np.float32)
    add(np.ones(3, np.float32), np.ones(3, np.float32), out)
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_a_second_process_loads_the_compiled_kernels(tmp_path):
    """The kernels are compiled once and then loaded from numba's cache: a second process compiles none of those
    a decode step uses (a cache key that changed from process to process, as a closure over an intrinsic's did,
    would compile them again in every command: seconds)."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import json, numpy as np
from llamacli.backends.cpu import kernels, layouts
from llamacli.backends.cpu.backend import PackedMatrix
from llamacli.testing import random_quant_rows
from llamacli.ggufio.ggml_types import GGMLQuantizationType as QT
rng = np.random.default_rng(0)
for qt in (QT.Q4_0, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q8_0, QT.Q6_K):
    cols = 256
    m = PackedMatrix(layouts.pack(random_quant_rows(qt, 4, cols, rng), qt, (4, cols)))
    m.product(np.ones((1, cols), np.float32)), m.rows(None)
used = [*kernels.LINEAR.values(), *kernels.DEQUANTIZE.values(), kernels.quantize]
print(json.dumps(sum(sum(k.stats.cache_misses.values()) for k in used)))
"""
    root = Path(__file__).resolve().parents[2]
    env = {**__import__("os").environ, "PYTHONPATH": str(root)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert runs[1].stdout.strip() == "0"


def test_the_memory_check_counts_the_packed_weights(random_model, monkeypatch):
    """The host-memory check counts what the CPU backend holds: a model whose float32 weights do not fit the memory
    but whose packed ones do loads on the CPU backend (the NumPy backend refuses it), and one that does not fit
    even so is refused naming the CPU backend."""
    from llamacli.backends import numpy_backend
    from llamacli.errors import HostMemoryError

    path = random_model("small-llama", "Q4_0")
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    float32, kv = numpy_backend.host_bytes(cfg, 64)
    rest = kv + numpy_backend.scratch_bytes(cfg, 64)
    packed = cpu_backend.weight_bytes(g, cfg)
    assert packed < float32 / 4
    monkeypatch.setattr(numpy_backend, "available_host_memory", lambda: (packed + float32) // 2 + rest)
    CpuBackend().load(g, cfg, 64)
    with pytest.raises(HostMemoryError, match="NumPy backend"):
        NumpyBackend().load(g, cfg, 64)
    monkeypatch.setattr(numpy_backend, "available_host_memory", lambda: packed // 2)
    with pytest.raises(HostMemoryError, match="for the CPU backend: .* weights"):
        CpuBackend().load(g, cfg, 64)


def test_passes_from_several_threads(random_model, monkeypatch):
    """Two threads running their own models at once get what each gets alone; where numba's threading layer is its
    work queue (which aborts the process on parallel launches from two threads at once) passes take a lock."""
    import threading

    path = random_model("tiny-llama", "Q8_0")
    pairs = [_pair(path)[1:] for _ in range(2)]
    alone = []
    for be, cfg in pairs:
        alone.append([prefill(be, cfg, [3, 4, 5], 0)[-1]] + [be.decode(7, p)[-1] for p in range(3, 9)])
    got: list = [None, None]

    def run(i):
        be, cfg = pairs[i]
        got[i] = [prefill(be, cfg, [3, 4, 5], 0)[-1]] + [be.decode(7, p)[-1] for p in range(3, 9)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(a, b) for i in range(2) for a, b in zip(alone[i], got[i]))
    be = pairs[0][0]
    monkeypatch.setattr(cpu_backend.kernels, "threading_layer", lambda: "workqueue")
    assert be.pass_context() is cpu_backend.PASSES


@pytest.mark.parametrize("shape,qtype", [("tiny-llama", "Q4_0"), ("tiny-gemma3", "Q8_0"), ("tiny-qwen3moe", "Q8_0")])
def test_speculative_greedy_replies_are_the_plain_ones(random_model, shape, qtype):
    """A verification pass's rows compute what decode steps do (the int16 products however many rows, each query's
    attention as a decode step's), so that speculative greedy replies are the plain ones: drafts of up to 16 ids
    (passes of 17 rows, past DEQUANT_ROWS) from n-grams (mostly accepted) and from a draft model of other weights
    (mostly rejected), on rings (gemma3) and experts."""
    from llamacli.engine.generate import Model
    from llamacli.engine.speculative import SpecSettings

    echo = [5, 9, 2, 40, 7, 7, 1, 5, 9, 2, 40, 7, 11, 60, 61, 62, 5, 9, 2, 40, 7, 7, 1, 5, 9, 2]
    with Model(random_model(shape, qtype, seed=2), backend="cpu", ctx=160) as m, \
            Model(random_model("tiny-llama", "Q8_0", seed=7), backend="cpu", ctx=160) as drafter:
        want = m.complete(echo, max_tokens=48, ignore_eos=True, temperature=0.0).tokens
        drafted = accepted = 0
        for spec, draft in ((SpecSettings(("ngram-simple",), 16, 0, 2), None),
                            (SpecSettings(("draft-simple",), 16), drafter)):
            m.draft = None
            if draft is not None:
                m.attach_draft(draft)
            m.seq.clear()  # (the whole prompt again, not from the cache)
            c = m.complete(echo, max_tokens=48, ignore_eos=True, temperature=0.0, speculative=spec)
            assert c.tokens == want, spec
            drafted, accepted = drafted + c.timings.drafted, accepted + c.timings.accepted
        m.draft = None
    assert 0 < accepted < drafted


@pytest.mark.parametrize("shape,qtype", [("tiny-llama", "Q4_0"), ("tiny-gemma3", "Q8_0"), ("tiny-gpt-oss", "MXFP4_MOE"),
                                         ("tiny-phi3", "F16")])
def test_a_verification_pass_gives_the_decode_steps_logits(random_model, shape, qtype):
    """Each row of a verification pass (Backend.forward_verify: 17 rows, past DEQUANT_ROWS) has the logits a decode
    step at its position gives, bit for bit: the same products (int16 activations; float32 matrices row by row, as
    BLAS rounds a matrix product otherwise: gpt-oss's router, phi3's F16 file) and attention (one query at a time)
    as a decode step, so that a speculative reply's choices are the plain reply's, near-ties included."""
    path = random_model(shape, qtype, seed=4)
    _, a, cfg = _pair(path, ctx=128)
    _, b, _ = _pair(path, ctx=128)
    ids = [int(i) for i in np.random.default_rng(5).integers(3, cfg.vocab_size, 30)]
    for be in (a, b):
        prefill(be, cfg, ids[:13], 0)
    rows = a.forward_verify(np.asarray(ids[13:30]), 13)
    for i, pos in enumerate(range(13, 30)):
        assert np.array_equal(rows[i], b.decode(ids[pos], pos)[-1]), pos
