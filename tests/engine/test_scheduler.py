"""The scheduler (engine/scheduler.py): many generations at once in their own cache slots, on the NumPy backend.

A request's output must not depend on what else runs: each is compared with the same request run alone
through Model.run (greedy and seeded sampled, logprobs, stop strings, max_tokens), bit for bit on the logprobs
(the NumPy backend steps each sequence with the same arithmetic whatever the batch). And: more requests than
slots queue and all finish; a consumer that stops early frees its slot; a slot's cache serves a later prompt's
prefix; a full context ends with "length"; too many waiting is SchedulerBusy; close() ends what is left.
"""

from __future__ import annotations

import threading

import pytest
from threadrun import drain

from llamacli.engine.generate import Completion, Model
from llamacli.engine.scheduler import Scheduler, SchedulerBusy, SchedulerClosed

SLOTS = 4


@pytest.fixture(scope="module")
def model(path):
    return Model(path, backend="numpy", ctx=96, slots=SLOTS)


def requests():
    """(prompt, run() keyword arguments): greedy, seeded sampled, with logprobs, stop strings, short and long."""
    prompts = ["Once upon a time", "The quick brown fox", "In the beginning", "A B C D E F G", "Hello there",
               "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12", "Once upon a time there was", "x"]
    settings = [dict(temperature=0.0), dict(temperature=0.9, seed=5), dict(temperature=0.0, logprobs=3),
                dict(temperature=1.2, top_k=40, seed=11, logprobs=2), dict(temperature=0.0, stop=["e"]),
                dict(temperature=0.7, seed=3, max_tokens=3), dict(temperature=0.0, repeat_penalty=1.3),
                dict(temperature=0.8, seed=1, max_tokens=0)]
    return [(p, {"max_tokens": 12, **s}) for p, s in zip(prompts, settings)]


def alone(path, prompt, kw) -> Completion:
    c = Completion()
    m = Model(path, backend="numpy", ctx=96)
    for _ in m.run(prompt, completion=c, raw=True, **kw):
        pass
    return c


def concurrently(model, sched, jobs) -> list[Completion]:
    """Each job's Model.run through the scheduler on a thread of its own, started together."""
    outs = [Completion() for _ in jobs]
    errors = []

    def one(i: int) -> None:
        try:
            prompt, kw = jobs[i]
            for _ in model.run(prompt, completion=outs[i], raw=True, scheduler=sched, **kw):
                pass
        except Exception as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return outs


def same(a: Completion, b: Completion, tol: float = 0.0) -> None:
    """Equal text, ids and finish; logprobs equal, or within `tol` where a prompt's prefix came from a slot's cache
    (computed in another pass than the rest: BLAS sums the products in another order)."""
    assert (a.text, a.tokens, a.finish_reason, a.prompt_tokens) == (b.text, b.tokens, b.finish_reason, b.prompt_tokens)
    if tol == 0.0 or a.logprobs is None:
        assert a.logprobs == b.logprobs
        return
    assert len(a.logprobs) == len(b.logprobs)
    for x, y in zip(a.logprobs, b.logprobs):
        assert [e["id"] for e in x["top_logprobs"]] == [e["id"] for e in y["top_logprobs"]]
        for u, v in zip([x, *x["top_logprobs"]], [y, *y["top_logprobs"]]):
            assert u["id"] == v["id"] and abs(u["logprob"] - v["logprob"]) <= tol


def test_each_request_gets_what_it_gets_alone(path, model):
    jobs = requests()
    want = [alone(path, p, kw) for p, kw in jobs]
    sched = Scheduler(model)
    try:
        got = concurrently(model, sched, jobs)  # 8 requests, 4 slots: half of them wait for a slot
        for g, w in zip(got, want):
            same(g, w)
        assert sched.steps > 0 and sched.batched > sched.steps  # decode steps did run several sequences
        assert sched.load == {"running": 0, "waiting": 0, "free_slots": SLOTS}
        again = concurrently(model, sched, jobs[::-1])  # other slots, other neighbours, caches left by others
        for g, w in zip(again, want[::-1]):
            same(g, w, tol=1e-5)
    finally:
        sched.close()


