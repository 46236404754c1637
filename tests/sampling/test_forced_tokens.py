"""A string a grammar forces may be written with the model's own user-defined tokens (Qwen's <tool_call>,
<think>): llguidance allows only the spelling the vocabulary's tokenizer gives for a forced string, so that
spelling must be the model's, not the bytes one at a time."""

from __future__ import annotations

import pytest

from llamacli.testing import tiny_vocab, write_model

structured = pytest.importorskip("llamacli.sampling.structured")
pytest.importorskip("llguidance")


def test_a_forced_string_may_be_its_user_defined_token(tmp_path):
    from llamacli.engine.generate import Model

    vocab = tiny_vocab()
    vocab["tokenizer.ggml.tokens"] = vocab["tokenizer.ggml.tokens"] + ["<tool_call>", "</tool_call>"]
    vocab["tokenizer.ggml.token_type"] = vocab["tokenizer.ggml.token_type"] + [4, 4]  # user-defined
    with Model(write_model(tmp_path / "m.gguf", "tiny-llama", "F32", vocab=vocab), backend="numpy", ctx=64) as model:
        tok = model.tokenizer
        c = structured.grammar_constraint(model, '%llguidance {}\nstart: "<tool_call>" "x" "</tool_call>"')
        c.reset()
        assert c.allowed()[tok.token_id("<tool_call>")]
        c.advance(tok.token_id("<tool_call>"))
        c.advance(tok.encode("x", add_bos=False)[0])
        assert c.allowed()[tok.token_id("</tool_call>")]
        c.advance(tok.token_id("</tool_call>"))
        assert c.is_done or c.allowed()[tok.eos_id]
