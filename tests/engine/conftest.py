"""Fixtures of the engine's scheduler tests (scheduler, prefix cache, chunked prefill, cache salt)."""

from __future__ import annotations

import pytest

from llamacli.testing import variant


@pytest.fixture(scope="module")
def path(random_model, llama_cpp_models):
    """A tiny Llama with a real SentencePiece vocabulary (32,000 ids), Q8_0, written once per module."""
    spec = variant("tiny-llama", vocab_size=32000)
    return random_model(spec, "Q8_0", vocab_file=str(llama_cpp_models / "ggml-vocab-llama-spm.gguf"), std=0.2)
