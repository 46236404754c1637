"""Chunked prefill in the scheduler (engine/scheduler.py), on the NumPy backend: a prompt longer than what is left of
the turn's prefill budget runs in prefill-only parts (SeqStep.fill) of at most the budget, one part per turn, the
running sequences taking their decode step every turn between; its first id comes from its last part.

The steps the backend saw are recorded (a wrapper around Backend.step), so the interleaving and the parts' bounds are
read off them. Outputs are compared with the same request run alone through Model.run (no scheduler: its prompt in
one step): the same ids, logprobs within float error (the parts are other passes: BLAS sums in another order).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from threadrun import drain

from llamacli.engine.generate import Completion, Model
from llamacli.engine.scheduler import Scheduler

SLOTS = 2
CTX = 160


@pytest.fixture(scope="module")
def model(path):
    return Model(path, backend="numpy", ctx=CTX, slots=SLOTS)


@pytest.fixture(scope="module")
def ref(path):
    return Model(path, backend="numpy", ctx=CTX)


@pytest.fixture
def steps(model, monkeypatch):
    """The steps the backend runs, as (slot, fill, start, n tokens) per sequence; model.seqs cleared first (each
    test's prompts start from 0)."""
    for seq in model.seqs:
        seq.clear()
    seen: list[list[tuple[int, bool, int, int]]] = []
    real = model.backend.step

    def recorded(batch):
        seen.append([(s.slot, s.fill, s.start, len(s.tokens)) for s in batch])
        return real(batch)

    monkeypatch.setattr(model.backend, "step", recorded)
    return seen


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 30000, size=n).tolist()




def alone(ref, prompt, kw) -> Completion:
    ref.seq.clear()
    c = Completion()
    drain(ref.run(prompt, completion=c, **kw))
    assert c.timings.cached_tokens == 0
    return c


def same(got: Completion, want: Completion, tol: float = 1e-4) -> None:
    assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
    for x, y in zip(got.logprobs or [], want.logprobs or []):
        assert [e["id"] for e in x["top_logprobs"]] == [e["id"] for e in y["top_logprobs"]]
        assert abs(x["logprob"] - y["logprob"]) <= tol


def prompt_steps(seen, slot: int) -> list[tuple[bool, int, int]]:
    """(fill, start, n) of each prompt-ish step of `slot` (a part, or a step of more than one token)."""
    return [(f, st, n) for batch in seen for (s, f, st, n) in batch if s == slot and (f or n > 1)]


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_long_prompt_joins_in_parts_while_another_streams(model, ref, steps, kw):
    """A 50-id prompt joins while a request streams (budget 8): it runs as parts of 8 from position 0 on, each turn
    beside the streaming request's decode step, its first id from its last part (2 ids); both get what they get
    alone."""
    kw = dict(max_tokens=24, ignore_eos=True, logprobs=2, **kw)
    short, long = ids(4, 1), ids(50, 2)
    want_short, want_long = alone(ref, short, kw), alone(ref, long, dict(kw, max_tokens=6))
    sched = Scheduler(model, prefill_budget=8)
    a, b = Completion(), Completion()
    try:
        g = model.run(short, completion=a, scheduler=sched, **kw)
        next(g)  # streaming, in its slot
        rest: dict = {}
        t = threading.Thread(target=lambda: rest.update(out=drain(g)))
        t.start()
        drain(model.run(long, completion=b, scheduler=sched, **dict(kw, max_tokens=6)))
        t.join(60)
    finally:
        sched.close()
    same(a, want_short)
    same(b, want_long)
    assert b.timings.prompt_tokens == 50
    slot_a = next(s for batch in steps for (s, f, st, n) in batch if n == 4)
    slot_b = 1 - slot_a
    assert prompt_steps(steps, slot_b) == [(True, st, 8) for st in range(0, 48, 8)] + [(False, 48, 2)]
    # the turns from its first part to its last: a's decode step beside each (a's consumer keeps up) or nearly
    first = next(i for i, batch in enumerate(steps) if any(s == slot_b for s, *_ in batch))
    last = max(i for i, batch in enumerate(steps) if (slot_b, False, 48, 2) in batch)
    decodes = [i for i in range(first, last + 1) for (s, f, st, n) in steps[i] if s == slot_a and n == 1 and not f]
    assert len(decodes) >= 3, steps[first : last + 1]


@pytest.mark.parametrize("budget, n", [(1, 1), (1, 2), (1, 5), (3, 2), (3, 3), (3, 4), (3, 10), (7, 6), (7, 7),
                                       (7, 8), (7, 15), (7, 22)])
