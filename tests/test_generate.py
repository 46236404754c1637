"""The engine on random models with real vocabularies: streamed text, stop strings, cache reuse."""

from __future__ import annotations

import pytest

from llamacli.generate import Model, _hold_back, _split_stop
from llamacli.testing import variant


@pytest.fixture(scope="module")
def spm_model(random_model, llama_cpp_models):
    spec = variant("tiny-llama", vocab_size=32000)
    return Model(random_model(spec, "Q8_0", vocab_file=str(llama_cpp_models / "ggml-vocab-llama-spm.gguf"), std=0.2),
                 backend="numpy", ctx=128)


def test_streamed_text_continues_the_prompt(spm_model):
    """SentencePiece pieces carry their leading space ("▁there"): the streamed text must keep it, so that
    prompt + output reads as decode(prompt ids + generated ids)."""
    tok = spm_model.tokenizer
    for seed in range(3):
        c = spm_model.complete("Once upon a time", raw=True, max_tokens=12, temperature=1.0, top_k=0, top_p=1.0,
                               min_p=0.0, seed=seed)
        whole = tok.decode(c.prompt_tokens + c.tokens, special=False)
        assert whole == tok.decode(c.prompt_tokens, special=False) + c.text


def test_prefix_reuse_prefills_only_the_difference(spm_model):
    a = spm_model.complete("The quick brown fox", raw=True, max_tokens=3, temperature=0)
    b = spm_model.complete("The quick brown fox jumps over", raw=True, max_tokens=3, temperature=0)
    assert a.timings.prompt_tokens == len(a.prompt_tokens) or a.timings.prompt_tokens < len(a.prompt_tokens)
    shared = 0
    for x, y in zip(a.prompt_tokens + a.tokens, b.prompt_tokens):
        if x != y:
            break
        shared += 1
    assert b.timings.prompt_tokens == len(b.prompt_tokens) - shared
    # and the reused cache gives the same tokens as a cold start
    cold = Model(spm_model.path, backend="numpy", ctx=128).complete("The quick brown fox jumps over", raw=True,
                                                                     max_tokens=3, temperature=0)
    assert cold.tokens == b.tokens


@pytest.mark.parametrize(
    "text,stops,before,hit",
    [("hello world", ["wor"], "hello ", True), ("abc", ["x"], "abc", False), ("a</s", ["</s>"], "a</s", False),
     ("one\n\ntwo", ["\n\n", "two"], "one", True), ("", ["x"], "", False)],
)
def test_split_stop(text, stops, before, hit):
    assert _split_stop(text, stops) == (before, hit)


@pytest.mark.parametrize(
    "text,stops,emit,held",
    [("hello </", ["</s>"], "hello ", "</"), ("abc", ["x"], "abc", ""), ("ab", ["abc", "b"], "", "ab"),
     ("xyz", [], "xyz", "")],
)
def test_hold_back(text, stops, emit, held):
    assert _hold_back(text, stops) == (emit, held)


def test_vocabulary_must_match_the_embedding(tmp_path):
    from llamacli.errors import ShapeMismatchError
    from llamacli.testing import variant, write_model

    from llamacli.testing import tiny_vocab

    small = tiny_vocab()  # 273 tokens, written over the writer's padded list; 300 embedding rows
    path = write_model(tmp_path / "m.gguf", variant("tiny-llama", vocab_size=300), "F32", metadata={
        "tokenizer.ggml.tokens": small["tokenizer.ggml.tokens"], "tokenizer.ggml.token_type": small["tokenizer.ggml.token_type"]})
    with pytest.raises(ShapeMismatchError, match="273 tokens .* 300 embedding rows"):
        Model(path, backend="numpy", ctx=64)
