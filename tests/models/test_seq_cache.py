"""A sequence's cache record (models/seq_cache.py): which ids a slot holds and where a new prompt may start."""

from __future__ import annotations

import pytest

from llamacli.models.config import ModelConfig
from llamacli.models.seq_cache import LayerCache, SequenceCache, common_prefix, layer_caches
from llamacli.testing import SHAPES, model_metadata


def test_layer_caches_are_what_the_backend_allocates(random_model) -> None:
    from llamacli.engine.generate import Model

    m = Model(random_model("tiny-gemma3", "F32"), backend="numpy", ctx=2048)
    try:
        layers = m.seq.layers
        assert [c.rows for c in layers] == [k.shape[0] for k in m.backend.k_cache]
        assert [c.window for c in layers] == [plan.window for plan in m.cfg.layers]
        assert {c.kind for c in layers} == {"kv"}
        assert any(c.rows < 2048 for c in layers) and any(c.rows == 2048 for c in layers)  # rings and full layers
    finally:
        m.close()
    cfg = ModelConfig.from_gguf(model_metadata(SHAPES["gemma3-270m"], 32768))
    assert [c.rows for c in layer_caches(cfg, 32768)].count(32768) == sum(p.window == 0 for p in cfg.layers)
    with pytest.raises(ValueError, match="unknown layer cache kind"):
        LayerCache("ssm")


def test_common_prefix_stops_at_the_first_difference_or_the_limit() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 9], 10) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 2) == 2
    assert common_prefix([], [1], 5) == 0


def test_a_kv_slot_keeps_the_shared_prefix_short_of_the_last_id() -> None:
    seq = SequenceCache([LayerCache("kv", 0, 64)], ctx=64)
    assert seq.reusable([5, 6, 7]) == 0  # holds nothing
    seq.begin_prompt(0, 3)
    seq.prompt_done([5, 6, 7])
    seq.begin_decode(3)
    seq.token_done(8)
    assert seq.ids == [5, 6, 7, 8] and len(seq) == 4 and not seq.full
    assert seq.reusable([5, 6, 7, 8, 9]) == 4  # a chat's next turn
    assert seq.reusable([5, 6, 7, 8]) == 3  # the same prompt: its last id runs again for its logits
    assert seq.reusable([5, 6, 1, 2]) == 2  # rewound to the first difference
    seq.begin_prompt(2, 4)
    assert seq.ids == [5, 6]  # a step that fails from here leaves the slot holding what it kept
    seq.clear()
    assert seq.reusable([5, 6, 1, 2]) == 0


def test_a_ring_that_overwrote_the_window_before_the_prefix_forgets_it() -> None:
    # window 4 in a ring of 8 rows, 32 positions: position p sits in row p mod 8
    seq = SequenceCache([LayerCache("kv", 4, 8), LayerCache("kv", 0, 32)], ctx=32)
    ids = list(range(20))
    seq.begin_prompt(0, 20)
    seq.prompt_done(ids)
    assert seq.written == 20
    # keys 13..15 before position 16 sit in rows 5..7, which positions 21..23 would overwrite: still held
    assert seq.reusable(ids[:16] + [99, 98]) == 16
    # keys 9..11 before position 12: rows 1..3, overwritten by positions 17..19
    assert seq.reusable(ids[:12] + [99]) == 0


def test_a_recurrent_slot_resumes_only_at_a_stored_state() -> None:
    seq = SequenceCache([LayerCache("recurrent"), LayerCache("kv", 0, 64)], ctx=64)
    assert seq.recurrent
    seq.begin_prompt(0, 10)
    seq.prompt_done(list(range(10)))
    # The live state has moved past position 9 (the decode's warm-up ran at 10): not a resume point by itself.
    assert seq.reusable(list(range(12))) == 0
    seq.stored(10)  # the backend kept the state after the prompt: a chat's next turn continues from it
    assert seq.reusable(list(range(12))) == 10
    assert seq.reusable(list(range(8)) + [50, 51]) == 0  # the state cannot be rewound to position 8
    seq.stored(4)
    assert seq.reusable(list(range(8)) + [50, 51]) == 4  # a stored state at 4 serves
    seq.begin_prompt(4, 6)  # what lies past 4 is dropped, its snapshots too
    assert seq.ids == [0, 1, 2, 3] and seq.snapshots == {4}
    seq.begin_prompt(2, 3)
    assert seq.snapshots == set()
    with pytest.raises(ValueError, match="a snapshot at 5 of a slot holding 2 ids"):
        seq.stored(5)


def test_a_hybrid_models_delta_net_layers_keep_a_recurrent_state(random_model) -> None:
    """qwen35's delta-net layers hold no K/V rows (the NumPy backend allocates none) but a recurrent state; the
    slot then resumes only where the backend holds one (SequenceCache.held, within the ids it holds)."""
    from llamacli.engine.generate import Model

    m = Model(random_model("tiny-qwen35", "F32"), backend="numpy", ctx=256)
    try:
        kinds = [c.kind for c in m.seq.layers]
        assert kinds == ["recurrent"] * 3 + ["kv"] + ["recurrent"] * 3 + ["kv"] and m.seq.recurrent
        assert [k.shape[0] for k in m.backend.k_cache] == [0, 0, 0, 256] * 2
    finally:
        m.close()
    seq = SequenceCache([LayerCache("recurrent"), LayerCache("kv", 0, 64)], ctx=64)
    seq.begin_prompt(0, 10)
    seq.prompt_done(list(range(10)))
    seq.held({10, 4, 30, 0})  # what lies past the ids held (30), or at 0, is no resume point
    assert seq.snapshots == {4, 10} and seq.reusable(list(range(12))) == 10


def test_snapshot_positions() -> None:
    from llamacli.models.seq_cache import SNAPSHOT_EVERY, snapshot_positions

    n = SNAPSHOT_EVERY
    assert snapshot_positions(0, 10) == [10]
    assert snapshot_positions(0, n) == [n]  # the end only, once
    assert snapshot_positions(10, 2 * n) == [n, 2 * n, 2 * n + 10]
    assert snapshot_positions(n, 1) == [n + 1]
