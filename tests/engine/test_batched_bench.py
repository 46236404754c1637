"""`llamacli bench -npl` (engine/batched_bench.py) on the NumPy backend with a tiny random model: llama-batched-bench's
table, JSON and CSV rows with n_parallel, every step one Backend.step of B sequences in slots 0..B-1, and one error
line for sizes that cannot run. No test times anything."""

from __future__ import annotations

import csv
import io
import json

import pytest

from clirun import run
from llamacli.backends.numpy_backend import NumpyBackend
from llamacli.engine.batched_bench import BatchedRow, run_batched
from llamacli.engine.generate import Model
from llamacli.testing import tiny_vocab, write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    vocab = {**tiny_vocab(), "tokenizer.ggml.pre": "gpt-2"}
    return str(write_model(tmp_path_factory.mktemp("bbench") / "tiny.gguf", "tiny-llama", "Q8_0", vocab=vocab))


def test_each_step_is_one_backend_step_of_b_sequences(tiny: str, monkeypatch) -> None:
    m = Model(tiny, backend="numpy", ctx=32)
    batches: list[list[tuple[int, int, int]]] = []  # per Backend.step: (slot, start, ids) of each sequence
    step = m.backend.step

    def spy(batch):
        batches.append([(s.slot, s.start, len(s.tokens)) for s in batch])
        return step(batch)

    monkeypatch.setattr(m.backend, "step", spy)
    rows = run_batched(m, [6], [3], [1, 3])
    assert [(r.pp, r.tg, r.b) for r in rows] == [(6, 3, 1), (6, 3, 3)]
    assert len(m.seqs) == 3 and all(len(seq) == 0 for seq in m.seqs)  # three slots, left empty
    timed = batches[-4:]  # B = 3's timed run: its prompts, then three decode steps
    assert timed[0] == [(0, 0, 6), (1, 0, 6), (2, 0, 6)]
    assert timed[1:] == [[(slot, 6 + k, 1) for slot in range(3)] for k in range(3)]
    # warm-ups: B = 1 twice (prompt and two decode steps each), B = 3 once; then the timed runs
    assert [len(b) for b in batches] == [1, 1, 1] * 2 + [1] * 4 + [3] * 3 + [3] * 4
    for r in rows:
        assert r.n_kv == r.b * (r.pp + r.tg) and r.t_pp > 0 and r.t_tg > 0
        assert r.speed_pp == pytest.approx(r.b * r.pp / r.t_pp) and r.speed_tg == pytest.approx(r.b * r.tg / r.t_tg)
        assert r.speed == pytest.approx(r.n_kv / (r.t_pp + r.t_tg))


def test_the_table_json_and_csv(tiny: str) -> None:
    r = run("bench", "-m", tiny, "--backend", "numpy", "-npl", "1,2", "-npp", "8,4", "-ntg", "3")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith("model: tiny.gguf (numpy); device: CPU") and "context 11 per sequence" in lines[0]
    head = next(line for line in lines if line.startswith("| PP"))
    assert [c.strip() for c in head.strip("|").split("|")] == [
        "PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"]
    body = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ") and
            line[2].isdigit()]
    assert [row[:4] for row in body] == [["8", "3", "1", "11"], ["8", "3", "2", "22"], ["4", "3", "1", "7"],
                                         ["4", "3", "2", "14"]]
    assert "running PP 8, TG 3, B 2" in r.err

    r = run("bench", "-m", tiny, "--backend", "numpy", "-npl", "2", "-p", "5", "-n", "0", "-o", "json")
    assert r.code == 0, r.err
    (row,) = json.loads(r.out)
    assert (row["n_prompt"], row["n_gen"], row["n_parallel"], row["n_kv"]) == (5, 0, 2, 10)
    assert row["speed_tg"] is None and row["speed_pp"] > 0 and row["backend"] == "numpy"

    r = run("bench", "-m", tiny, "--backend", "numpy", "-npl", "1,3", "-npp", "4", "-ntg", "2", "-o", "csv")
    assert r.code == 0, r.err
    table = list(csv.DictReader(io.StringIO(r.out)))
    assert [(x["n_parallel"], x["n_kv"], x["speed_tg"] != "") for x in table] == [("1", "6", True), ("3", "18", True)]


