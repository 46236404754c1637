"""Chat templates: a conversation -> the prompt text the model was trained on.

The template is the file's `tokenizer.chat_template` (Jinja, as in the model's tokenizer_config.json), rendered
the way transformers' apply_chat_template renders it: an ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`, and a `tojson` that keeps
non-ASCII text. A file without one gets a built-in format chosen by architecture and vocabulary (ChatML,
Llama 3, Phi-3, Gemma, Llama 2 [INST], gpt-oss's harmony); `.source` says which ('gguf' or 'builtin:<name>').

Templates come from downloaded files, so they are untrusted code: they compile and render in the sandbox of
template_sandbox.py, bounded in source size, time, memory and output size. Every failure is a TemplateError.
"""

from __future__ import annotations

from typing import Any

from ..errors import TemplateError
from ..tokenizer.tokenizer import TooManyTokens
from . import template_sandbox
from .template_sandbox import DEFAULT_MAX_CHARS, DEFAULT_TIMEOUT_S, MAX_RANGE, MAX_SOURCE_CHARS  # noqa: F401 (API)

# -- built-in formats ------------------------------------------------------------------------------------------

BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        " + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "phi3": (
        "{% for message in messages %}"
        "{% if message['role'] in ('system', 'user', 'assistant') and message['content'] %}"
        "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
    ),
    "llama2": (
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
        "{% for message in turns %}"
        "{% if message['role'] == 'user' %}"
        "{% set content = message['content'] %}"
        "{% if loop.first and system %}"
        "{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + content %}"
        "{% endif %}"
        "{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
        "{% endif %}"
        "{% endfor %}"
    ),
    # Gemma 1-3 (llama.cpp's LLM_CHAT_TEMPLATE_GEMMA): "assistant" is "model", and Gemma has no system turn,
    # so a system message goes in front of the next user turn followed by a blank line, untrimmed, as the
    # official Gemma 3 template does for its first message. Unlike that template, roles that do not alternate
    # are rendered, not refused (llama.cpp's built-in is as lenient).
    "gemma": (
        "{{ bos_token }}"
        "{% set ns = namespace(system='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}"
        "{% set ns.system = ns.system + message['content'] + '\n\n' %}"
        "{% else %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' }}"
        "{% if role != 'model' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
        "{{ message['content'] | trim + '<end_of_turn>\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    # gpt-oss's harmony format (openai/harmony), as its chat_template.jinja renders a conversation without tools:
    # the system message with the reasoning effort, the caller's system message as the developer's instructions,
    # earlier answers as their final channel (their analysis dropped), the reply opened with <|start|>assistant.
    "harmony": (
        "{{ '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\nReasoning: ' }}"
        "{{ (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n# Valid channels: analysis, "
        "commentary, final. Channel must be included for every message.<|end|>' }}"
        "{% if messages and messages[0]['role'] in ('system', 'developer') %}"
        "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
        "{% if system %}{{ '<|start|>developer<|message|># Instructions\n\n' + system + '\n\n<|end|>' }}{% endif %}"
        "{% for message in turns %}"
        "{% if message['role'] == 'assistant' %}"
        "{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
        "{% elif message['role'] == 'user' %}{{ '<|start|>user<|message|>' + message['content'] + '<|end|>' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
    ),
}

GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding"})
# The tokens builtin_for looks for.
_SIGNS = frozenset({"<start_of_turn>", "<end_of_turn>", "<|start|>", "<|channel|>", "<|message|>", "<|eot_id|>",
                    "<|start_header_id|>", "<|im_start|>"})


def builtin_for(md: dict[str, Any], arch: str | None = None) -> str:
    """The built-in format for a file without a template: by architecture, then by vocabulary (the tokens
    llama.cpp's llm_chat_detect_template looks for in a template's text)."""
    arch = arch or md.get("general.architecture")
    arch = arch if isinstance(arch, str) else None  # a hostile file's array or number names nothing
    tokens = md.get("tokenizer.ggml.tokens")
    # Which of the tokens below the vocabulary holds (a scan for each, comparing: no set of all its tokens, and
    # an unhashable item of a hostile list is only unequal).
    has = {s for s in _SIGNS if s in tokens}.__contains__ if isinstance(tokens, list) else set().__contains__
    if arch == "qwen2":
        return "chatml"
    if arch in GEMMA_ARCHITECTURES or (has("<start_of_turn>") and has("<end_of_turn>")):
        return "gemma"
    if arch == "gpt-oss" or (has("<|start|>") and has("<|channel|>") and has("<|message|>")):
        return "harmony"
    if has("<|eot_id|>") or has("<|start_header_id|>"):
        return "llama3"
    if arch == "phi3":
        return "phi3"
    if md.get("tokenizer.ggml.model") == "llama" and not has("<|im_start|>"):
        return "llama2"
    return "chatml"  # llama.cpp's default too


