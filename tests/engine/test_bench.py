"""`llamacli bench` on the NumPy backend with a tiny random model: the table, the JSON and CSV rows, and what
--profile / --kernels say without a GPU. (The CUDA figures live in BENCHMARKS.md; no test times anything.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from clirun import run
from llamacli.engine.bench import BenchRow, ProfileRow, render, render_kernels, render_profile, run_bench
from llamacli.engine.generate import Model
from llamacli.testing import tiny_vocab, write_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    vocab = {**tiny_vocab(), "tokenizer.ggml.pre": "gpt-2"}  # the tokenizer's name for GPT-2's pre-tokenizer
    return str(write_model(tmp_path_factory.mktemp("bench") / "tiny.gguf", "tiny-llama", "Q8_0", vocab=vocab))


def test_table_has_the_issue_columns(tiny: str) -> None:
    r = run("bench", "-m", tiny, "--backend", "numpy", "-p", "8", "-n", "4", "-r", "2")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith("device: CPU") and "GB/s (read + write)" in lines[0]
    head = next(l for l in lines if l.startswith("| model"))
    assert [c.strip() for c in head.strip("|").split("|")] == [
        "model", "size", "params", "backend", "test", "t/s", "GB/s", "% BW"]
    pp = next(l for l in lines if "| pp8 |" in l)
    tg = next(l for l in lines if "| tg4 |" in l)
    assert "±" in pp and pp.rstrip().endswith("|  |  |")  # no bandwidth figures for prefill
    cells = [c.strip() for c in tg.strip("|").split("|")]
    assert float(cells[6]) > 0 and cells[7].endswith("%")


def test_json_rows_parse(tiny: str) -> None:
    r = run("bench", "-m", tiny, "--backend", "numpy", "-p", "8", "-n", "4", "--pg", "4,2", "-r", "2", "-o", "json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)
    assert [x["test"] for x in rows] == ["pp8", "tg4", "pp4+tg2"]
    for x in rows:
        for key in ("model", "size", "params", "backend", "device", "n_prompt", "n_gen", "avg_ts", "stddev_ts",
                    "samples_ts", "gb_per_s", "bw_fraction"):
            assert key in x, key
        assert len(x["samples_ts"]) == 2 and x["avg_ts"] > 0 and x["device"].startswith("CPU")
    assert rows[1]["gb_per_s"] > 0 and 0 < rows[1]["bw_fraction"]
    assert rows[0]["gb_per_s"] is None and rows[2]["gb_per_s"] is None


def test_csv_has_a_header_and_one_line_per_test(tiny: str) -> None:
    r = run("bench", "-m", tiny, "--backend", "numpy", "-p", "8", "-n", "0", "-r", "1", "-o", "csv")
    assert r.code == 0, r.err
    lines = r.out.strip().splitlines()
    assert lines[0].startswith("model,size,params,backend,device,test") and len(lines) == 2


@pytest.mark.parametrize("flag", ["--profile", "--kernels"])
def test_profile_and_kernels_need_cuda(tiny: str, flag: str) -> None:
    r = run("bench", "-m", tiny, "--backend", "numpy", flag)
    assert r.code != 0
    line = r.one_line_error()
    assert f"{flag} needs the CUDA backend" in line and "numpy" in line


def test_profile_and_kernels_exclude_each_other(tiny: str) -> None:
    r = run("bench", "-m", tiny, "--backend", "numpy", "--profile", "--kernels")
    assert r.code != 0 and "pick one" in r.one_line_error()


def test_decode_attention_summary_counts_the_keys_each_layer_reads(random_model) -> None:
    """bench --profile's decode attention line: K and V bytes at the position (a sliding-window layer reads
    only its window), GB/s from the attention families' time, the share of the copy bandwidth."""
    from llamacli.engine.bench import attention_kv_bytes, decode_attention_summary
    from llamacli.ggufio.file import open_gguf
    from llamacli.models.config import ModelConfig

    g = open_gguf(random_model("tiny-gemma3", "F32"))
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    windows = [plan.window for plan in cfg.layers]
    assert any(windows) and not all(windows)  # local and global layers
    pos = max(windows) + 100
    per_key = 2 * cfg.n_head_kv * cfg.head_dim * 2
    assert attention_kv_bytes(cfg, pos) == [(w or pos + 1) * per_key for w in windows]
    assert attention_kv_bytes(cfg, 3) == [4 * per_key] * cfg.n_layer
    rows = [ProfileRow(f"decode @{pos}", "RoPE+KV+attention", 0.5, 0.4, cfg.n_layer),
            ProfileRow(f"decode @{pos}", "norm+QKV", 0.2, 0.2, cfg.n_layer),
            ProfileRow("prefill 8", "attention", 9.0, 0.5, 1)]  # not the decode step's
    a = decode_attention_summary(cfg, pos, rows, 2.0e12)
    total = sum(attention_kv_bytes(cfg, pos))
    assert a["kv_bytes"] == total and a["ms"] == 0.5 and a["layers"] == cfg.n_layer
    assert a["gb_per_s"] == pytest.approx(total / 0.5e-3 / 1e9, rel=1e-3)
    assert a["bandwidth_share"] == pytest.approx(total / 0.5e-3 / 2.0e12, rel=1e-3)
    text = render_profile(rows, {}, "md", "dev", a)
    assert f"decode attention @{pos}: {0.5e3 / cfg.n_layer:.2f} us a layer" in text
    assert "% of the copy bandwidth" in text
    assert json.loads(render_profile(rows, {}, "json", "dev", a))["decode_attention"]["kv_bytes"] == total


