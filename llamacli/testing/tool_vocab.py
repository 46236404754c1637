"""Tiny vocabularies with a model family's chat-template tokens, for tests of tool calling (chat/tool_*.py, the
server's tools): testing.tiny_vocab's byte-level BPE plus the family's special tokens, typed as in the real
GGUF files (control tokens for Llama 3's headers and <|python_tag|>, Mistral's [INST] and [TOOL_CALLS], Gemma
4's <|tool_call>; user-defined for Qwen's <tool_call> and <think>), with the template given (the real one is in
llama.cpp's models/templates/, the `llama_cpp_models` test fixture)."""

from __future__ import annotations

from typing import Any

from . import tiny_vocab
from .harmony import harmony_vocab

CONTROL, USER_DEFINED = 3, 4

# family -> (template file, [(token, type)], BOS, EOS)
FAMILIES: dict[str, tuple[str, list[tuple[str, int]], str | None, str]] = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", [(t, USER_DEFINED) for t in ("<tool_call>", "</tool_call>", "<think>",
                                                                     "</think>")], None, "<|im_end|>"),
    "qwen3.5": ("Qwen3.5-4B.jinja", [(t, USER_DEFINED) for t in ("<tool_call>", "</tool_call>", "<think>",
                                                                 "</think>")], None, "<|im_end|>"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", [(t, CONTROL) for t in (
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
        "<|python_tag|>")], "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", [(t, CONTROL) for t in (
        "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
        "[TOOL_CONTENT]")], "<s>", "</s>"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", [(t, CONTROL) for t in (
        "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]", "[/TOOL_RESULTS]")], "<s>", "</s>"),
    "gemma4": ("google-gemma-4-31B-it.jinja", [(t, CONTROL) for t in (
        "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
        "<tool_response|>", '<|"|>', "<|channel>", "<channel|>")], "<bos>", "<turn|>"),
    "gemma2": ("google-gemma-2-2b-it.jinja", [(t, CONTROL) for t in ("<bos>", "<start_of_turn>", "<end_of_turn>")],
               "<bos>", "<end_of_turn>"),
    "gpt-oss": ("openai-gpt-oss-120b.jinja", [], None, "<|return|>"),
}


def gemma4_vocab(template: str | None) -> dict[str, Any]:
    """tool_vocab("gemma4", template) with its special tokens typed as llama.cpp's converter types them in real files
    (conversion/gemma.py Gemma4Model.set_vocab): the channel and tool markers user-defined, so that the detokenizer
    prints them and the reply's parsers see them; <|turn>, <turn|>, <|think|> control tokens."""
    vocab = tool_vocab("gemma4", template)
    shown = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'}
    tokens = list(vocab["tokenizer.ggml.tokens"]) + ["<|think|>"]
    types = [USER_DEFINED if t in shown else k for t, k in zip(tokens, vocab["tokenizer.ggml.token_type"])] + [CONTROL]
    vocab.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types})
    return vocab


def tool_vocab(family: str, template: str | None) -> dict[str, Any]:
    """tiny_vocab() with `family`'s special tokens, BOS and EOS, and `template` as tokenizer.chat_template."""
    if family == "gpt-oss":
        return harmony_vocab(template)
    _, extra, bos, eos = FAMILIES[family]
    vocab = tiny_vocab()
    tokens = list(vocab["tokenizer.ggml.tokens"])
    types = list(vocab["tokenizer.ggml.token_type"])
    for text, kind in extra:
        if text not in tokens:
            tokens.append(text)
            types.append(kind)
    ids = {t: i for i, t in enumerate(tokens)}
    vocab.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                  "tokenizer.ggml.eos_token_id": ids[eos], "tokenizer.ggml.add_bos_token": bos is not None})
    if bos is not None:
        vocab["tokenizer.ggml.bos_token_id"] = ids[bos]
    if template is None:
        del vocab["tokenizer.chat_template"]
    else:
        vocab["tokenizer.chat_template"] = template
    return vocab