# -- the template ---------------------------------------------------------------------------------------------


class ChatTemplate:
    """A compiled chat template. `render(messages)` -> prompt text; `source` is 'gguf' or 'builtin:<name>'."""

    def __init__(
        self,
        text: str,
        *,
        source: str = "custom",
        special_tokens: dict[str, str] | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if not isinstance(text, str):
            raise TemplateError(f"a chat template must be text, got {type(text).__name__}")
        self.text = text
        self.source = source
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... as the template sees them
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self._template = template_sandbox.compile_template(text, source, max_chars, timeout_s)

    @classmethod
    def from_metadata(cls, md: dict[str, Any], arch: str | None = None, **limits: Any) -> "ChatTemplate":
        """The file's tokenizer.chat_template, else the built-in format for its architecture/vocabulary."""
        special = _special_token_texts(md)
        text = md.get("tokenizer.chat_template")
        if isinstance(text, str) and text.strip():
            return cls(text, source="gguf", special_tokens=special, **limits)
        name = builtin_for(md, arch)
        return cls(BUILTIN_TEMPLATES[name], source=f"builtin:{name}", special_tokens=special, **limits)

    @classmethod
    def builtin(cls, name: str, special_tokens: dict[str, str] | None = None, **limits: Any) -> "ChatTemplate":
        if name not in BUILTIN_TEMPLATES:
            raise TemplateError(f"no built-in chat template {name!r} (have: {', '.join(BUILTIN_TEMPLATES)})")
        return cls(BUILTIN_TEMPLATES[name], source=f"builtin:{name}", special_tokens=special_tokens, **limits)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt for `messages` ([{'role': 'user', 'content': '...'}, ...]). Extra variables (tools,
        enable_thinking, ...) reach the template as they are, after conversion to plain JSON-like data."""
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise TemplateError("chat messages must be a list of {'role': ..., 'content': ...} dicts")
        context: dict[str, Any] = {
            "messages": _plain([_alias_reasoning(m) for m in messages]),
            "tools": None,
            "documents": None,
            "add_generation_prompt": bool(add_generation_prompt),
            **self.special_tokens,
            **_plain(variables),
        }
        return template_sandbox.render(self._template, context, self.source, self.max_chars, self.timeout_s)

    def __repr__(self) -> str:
        return f"ChatTemplate(source={self.source!r}, {len(self.text)} chars)"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is the one most templates read


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by, as transformers passes it: Qwen3-style
    templates read `reasoning_content`, gpt-oss reads `thinking`; callers write either, or `reasoning`."""
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(
    md: dict[str, Any], messages: list[dict[str, Any]], add_generation_prompt: bool = True, arch: str | None = None
) -> str:
    """One-shot: ChatTemplate.from_metadata(md, arch).render(messages, add_generation_prompt)."""
    return ChatTemplate.from_metadata(md, arch).render(messages, add_generation_prompt)


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    """[system?, user] as template messages."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": "user", "content": user}]


def encode_prompt(tokenizer: Any, prompt: str, *, add_bos: bool | None = None, limit: int | None = None) -> list[int]:
    """Token ids of a rendered chat prompt: special-token strings become their ids, and BOS is added as the
    file says (add_bos None) unless the template already wrote it. No EOS: the model answers next. `limit`:
    more ids than that (BOS counted) is the tokenizer's TooManyTokens, found without tokenizing it whole."""
    ids = tokenizer.encode(prompt, special=True, add_bos=False, add_eos=False, limit=limit)
    want_bos = tokenizer.add_bos if add_bos is None else add_bos
    if want_bos and tokenizer.bos_id is not None and not (ids and ids[0] == tokenizer.bos_id):
        ids.insert(0, tokenizer.bos_id)
        if limit is not None and len(ids) > limit:
            raise TooManyTokens(limit, len(ids))
    return ids


def _special_token_texts(md: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token as transformers passes them: from the file's ids."""
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        return {}
    spm = md.get("tokenizer.ggml.model") == "llama"
    out = {}
    keys = (("bos", "bos", 1), ("eos", "eos", 2), ("unk", "unknown", 0), ("pad", "padding", None))
    for name, key, spm_default in keys:
        tid = md.get(f"tokenizer.ggml.{key}_token_id")
        if not isinstance(tid, int) and spm:
            tid = spm_default  # llama.cpp's defaults for a SentencePiece vocabulary
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            out[f"{name}_token"] = tokens[tid]
    return out


def _plain(value: Any) -> Any:
    """Plain data only (str, int, float, bool, None, dict, list, tuple): no object with methods reaches the
    template. Anything else becomes a '<TypeName>' placeholder, as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"
