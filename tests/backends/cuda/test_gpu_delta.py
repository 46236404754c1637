"""The hybrid models (qwen35, qwen35moe, qwen3next) on the CUDA backend, op by op, against the NumPy reference: the
delta-net kernels (kernels/delta.cu) on fresh random inputs at odd shapes, outputs poisoned with NaN first; the Conv
and DeltaRule operations with their states carried across calls, stored and resumed; and whole random models of the
three architectures: logits, greedy ids, a prompt in chunks, a prompt resumed from a stored state, several cache
slots in one step, a verification's rollback. Tolerances are atol + rtol*|ref| (kernels) and the relative L2 error of
the CUDA-vs-NumPy model tests (tests/backends/cuda/test_gpu_backend.py). Needs a GPU (marker gpu)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

cp = pytest.importorskip("cupy")

from gpu_checks import assert_close, case_id, check_logits_and_greedy_ids, check_slots_schedule, rel_l2  # noqa: E402

from llamacli.backends.base import LayerWeights, ModelWeights  # noqa: E402
from llamacli.backends.cuda import CudaBackend, cuda_available, delta  # noqa: E402
from llamacli.backends.cuda.device import DeviceModel  # noqa: E402
from llamacli.backends.numpy_backend import NumpyBackend, key_heads  # noqa: E402
from llamacli.backends.numpy_delta import recurrent  # noqa: E402
from llamacli.backends.step import Sampler, SeqStep  # noqa: E402
from llamacli.errors import BackendError  # noqa: E402
from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.models import rope as rope_tables  # noqa: E402
from llamacli.models.base import LayerPlan  # noqa: E402
from llamacli.models.block import Conv, DeltaRule  # noqa: E402
from llamacli.models.config import ROPE_NEOX, ModelConfig  # noqa: E402
from llamacli.models.seq_cache import SNAPSHOT_EVERY  # noqa: E402
from llamacli.models.weights import check_tensors  # noqa: E402
from llamacli.sampling.sampling import SamplingParams, make_rng  # noqa: E402
from llamacli.testing import variant  # noqa: E402

_ok, _why = cuda_available()
if not _ok:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.gpu

T_CASES = [1, 7, 64, 65, 130]


def poisoned(shape):
    return cp.full(shape, cp.nan, dtype=cp.float32)


# -- the kernels ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", T_CASES)
@pytest.mark.parametrize("c,k", [(33, 4), (300, 2), (17, 1)])
def test_conv_silu_and_the_window(t, c, k) -> None:
    """conv_silu_f32 over the window and the tokens; conv_window_f32 at points inside the pass, and in place (the
    window moved on: also when the pass is shorter than the window)."""
    rng = np.random.default_rng(100 * t + c)
    x = rng.standard_normal((t, c)).astype(np.float32)
    w = (0.5 * rng.standard_normal((c, k))).astype(np.float32)
    win = rng.standard_normal((k - 1, c)).astype(np.float32)
    full = np.concatenate([win, x]).astype(np.float64)  # inputs at positions -(K - 1) .. T - 1
    ref = sum(full[j : j + t] * w[:, j] for j in range(k))
    ref = ref / (1.0 + np.exp(-ref))
    dx, dwin, out = cp.asarray(x), cp.asarray(win), poisoned((t, c))
    delta.conv_into(dx, cp.asarray(w), dwin, out)
    assert_close(out.get(), ref, 1e-5, 1e-4, "conv")
    if k == 1:
        return
    for at in sorted({1, max(1, t // 2), t}):
        dst = poisoned((k - 1, c))
        delta.conv_window(dx, dwin, dst, at)
        np.testing.assert_array_equal(dst.get(), full[at : at + k - 1].astype(np.float32))
    delta.conv_window(dx, dwin, dwin, t)
    np.testing.assert_array_equal(dwin.get(), full[t:].astype(np.float32))


def rule_reference(qkv, a, b, ssm_a, dt, s, hk, dk, heads, eps):
    """The NumPy backend's delta rule on plain arrays (numpy_delta.recurrent) -> (out [T, Hv dv], state)."""
    t = qkv.shape[0]
    hv = s.shape[0]

    def l2(x):
        return (x / np.sqrt((x.astype(np.float64) ** 2).sum(-1, keepdims=True) + eps)).astype(np.float32)

    q = l2(qkv[:, : hk * dk].reshape(t, hk, dk)) / np.float32(math.sqrt(dk))
    k = l2(qkv[:, hk * dk : 2 * hk * dk].reshape(t, hk, dk))
    v = qkv[:, 2 * hk * dk :].reshape(t, hv, -1)
    src = key_heads(heads, hk, hv)
    g = (ssm_a * np.logaddexp(0.0, a + dt)).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-b))).astype(np.float32)
    args = [x.transpose(1, 0, *range(2, x.ndim)) for x in (q[:, src], k[:, src], v, g, beta)]
    out, end = recurrent(*args, s)
    return out.transpose(1, 0, 2).reshape(t, -1), end, q, k


