"""The step contract (backends/step.py, Backend.step) on the NumPy backend: a sequence's first step prefills its
prompt and picks the first id from the last logits; each later step decodes one token; the ids are those of
the plain forward pass and the host sampler, draw for draw. (The CUDA backend runs the same contract through
its fused steps: tests/backends/cuda/test_gpu_backend.py compares generations across backends.)"""

from __future__ import annotations

import numpy as np
import pytest

from llamacli.backends.numpy_backend import NumpyBackend
from llamacli.backends.step import Sampler, SeqStep
from llamacli.errors import BackendError
from llamacli.ggufio.file import open_gguf
from llamacli.models import block
from llamacli.models.config import ModelConfig
from llamacli.sampling.sampling import SamplingParams, make_rng, sample
from llamacli.sampling.structured import pack_words


def backend(path, ctx=64) -> NumpyBackend:
    g = open_gguf(path)
    be = NumpyBackend()
    be.load(g, ModelConfig.from_gguf(g.metadata, set(g.tensors)), ctx)
    return be


def reference(path, prompt, n, params, seed):
    """The ids of `n` steps by hand: block.run over the prompt, then over one token at a time, each id drawn
    by sampling.sample from its own generator."""
    be = backend(path)
    rng, history = make_rng(seed), list(prompt)
    logits = block.run(be, be.cfg, be.token_ids(np.asarray(prompt)), be.positions(0, len(prompt)))
    ids = []
    for _ in range(n):
        tok = sample(be.to_host(logits)[-1], params, rng, history)
        ids.append(tok)
        history.append(tok)
        pos = len(prompt) + len(ids) - 1
        logits = block.run(be, be.cfg, be.token_ids(np.asarray([tok])), be.positions(pos, 1))
    return ids


def stepped(be, prompt, n, sampler, keep=0):
    """`n` ids through Backend.step: the prompt's step (its tokens from `keep` on), then n - 1 decode steps."""
    out = be.step([SeqStep(prompt[keep:], keep, sampler)])
    ids = [out[0].id]
    sampler.history.append(ids[-1])
    for i in range(n - 1):
        out = be.step([SeqStep([ids[-1]], len(prompt) + i, sampler)])
        ids.append(out[0].id)
        sampler.history.append(ids[-1])
    return ids


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3),
    SamplingParams(temperature=0.7, top_k=0, min_p=0.05, repeat_penalty=1.3, seed=5),
])
def test_steps_give_the_forward_pass_and_the_sampler_ids(random_model, params) -> None:
    path = random_model("tiny-llama", "F32")
    prompt = [5, 9, 2, 40, 7, 7, 1]
    want = reference(path, prompt, 12, params, params.seed)
    be = backend(path)
    got = stepped(be, prompt, 12, Sampler(params, make_rng(params.seed), list(prompt)))
    assert got == want


def test_a_new_sampler_starts_a_new_sequence_over_a_kept_prefix(random_model) -> None:
    """A second generation (a new Sampler) whose prompt extends the cached ids prefills only the rest, and
    gives the ids a fresh backend gives for the whole prompt."""
    path = random_model("tiny-llama", "F32")
    params = SamplingParams(temperature=0.0)
    be = backend(path)
    first = stepped(be, [3, 4, 5], 4, Sampler(params, make_rng(0), [3, 4, 5]))
    prompt = [3, 4, 5] + first[:3] + [11, 12]
    again = stepped(be, prompt, 5, Sampler(params, make_rng(0), list(prompt)), keep=6)
    assert again == stepped(backend(path), prompt, 5, Sampler(params, make_rng(0), list(prompt)))


def test_logits_and_masks_come_through_the_step(random_model) -> None:
    """A sampler that asks for logits gets each step's raw logits (those of the forward pass), and a mask keeps
    every id inside it, with the logits and without."""
    path = random_model("tiny-llama", "F32")
    be = backend(path)
    vocab = be.cfg.vocab_size
    allowed = np.zeros(vocab, bool)
    allowed[[7, 19, 23]] = True
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, seed=2), make_rng(2), [1, 2], mask=lambda: pack_words(allowed),
                logits=True)
    out = be.step([SeqStep([1, 2], 0, s)])[0]
    ref = backend(path)
    want = ref.to_host(block.run(ref, ref.cfg, ref.token_ids(np.asarray([1, 2])), ref.positions(0, 2)))[-1]
    np.testing.assert_allclose(out.logits, want, rtol=1e-5, atol=1e-6)
    ids = [out.id]
    for i in range(6):
        ids.append(be.step([SeqStep([ids[-1]], 2 + i, s)])[0].id)
    assert set(ids) <= {7, 19, 23}
    masked = stepped(be, [1, 2, 3], 8, Sampler(SamplingParams(temperature=1.0, top_k=0, seed=4), make_rng(4), [1, 2, 3],
                                              mask=lambda: pack_words(allowed)))
    assert set(masked) <= {7, 19, 23}


