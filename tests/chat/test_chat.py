"""Chat templates: real templates render as transformers renders them, built-in fallbacks by architecture,
the sandbox refuses the known template-injection payloads, and rendering is bounded in time and size."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llamacli.chat.template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    builtin_for,
    chat_messages,
    encode_prompt,
    render_chat,
)
from llamacli.errors import TemplateError
from llamacli.ggufio.file import open_gguf
from llamacli.tokenizer.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Ünïcode ✓"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? Answer in {{ braces }} and <b>tags</b>."},
]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}

NAMED = [
    "Qwen-Qwen2.5-7B-Instruct",
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
    "microsoft-Phi-3.5-mini-instruct",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "HuggingFaceTB-SmolLM3-3B",
]


def transformers_render(source: str, messages: list[dict], add_generation_prompt: bool = True, **kw) -> str:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = utils.render_jinja_template(
        conversations=[messages], chat_template=source, add_generation_prompt=add_generation_prompt, **kw
    )
    return rendered[0]


def template_files(models: Path) -> list[Path]:
    return sorted((models / "templates").glob("*.jinja"))


# -- real templates ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_named_templates_match_transformers(name: str, add_generation_prompt: bool, llama_cpp_models: Path) -> None:
    path = llama_cpp_models / "templates" / f"{name}.jinja"
    if not path.exists():
        pytest.skip(f"{path.name} is not in this llama.cpp release")
    source = path.read_text(encoding="utf-8")
    want = transformers_render(source, CONVERSATION, add_generation_prompt, **SPECIAL)
    got = ChatTemplate(source, special_tokens=SPECIAL).render(CONVERSATION, add_generation_prompt)
    assert got == want
    assert "What is 2+2?" in got and "{{ braces }}" in got


def test_every_template_renders_as_transformers_does(llama_cpp_models: Path) -> None:
    """All of llama.cpp's real templates: the same text as transformers, or (tool-only templates, Gemma 2 with a
    system message) both refuse, ours with a TemplateError."""
    files = template_files(llama_cpp_models)
    assert len(files) >= 10
    agree = 0
    for path in files:
        source = path.read_text(encoding="utf-8")
        try:
            want = transformers_render(source, CONVERSATION, **SPECIAL)
        except Exception:
            want = None
        try:
            got = ChatTemplate(source, special_tokens=SPECIAL).render(CONVERSATION)
        except TemplateError:
            got = None
        assert got == want, path.name
        agree += want is not None
    assert agree >= len(files) - 8


REASONING = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "thinking": "Greet back."},
     {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "Be kind."},
     {"role": "user", "content": "Bye"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning": "Short.",
                                          "thinking": "Other."}, {"role": "user", "content": "Bye"}],
]


def test_reasoning_fields_reach_templates_as_transformers_passes_them(llama_cpp_models: Path) -> None:
    """An assistant message's reasoning given as `thinking`, `reasoning_content` or `reasoning`: every real
    template renders it as transformers does (Qwen3 reads reasoning_content, gpt-oss thinking)."""
    seen_reasoning = 0
    for path in template_files(llama_cpp_models):
        source = path.read_text(encoding="utf-8")
        for conversation in REASONING:
            try:
                want = transformers_render(source, conversation, **SPECIAL)
            except Exception:
                want = None
            try:
                got = ChatTemplate(source, special_tokens=SPECIAL).render(conversation)
            except TemplateError:
                got = None
            assert got == want, (path.name, conversation[1])
            seen_reasoning += want is not None and any(w in want for w in ("Greet back.", "Be kind.", "Short."))
    assert seen_reasoning >= 6  # Qwen3, gpt-oss, DeepSeek...: templates that print the reasoning do print it


def test_gguf_template_from_the_smollm2_file(smollm2: Path) -> None:
    md = open_gguf(smollm2).metadata
    template = ChatTemplate.from_metadata(md)
    assert template.source == "gguf"
    text = template.render(chat_messages("Hi", system="Be brief"))
    assert text == "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert text == transformers_render(md["tokenizer.chat_template"], chat_messages("Hi", "Be brief"),
                                       bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert render_chat(md, chat_messages("Hi", "Be brief")) == text
    ids = encode_prompt(Tokenizer.from_metadata(md), text)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|>, and two <|im_end|> parsed as tokens


# -- built-in fallbacks --------------------------------------------------------------------------------------


def test_builtin_formats_exactly() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    render = {name: ChatTemplate.builtin(name, SPECIAL).render(messages) for name in BUILTIN_TEMPLATES}
    assert render["chatml"] == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render["llama3"] == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "U1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|><|start_header_id|>user"
        "<|end_header_id|>\n\nU2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render["phi3"] == (
        "<|system|>\nS<|end|>\n<|user|>\nU1<|end|>\n<|assistant|>\nA1<|end|>\n<|user|>\nU2<|end|>\n<|assistant|>\n"
    )
    assert render["llama2"] == "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\nU1 [/INST] A1 </s><s>[INST] U2 [/INST]"
    assert render["gemma"] == (
        "<s><start_of_turn>user\nS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
        "<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n"
    )
    assert ChatTemplate.builtin("chatml").render(messages, add_generation_prompt=False).endswith("U2<|im_end|>\n")
    with pytest.raises(TemplateError, match="no built-in"):
        ChatTemplate.builtin("vicuna")


@pytest.mark.parametrize(
    "vocab, arch, want",
    [
        ("qwen2", "qwen2", "chatml"),
        ("llama-bpe", "llama", "llama3"),
        ("phi-3", "phi3", "phi3"),
        ("llama-spm", "llama", "llama2"),
        ("gpt-2", "gpt2", "chatml"),
    ],
)
def test_fallback_by_architecture(vocab: str, arch: str, want: str, llama_cpp_models: Path) -> None:
    md = dict(open_gguf(llama_cpp_models / f"ggml-vocab-{vocab}.gguf").metadata)
    md.pop("tokenizer.chat_template", None)
    md["general.architecture"] = arch
    assert builtin_for(md) == want
    template = ChatTemplate.from_metadata(md)
    assert template.source == f"builtin:{want}"
    tok = Tokenizer.from_metadata(md)
    ids = encode_prompt(tok, template.render(chat_messages("Hello", system="Sys")))
    if tok.add_bos:
        assert ids[0] == tok.bos_id and ids[1] != tok.bos_id  # BOS once, even where the template writes it
    specials = {"chatml": "<|im_start|>", "llama3": "<|start_header_id|>", "phi3": "<|user|>", "llama2": "<s>"}
    if want != "chatml" or vocab == "qwen2":  # GPT-2's vocabulary has no ChatML tokens: they stay text
        assert tok.token_id(specials[want]) in ids


# Gemma 3's official chat template (google/gemma-3-*-it tokenizer_config.json, as transformers renders it).
GEMMA3_OFFICIAL = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)

GEMMA_CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "  Spaces kept around the system text \n"}, {"role": "user", "content": " \tpadded\n\n"}],
    [{"role": "system", "content": "Sys"}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": " 4.\n"}, {"role": "user", "content": "And 3+3? {{ braces }} <b>"}],
    [{"role": "user", "content": "Ünïcode ✓ 日本語 🦙"}, {"role": "assistant", "content": "<start_of_turn> as text"},
     {"role": "user", "content": "line\nbreaks\n\nkept"}],
]


@pytest.mark.parametrize("conversation", GEMMA_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma_builtin_renders_as_the_official_gemma3_template(conversation, add_generation_prompt) -> None:
    """Gemma files carry no template: the built-in gives transformers' rendering of the official one, system
    message folded into the first user turn (untrimmed, then a blank line), user and model turns trimmed."""
    special = {"bos_token": "<bos>", "eos_token": "<eos>"}
    want = transformers_render(GEMMA3_OFFICIAL, conversation, add_generation_prompt, **special)
    assert ChatTemplate.builtin("gemma", special).render(conversation, add_generation_prompt) == want


def test_gemma_builtin_renders_what_the_official_template_refuses() -> None:
    """As llama.cpp's built-in: roles that do not alternate, and a system message later on (it goes in front of
    the next user turn), render instead of failing a chat."""
    conversation = [{"role": "user", "content": "A"}, {"role": "user", "content": "B"},
                    {"role": "system", "content": "S"}, {"role": "assistant", "content": "C"},
                    {"role": "user", "content": "D"}]
    with pytest.raises(Exception, match="alternate"):
        transformers_render(GEMMA3_OFFICIAL, conversation, bos_token="<bos>")
    assert ChatTemplate.builtin("gemma", {"bos_token": "<bos>"}).render(conversation) == (
        "<bos><start_of_turn>user\nA<end_of_turn>\n<start_of_turn>user\nB<end_of_turn>\n"
        "<start_of_turn>model\nC<end_of_turn>\n<start_of_turn>user\nS\n\nD<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize(
    "arch, tokens, want",
    [
        ("gemma3", [], "gemma"),
        ("gemma2", [], "gemma"),
        ("gemma", [], "gemma"),
        ("llama", ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"], "gemma"),  # by vocabulary
        ("llama", ["<unk>", "<s>", "</s>", "<start_of_turn>"], "llama2"),  # half a turn format is not Gemma's
        ("gemma4", ["<bos>", "<|turn>", "<turn|>"], "chatml"),  # Gemma 4 files bring their template
    ],
)
def test_gemma_is_chosen_by_architecture_then_vocabulary(arch, tokens, want) -> None:
    model = "gemma4" if arch == "gemma4" else "llama"
    md = {"general.architecture": arch, "tokenizer.ggml.model": model, "tokenizer.ggml.tokens": tokens}
    assert builtin_for(md) == want
    assert ChatTemplate.from_metadata(md).source == f"builtin:{want}"


# -- the sandbox ---------------------------------------------------------------------------------------------

PAYLOADS = [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ [].__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ self.__init__.__globals__.__builtins__ }}",
    "{{ lipsum.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ request.application.__globals__.__builtins__.__import__('os').popen('id').read() }}",
    "{{ config.__class__.__init__.__globals__['os'] }}",
    "{{ ''|attr('__class__') }}",
    "{{ ()|attr('\\x5f\\x5fclass\\x5f\\x5f') }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ messages.__class__ }}",
    "{{ messages['__class__'] }}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ range.__self__ }}",
    "{{ dict.__class__.__mro__ }}",
    "{% set ns = namespace(__class__=1) %}",
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    "{% for m in messages %}{{ loop.__class__ }}{% endfor %}",
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_injection_payloads_raise_template_error(payload: str) -> None:
    with pytest.raises(TemplateError):
        ChatTemplate(payload).render(CONVERSATION)


@pytest.mark.parametrize(
    "template",
    [
        "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
        "{{ joiner.__init__.__globals__['os'].system('touch MARKER') }}",
        "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
        "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
        "{{ c(['touch', 'MARKER']) }}{% endif %}{% endfor %}",
        "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}",
        "{{ request.application.__globals__.__builtins__.open('MARKER', 'w').write('x') }}",
        "{{ namespace.__init__.__globals__.__builtins__.open('MARKER', 'w') }}",
    ],
)
def test_file_writing_payloads_write_nothing(template: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(TemplateError):
        ChatTemplate(template.replace("MARKER", str(marker))).render(CONVERSATION)
    assert not marker.exists()


def test_template_errors_are_clean() -> None:
    with pytest.raises(TemplateError, match="raised: roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(CONVERSATION)
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}")
    with pytest.raises(TemplateError, match="undefined"):
        ChatTemplate("{{ nothing.here }}").render(CONVERSATION)
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 1 / 0 }}").render(CONVERSATION)
    with pytest.raises(TemplateError, match="messages"):
        ChatTemplate("x").render("not a list")  # type: ignore[arg-type]


def test_template_helpers_behave_like_transformers() -> None:
    t = ChatTemplate("{{ messages[0]|tojson }}|{{ strftime_now('%Y') }}|{{ dict(a=1)|tojson }}")
    out = t.render([{"role": "user", "content": "é ✓"}])
    assert out.split("|")[0] == '{"role": "user", "content": "é ✓"}'
    assert out.split("|")[1] == time.strftime("%Y")
    assert out.split("|")[2] == '{"a": 1}'
    # trim_blocks + lstrip_blocks: block lines leave no blank lines or indentation behind
    t = ChatTemplate("{% for m in messages %}\n    {% if m.role %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert t.render([{"role": "u", "content": "a"}, {"role": "u", "content": "b"}]) == "a\nb\n"
    # loopcontrols and transformers' {% generation %} marker
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                     "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert t.render([{"role": "u", "content": "a"}, {"role": "u", "content": "b"}]) == "a"
    # extra variables reach the template; the caller's messages are not modified
    messages = [{"role": "user", "content": "x"}]
    assert ChatTemplate("{{ enable_thinking }}").render(messages, enable_thinking=False) == "False"
    assert messages == [{"role": "user", "content": "x"}]


# -- bounded rendering ---------------------------------------------------------------------------------------

RUNAWAY = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}", "longer than"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "exceeds"),
    ("{% for i in range(10**9) %}{% endfor %}", "range"),
    ("{{ 'x' * 10**10 }}", "exceed"),
    ("{{ [1] * 10**9 }}", "exceed"),
    ("{{ 9 ** (9 ** 9) }}", "too large"),
    ("{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "exceed"),
    ("{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "exceed"),
    ("{{ 'x'|center(10**10) }}", "exceed"),
    ("{{ 'x'.ljust(10**10) }}", "exceed"),
    ("{{ '%999999999999d' % 1 }}", "exceed"),
    ("{{ '%999999999999d'|format(1) }}", "exceed"),
    ("{{ '{:>99999999999}'.format(1) }}", "exceed"),
    ("{{ ('x' * 1000000).replace('x', 'yyyyyyyyyyyy') }}", "exceed"),
    ("{{ ('x' * 1000000)|replace('x', 'yyyyyyyyyyyy') }}", "exceed"),
    ("{{ (['x' * 100000] * 100)|join }}", "exceed"),
    ("{{ ['x' * 100000] * 100 }}", "exceed"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed"),
]


@pytest.mark.parametrize("template, why", RUNAWAY)
def test_runaway_templates_are_stopped(template: str, why: str) -> None:
    start = time.monotonic()
    with pytest.raises(TemplateError, match=why):
        ChatTemplate(template, max_chars=1_000_000, timeout_s=0.5).render(CONVERSATION)
    assert time.monotonic() - start < 5.0


def test_limits_leave_normal_templates_alone() -> None:
    t = ChatTemplate("{{ 'ab' * 3 }}|{{ [1, 2]|join(',') }}|{{ '%03d'|format(7) }}|{{ '{:>3}'.format('x') }}|"
                     "{{ 'a b'.replace(' ', '_') }}|{{ 2 ** 10 }}|{% for i in range(3) %}{{ i }}{% endfor %}|"
                     "{{ messages|map(attribute='role')|join(' ') }}", max_chars=1000, timeout_s=0.5)
    assert t.render(CONVERSATION) == "ababab|1,2|007|  x|a_b|1024|012|system user assistant user"


def test_deadline_works_in_any_thread_and_leaves_nothing_pending() -> None:
    import threading

    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            ChatTemplate(looping, timeout_s=0.3).render([])
        except BaseException as exc:  # noqa: BLE001 (the test wants to see whatever came out)
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], TemplateError)
    # Renders that end right at their deadline leave no watchdog exception pending for the code after them.
    for timeout in (0.0005, 0.001, 0.002, 0.005, 0.01):
        for _ in range(4):
            try:
                ChatTemplate("{% for i in range(3000) %}{{ i }}{% endfor %}", timeout_s=timeout).render([])
            except TemplateError:
                pass
    total = 0
    for i in range(300_000):  # a pending asynchronous exception would surface in this loop
        total += i
    assert total == 44_999_850_000


def test_a_firing_inside_the_watchdogs_enter_leaves_no_second_one(monkeypatch) -> None:
    """A deadline shorter than the time to enter the watchdog fires inside its __enter__, so the with-statement
    never calls __exit__: the render still ends in a TemplateError, and nothing fires into the code after it
    when the watchdog's second firing (REFIRE_S later) comes due."""
    import threading

    from llamacli.chat import template_watchdog as W

    real_start = threading.Thread.start

    def slow_start(self: threading.Thread) -> None:
        real_start(self)
        if self.name == "template-watchdog":
            time.sleep(0.05)  # the watchdog's deadline passes before __enter__ returns: it fires in there

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    for _ in range(3):
        with pytest.raises(TemplateError, match="longer than"):
            ChatTemplate("{{ 'x' }}", timeout_s=0.001).render([])
    monkeypatch.undo()
    end = time.monotonic() + W.REFIRE_S + 0.3
    spins = 0
    while time.monotonic() < end:  # a second firing would surface in this loop
        spins += 1
    assert spins > 0


def test_builtin_choice_ignores_hostile_metadata_types() -> None:
    """An architecture that is an array or a number and token lists holding arrays pick a format (the
    fuzzer's find: a TypeError from `in` on an unhashable value)."""
    assert builtin_for({"general.architecture": ["gemma3"], "tokenizer.ggml.tokens": [["<|eot_id|>"], 7]}) == "chatml"
    assert builtin_for({"general.architecture": 3, "tokenizer.ggml.tokens": ["<start_of_turn>", "<end_of_turn>"]}) == "gemma"
    assert builtin_for({"tokenizer.ggml.tokens": "not a list"}) == "chatml"