@pytest.mark.parametrize("t", T_CASES)
@pytest.mark.parametrize("hk,hv,dk,heads", [(2, 6, 40, "tiled"), (2, 6, 40, "grouped"), (3, 3, 16, "tiled"),
                                            (1, 4, 128, "grouped"), (4, 8, 128, "tiled"), (2, 4, 24, "grouped"),
                                            (1, 1, 704, "tiled")])  # (past 48 KiB of shared memory: the opt-in)
def test_delta_rule_kernel(t, hk, hv, dk, heads) -> None:
    """delta_qk_f32 (the L2 norms, q's scale, k . q) and delta_rule_f32 from a random state: the output of every token
    and the state after the last, value heads reading their key heads tiled or grouped, column tiles cut short."""
    rng = np.random.default_rng(7 * t + dk)
    eps = 1e-6
    c = 2 * hk * dk + hv * dk
    qkv = rng.standard_normal((t, c)).astype(np.float32)
    a, b = (rng.standard_normal((t, hv)).astype(np.float32) for _ in "ab")
    ssm_a = (-np.exp(rng.uniform(-2, 1, hv))).astype(np.float32)
    dt = rng.standard_normal(hv).astype(np.float32)
    s0 = (0.3 * rng.standard_normal((hv, dk, dk))).astype(np.float32)
    want, want_s, q, k = rule_reference(qkv, a, b, ssm_a, dt, s0, hk, dk, heads, eps)
    dqkv = cp.asarray(qkv)
    qn, kn, kq = delta.delta_qk(cp, dqkv, hk, dk, eps)
    assert_close(qn.get(), q, 1e-6, 1e-5, "q")
    assert_close(kn.get(), k, 1e-6, 1e-5, "k")
    assert_close(kq.get(), (q.astype(np.float64) * k).sum(-1), 1e-6, 1e-5, "k.q")
    s, out = cp.asarray(s0), poisoned((t, hv * dk))
    delta.delta_rule_into(qn, kn, kq, dqkv, cp.asarray(a), cp.asarray(b), cp.asarray(ssm_a), cp.asarray(dt), s, out,
                          heads == "grouped")
    assert_close(out.get(), want, 1e-4, 1e-3, "out")
    assert_close(s.get(), want_s, 1e-4, 1e-3, "state")


@pytest.mark.parametrize("rows,d", [(1, 16), (7, 128), (65, 40), (130, 256)])
def test_gated_norm_and_sigmoid_gate(rows, d) -> None:
    rng = np.random.default_rng(rows + d)
    x = rng.standard_normal((rows, 3, d)).astype(np.float32)
    z = (3 * rng.standard_normal((rows, 3, d))).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    be, ref = CudaBackend(use_graph=False), NumpyBackend()
    got = be.gated_norm(cp.asarray(x), cp.asarray(w), cp.asarray(z), 1e-6)
    assert_close(got.get(), ref.gated_norm(x, w, z, 1e-6), 1e-5, 1e-4, "gated norm")
    flat, zf = x.reshape(rows, -1), (10 * rng.standard_normal((rows, 3 * d))).astype(np.float32)
    got = be.sigmoid_gate(cp.asarray(flat), cp.asarray(zf))
    assert_close(got.get(), ref.sigmoid_gate(flat, zf), 1e-6, 1e-5, "gate [T, N]")
    one = zf[:, :1].copy()  # a gate for each row (the shared expert's)
    got = be.sigmoid_gate(cp.asarray(flat), cp.asarray(one))
    assert_close(got.get(), ref.sigmoid_gate(flat, one), 1e-6, 1e-5, "gate [T, 1]")


# -- the operations over a slot's states ----------------------------------------------------------------------------