def test_the_contract_refuses_what_this_backend_cannot_run(random_model) -> None:
    be = backend(random_model("tiny-llama", "F32"))
    s = Sampler(SamplingParams(temperature=0.0), make_rng(0), [1])
    with pytest.raises(BackendError, match="one sequence per cache slot"):
        be.step([SeqStep([1], 0, s), SeqStep([2], 0, Sampler(s.params, make_rng(0), [2]))])
    with pytest.raises(BackendError, match=r"slots 0\.\.0 \(got slots \[1\]\)"):
        be.step([SeqStep([1], 0, s, slot=1)])
    be.step([SeqStep([1, 2], 0, s)])
    with pytest.raises(BackendError, match="one token"):
        be.step([SeqStep([3, 4], 2, s)])
    with pytest.raises(BackendError, match="next position 2"):
        be.step([SeqStep([3], 5, s)])
    be.step([SeqStep([3], 2, s)])
    other = Sampler(s.params, make_rng(0), [9])
    be.step([SeqStep([9], 0, other)])  # another sequence takes the cache
    with pytest.raises(BackendError, match="no longer holds this sequence"):
        be.step([SeqStep([4], 3, s)])


def test_a_failed_step_leaves_the_sequence_to_start_again(random_model, monkeypatch) -> None:
    be = backend(random_model("tiny-llama", "F32"))
    s = Sampler(SamplingParams(temperature=0.0), make_rng(0), [1, 2])
    first = be.step([SeqStep([1, 2], 0, s)])[0].id

    def broken(token, pos):
        raise KeyboardInterrupt

    monkeypatch.setattr(be, "decode", broken)
    with pytest.raises(KeyboardInterrupt):
        be.step([SeqStep([first], 2, s)])
    monkeypatch.undo()
    with pytest.raises(BackendError, match="start it again"):
        be.step([SeqStep([first], 2, s)])
    again = Sampler(s.params, make_rng(0), [1, 2])
    assert be.step([SeqStep([1, 2], 0, again)])[0].id == first


def test_sequences_in_their_own_slots_step_as_they_would_alone(random_model) -> None:
    """Four sequences in four cache slots, stepped together (their prompts of different lengths, then decode
    steps in one batch, one of them joining late): each gets the ids and logits it gets alone in slot 0, and a
    sequence's cache is its slot's (the others' steps do not disturb it)."""
    path = random_model("tiny-llama", "F32")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 200, size=n).tolist() for n in (5, 1, 12, 7)]

    def alone(ids: list[int], n: int) -> list[tuple[int, np.ndarray]]:
        be = backend(path)
        s = Sampler(SamplingParams(temperature=0.8, seed=11), make_rng(11), list(ids), logits=True)
        out = be.step([SeqStep(ids, 0, s)])[0]
        got = [(out.id, out.logits)]
        for i in range(n - 1):
            out = be.step([SeqStep([got[-1][0]], len(ids) + i, s)])[0]
            got.append((out.id, out.logits))
        return got

    want = [alone(p, 6) for p in prompts]
    be = backend(path)
    be.set_slots(4)
    samplers = [Sampler(SamplingParams(temperature=0.8, seed=11), make_rng(11), list(p), logits=True) for p in prompts]
    got: list[list[tuple[int, np.ndarray]]] = [[] for _ in prompts]
    for slot in (0, 1, 2):  # the prompts of three, then their decode steps together; the fourth joins later
        out = be.step([SeqStep(prompts[slot], 0, samplers[slot], slot=slot)])[0]
        got[slot].append((out.id, out.logits))
    for rnd in range(5):
        batch = [SeqStep([got[i][-1][0]], len(prompts[i]) + len(got[i]) - 1, samplers[i], slot=i)
                 for i in range(3) if len(got[i]) < 6]
        if rnd == 1:
            batch.append(SeqStep(prompts[3], 0, samplers[3], slot=3))
        elif rnd > 1:
            batch.append(SeqStep([got[3][-1][0]], len(prompts[3]) + len(got[3]) - 1, samplers[3], slot=3))
        for seq, out in zip(batch, be.step(batch)):
            got[seq.slot].append((out.id, out.logits))
    for i in range(4):
        n = min(len(got[i]), 6)
        assert [t for t, _ in got[i][:n]] == [t for t, _ in want[i][:n]], i
        for (_, a), (_, b) in zip(got[i][:n], want[i][:n]):
            np.testing.assert_array_equal(a, b)  # the same arithmetic whatever else ran: bit for bit
    with pytest.raises(BackendError, match="no longer holds this sequence"):  # a new sequence takes slot 2
        other = Sampler(SamplingParams(temperature=0.0), make_rng(0), [5])
        be.step([SeqStep([5], 0, other, slot=2)])
        be.step([SeqStep([got[2][-1][0]], len(prompts[2]) + 5, samplers[2], slot=2)])
    be.set_slots(2)  # fewer slots: slot 0's cache and sequence stay
    with pytest.raises(BackendError, match="slots 0..1"):
        be.step([SeqStep([1], 0, Sampler(SamplingParams(), make_rng(0), [1]), slot=3)])


