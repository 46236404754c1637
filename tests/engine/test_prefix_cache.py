"""The prefix cache across requests (engine/prefix_cache.py), on the NumPy backend: a prompt's blocks computed in
one slot serve any later prompt in any slot, and the output is the same as with the whole prompt prefilled.

Prompts are token ids (blocks of 16 are then exact). The reference for each is the same prompt prefilled whole
(a model without the cache, its slot cleared first); greedy ids are compared. cached_tokens (Timings) counts the
prompt ids not prefilled, prefix_cached_tokens those the cache gave.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from threadrun import drain

from llamacli.engine.generate import Completion, Model
from llamacli.engine.prefix_cache import BLOCK, PrefixCacheOff
from llamacli.engine.scheduler import Scheduler


@pytest.fixture(scope="module")
def ref(path):
    return Model(path, backend="numpy", ctx=192)


def ids(n: int, seed: int, vocab: int = 30000) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab - 10, size=n).tolist()


def run(model, prompt: list[int], sched=None, n: int = 5) -> Completion:
    c = Completion()
    drain(model.run(prompt, completion=c, max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2,
                    scheduler=sched))
    return c


def whole(ref, prompt: list[int], n: int = 5) -> Completion:
    """The greedy run with the prompt prefilled whole."""
    ref.seq.clear()
    c = run(ref, prompt, n=n)
    assert c.timings.cached_tokens == 0
    return c


def same(got: Completion, want: Completion, tol: float = 1e-4) -> bool:
    """The same ids, and each step's logprobs within `tol` (rows computed in another pass than the rest: BLAS
    sums the products in another order)."""
    assert got.tokens == want.tokens
    for x, y in zip(got.logprobs, want.logprobs):
        assert [e["id"] for e in x["top_logprobs"]] == [e["id"] for e in y["top_logprobs"]]
        for u, v in zip([x, *x["top_logprobs"]], [y, *y["top_logprobs"]]):
            assert abs(u["logprob"] - v["logprob"]) <= tol, (u, v)
    return True


def hold(model, prompt: list[int], sched):
    """A request that keeps its slot: its first id taken, the rest not read (it sits out the decode steps)."""
    g = model.run(prompt, completion=Completion(), max_tokens=50, temperature=0.0, ignore_eos=True, scheduler=sched)
    next(g)
    return g


def test_a_shared_prefix_computed_in_one_slot_serves_another(path, ref):
    m = Model(path, backend="numpy", ctx=192, slots=2)
    m.enable_prefix_cache()
    sched = Scheduler(m)
    system = ids(40, 1)
    try:
        held = hold(m, system + ids(10, 2), sched)  # slot 0, its prompt's blocks stored
        b = system + ids(10, 3)
        got = run(m, b, sched)  # slot 1: the only one free
        assert got.timings.prefix_cached_tokens == got.timings.cached_tokens == 32  # 40 ids: 2 whole blocks
        assert got.timings.prompt_tokens == len(b) - 32
        assert same(got, whole(ref, b))
        held.close()
    finally:
        sched.close()


def test_a_prompt_comes_back_after_its_slot_held_another(path, ref):
    """One slot: A, then B (which replaces A in the slot), then A with its reply and one more turn (a resent
    conversation): A's blocks, its reply's included, come from the cache."""
    m = Model(path, backend="numpy", ctx=192)
    m.enable_prefix_cache()
    a = ids(30, 4)
    first = run(m, a, n=8)
    run(m, ids(30, 5))  # the slot now holds B
    turn = a + first.tokens + ids(6, 6)
    got = run(m, turn)
    # 37 ids held (the last id handed out was never fed back): 2 blocks, the second ending in the reply
    assert got.timings.prefix_cached_tokens == got.timings.cached_tokens == 32
    assert same(got, whole(ref, turn))
    without = Model(path, backend="numpy", ctx=192)
    run(without, a, n=8)
    run(without, ids(30, 5))
    assert run(without, turn).timings.cached_tokens == 0  # (the slot alone keeps nothing of A)


def test_prompts_at_block_edges(path, ref):
    """A prompt that ends on a block's end keeps all but its last id (whose logits give the first id); one that
    differs from a stored block in that block's last id keeps only the blocks before; a prompt shorter than a
    block stores nothing."""
    m = Model(path, backend="numpy", ctx=192)
    cache = m.enable_prefix_cache()
    base = ids(32, 7)
    run(m, base)
    run(m, ids(5, 8))  # (the slot moves on; 5 ids: no whole block)
    again = run(m, base)
    assert again.timings.cached_tokens == again.timings.prefix_cached_tokens == 31
    assert same(again, whole(ref, base))
    run(m, ids(5, 8))
    near = base[:31] + [base[31] + 1] + ids(7, 9)  # block 1 differs in its last id only
    got = run(m, near)
    assert got.timings.prefix_cached_tokens == 16 and same(got, whole(ref, near))
    tokens = cache.tokens
    run(m, ids(15, 10), n=1)  # 15 ids held: no whole block to keep
    assert cache.tokens == tokens
    run(m, ids(5, 8))
    tail = base[:20]  # ends inside block 1: block 0 serves
    got = run(m, tail)
    assert got.timings.prefix_cached_tokens == 16 and same(got, whole(ref, tail))


def test_eviction_under_a_small_bound(path, ref):
    """Three blocks of room: a longer prompt keeps its first three; another prompt takes their place, the least
    recently used first; a prompt whose blocks went is prefilled whole, with the same ids."""
    m = Model(path, backend="numpy", ctx=192)
    cache = m.enable_prefix_cache(3 * BLOCK * m.backend.kv_row_bytes())
    assert cache.capacity == 3
    a, b = ids(80, 11), ids(48, 12)
    run(m, a)
    assert cache.tokens == 48 and cache.evictions == 0  # the first three of its five blocks
    run(m, ids(5, 8))
    got = run(m, a)
    assert got.timings.prefix_cached_tokens == 48 and same(got, whole(ref, a))
    run(m, b)
    assert cache.tokens == 48 and cache.evictions == 3  # a's blocks made room for b's
    run(m, ids(5, 8))
    got = run(m, a)
    assert got.timings.cached_tokens == 0 and same(got, whole(ref, a))
    assert cache.tokens == 48  # (a's first blocks are back in)
    with pytest.raises(PrefixCacheOff, match="holds no block"):  # a bound under one block
        m.enable_prefix_cache(BLOCK * m.backend.kv_row_bytes() - 1)
    assert m.prefix_cache is None


def test_concurrent_clients_sharing_a_system_prompt(path, ref):
    """Six requests with one system prompt and their own questions on three slots, started together: each gets
    what it gets prefilled whole, and the system prompt was computed once, not per slot."""
    m = Model(path, backend="numpy", ctx=192, slots=3)
    cache = m.enable_prefix_cache()
    system = ids(50, 13)
    prompts = [system + ids(6, 20 + i) for i in range(6)]
    want = [whole(ref, p) for p in prompts]
    sched = Scheduler(m)
    outs = [Completion() for _ in prompts]
    try:
        threads = [threading.Thread(target=lambda i=i: drain(m.run(
            prompts[i], completion=outs[i], max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2,
            scheduler=sched)))
            for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sched.close()
    assert all(same(c, w) for c, w in zip(outs, want))
    assert all(c.timings.cached_tokens == 48 for c in outs[1:] if c.timings.prefix_cached_tokens)
    assert sum(c.timings.cached_tokens == 0 for c in outs) == 1  # only the first prefilled the system prompt
    assert cache.hits >= 48 * 2  # (the two other slots' first requests at least)


def test_a_model_with_recurrent_layers_gets_no_prefix_cache(random_model):
    m = Model(random_model("tiny-qwen35", "F32"), backend="numpy", ctx=64)
    with pytest.raises(PrefixCacheOff, match="recurrent"):
        m.enable_prefix_cache()
    assert m.prefix_cache is None


@pytest.fixture(scope="module")
def ring_path(random_model):
    return random_model("tiny-gemma3", "Q8_0")  # window 8: rings of 640 rows at ctx 1024 and more


def test_sliding_window_rings_restore_the_window_before_the_prefix(ring_path):
    """Rings (a window of 8 in 640 rows): a 700-id shared prefix, stored by a request in slot 0 whose ring still
    held its end, serves a request in slot 1: the window before the prefix's end is copied into the ring, which
    then wraps; the ids are those of the prompt prefilled whole."""
    ref = Model(ring_path, backend="numpy", ctx=1024)
    m = Model(ring_path, backend="numpy", ctx=1024, slots=2)
    m.enable_prefix_cache()
    assert any(0 < c.rows < 1024 for c in m.seq.layers)  # (rings indeed)
    system = ids(700, 30, 270)
    sched = Scheduler(m)
    try:
        held = hold(m, system + ids(20, 31, 270), sched)
        b = system + ids(20, 32, 270)
        got = run(m, b, sched)
        assert got.timings.prefix_cached_tokens == 688 and same(got, whole(ref, b))
        # Slot 1's rings hold only the window before 688 of the prefix: a prompt sharing its first 500 ids may not
        # start at 500 from the slot's own rows (their ring rows were never written), but from the cache's blocks.
        c = system[:500] + ids(12, 36, 270)
        got = run(m, c, sched)
        assert got.timings.cached_tokens == got.timings.prefix_cached_tokens == 496 and same(got, whole(ref, c))
        # A prompt that ends on a block's end (688 ids): all but its last id kept (500 of them the slot's own),
        # whose query reads the ring's window before it, position 680 included.
        edge = system[:688]
        got = run(m, edge, sched)
        assert got.timings.cached_tokens == 687 and same(got, whole(ref, edge))
        held.close()
    finally:
        sched.close()


def test_a_ring_that_moved_on_serves_no_prefix(ring_path):
    """The shared prefix's end left the rings (the first request ran 1,000 positions past it before its blocks
    were stored): the rings' rows of the window before it were never stored, so the later prompt is prefilled
    whole, with the same ids."""
    ref = Model(ring_path, backend="numpy", ctx=1536)
    m = Model(ring_path, backend="numpy", ctx=1536)
    cache = m.enable_prefix_cache()
    system = ids(200, 33, 270)
    m.prefix_cache = None  # the first prompt's step stores nothing: its blocks go in when it ends
    first = system + ids(1000, 34, 270)
    c = Completion()
    drain(m.run(first, completion=c, max_tokens=2, temperature=0.0, ignore_eos=True))
    m.prefix_cache = cache
    cache.store(m.seq)
    assert cache.tokens == 1200 // BLOCK * BLOCK
    run(m, ids(5, 8, 270))
    b = system + ids(10, 35, 270)
    got = run(m, b)
    assert got.timings.cached_tokens == 0 and same(got, whole(ref, b))


def test_layers_of_their_own_shapes_and_shared_kv(random_model):
    """Gemma 4: K/V heads of one size on sliding layers and another on global ones, and layers that read an
    earlier layer's cache (none of their own): the pool holds each layer's own shape, the shared layers none."""
    path = random_model("tiny-gemma4", "F32")
    ref, m = Model(path, backend="numpy", ctx=192), Model(path, backend="numpy", ctx=192)
    cache = m.enable_prefix_cache()
    vocab = m.cfg.vocab_size
    assert {m.cfg.layer_head_dim(i) for i in range(m.cfg.n_layer)} == {32, 64}
    assert any(c.kind == "shared" for c in m.seq.layers) and len(cache.full_layers) < m.cfg.n_layer
    a = ids(40, 40, vocab)
    run(m, a)
    run(m, ids(5, 41, vocab))
    b = a[:35] + ids(6, 42, vocab)
    got = run(m, b)
    assert got.timings.prefix_cached_tokens == 32 and same(got, whole(ref, b))
