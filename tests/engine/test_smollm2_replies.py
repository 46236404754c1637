"""tests/smollm2_greedy.json holds the NumPy backend's greedy replies on the real SmolLM2 to a prompt set. The
GPU test (test_gpu_backend.test_smollm2_greedy_64_tokens_identical) compares the CUDA backend with them rather
than running the reference on the GPU machine; this test keeps them what the NumPy backend generates (and the
NumPy backend itself is held to transformers by test_model_reference.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from llamacli.engine.generate import load


def test_stored_greedy_replies_are_the_numpy_backends(smollm2) -> None:
    data = json.loads((Path(__file__).parents[1] / "smollm2_greedy.json").read_text())
    with open(smollm2, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == data["model_sha256"]
    m = load(smollm2, backend="numpy", ctx=data["ctx"])
    assert len(data["replies"]) == 5
    for prompt, want in data["replies"].items():
        got = m.complete(prompt, max_tokens=data["max_tokens"], temperature=0.0).tokens
        assert got == want, prompt


def test_the_cpu_backend_gives_the_stored_greedy_replies(smollm2) -> None:
    """The CPU backend (quantized weights, int16 activations: llamacli/backends/cpu/) replies as the reference does,
    64 greedy tokens to each prompt."""
    pytest.importorskip("numba")
    data = json.loads((Path(__file__).parents[1] / "smollm2_greedy.json").read_text())
    m = load(smollm2, backend="cpu", ctx=data["ctx"])
    for prompt, want in data["replies"].items():
        assert m.complete(prompt, max_tokens=data["max_tokens"], temperature=0.0).tokens == want, prompt