def test_parts_at_odd_budgets(model, ref, steps, budget, n):
    """A prompt of n ids alone at a budget: parts of the budget from 0 on while more than the budget remains, the
    rest (1..budget ids) the prompt step; the ids are those of the whole prompt."""
    prompt = ids(n, 10 + n)
    kw = dict(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    sched = Scheduler(model, prefill_budget=budget)
    c = Completion()
    try:
        drain(model.run(prompt, completion=c, scheduler=sched, **kw))
    finally:
        sched.close()
    same(c, alone(ref, prompt, kw))
    slot = steps[0][0][0]
    whole = (n - 1) // budget  # parts before the last
    want = [(True, i * budget, budget) for i in range(whole)]
    last = n - whole * budget
    got = [(f, st, k) for batch in steps for (s, f, st, k) in batch if s == slot][: whole + 1]
    assert got == want + [(False, whole * budget, last)]


def test_a_request_cancelled_between_parts_frees_its_slot_and_the_prefix_cache_keeps_what_ran(path, ref):
    """Cancelled after its second part of 16 (of a 60-id prompt): it ends "cancelled" with no id, its slot is freed,
    and the slot's record and the prefix cache hold the 32 ids whose rows the slot holds; the same prompt resent
    (that slot's record cleared, so another slot takes it) gets those 32 from the cache, runs the rest in parts (only the prefilled ids counted against the budget), and
    gets the ids of the whole prompt."""
    m = Model(path, backend="numpy", ctx=CTX, slots=SLOTS)
    cache = m.enable_prefix_cache()
    prompt = ids(60, 20)
    kw = dict(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    sched = Scheduler(m, prefill_budget=16)
    real, seen = m.backend.step, []
    c = Completion()

    def step(batch):
        seen.append([(s.slot, s.fill, s.start, len(s.tokens)) for s in batch])
        outs = real(batch)
        if any(s.fill and s.start == 16 for s in batch):
            c.cancel()  # (the client leaves while its prompt is under way)
        return outs

    m.backend.step = step
    try:
        assert drain(m.run(prompt, completion=c, scheduler=sched, **kw)) == []
        assert c.finish_reason == "cancelled" and c.tokens == []
        for _ in range(100):
            if sched.load["free_slots"] == SLOTS:
                break
            threading.Event().wait(0.02)
        assert sched.load == {"running": 0, "waiting": 0, "free_slots": SLOTS}
        slot = seen[0][0][0]
        assert [b for b in seen if b[0][0] == slot] == [[(slot, True, 0, 16)], [(slot, True, 16, 16)]]
        assert m.seqs[slot].ids == prompt[:32] and cache.tokens == 32
        m.seqs[slot].clear()
        seen.clear()
        got = Completion()
        drain(m.run(prompt + [7, 8, 9], completion=got, scheduler=sched, **kw))
    finally:
        sched.close()
        del m.backend.step
    assert got.timings.prefix_cached_tokens == got.timings.cached_tokens == 32 and got.timings.prompt_tokens == 31
    again = seen[0][0][0]
    assert again != slot
    assert prompt_steps(seen, again) == [(True, 32, 16), (False, 48, 15)]
    same(got, alone(ref, prompt + [7, 8, 9], kw))


def test_a_failing_part_fails_its_request_alone(model, ref, steps, monkeypatch):
    """A part that raises fails its request; the request streaming beside it finishes as it would alone, and the
    same prompt sent again (the slot's record holding only the parts that ran) gets the whole prompt's ids."""
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    short, long = ids(3, 30), ids(40, 31)
    want = alone(ref, short, kw)
    sched = Scheduler(model, prefill_budget=6)
    real = model.backend.step

    def flaky(batch):
        if any(s.fill and s.start == 12 for s in batch):
            raise RuntimeError("a part fell over")
        return real(batch)

    monkeypatch.setattr(model.backend, "step", flaky)
    a = Completion()
    try:
        g = model.run(short, completion=a, scheduler=sched, **kw)
        next(g)
        rest: dict = {}
        t = threading.Thread(target=lambda: rest.update(out=drain(g)))
        t.start()
        with pytest.raises(RuntimeError, match="fell over"):
            drain(model.run(long, completion=Completion(), scheduler=sched, **kw))
        t.join(60)
        same(a, want)
        monkeypatch.setattr(model.backend, "step", real)
        c = Completion()
        drain(model.run(long, completion=c, scheduler=sched, **kw))
    finally:
        sched.close()
    same(c, alone(ref, long, kw))
    assert c.timings.prompt_tokens == 28  # its slot again (it keeps most), past the two parts that ran


def test_a_backend_that_runs_prompts_whole_gets_them_whole(model, ref, steps, monkeypatch):
    """Backend.fill_steps False (CUDA's today): the prompt's step runs whole, however long against the budget."""
    monkeypatch.setattr(model.backend, "fill_steps", False)
    prompt = ids(20, 40)
    kw = dict(max_tokens=3, temperature=0.0, ignore_eos=True)
    sched = Scheduler(model, prefill_budget=4)
    c = Completion()
    try:
        drain(model.run(prompt, completion=c, scheduler=sched, **kw))
    finally:
        sched.close()
    same(c, alone(ref, prompt, kw))
    assert [st for batch in steps for st in batch if st[3] > 1] == [(steps[0][0][0], False, 0, 20)]


def test_a_prefill_budget_below_one_is_refused(model):
    with pytest.raises(ValueError, match="prefill budget"):
        Scheduler(model, prefill_budget=0)


def test_a_recurrent_model_in_parts(random_model):
    """Gated DeltaNet layers (tiny-qwen35): each part resumes from the state the part before stored at its end;
    the ids are the whole prompt's."""
    path = random_model("tiny-qwen35", "F32")
    prompt = np.random.default_rng(9).integers(3, 200, size=23).tolist()
    kw = dict(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    want = Completion()
    drain(Model(path, backend="numpy", ctx=64).run(prompt, completion=want, **kw))
    m = Model(path, backend="numpy", ctx=64, slots=2)
    real, seen = m.backend.step, []
    m.backend.step = lambda batch: seen.extend((s.fill, s.start, len(s.tokens)) for s in batch) or real(batch)
    sched = Scheduler(m, prefill_budget=5)
    c = Completion()
    try:
        drain(m.run(prompt, completion=c, scheduler=sched, **kw))
    finally:
        sched.close()
    same(c, want)
    assert c.timings.prompt_tokens == 23
    assert seen[:5] == [(True, st, 5) for st in range(0, 20, 5)] + [(False, 20, 3)]