def delta_cfg(hk: int, hv: int, dk: int, k: int, heads: tuple[str, ...]) -> ModelConfig:
    """A model of delta-net layers only (one per entry of `heads`), for the Conv and DeltaRule operations."""
    return ModelConfig(
        architecture="qwen35", name="t", n_layer=len(heads), n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128,
        vocab_size=100, context_length=4096, rope_type=ROPE_NEOX, rope_dim=16, rope_freq_base=1e7,
        rope_scaling="none", rope_scaling_factor=1.0, rope_original_context=4096, rope_attn_factor=1.0, rms_eps=1e-6,
        tied_embeddings=False, bos_token_id=None, eos_token_id=None,
        layers=tuple(LayerPlan(mixer="delta_net", ssm_heads=h) for h in heads), ssm_conv_kernel=k, ssm_state_size=dk,
        ssm_group_count=hk, ssm_time_step_rank=hv, ssm_inner_size=hv * dk)


def delta_backends(cfg: ModelConfig, ctx: int, rng) -> tuple[CudaBackend, NumpyBackend]:
    """Both backends over the same random delta-net weights (no file: conv taps, dt, A, the output norm)."""
    layers = []
    for _ in range(cfg.n_layer):
        hv = cfg.ssm_time_step_rank
        layers.append(dict(attn_norm=np.ones(cfg.n_embd, np.float32),
                           ssm_conv1d=(0.5 * rng.standard_normal((cfg.ssm_conv_dim, cfg.ssm_conv_kernel))).astype(np.float32),
                           ssm_dt=rng.standard_normal(hv).astype(np.float32),
                           ssm_a=(-np.exp(rng.uniform(-2, 1, hv))).astype(np.float32),
                           ssm_norm=rng.standard_normal(cfg.ssm_state_size).astype(np.float32)))
    theta = rope_tables.inv_freq(cfg, None, ctx)
    ref = NumpyBackend()
    ref.adopt(cfg, ctx, ModelWeights(None, [LayerWeights(**L) for L in layers], None, None), theta, theta)
    be = CudaBackend(use_graph=False)
    dev = ModelWeights(None, [LayerWeights(**{n: cp.asarray(v) for n, v in L.items()}) for L in layers], None, None)
    be.attach(DeviceModel(cfg, ctx, dev, (), cp.asarray(theta.astype(np.float64))))
    return be, ref


def run_layers(be, ref, cfg, start, t, rng, stale_pos=False):
    """Each layer's Conv then DeltaRule over t tokens at `start` (random inputs), as block.run orders them; the outputs
    compared. `stale_pos`: the CUDA backend's positions are not the last it made (the first is read from the device)."""
    hv, c = cfg.ssm_time_step_rank, cfg.ssm_conv_dim
    for i, plan in enumerate(cfg.layers):
        x = rng.standard_normal((t, c)).astype(np.float32)
        pos = be.positions(start, t)
        if stale_pos:
            be.positions(0, 1)
        got = be.conv(Conv(i), cp.asarray(x), pos)
        want = ref.conv(Conv(i), x, ref.positions(start, t))
        assert_close(got.get(), want, 1e-5, 1e-4, f"conv {i} at {start}+{t}")
        qkv = rng.standard_normal((t, c)).astype(np.float32)
        a, b = (rng.standard_normal((t, hv)).astype(np.float32) for _ in "ab")
        op = DeltaRule(i, plan.ssm_heads)
        got = be.delta_rule(op, cp.asarray(qkv), cp.asarray(a), cp.asarray(b), be.positions(start, t))
        want = ref.delta_rule(op, qkv, a, b, ref.positions(start, t))
        assert_close(got.get(), want, 2e-4, 2e-3, f"delta rule {i} at {start}+{t}")


