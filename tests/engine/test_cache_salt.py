"""Cache salts (vLLM's cache_salt; Model.run's cache_salt), on the NumPy backend: a request keeps K/V only from
requests of the same salt, unsalted ones only from unsalted ones, in its cache slot (SequenceCache) and in the
prefix cache (engine/prefix_cache.py) alike, and its output is the one its prompt prefilled whole gives.

Prompts are token ids (blocks of 16 are then exact). cached_tokens (Timings) counts the prompt ids not
prefilled, prefix_cached_tokens those the prefix cache gave.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from llamacli.engine.generate import Completion, Model
from llamacli.engine.prefix_cache import BLOCK
from llamacli.engine.scheduler import Scheduler
from llamacli.errors import UsageError
from llamacli.models.seq_cache import LayerCache, SequenceCache


@pytest.fixture(scope="module")
def ref(path):
    return Model(path, backend="numpy", ctx=192)


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 29990, size=n).tolist()


def run(model, prompt: list[int], salt: str | None = None, sched=None, n: int = 4) -> Completion:
    c = Completion()
    out: dict = {}

    def go() -> None:
        try:
            out["text"] = list(model.run(prompt, completion=c, max_tokens=n, temperature=0.0, ignore_eos=True,
                                         scheduler=sched, **({} if salt is None else {"cache_salt": salt})))
        except BaseException as exc:  # noqa: BLE001 (raised below)
            out["exc"] = exc

    t = threading.Thread(target=go, daemon=True)  # (a hang fails the test rather than the run)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the generation hangs"
    if "exc" in out:
        raise out["exc"]
    return c


def whole(ref, prompt: list[int]) -> list[int]:
    """The greedy ids with the prompt prefilled whole."""
    ref.seq.clear()
    c = run(ref, prompt)
    assert c.timings.cached_tokens == 0
    return c.tokens


def test_a_slot_filled_under_another_salt_keeps_nothing(path, ref):
    """One slot, no prefix cache: the same prompt under salts x, y, y, none, none, x: only a request of the salt
    the slot was filled under keeps its ids."""
    m = Model(path, backend="numpy", ctx=192)
    a = ids(40, 1)
    want = whole(ref, a)
    for salt, cached in (("x", 0), ("y", 0), ("y", 39), (None, 0), (None, 39), ("x", 0)):
        c = run(m, a, salt)
        assert c.timings.cached_tokens == cached, salt
        assert c.tokens == want


def test_the_prefix_cache_serves_a_salt_only_its_own_blocks(path, ref):
    """One slot with the prefix cache, another prompt taking the slot between: a prompt's blocks stored under
    one salt serve that salt alone, and unsalted blocks serve only unsalted prompts."""
    m = Model(path, backend="numpy", ctx=192)
    m.enable_prefix_cache(64 * BLOCK * m.backend.kv_row_bytes())  # (room for every salt's blocks: none evicted)
    system = ids(40, 2)
    a, b, other = system + ids(8, 3), system + ids(8, 4), ids(20, 5)
    want = whole(ref, b)
    salt = "tenant \ud800 \U0001f600"  # (a lone surrogate: JSON may carry one)
    run(m, a, salt)
    for s in ("other", None, salt[:-1], salt + " "):
        run(m, other, s)  # (the slot moves on: only the prefix cache could serve b)
        c = run(m, b, s)
        assert c.timings.cached_tokens == 0, s
        assert c.tokens == want
    run(m, other)
    c = run(m, b, salt)
    assert c.timings.prefix_cached_tokens == c.timings.cached_tokens == 2 * BLOCK  # 40 ids: 2 whole blocks
    assert c.tokens == want
    run(m, other, salt)
    c = run(m, a)  # the unsalted b above stored the system prompt's blocks unsalted
    assert c.timings.prefix_cached_tokens == 2 * BLOCK
    assert c.tokens == whole(ref, a)


def test_the_scheduler_picks_no_slot_of_another_salt(path, ref):
    """Two slots: a prompt under x fills one; the same prompt under y gets the other, and nothing cached; each
    salt then comes back to its own slot's ids, and a request holding the x slot leaves the y request nothing
    of it, nor of the prefix cache."""
    m = Model(path, backend="numpy", ctx=192, slots=2)
    m.enable_prefix_cache()
    sched = Scheduler(m)
    a = ids(40, 6)
    want = whole(ref, a)
    try:
        assert run(m, a, "x", sched).timings.cached_tokens == 0
        assert run(m, a, "y", sched).timings.cached_tokens == 0
        assert run(m, a, "x", sched).timings.cached_tokens == 39
        c = run(m, a, "y", sched)
        assert c.timings.cached_tokens == 39 and c.tokens == want
        b = a[:32] + ids(10, 7)
        held = m.run(b, completion=Completion(), max_tokens=50, temperature=0.0, ignore_eos=True, scheduler=sched,
                     cache_salt="x")
        next(held)  # its slot taken (the x slot: it holds the most of b), the other free
        c = run(m, b, "z", sched)
        assert c.timings.cached_tokens == 0 and c.tokens == whole(ref, b)
        c = run(m, b, "x", sched)  # (the slot z left, and the x blocks of a)
        assert c.timings.prefix_cached_tokens == c.timings.cached_tokens == 2 * BLOCK
        held.close()
    finally:
        sched.close()


@pytest.mark.parametrize("salt, why", [("", "an empty string"), ("s" * 257, "257 characters"), (7, "a number"),
                                       (b"x", "bytes"), (["x"], "a list"), (True, "a boolean")])
def test_a_bad_salt_is_refused(ref, salt, why):
    with pytest.raises(UsageError) as exc:
        run(ref, ids(5, 8), salt)
    assert str(exc.value) == f"cache_salt must be a string of 1 to 256 characters, got {why}"
    assert run(ref, ids(5, 8), "s" * 256).tokens  # (the longest taken)


def test_a_slots_record_keeps_its_salt():
    seq = SequenceCache([LayerCache("kv", 0, 64)], 64)
    seq.begin_prompt(0, 10, "x")
    seq.prompt_done(list(range(10)))
    assert seq.reusable(list(range(12)), "x") == 10
    assert seq.reusable(list(range(12))) == seq.reusable(list(range(12)), "y") == 0
    with pytest.raises(ValueError, match="another cache salt"):
        seq.begin_prompt(5, 12, "y")
    seq.clear()
    assert seq.salt is None


def test_a_draft_models_slot_keeps_nothing_of_another_salt(random_model, monkeypatch):
    """With a draft model (speculative decoding), its slot too keeps the prompt only for the salt that filled it:
    its first prefill of a request starts at 0 under another salt, past the prompt under the same."""
    from llamacli.engine.speculative import SpecSettings

    m = Model(random_model("tiny-llama", "F32"), backend="numpy", ctx=160)
    m.attach_draft(Model(random_model("tiny-llama", "F32", seed=7), backend="numpy", ctx=160))
    plain = Model(random_model("tiny-llama", "F32"), backend="numpy", ctx=160)
    backend, starts = m.draft.model.backend, []
    step = backend.step
    monkeypatch.setattr(backend, "step", lambda batch: starts.append(batch[0].start) or step(batch))
    prompt = [5, 9, 2, 40, 7, 7, 1, 5, 9, 2, 40, 7, 11, 60, 61, 62, 5, 9, 2] * 2
    want = plain.complete(prompt, max_tokens=8, temperature=0.0, ignore_eos=True).tokens
    for salt, kept in (("x", False), ("y", False), ("y", True), (None, False), ("x", False)):
        del starts[:]
        c = m.complete(prompt, max_tokens=8, temperature=0.0, ignore_eos=True, cache_salt=salt,
                       speculative=SpecSettings(("draft-simple",), 3))
        assert c.tokens == want and starts
        assert (starts[0] > 0) == kept, (salt, starts)