def test_renderers_without_a_gpu() -> None:
    rows = [ProfileRow("prefill 8", "QKV", 0.5, 0.25, 3), ProfileRow("prefill 8", "FFN", 1.5, 0.75, 6)]
    text = render_profile(rows, {"prefill 8": 2.1}, "md", "dev")
    assert "| prefill 8 | FFN | 1.500 | 75.0% | 6 |" in text and "prefill 8: 2.100 ms" in text
    assert json.loads(render_profile(rows, {"prefill 8": 2.1}, "json", "dev"))["rows"][0]["family"] == "QKV"
    krows = [{"kernel": "mv1_q4_k", "shape": "4096x4096", "us": 5.0, "gb_per_s": 1900.0, "tflops": 6.7, "vs": "copy"}]
    text = render_kernels(krows, 3.0e12, "md", "dev")
    assert "| mv1_q4_k | 4096x4096 | 5.0 | 1900 | 63.3% | 6.70 | copy |" in text
    row = BenchRow("m", 10, 5, "numpy", "tg4", 0, 4, [10.0, 12.0], bytes_per_token=1e6, bandwidth=1e10)
    assert "11.00 ± 1.41" in render([row], "md", "dev", 1e10)


def test_depth_runs_each_test_after_a_context(tiny: str) -> None:
    """-d as llama-bench's: each test after D tokens already in the cache; the rows say n_depth."""
    r = run("bench", "-m", tiny, "--backend", "numpy", "-p", "8", "-n", "4", "-d", "0,16", "-r", "1", "-o", "json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)
    assert [(x["test"], x["n_depth"]) for x in rows] == [("pp8", 0), ("tg4", 0), ("pp8 @ d16", 16), ("tg4 @ d16", 16)]
    assert rows[3]["gb_per_s"] > 0 and rows[2]["gb_per_s"] is None
    bad = run("bench", "-m", tiny, "--backend", "numpy", "-d", "x")
    assert bad.code == 2 and bad.one_line_error().startswith("error: -d takes")


def test_depth_prefills_the_context_before_the_test(tmp_path) -> None:
    m = Model(write_model(tmp_path / "t.gguf", "tiny-llama", "F32"), backend="numpy", ctx=64)
    run_bench(m, [8], [], [], 1, depths=[16])
    filled = np.abs(m.backend.k_cache[0]).reshape(64, -1).max(axis=1) > 0
    assert filled[:24].all() and not filled[24:].any()  # the context 0..15, then the test's 16..23
