"""gpt-oss's harmony chat format: the real template renders as jinja2 and transformers render it, the analysis
channel splits from the final one however the stream is cut, and generate / chat / run / serve put the reasoning
on stderr (or `reasoning`, `reasoning_content`) and only the answer on stdout.

End to end, a tiny model with a harmony vocabulary and the real template runs through the real engine with its
sampler replaced by a script (the ids of a harmony reply): the words are the script's, everything else (prompt,
prefill, end of generation at <|return|>, detokenizer, splitter, commands) is the program's."""

from __future__ import annotations

import json
import random
import time
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from clirun import run
from llamacli.chat import template_sandbox
from llamacli.chat.harmony import MARKERS, HarmonySplitter, split_harmony
from llamacli.chat.reasoning import ReplyRouter, make_splitter, reply_format, split_reasoning, template_variables
from llamacli.chat.template import ChatTemplate
from llamacli.testing import variant, write_model
from llamacli.testing.harmony import GPT_OSS_TEMPLATE, harmony_vocab
from llamacli.tokenizer.tokenizer import StreamDecoder, Tokenizer

NOW = datetime(2025, 8, 5, 12, 0, 0)


@pytest.fixture(scope="module")
def template(llama_cpp_models: Path) -> str:
    path = llama_cpp_models / "templates" / GPT_OSS_TEMPLATE
    if not path.exists():
        pytest.skip(f"{path.name} is not in this llama.cpp release")
    return path.read_text(encoding="utf-8")


# -- the template ------------------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather <now> & 'later'",
    "parameters": {"type": "object", "required": ["location"], "properties": {
        "location": {"type": "string", "description": "A city"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "array", "items": {"type": "integer"}},
        "options": {"type": "object", "properties": {"exact": {"type": "boolean"}}}}}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse. Ünïcode ✓ {{ braces }}"}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello.", "thinking": "Greet back."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello.", "reasoning_content": "Be kind."},
     {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}],
    [{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "thinking": "Call the tool.",
      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]},
     {"role": "tool", "content": '{"t": 20}'}, {"role": "assistant", "content": "20 °C."},
     {"role": "user", "content": "Thanks"}],
]
VARIABLES = [{}, {"reasoning_effort": "high"}, {"reasoning_effort": "low", "enable_thinking": False},
             {"model_identity": "You are Tiny.", "builtin_tools": ["browser", "python"]}]


class _Frozen(datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ANN001, ANN206
        return NOW


def jinja2_render(source: str, messages: list[dict], add_generation_prompt: bool, **variables) -> str:
    """Plain jinja2, set up as transformers' apply_chat_template sets it up (its _compile_jinja_template)."""

    def raise_exception(message):  # noqa: ANN001, ANN202
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # noqa: ANN001, ANN202
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: NOW.strftime(fmt))
    return env.from_string(source).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def test_the_real_template_renders_as_jinja2_and_transformers_render_it(template, monkeypatch):
    monkeypatch.setattr(template_sandbox, "datetime", _Frozen)
    try:
        from transformers.utils import chat_template_utils
    except ImportError:
        chat_template_utils = None
    compiled = ChatTemplate(template, source="gguf")
    checked = 0
    for conversation in CONVERSATIONS:
        for variables in VARIABLES:
            for add_generation_prompt in (True, False):
                for tools in (None, TOOLS):
                    kw = {**variables, **({"tools": tools} if tools else {})}
                    got = compiled.render(conversation, add_generation_prompt, **kw)
                    assert got == jinja2_render(template, conversation, add_generation_prompt, **kw)
                    if chat_template_utils is not None:
                        with monkeypatch.context() as m:
                            m.setattr(chat_template_utils, "datetime", _Frozen, raising=False)
                            want = chat_template_utils.render_jinja_template(
                                conversations=[conversation], chat_template=template,
                                add_generation_prompt=add_generation_prompt, **kw)[0][0]
                        assert got == want
                    checked += 1
    assert checked == len(CONVERSATIONS) * len(VARIABLES) * 4


def test_what_the_template_makes_of_a_conversation(template, monkeypatch):
    monkeypatch.setattr(template_sandbox, "datetime", _Frozen)
    text = ChatTemplate(template).render(CONVERSATIONS[1], reasoning_effort="high")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                           "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: high\n\n")
    assert "<|start|>developer<|message|># Instructions\n\nBe terse." in text  # the system message
    # An earlier answer goes back as its final channel; its analysis is dropped.
    assert "<|start|>assistant<|channel|>final<|message|>Hello.<|end|><|start|>user<|message|>2+2?<|end|>" in text
    assert "Greet back." not in text
    assert text.endswith("<|start|>assistant") and reply_format(text) == "harmony"


