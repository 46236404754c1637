"""A tiny vocabulary with gpt-oss's harmony tokens, for tests of the harmony chat format (and tiny gpt-oss models).

The special tokens are spelled, typed and chosen as in a real gpt-oss GGUF (o200k_harmony: control tokens,
BOS <|startoftext|>, EOS <|return|>, padding <|endoftext|>); the rest is testing.tiny_vocab's byte-level BPE.
The chat template is the caller's: the real one is llama.cpp's models/templates/openai-gpt-oss-120b.jinja (the
`llama_cpp_models` test fixture), the same text as the file's tokenizer.chat_template.
"""

from __future__ import annotations

from typing import Any

from . import tiny_vocab

GPT_OSS_TEMPLATE = "openai-gpt-oss-120b.jinja"  # in llama.cpp's models/templates/
HARMONY_TOKENS = ("<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                  "<|message|>", "<|call|>")
CONTROL = 3


def harmony_vocab(template: str | None = None) -> dict[str, Any]:
    """tiny_vocab() plus the harmony control tokens, with gpt-oss's BOS/EOS/padding and `template` as
    tokenizer.chat_template (None: no template)."""
    vocab = tiny_vocab()
    tokens = list(vocab["tokenizer.ggml.tokens"]) + list(HARMONY_TOKENS)
    ids = {t: i for i, t in enumerate(tokens)}
    vocab.update({
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": list(vocab["tokenizer.ggml.token_type"]) + [CONTROL] * len(HARMONY_TOKENS),
        "tokenizer.ggml.bos_token_id": ids["<|startoftext|>"],
        "tokenizer.ggml.eos_token_id": ids["<|return|>"],
        "tokenizer.ggml.padding_token_id": ids["<|endoftext|>"],
        "tokenizer.ggml.pre": "gpt-4o",
    })
    if template is None:
        del vocab["tokenizer.chat_template"]
    else:
        vocab["tokenizer.chat_template"] = template
    return vocab
