"""How the tokenizer takes the vocabulary from a file's metadata: once, shared with its other readers (the chat
template's special tokens, a file without a template's built-in format), empty tokens renamed in a copy."""

from __future__ import annotations

import pytest

from llamacli.chat.template import ChatTemplate
from llamacli.ggufio.file import open_gguf
from llamacli.ggufio.metadata import StringArray
from llamacli.testing import tiny_vocab, write_model
from llamacli.tokenizer.tokenizer import Tokenizer


@pytest.fixture()
def decodes(monkeypatch) -> list[int]:
    """Each StringArray.tolist() call (a whole string array decoded), by the array's length."""
    calls: list[int] = []
    tolist = StringArray.tolist

    def counted(self):
        calls.append(len(self))
        return tolist(self)

    monkeypatch.setattr(StringArray, "tolist", counted)
    return calls


@pytest.mark.parametrize("template", [True, False])
def test_the_vocabulary_is_decoded_once_while_a_tokenizer_holds_it(tmp_path, decodes, template):
    """The chat template's special tokens (and, without a template, the built-in format's choice) read the
    tokens the tokenizer already decoded: a 128k vocabulary decoded again cost more than compiling the
    template."""
    vocab = tiny_vocab()
    if not template:
        vocab.pop("tokenizer.chat_template")
    path = write_model(tmp_path / "m.gguf", "tiny-llama", "F32", vocab=vocab)
    md = open_gguf(path).metadata
    n_tokens = len(vocab["tokenizer.ggml.tokens"])
    tok = Tokenizer.from_metadata(md)
    chat = ChatTemplate.from_metadata(md)
    assert decodes.count(n_tokens) == 1
    assert chat.source == ("gguf" if template else "builtin:chatml")
    assert tok.encode("<|im_start|>", special=True) == [tok.token_id("<|im_start|>")]


def test_empty_tokens_are_renamed_in_a_copy():
    """As llama.cpp: an empty token is "[EMPTY_<id>]"; the caller's list stays as it was."""
    vocab = tiny_vocab()
    tokens = vocab["tokenizer.ggml.tokens"]
    tokens[-1] = ""
    tok = Tokenizer.from_metadata(vocab)
    last = len(tokens) - 1
    assert tok.piece(last) == f"[EMPTY_{last}]" and tok.token_id(f"[EMPTY_{last}]") == last
    assert tokens[-1] == ""