def test_the_builtin_format_for_a_file_without_a_template_renders_as_the_real_one(template, monkeypatch):
    from llamacli.chat.template import builtin_for

    monkeypatch.setattr(template_sandbox, "datetime", _Frozen)
    assert builtin_for({"general.architecture": "gpt-oss"}) == "harmony"
    vocab = harmony_vocab()
    assert builtin_for({**vocab, "general.architecture": "llama"}) == "harmony"  # by its vocabulary
    fallback = ChatTemplate.from_metadata({**vocab, "general.architecture": "gpt-oss"})
    assert fallback.source == "builtin:harmony"
    real = ChatTemplate(template)
    plain = [[{k: v for k, v in m.items() if k != "thinking" and k != "reasoning_content"} for m in c]
             for c in CONVERSATIONS[:3]]
    for conversation in plain + [[{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}]]:
        for variables in ({}, {"reasoning_effort": "low"}):
            assert fallback.render(conversation, **variables) == real.render(conversation, **variables)


def test_think_flags_and_efforts_as_template_variables(template):
    assert template_variables(template, None) == {}
    assert template_variables(template, True) == {"enable_thinking": True}  # the template's default: medium
    assert template_variables(template, False) == {"enable_thinking": False, "reasoning_effort": "low"}
    assert template_variables(template, "high") == {"enable_thinking": True, "reasoning_effort": "high"}
    qwen = "{% if enable_thinking is false %}<think>\n\n</think>{% endif %}"
    assert template_variables(qwen, False) == {"enable_thinking": False}
    assert template_variables(qwen, "low") == {"enable_thinking": True}


# -- splitting a reply -------------------------------------------------------------------------------------------

CASES = [
    # (reply as the detokenizer prints it, reasoning, answer)
    ("<|channel|>analysis<|message|>2+2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>4.",
     "2+2 is 4.", "4."),
    ("<|channel|>final<|message|>Just the answer.", "", "Just the answer."),
    ("<|channel|>analysis<|message|>Only thinking.<|end|>", "Only thinking.", ""),
    ("<|channel|>analysis<|message|>Cut off in the mid", "Cut off in the mid", ""),  # max tokens
    ("<|channel|>analysis<|message|>Thought.<|end|><|start|>assist", "Thought.", ""),
    ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking."
     "<|end|><|start|>assistant<|channel|>final<|message|>Done.", "Plan.", "Checking.\n\nDone."),
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Paris"}',
     '{"location": "Paris"}', ""),
    ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary to=functions.f "
     "<|constrain|>json<|message|>{}", "Need it.\n\n{}", ""),
    ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|>"
     "<|start|>assistant<|channel|>final <|constrain|>json<|message|>{\"x\": 1}", "A.\n\nB.", '{"x": 1}'),
    ("<|channel|>analysis<|message|>No end.<|channel|>final<|message|>Still split.", "No end.", "Still split."),
    ("<|channel|>analysis<|message|>x<|end|><|start|>user<|message|>A made-up user turn.<|end|>", "x", ""),
    ("<|channel|>analysis<|message|>a < b and <|x|> is text<|end|><|start|>assistant<|channel|>final<|message|>"
     "1 <| 2", "a < b and <|x|> is text", "1 <| 2"),
    ("<|channel|>analysis<|message|>Ünïcode ✓<|end|><|start|>assistant<|channel|>final<|message|>日本語",
     "Ünïcode ✓", "日本語"),
    ("Plain text: the model ignored the format.", "", "Plain text: the model ignored the format."),
    ("<|channel|>fin", "", ""),
    ("", "", ""),
    # no text is lost: a header longer than MAX_HEADER is text, as are words before a header and after <|end|>
    ("x" * 300 + "<|channel|>final<|message|>hi", "", "x" * 300 + "\n\nhi"),
    ("<|channel|>" + "y" * 300 + "<|message|>z", "", "y" * 300 + "z"),
    ("Sure.<|channel|>final<|message|>hi", "", "Sure.\n\nhi"),
    ("<|channel|>analysis<|message|>t<|end|>The answer is 4.", "t", "The answer is 4."),
    ("<|channel|>analysis<|message|>t<|end|>\n <|start|>assistant<|channel|>final<|message|>4", "t", "4"),
    ("<|channel|>final<|message|>A<|end|>B<|return|>", "", "A\n\nB"),
    ("<|channel|>analysis<|message|>t<|end|><|start|>Plain words, cut off", "t", "Plain words, cut off"),
    ("<|channel|>analysis<|message|>t<|end|><|start|>functions.f to=assistant<|channel|>commentary<|message|>{}",
     "t", ""),  # the model writing a tool's answer: nowhere
    ("<|channel|>analysis<|message|>t<|end|><|start|>developer<|message|>Be brief.<|end|>", "t", ""),
]