def filled(be, prompt, parts, sampler, slot=0, keep=0):
    """The prompt from `keep` on in prefill-only steps of the sizes `parts` (SeqStep.fill), then the prompt step of
    the rest -> that step's StepOut; each part chooses nothing and leaves the sampler not started."""
    at = keep
    for n in parts:
        out = be.step([SeqStep(prompt[at : at + n], at, sampler, slot=slot, fill=True)])[0]
        assert out.id == -1 and out.logits is None and out.choices is None
        assert sampler.position == -1
        at += n
    return be.step([SeqStep(prompt[at:], at, sampler, slot=slot)])[0]


@pytest.mark.parametrize("parts", [[1], [3, 3], [7], [1, 1, 1, 1, 1], [10, 2]])
def test_a_prompt_in_prefill_only_parts_gives_the_whole_prompts_logits(random_model, parts) -> None:
    """Prefill-only parts of a prompt write its K/V and choose nothing; the prompt step of the rest, from where they
    ended, gives the logits (and then the ids) of the whole prompt in one step."""
    path = random_model("tiny-llama", "F32")
    prompt = np.random.default_rng(5).integers(0, 200, size=13).tolist()
    params = SamplingParams(temperature=0.8, top_k=30, seed=7)

    def run(parts):
        be = backend(path)
        s = Sampler(params, make_rng(7), list(prompt), logits=True)
        out = filled(be, prompt, parts, s) if parts else be.step([SeqStep(prompt, 0, s)])[0]
        assert s.position == len(prompt)
        ids = [out.id]
        for i in range(5):
            s.history.append(ids[-1])
            ids.append(be.step([SeqStep([ids[-1]], len(prompt) + i, s)])[0].id)
        return out.logits, ids

    logits, ids = run(parts)
    whole_logits, whole_ids = run([])
    np.testing.assert_allclose(logits, whole_logits, rtol=0, atol=1e-5 * float(np.abs(whole_logits).max()))
    assert ids == whole_ids


def test_prefill_only_steps_are_refused_where_they_cannot_run(random_model) -> None:
    be = backend(random_model("tiny-llama", "F32"), ctx=16)
    s = Sampler(SamplingParams(temperature=0.0), make_rng(0), [1, 2, 3])
    with pytest.raises(BackendError, match="room for the prompt's last part"):  # the context's last position
        be.step([SeqStep(list(range(16)), 0, s, fill=True)])
    with pytest.raises(BackendError, match="room for the prompt's last part"):
        be.step([SeqStep([], 0, s, fill=True)])
    first = be.step([SeqStep([1, 2, 3], 0, s)])[0].id
    with pytest.raises(BackendError, match="before the sequence's prompt step"):  # a started sampler
        be.step([SeqStep([first], 3, s, fill=True)])
    other = Sampler(s.params, make_rng(0), [9, 8])
    be.step([SeqStep([9], 0, other, fill=True)])  # another sequence's part takes the slot's cache
    with pytest.raises(BackendError, match="no longer holds this sequence"):
        be.step([SeqStep([first], 3, s)])
    be.fill_steps = False  # (a backend that runs prompts whole: CUDA's today)
    with pytest.raises(BackendError, match="takes no prefill-only steps"):
        be.step([SeqStep([8], 1, other, fill=True)])