def test_a_context_too_small_for_some_sizes_skips_them(tiny: str) -> None:
    r = run("bench", "-m", tiny, "--backend", "numpy", "-npl", "1", "-npp", "4,40", "-ntg", "2", "-c", "16",
            "-o", "json")
    assert r.code == 0, r.err
    assert [x["n_prompt"] for x in json.loads(r.out)] == [4]
    assert "skipping PP 40, TG 2: a sequence needs a context of 42, have 16" in r.err


@pytest.mark.parametrize("args, message", [
    (["-npl", "0"], "error: -npl values must lie in 1..256"),
    (["-npl", "1,100000"], "error: -npl values must lie in 1..256"),
    (["-npl", "1,x"], "error: -npl takes comma-separated integers"),
    (["-npl", "-4"], "error: -npl values must be >= 0"),
    (["-npl", ","], "error: -npl takes at least one number"),
    (["-npl", "2", "-npp", "0"], "error: -npp values must be >= 1"),
    (["-npl", "2", "-ntg", "1e3"], "error: -ntg takes comma-separated integers"),
    (["-npl", "2", "-npp", "8", "-p", "8"], "error: -npp and -p give the same sizes"),
    (["-npl", "2", "--profile"], "error: --profile does not go with -npl"),
    (["-npl", "2", "-r", "3"], "error: -r does not go with -npl"),
    (["-npp", "8"], "error: -npp goes with -npl"),
    (["-npl", "2", "-npp", "40", "-c", "16"], "error: no -npp/-ntg pair fits a context of 16"),
    (["-npl", "2", "-o", "xml"], "error: --output must be md, json or csv"),
    (["--url", "http://127.0.0.1:9", "-npp", "8"], "error: -npp measures a model here, not a server"),
])
def test_sizes_that_cannot_run_are_one_error_line(tiny: str, args: list[str], message: str) -> None:
    backend = [] if "--url" in args else ["--backend", "numpy"]
    r = run("bench", "-m", tiny, *backend, *args)
    assert r.code == 2 and r.one_line_error().startswith(message), r.err
    assert r.out == ""


def test_more_sequences_than_the_backend_holds_are_skipped(tiny: str) -> None:
    """A backend of one cache slot (the base Backend's set_slots): -npl 1,2 runs B = 1 and says why
    B = 2 is skipped; -npl 2 alone is one error line naming it."""
    from llamacli.backends.base import Backend

    r = run("bench", "-m", tiny, "--backend", "numpy", "-npl", "1,2", "-npp", "4", "-ntg", "2", "-o", "json")
    assert r.code == 0 and [x["n_parallel"] for x in json.loads(r.out)] == [1, 2]
    real = NumpyBackend.set_slots
    try:
        NumpyBackend.set_slots = Backend.set_slots  # (the base class's: one slot)
        r = run("bench", "-m", tiny, "--backend", "numpy", "-npl", "1,2", "-npp", "4", "-ntg", "2", "-o", "json")
        assert r.code == 0 and [x["n_parallel"] for x in json.loads(r.out)] == [1]
        assert "skipping B 2: -npl 2: the numpy backend holds one sequence's cache at a time" in r.err
        r = run("bench", "-m", tiny, "--backend", "numpy", "-npl", "2", "-npp", "4", "-ntg", "2")
        assert r.code == 1 and r.out == ""
        assert r.one_line_error().startswith("error: -npl 2: the numpy backend holds one sequence's cache")
    finally:
        NumpyBackend.set_slots = real


def test_rows_without_decode_steps() -> None:
    row = BatchedRow(pp=8, tg=0, b=4, t_pp=0.5, t_tg=0.0)
    assert (row.n_kv, row.speed_pp, row.speed_tg, row.speed) == (32, 64.0, None, 64.0)