def _feed(splitter, pieces: list[str]) -> tuple[str, str]:
    think = answer = ""
    for p in pieces:
        t, a = splitter.feed(p)
        think, answer = think + t, answer + a
    t, a = splitter.finish()
    return think + t, answer + a


@pytest.mark.parametrize("text,reasoning,answer", CASES, ids=[t[:40] for t, _, _ in CASES])
def test_whole_replies(text, reasoning, answer):
    assert split_harmony(text) == (reasoning, answer)
    assert split_reasoning(text, False, "harmony") == (reasoning, answer)


@pytest.mark.parametrize("text,reasoning,answer", CASES, ids=[t[:40] for t, _, _ in CASES])
def test_any_cut_into_pieces_gives_the_same(text, reasoning, answer):
    rng = random.Random(len(text))
    for _ in range(60):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = HarmonySplitter()
        think, ans = _feed(s, pieces)
        assert (think.strip(), ans) == (reasoning, answer), pieces
        assert s.texts == (reasoning, answer)
        assert not any(m in think + ans for m in MARKERS)


def test_character_by_character_never_shows_a_marker():
    for text, reasoning, answer in CASES:
        s = HarmonySplitter()
        think, ans = _feed(s, list(text))
        assert (think.strip(), ans) == (reasoning, answer)
        for marker in MARKERS:
            assert marker not in think and marker not in ans


def test_token_by_token_through_the_detokenizer():
    """As the engine streams it: one token's text at a time, harmony markers as single control tokens."""
    tok = Tokenizer.from_metadata(harmony_vocab())
    for text, reasoning, answer in CASES[:13]:
        ids = tok.encode(text, special=True, add_bos=False)
        decoder, s = StreamDecoder(tok, special=False, strip_dummy_prefix=False), HarmonySplitter()
        think, ans = _feed(s, [decoder.feed(i) for i in ids] + [decoder.flush()])
        assert (think.strip(), ans) == (reasoning, answer)


FRAGMENTS = [*MARKERS, "<|start|>assistant", "<|channel|>analysis", "<|channel|>final", "<|channel|>commentary",
             " to=functions.f", " json", "assistant", "user", "developer", "tool", "functions.f", "analysis",
             "final", "<|", "<|en", "<|st", "<|chan", "<", "|>", " ", "\n\n", "Sure.", "word", "4", "ü", "x" * 120]


def _random_reply(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 30)))


def test_the_stream_splits_as_the_whole_text_does():
    """Property: whatever the text and however it is cut, feeding it piece by piece gives what split_harmony
    gives for the whole, and no marker reaches either side."""
    rng = random.Random(7)
    texts = [text for text, _, _ in CASES] + [_random_reply(rng) for _ in range(400)]
    for text in texts:
        whole = split_harmony(text)
        for _ in range(8):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 20))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            s = HarmonySplitter()
            think, ans = _feed(s, pieces)
            assert s.texts == whole and (think.strip(), ans) == whole, (text, pieces)
        assert _feed(HarmonySplitter(), list(text))[1] == whole[1], text
        assert not any(m in whole[0] + whole[1] for m in MARKERS), text


def test_the_answer_streams_as_soon_as_it_is_certain():
    s = HarmonySplitter()
    assert s.feed("<|channel|>analysis<|message|>") == ("", "")
    assert s.feed("Hmm") == ("Hmm", "")
    assert s.feed("<|en") == ("", "")  # might be <|end|>
    assert s.feed("d|><|start|>assistant<|channel|>final<|message|>Par") == ("", "Par")
    assert s.feed("is.") == ("", "is.")
    assert s.finish() == ("", "")


def test_a_long_reply_is_linear():
    s = HarmonySplitter()
    s.feed("<|channel|>analysis<|message|>")
    t0 = time.perf_counter()
    for _ in range(20000):
        s.feed("word ")
    s.feed("<|end|><|start|>assistant<|channel|>final<|message|>done")
    assert time.perf_counter() - t0 < 2.0
    assert s.texts[1] == "done" and len(s.texts[0]) == 5 * 20000 - 1


def test_a_runaway_header_is_text_without_markers():
    s = HarmonySplitter()
    think, ans = _feed(s, ["<|channel|>", "x" * 300, "<|end|><|start|>assistant<|channel|>final<|message|>", "more"])
    assert think == "" and ans == "x" * 300 + "\n\nmore"


