"""How a load reads the vocabulary from a file's metadata: once, in the tokenizer's thread (the config and the
engine's check take its length only), shared with its other readers (the chat template's special tokens, a
file without a template's built-in format); empty tokens renamed in a copy."""

from __future__ import annotations

import threading

import pytest

from llamacli.chat.template import ChatTemplate
from llamacli.engine.generate import Model
from llamacli.ggufio.file import open_gguf
from llamacli.ggufio.metadata import StringArray
from llamacli.models.config import ModelConfig
from llamacli.testing import tiny_vocab, write_model
from llamacli.tokenizer.tokenizer import Tokenizer

N_TOKENS = len(tiny_vocab()["tokenizer.ggml.tokens"])


@pytest.fixture()
def decodes(monkeypatch) -> list[tuple[int, str]]:
    """Each StringArray.tolist() call (a whole string array decoded): (the array's length, the thread)."""
    calls: list[tuple[int, str]] = []
    tolist = StringArray.tolist

    def counted(self):
        calls.append((len(self), threading.current_thread().name))
        return tolist(self)

    monkeypatch.setattr(StringArray, "tolist", counted)
    return calls


def vocabulary_decodes(calls: list[tuple[int, str]]) -> list[str]:
    """The threads that decoded the tokens array (no other string array of the tiny model has its length)."""
    return [thread for n, thread in calls if n == N_TOKENS]


@pytest.mark.parametrize("template", [True, False])
def test_the_vocabulary_is_decoded_once_while_a_tokenizer_holds_it(tmp_path, decodes, template):
    """The chat template's special tokens (and, without a template, the built-in format's choice) read the
    tokens the tokenizer already decoded: a 128k vocabulary decoded again cost more than compiling the
    template."""
    vocab = tiny_vocab()
    if not template:
        vocab.pop("tokenizer.chat_template")
    md = open_gguf(write_model(tmp_path / "m.gguf", "tiny-llama", "F32", vocab=vocab)).metadata
    tok = Tokenizer.from_metadata(md)
    chat = ChatTemplate.from_metadata(md)
    assert len(vocabulary_decodes(decodes)) == 1
    assert chat.source == ("gguf" if template else "builtin:chatml")
    assert tok.encode("<|im_start|>", special=True) == [tok.token_id("<|im_start|>")]


def test_the_config_takes_the_vocabulary_size_without_decoding_it(tmp_path, decodes):
    """Where the file has no <arch>.vocab_size, the size is the tokens array's length."""
    path = write_model(tmp_path / "m.gguf", "tiny-llama", "F32", vocab=tiny_vocab(), metadata={"llama.vocab_size": None})
    g = open_gguf(path)
    assert "llama.vocab_size" not in g.metadata
    assert ModelConfig.from_gguf(g.metadata, set(g.tensors)).vocab_size == N_TOKENS
    assert vocabulary_decodes(decodes) == []


def test_a_load_decodes_the_vocabulary_once_in_the_tokenizers_thread(tmp_path, decodes):
    """Not in the main thread, where the config and the engine's size check only need its length, before the
    backend starts; the chat prompt after the load decodes nothing more."""
    m = Model(write_model(tmp_path / "m.gguf", "tiny-llama", "F32", vocab=tiny_vocab()), backend="numpy")
    try:
        m.render_chat([{"role": "user", "content": "hi"}])
        assert vocabulary_decodes(decodes) == ["llamacli-tokenizer"]
    finally:
        m.close()


def test_empty_tokens_are_renamed_in_a_copy():
    """As llama.cpp: an empty token is "[EMPTY_<id>]"; the caller's list stays as it was."""
    vocab = tiny_vocab()
    tokens = vocab["tokenizer.ggml.tokens"]
    tokens[-1] = ""
    tok = Tokenizer.from_metadata(vocab)
    last = len(tokens) - 1
    assert tok.piece(last) == f"[EMPTY_{last}]" and tok.token_id(f"[EMPTY_{last}]") == last
    assert tokens[-1] == ""