@pytest.mark.parametrize("hk,hv,dk,k", [(2, 6, 40, 4), (2, 4, 16, 4), (4, 8, 128, 4), (1, 2, 24, 1)])
def test_conv_and_delta_rule_carry_store_and_resume_the_state(hk, hv, dk, k) -> None:
    """Passes of 7, 1, 1, 64, 65 and 130 tokens (past SNAPSHOT_EVERY inside the last), each layer's Conv and
    DeltaRule against the NumPy backend's, the state carried from pass to pass; the positions stored (snapshots) are
    the reference's; a pass resumed from each stored state gives the reference's outputs; a pass where the state does
    not stand is refused."""
    cfg = delta_cfg(hk, hv, dk, k, ("tiled", "grouped", "tiled"))
    rng = np.random.default_rng(dk + k)
    be, ref = delta_backends(cfg, 1024, rng)
    assert be.op_path and be.delta is not None
    start = 0
    for n, t in enumerate([7, 1, 1, 64, 65, 130]):
        run_layers(be, ref, cfg, start, t, rng, stale_pos=n == 2)
        start += t
        assert be.snapshots(0) == ref.snapshots(0)
    held = sorted(ref.snapshots(0))
    assert SNAPSHOT_EVERY in held and start in held
    for p in reversed(held):  # (the latest first: resuming at a position forgets those past it)
        be.resume(0, p)
        ref.resume(0, p)
        run_layers(be, ref, cfg, p, 20, rng)
        assert be.snapshots(0, p + 20) == ref.snapshots(0, p + 20)
    with pytest.raises(BackendError, match="stands at position"):
        be.conv(Conv(0), cp.zeros((1, cfg.ssm_conv_dim), cp.float32), be.positions(3, 1))
    with pytest.raises(BackendError, match="no recurrent state is stored at position 5"):
        be.resume(0, 5)


# -- whole models -----------------------------------------------------------------------------------------------------


def loaded(path, backend, ctx=512):
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    check_tensors(g, cfg, backend.runnable_types)
    backend.load(g, cfg, ctx)
    return cfg, backend


def greedy(logits: bool = True, speculative: bool = False) -> Sampler:
    return Sampler(SamplingParams(temperature=0.0), make_rng(0), [], logits=logits, speculative=speculative)


# Head dim 256 with 64 dims rotating and d_k = d_v = 128, as in the released Qwen3.5 files (the tensor-core prefill
# attention, attention_split in decode, full column tiles of the rule)
QWEN35_D256 = variant("tiny-qwen35", head_dim=256, rope_dim=64, ssm_state_size=128, name="qwen35-d256")
QWEN3NEXT_GROUPED = variant("tiny-qwen3next", ssm_time_step_rank=6, name="qwen3next-hv6")
MODEL_CASES = [("tiny-qwen35", QT.F32), ("tiny-qwen35", QT.Q8_0), ("tiny-qwen35moe", QT.F32),
               ("tiny-qwen35moe", "Q4_K_M"), ("tiny-qwen3next", QT.F32), ("tiny-qwen3next", QT.Q8_0),
               (QWEN35_D256, QT.Q8_0), (QWEN3NEXT_GROUPED, QT.F32)]


@pytest.mark.parametrize("shape,qtype", MODEL_CASES, ids=case_id)
def test_hybrid_logits_and_greedy_ids_match_numpy(random_model, shape, qtype) -> None:
    """Every position's logits of a 13-token prompt (block.run) within the CUDA backend's tolerance of the reference,
    and 32 greedy ids through the step contract equal (the decode op by op, the argmax on the host)."""
    path = random_model(shape, qtype)
    cfg, ref = loaded(path, NumpyBackend())
    check_logits_and_greedy_ids(cfg, ref, loaded(path, CudaBackend())[1])


@pytest.mark.parametrize("shape", ["tiny-qwen35", "tiny-qwen3next"])
def test_a_prompt_in_chunks_gives_the_one_pass_logits(random_model, shape) -> None:
    """A 150-token prompt in passes of 64 (and 7) tokens gives the logits of one pass, on CUDA as on the reference."""
    path = random_model(shape, QT.F32)
    cfg, ref = loaded(path, NumpyBackend())
    _, be = loaded(path, CudaBackend())
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, size=150).tolist()
    want = ref.step([SeqStep(prompt, 0, greedy())])[0].logits
    whole = be.step([SeqStep(prompt, 0, greedy())])[0].logits
    assert rel_l2(whole, want) <= 1e-2
    for chunk in (64, 7):
        be.prefill_chunk = chunk
        got = be.step([SeqStep(prompt, 0, greedy())])[0].logits
        assert rel_l2(got, want) <= 1e-2 and rel_l2(got, whole) <= 1e-2