class _Side:
    def __init__(self):
        self.text = ""

    def write(self, s):  # noqa: ANN001, ANN201
        self.text += s

    def flush(self):  # noqa: ANN201
        pass

    def isatty(self):  # noqa: ANN201
        return False


def test_the_router_picks_the_harmony_splitter():
    class C:
        think_open, reasoning_format = False, "harmony"

    assert isinstance(make_splitter(C()), HarmonySplitter)
    side, answer = _Side(), []
    router = ReplyRouter(C(), answer.append, side)
    for piece in ["<|channel|>", "analysis", "<|message|>", "Add them.", "<|end|>", "<|start|>", "assistant",
                  "<|channel|>", "final", "<|message|>", "Four", "."]:
        router.write(piece)
    router.end()
    assert "".join(answer) == "Four." and side.text == "Add them.\n"


# -- the engine and the commands -----------------------------------------------------------------------------------

REPLY = "<|channel|>analysis<|message|>Add two and two.<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>"
REPLY2 = "<|channel|>analysis<|message|>Six.<|end|><|start|>assistant<|channel|>final<|message|>Six.<|return|>"


@pytest.fixture(scope="module")
def oss(tmp_path_factory, template) -> Path:
    """A tiny model with a harmony vocabulary and gpt-oss's chat template."""
    spec = variant("tiny-llama", context_length=2048, name="tiny-oss")  # room for the template's system message
    return write_model(tmp_path_factory.mktemp("oss") / "tiny-oss.gguf", spec, "F32", vocab=harmony_vocab(template))


class Script:
    """A backend's sampling replaced by the ids of scripted replies (one after the other)."""

    def __init__(self, *replies: str):
        self.tok = Tokenizer.from_metadata(harmony_vocab())
        self.ids = [i for r in replies for i in self.tok.encode(r, special=True, add_bos=False)]

    def next(self, *args, **kw) -> int:  # noqa: ANN002, ANN003
        assert self.ids, "the script ran out"
        return self.ids.pop(0)

    def install(self, monkeypatch, target) -> "Script":  # noqa: ANN001
        for name in ("sample", "decode_greedy", "decode_sampled"):  # every way the engine picks a token
            if hasattr(target, name):
                monkeypatch.setattr(target, name, self.next)
        return self


def numpy_backend():  # noqa: ANN201
    from llamacli.backends.numpy_backend import NumpyBackend

    return NumpyBackend


def gen(model: Path, *args: str):  # noqa: ANN201
    return run("generate", str(model), "--backend", "numpy", "-p", "What is 2+2?", "--greedy", *args)


def test_generate_streams_the_answer_and_the_reasoning_apart(oss, monkeypatch):
    Script(REPLY, REPLY).install(monkeypatch, numpy_backend())
    r = gen(oss, "-q")
    assert r.code == 0, r.err
    assert r.out == "Four.\n" and r.err == "Add two and two.\n"
    j = json.loads(gen(oss, "-q", "--json").out)
    assert (j["reasoning"], j["text"], j["finish_reason"]) == ("Add two and two.", "Four.", "eos")
    tok = Tokenizer.from_metadata(harmony_vocab())
    assert tok.decode(j["tokens"]).endswith("<|message|>Four.")  # <|return|> ended it and is not among them


def test_a_reply_cut_off_after_its_analysis_prints_no_control_text(oss, monkeypatch):
    script = Script("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Fo")
    script.install(monkeypatch, numpy_backend())
    n = len(script.tok.encode("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assist", special=True, add_bos=False))
    r = gen(oss, "-q", "--json", "-n", str(n))  # max tokens in the next header
    j = json.loads(r.out)
    assert (j["reasoning"], j["text"], j["finish_reason"]) == ("Hmm.", "", "length")
    Script("<|channel|>analysis<|message|>Only this.<|end|><|endoftext|>").install(monkeypatch, numpy_backend())
    r = gen(oss, "-q")
    assert r.code == 0 and r.out == "" and r.err == "Only this.\n"


def test_think_flags_and_reasoning_effort_reach_the_system_message(oss, monkeypatch):
    from llamacli.engine.generate import Model

    with Model(oss, backend="numpy", ctx=512) as m:
        def prompt(**kw):  # noqa: ANN003, ANN202
            return m.tokenizer.decode(m.prompt_ids("Hi", **kw))

        assert "Reasoning: medium" in prompt() and "Reasoning: medium" in prompt(think=True)
        assert "Reasoning: low" in prompt(think=False)
        assert "Reasoning: high" in prompt(think="high")
        assert m.thinks
    Script(REPLY, REPLY, REPLY).install(monkeypatch, numpy_backend())
    r = gen(oss, "--no-think")
    assert r.code == 0 and "this model always reasons: --no-think asks for low reasoning effort" in r.err
    r = gen(oss, "--reasoning-effort", "high", "-q", "--json")
    assert r.code == 0 and json.loads(r.out)["text"] == "Four."
    assert "ignored" not in gen(oss, "--think").err
    r = gen(oss, "--reasoning-effort", "extreme")
    assert r.code == 2 and "--reasoning-effort must be one of none, minimal, low, medium, high" in r.one_line_error()
    r = gen(oss, "--reasoning-effort", "low", "--think")
    assert r.code == 2 and r.one_line_error()