def test_a_consumer_that_stops_frees_its_slot(model):
    sched = Scheduler(model)
    try:
        gens = [model.run("Once upon a time", completion=Completion(), raw=True, max_tokens=80, temperature=0.0,
                          scheduler=sched) for _ in range(SLOTS)]
        for g in gens:
            next(g)  # every slot busy with a long generation
        for g in gens:
            g.close()  # the client left
        c = Completion()
        text = "".join(drain(model.run("Hello", completion=c, raw=True, max_tokens=4, temperature=0.0,
                                       scheduler=sched)))
        assert c.finish_reason in ("length", "eos") and len(c.tokens) <= 4 and isinstance(text, str)
        for _ in range(100):
            if sched.load["free_slots"] == SLOTS:
                break
            threading.Event().wait(0.05)
        assert sched.load == {"running": 0, "waiting": 0, "free_slots": SLOTS}
    finally:
        sched.close()


def test_a_slots_cache_serves_a_later_prompts_prefix(model):
    sched = Scheduler(model)
    try:
        long = "Numbers: " + " ".join(str(i) for i in range(20))
        first = Completion()
        drain(model.run(long, completion=first, raw=True, max_tokens=2, temperature=0.0, scheduler=sched))
        second = Completion()
        drain(model.run(long + " and more", completion=second, raw=True, max_tokens=2, temperature=0.0,
                       scheduler=sched))
        assert second.timings.prompt_tokens < len(second.prompt_tokens) // 2  # the shared prefix was not prefilled
    finally:
        sched.close()


def test_a_full_context_ends_with_length(path, model):
    sched = Scheduler(model)
    kw = dict(max_tokens=500, temperature=0.0, ignore_eos=True)
    try:
        c = Completion()
        drain(model.run("Once upon a time", completion=c, raw=True, scheduler=sched, **kw))
        # the context's every position holds an id, and the last id handed out needs none of its own
        assert c.finish_reason == "length" and len(c.prompt_tokens) + len(c.tokens) == model.ctx + 1
        same(c, alone(path, "Once upon a time", kw))
    finally:
        sched.close()


def test_too_many_waiting_is_busy_and_close_ends_the_rest(model):
    sched = Scheduler(model, max_waiting=2)
    held, ended, threads = [], [], []
    try:
        for _ in range(SLOTS):  # every slot taken by a long generation nobody reads further
            g = model.run("Once upon a time", completion=Completion(), raw=True, max_tokens=90, temperature=0.0,
                          ignore_eos=True, scheduler=sched)
            next(g)
            held.append(g)
        for _ in range(2):  # two wait for a slot (a run queues at its first next(), which then blocks)
            gen = model.run("Hello", completion=Completion(), raw=True, max_tokens=3, scheduler=sched)
            threads.append(threading.Thread(target=_drain, args=(gen, ended)))
            threads[-1].start()
        for _ in range(250):
            if sched.load["waiting"] == 2:
                break
            threading.Event().wait(0.02)
        assert sched.load["waiting"] == 2
        with pytest.raises(SchedulerBusy, match="waiting"):
            next(model.run("Hello", completion=Completion(), raw=True, max_tokens=3, scheduler=sched))
    finally:
        sched.close()
    for t in threads:
        t.join(10)
    assert len(ended) == 2 and all(isinstance(x, SchedulerClosed) for x in ended)
    with pytest.raises(SchedulerClosed):
        next(model.run("Hello", completion=Completion(), raw=True, max_tokens=3, scheduler=sched))


def _drain(gen, out: list) -> None:
    try:
        list(gen)
    except SchedulerClosed as exc:
        out.append(exc)


def test_a_failing_step_fails_its_requests_and_the_scheduler_goes_on(model, monkeypatch):
    sched = Scheduler(model)
    try:
        real = model.backend.step
        calls = {"n": 0}

        def flaky(batch):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("device fell over")
            return real(batch)

        monkeypatch.setattr(model.backend, "step", flaky)
        with pytest.raises(RuntimeError, match="fell over"):
            drain(model.run("Once upon a time", completion=Completion(), raw=True, max_tokens=10, temperature=0.0,
                           ignore_eos=True, scheduler=sched))
        monkeypatch.undo()
        c = Completion()
        drain(model.run("Once upon a time", completion=c, raw=True, max_tokens=5, temperature=0.0, ignore_eos=True,
                       scheduler=sched))
        assert len(c.tokens) == 5 and c.finish_reason == "length"
    finally:
        sched.close()




class FailingConstraint:
    """Allows every id; its advance raises at the `at`-th id (an llguidance matcher in error)."""

    def __init__(self, vocab: int, at: int, message: str):
        self.vocab, self.at, self.message, self.n = vocab, at, message, 0

    def reset(self) -> None:
        self.n = 0

    def allowed(self):
        import numpy as np

        return np.ones(self.vocab, bool)

    def advance(self, token: int) -> None:
        from llamacli.sampling.structured import ConstraintError

        self.n += 1
        if self.n == self.at:
            raise ConstraintError(self.message)

    @property
    def is_done(self) -> bool:
        return False