def test_prefill_only_parts_in_their_own_slot_leave_the_others_alone(random_model) -> None:
    """A prompt's parts in slot 1 between another sequence's decode steps in slot 0 (as the scheduler interleaves
    them): both get the ids they get alone."""
    path = random_model("tiny-llama", "F32")
    a, b = [4, 8, 15, 16, 23], np.random.default_rng(2).integers(0, 200, size=11).tolist()
    params = SamplingParams(temperature=0.0)
    want_a = stepped(backend(path), a, 6, Sampler(params, make_rng(0), list(a)))
    want_b = stepped(backend(path), b, 3, Sampler(params, make_rng(0), list(b)))
    be = backend(path)
    be.set_slots(2)
    sa, sb = Sampler(params, make_rng(0), list(a)), Sampler(params, make_rng(0), list(b))
    got_a = [be.step([SeqStep(a, 0, sa)])[0].id]
    for i, at in enumerate((0, 4, 8)):  # b's parts of 4, 4, then its prompt step of 3, each beside a's decode step
        step = SeqStep(b[at : at + 4], at, sb, slot=1, fill=at < 8)
        outs = be.step([SeqStep([got_a[-1]], len(a) + i, sa), step])
        sa.history.append(got_a[-1])
        got_a.append(outs[0].id)
    got_b = [outs[1].id]
    while len(got_a) < 6 or len(got_b) < 3:
        batch = [SeqStep([got_a[-1]], len(a) + len(got_a) - 1, sa)] if len(got_a) < 6 else []
        if len(got_b) < 3:
            batch.append(SeqStep([got_b[-1]], len(b) + len(got_b) - 1, sb, slot=1))
        outs = be.step(batch)
        for seq, out in zip(batch, outs):
            mine = got_a if seq.sampler is sa else got_b
            seq.sampler.history.append(mine[-1])
            mine.append(out.id)
    assert got_a == want_a and got_b == want_b


def test_a_recurrent_models_prompt_in_parts_resumes_each_from_the_last(random_model) -> None:
    """Gated DeltaNet layers (tiny-qwen35): each part stores the state at its end, the slot's latest, which the next
    part (and the prompt step) resumes from; the logits are the whole prompt's (within float error: the delta
    rule's chunks fall elsewhere) and the prompt's end is a stored state as after a whole prompt."""
    path = random_model("tiny-qwen35", "F32")
    prompt = np.random.default_rng(9).integers(0, 200, size=30).tolist()
    be = backend(path)
    s = Sampler(SamplingParams(temperature=0.0), make_rng(0), list(prompt), logits=True)
    at = 0
    for n in (7, 11, 5):
        out = be.step([SeqStep(prompt[at : at + n], at, s, fill=True)])[0]
        at += n
        assert out.id == -1 and at in out.snapshots
    out = be.step([SeqStep(prompt[at:], at, s)])[0]
    assert len(prompt) in out.snapshots
    whole = backend(path).step([SeqStep(prompt, 0, Sampler(s.params, make_rng(0), list(prompt), logits=True))])[0]
    np.testing.assert_allclose(out.logits, whole.logits, rtol=0, atol=1e-4 * float(np.abs(whole.logits).max()))
    assert out.id == whole.id


def test_the_cpu_backend_takes_prefill_only_steps_too(random_model) -> None:
    """The CPU backend (the NumPy one with packed weights and compiled kernels) inherits the prefill-only step."""
    from llamacli.backends.cpu.backend import CpuBackend

    path = random_model("tiny-llama", "Q8_0")
    g = open_gguf(path)
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    prompt = np.random.default_rng(1).integers(3, 200, size=17).tolist()
    outs = []
    for parts in ([5, 5, 5], []):
        be = CpuBackend()
        be.load(g, cfg, 64)
        assert be.fill_steps
        s = Sampler(SamplingParams(temperature=0.0), make_rng(0), list(prompt), logits=True)
        outs.append(filled(be, prompt, parts, s))
    np.testing.assert_allclose(outs[0].logits, outs[1].logits, rtol=0, atol=1e-4 * float(np.abs(outs[1].logits).max()))
    assert outs[0].id == outs[1].id