def test_chat_keeps_only_the_final_answers_in_the_conversation(oss, monkeypatch):
    from llamacli.engine.chat_session import ChatSession
    from llamacli.engine.generate import Model

    Script(REPLY, REPLY2).install(monkeypatch, numpy_backend())
    with Model(oss, backend="numpy", ctx=1024) as m:
        s = ChatSession(m, system="Be terse.", max_tokens=64)
        first = s.reply("What is 2+2?")
        assert (first.reasoning, first.text) == ("Add two and two.", "Four.")
        second = s.reply("And 3+3?")
        assert (second.reasoning, second.text) == ("Six.", "Six.")
        assert s.history[1] == {"role": "assistant", "content": "Four."}
        prompt = m.tokenizer.decode(second.prompt_tokens)
        earlier = "<|start|>assistant<|channel|>final<|message|>Four.<|end|><|start|>user<|message|>And 3+3?<|end|>"
        assert earlier in prompt
        assert "Add two and two." not in prompt  # the analysis of an earlier turn is dropped, as the template does
        assert s.turns[1].reused > 0  # the cache still serves the common prefix


def test_chat_and_run_print_answers_only(oss, monkeypatch):
    Script(REPLY, REPLY2).install(monkeypatch, numpy_backend())
    r = run("chat", str(oss), "--backend", "numpy", "--greedy", "-q", stdin="What is 2+2?\nAnd 3+3?\n")
    assert r.code == 0, r.err
    assert r.out == "Four.\nSix.\n"
    assert r.err == "Add two and two.\nSix.\n"
    Script(REPLY).install(monkeypatch, numpy_backend())
    r = run("chat", str(oss), "--backend", "numpy", "--greedy", "-q", "--json", stdin="What is 2+2?\n")
    j = json.loads(r.out)
    assert (j["reasoning"], j["text"]) == ("Add two and two.", "Four.")
    Script(REPLY).install(monkeypatch, numpy_backend())
    r = run("run", str(oss), "What is 2+2?", "--backend", "numpy", "--greedy", "-q", "--reasoning-effort", "low")
    assert r.code == 0 and r.out == "Four.\n" and r.err == "Add two and two.\n"


# -- serve -------------------------------------------------------------------------------------------------------


def test_serve_returns_reasoning_content_and_streams_it(oss, monkeypatch):
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from test_serve import start  # a running server on a free port

    from llamacli.engine.generate import Model

    with Model(oss, backend="numpy", ctx=512) as model:
        Script(REPLY, REPLY, REPLY, REPLY).install(monkeypatch, model.backend)
        url, server, thread = start(model, "oss")
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            kw = {"model": "oss", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 64,
                  "temperature": 0}
            r = client.chat.completions.create(**kw)
            msg = r.choices[0].message
            assert (msg.content, getattr(msg, "reasoning_content", None)) == ("Four.", "Add two and two.")
            assert r.choices[0].finish_reason == "stop"
            assert "Reasoning: medium" in model.tokenizer.decode(model.seq.ids)
            deltas = [(getattr(ev.choices[0].delta, "reasoning_content", None) or "",
                       ev.choices[0].delta.content or "")
                      for ev in client.chat.completions.create(stream=True, **kw) if ev.choices]
            assert "".join(d[0] for d in deltas) == "Add two and two."
            assert "".join(d[1] for d in deltas) == "Four."
            assert not any("<|" in d[0] + d[1] for d in deltas)
            r = client.chat.completions.create(reasoning_effort="high", **kw)
            assert r.choices[0].message.content == "Four."
            assert "Reasoning: high" in model.tokenizer.decode(model.seq.ids)
            client.chat.completions.create(reasoning_effort="Minimal", **kw)  # read as the CLI reads it
            assert "Reasoning: low" in model.tokenizer.decode(model.seq.ids)
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(extra_body={"chat_template_kwargs": {"reasoning_effort": "max"}}, **kw)
            assert "reasoning_effort" in str(e.value)
        finally:
            server.should_exit = True
            thread.join(10)