def test_a_requests_own_failure_stays_its_own(model):
    """A request whose constraint fails (on the worker thread, batched with another) gets its error; the request
    beside it finishes untouched, and the scheduler goes on serving."""
    from llamacli.sampling.structured import ConstraintError

    sched = Scheduler(model)
    try:
        bad = model.run("Hello", completion=Completion(), raw=True, max_tokens=12, temperature=0.0, ignore_eos=True,
                        constraint=FailingConstraint(model.cfg.vocab_size, 4, "someone else's grammar"),
                        scheduler=sched)
        good = Completion()
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(out=drain(model.run(
            "Once upon a time", completion=good, raw=True, max_tokens=12, temperature=0.0, ignore_eos=True,
            scheduler=sched))))
        t.start()
        with pytest.raises(ConstraintError, match="someone else's grammar"):
            drain(bad)
        t.join(60)
        assert len(good.tokens) == 12 and good.finish_reason == "length"
        assert sched.thread.is_alive()
        c = Completion()
        drain(model.run("Hi", completion=c, raw=True, max_tokens=3, temperature=0.0, ignore_eos=True,
                        scheduler=sched))
        assert len(c.tokens) == 3
    finally:
        sched.close()


def test_a_cancelled_waiting_request_leaves_at_once_unprefilled(model, monkeypatch):
    """With the worker held in a step, a waiting request cancelled through Completion.cancel leaves the queue at
    once (its consumer's wait ends) and its prompt is never prefilled."""
    sched = Scheduler(model)
    gate, prompts = threading.Event(), []
    step = model.backend.step

    def held(batch):
        gate.wait(30)
        prompts.extend(len(s.tokens) for s in batch if len(s.tokens) > 1)
        return step(batch)

    monkeypatch.setattr(model.backend, "step", held)
    held_runs, threads = [], []
    try:
        for _ in range(SLOTS):  # every slot busy, the worker held in the first prompt step
            g = model.run("Once upon a time", completion=Completion(), raw=True, max_tokens=5, temperature=0.0,
                          scheduler=sched)
            held_runs.append(g)
            threads.append(threading.Thread(target=lambda g=g: drain(g), daemon=True))
            threads[-1].start()
        # each is submitted from its thread when drained: all of them first, or the request under test could be
        # queued ahead of some and take a slot (then it leaves at the next turn, after the held step)
        for _ in range(250):
            if sched.load["waiting"] + sched.load["running"] == SLOTS:
                break
            threading.Event().wait(0.02)
        waiting = Completion()
        ended: dict = {}
        w = threading.Thread(target=lambda: ended.update(out=drain(model.run(
            "word " * 40, completion=waiting, raw=True, max_tokens=5, temperature=0.0, scheduler=sched))))
        w.start()
        for _ in range(250):  # it waits: every slot is taken (the held requests' prompts, or waits of theirs)
            if waiting.cancel is not None and sched.load["waiting"] + sched.load["running"] == SLOTS + 1:
                break
            threading.Event().wait(0.02)
        before = sched.load["waiting"]
        assert before >= 1 and waiting.cancel is not None
        waiting.cancel()
        w.join(10)
        assert not w.is_alive() and ended["out"] == [] and waiting.finish_reason == "cancelled"
        assert sched.load["waiting"] == before - 1
    finally:
        gate.set()
        for t in threads:
            t.join(30)
        sched.close()
    assert all(n < 20 for n in prompts)  # the 40-word prompt never ran


def test_a_conversation_keeps_its_slot_while_others_stand_empty(model):
    """llama-server's rule: a prompt sharing only a little with a slot's long conversation takes an empty slot,
    so the conversation's next turn prefills only the new part."""
    sched = Scheduler(model)
    try:
        a = Completion()
        convo = "System: be brief. User: " + " ".join(f"w{i}" for i in range(30))
        drain(model.run(convo, completion=a, raw=True, max_tokens=4, temperature=0.0, ignore_eos=True,
                        scheduler=sched))
        drain(model.run("System: be brief. User: hi", completion=Completion(), raw=True, max_tokens=2,
                        temperature=0.0, scheduler=sched))
        turn = Completion()
        drain(model.run(convo + " more words", completion=turn, raw=True, max_tokens=2, temperature=0.0,
                        scheduler=sched))
        assert turn.timings.prompt_tokens <= len(turn.prompt_tokens) - len(a.prompt_tokens)
    finally:
        sched.close()