@pytest.mark.parametrize("shape", ["tiny-qwen35", "tiny-qwen35moe", "tiny-qwen3next"])
def test_a_prompt_resumed_from_a_stored_state_matches_numpy(random_model, shape) -> None:
    """The same steps on both backends (models/seq_cache.py's contract): a prompt of 300 stores its states at 256 and
    300, decode steps store theirs; prompts resumed at 300 and at 256 give the reference's logits (and those of the
    whole prompt from 0), the same positions held after each step; a prompt at a position with no stored state is
    refused on both."""
    path = random_model(shape, QT.F32)
    cfg, ref = loaded(path, NumpyBackend())
    _, be = loaded(path, CudaBackend())
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=SNAPSHOT_EVERY + 44).tolist()

    def both(seq: SeqStep, s_ref: Sampler):
        got = be.step([seq])[0]
        want = ref.step([SeqStep(seq.tokens, seq.start, s_ref, seq.slot)])[0]
        assert got.snapshots == want.snapshots
        assert rel_l2(got.logits, want.logits) <= 1e-2
        return got

    s, r = greedy(), greedy()
    first = both(SeqStep(ids[:300], 0, s), r)
    assert first.snapshots == {SNAPSHOT_EVERY, 300}
    both(SeqStep([7], 300, s), r)
    out = both(SeqStep([8], 301, s), r)
    assert out.snapshots == {SNAPSHOT_EVERY, 300, 302}
    fresh = CudaBackend()
    loaded(path, fresh)
    for start in (300, SNAPSHOT_EVERY):
        rest = ids[start:] + [5, 6, 7]
        resumed = both(SeqStep(rest, start, greedy()), greedy())
        whole = fresh.step([SeqStep(ids[:start] + rest, 0, greedy())])[0]
        assert rel_l2(resumed.logits, whole.logits) <= 1e-2
    for backend in (be, ref):
        with pytest.raises(BackendError, match="no recurrent state is stored at position 100"):
            backend.step([SeqStep([1, 2], 100, greedy())])


@pytest.mark.parametrize("shape", ["tiny-qwen35", "tiny-qwen3next"])
def test_several_slots_in_one_step_match_numpy(random_model, shape) -> None:
    """Three cache slots: prompts of 5, 40 and 17 tokens in one step, then decode steps of all three together (one
    sequence leaving after four and a new one taking its slot): each sequence's ids and logits are the reference's
    under the same schedule (the slots' recurrent states and KV rows kept apart)."""
    path = random_model(shape, QT.Q8_0)
    cfg, ref = loaded(path, NumpyBackend())
    _, be = loaded(path, CudaBackend())
    check_slots_schedule(cfg, ref, be, snapshots=True)


def test_a_rejected_draft_leaves_the_states_of_plain_decode(random_model) -> None:
    """A verification (speculative decoding) whose drafts go wrong after the first two: its rows are the plain decode's
    logits, and after the rollback (the state stored before it restored, the two accepted ids run again) every later
    step's logits are the plain decode's (the NumPy reference's)."""
    path = random_model("tiny-qwen35", QT.F32)
    cfg, ref = loaded(path, NumpyBackend())
    _, be = loaded(path, CudaBackend())
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, size=9).tolist()
    p = len(prompt)
    rs = greedy()
    plain, want = [ref.step([SeqStep(prompt, 0, rs)])[0].id], []
    for i in range(8):
        out = ref.step([SeqStep([plain[-1]], p + i, rs)])[0]
        plain.append(out.id)
        want.append(out.logits)
    s = greedy(speculative=True)
    assert be.step([SeqStep(prompt, 0, s)])[0].id == plain[0]
    drafts = plain[1:3] + [(plain[3] + 1) % cfg.vocab_size, plain[4]]  # two right, then wrong
    out = be.step([SeqStep([plain[0], *drafts], p, s)])[0]
    assert out.logits.shape == (5, cfg.vocab_size)
    for i in range(3):
        assert rel_l2(out.logits[i], want[i]) <= 1e-2
    for i in range(3, 8):  # the engine took two drafts and plain[3]: the next step is that id at p + 3
        got = be.step([SeqStep([plain[i]], p + i, s)])[0]
        assert rel_l2(got.logits, want[i]) <= 1e-2


def test_bench_profile_runs_a_hybrid_model(random_model) -> None:
    """bench --profile on a hybrid model (engine/bench.py run_profile): the op-by-op decode step profiled, and the
    timed decode steps each starting again from the state stored at the prompt's end."""
    from llamacli.engine.bench import run_profile
    from llamacli.engine.generate import Model

    m = Model(random_model("tiny-qwen35", QT.Q8_0), backend="cuda", ctx=256)
    try:
        rows, spans, _ = run_profile(m, 16)
    finally:
        m.close()
    assert {r.family for r in rows} >= {"delta net"} and spans["decode step, graph replay"] > 0
