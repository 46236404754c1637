"""Tool calls in the chat layer: the call format read from real chat templates (llama.cpp's models/templates), the
parser that reads a reply back (the same however the stream is cut), the grammar that holds a call to its
schema (llguidance over a byte vocabulary, as the grammar check's worker runs it), and the request's tools
checked and made ready for the template."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from llamacli.chat.template import ChatTemplate
from llamacli.chat.tool_format import GENERIC, ToolFormat, call, detect, rendered_calls
from llamacli.chat.tool_grammar import tool_grammar
from llamacli.chat.tool_reply import ToolReply, parse_reply
from llamacli.chat.tools import (
    ToolError,
    depth,
    message_fields,
    read_parallel,
    read_tool_choice,
    read_tools,
    template_messages,
)
from llamacli.testing.tool_vocab import FAMILIES, tool_vocab
from llamacli.tokenizer.tokenizer import StreamDecoder, Tokenizer

WEATHER = {"type": "object", "properties": {
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "city": {"type": "string"}}, "required": ["unit", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("get_time", CLOCK)]
SCHEMAS = dict(TOOLS)
THINK = SimpleNamespace(reasoning_format="think", think_open=False)
HARMONY = SimpleNamespace(reasoning_format="harmony", think_open=False)
A1, A2 = {"unit": "celsius", "days": 3, "city": "Paris </tool_call> [ARGS] {x"}, {"utc": True}


@pytest.fixture(scope="module")
def templates(llama_cpp_models: Path) -> Path:
    return llama_cpp_models / "templates"


def load(templates: Path, name: str) -> ChatTemplate:
    path = templates / name
    if not path.exists():
        pytest.skip(f"{name} is not in this llama.cpp release")
    return ChatTemplate(path.read_text(encoding="utf-8"), special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def family(templates: Path, name: str) -> tuple[ChatTemplate, Tokenizer]:
    """A family's real template and a tiny vocabulary with its special tokens."""
    template = load(templates, FAMILIES[name][0])
    return template, Tokenizer.from_metadata(tool_vocab(name, template.text))


# -- the format, read from the template ----------------------------------------------------------------------------

FORMATS = [  # template, family for its tokenizer (or None), kind, fields
    ("Qwen-Qwen3-0.6B.jinja", None, "json", {"open": "<tool_call>\n", "close": "\n</tool_call>", "sep": "\n",
                                              "parallel": True, "args_key": "arguments"}),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", None, "json", {"open": "<tool_call>\n", "parallel": True}),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", None, "json", {"open": "<tool_call>\n"}),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3.1", "json", {
        "open": "", "close": "", "args_key": "parameters", "parallel": False, "triggers": ("<|python_tag|>",)}),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", None, "json", {"open": "", "args_key": "parameters", "triggers": ()}),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral-nemo", "json", {
        "open": "[TOOL_CALLS][", "close": "]", "array": True, "id_key": "id", "sep": ", ", "short_ids": True}),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral", "name_args", {
        "open": "[TOOL_CALLS]", "id_mid": "[CALL_ID]", "args_mid": "[ARGS]", "short_ids": True, "parallel": True}),
    ("unsloth-mistral-Devstral-Small-2507.jinja", None, "name_args", {"open": "[TOOL_CALLS]", "id_mid": None,
                                                                      "args_mid": "[ARGS]"}),
    ("Qwen3.5-4B.jinja", None, "xml", {"open": "<tool_call>\n", "fn_open": "<function=", "param_open": "<parameter=",
                                       "param_close": "\n</parameter>\n", "fn_close": "</function>"}),
    ("Qwen3-Coder.jinja", None, "xml", {"fn_open": "<function="}),
    ("google-gemma-4-31B-it.jinja", "gemma4", "gemma", {"open": "<|tool_call>call:", "close": "<tool_call|>",
                                                        "quote": '<|"|>', "parallel": True}),
    ("openai-gpt-oss-120b.jinja", None, "harmony", {}),
    ("google-gemma-2-2b-it.jinja", None, "generic", {"system_role": False}),
    ("microsoft-Phi-3.5-mini-instruct.jinja", None, "generic", {"system_role": True}),
]


@pytest.mark.parametrize("name, fam, kind, fields", FORMATS, ids=[f[0] for f in FORMATS])
def test_the_call_format_is_read_from_the_template(templates, name, fam, kind, fields):
    template = load(templates, name)
    tokenizer = Tokenizer.from_metadata(tool_vocab(fam, template.text)) if fam else None
    fmt = detect(template, tokenizer)
    assert fmt.kind == kind
    for key, value in fields.items():
        assert getattr(fmt, key) == value, key
    assert detect(template, tokenizer) is fmt  # once per template


def test_control_tokens_in_the_markers_are_listed_with_their_ids(templates):
    template, tok = family(templates, "mistral")
    fmt = detect(template, tok)
    assert {t for t, _ in fmt.specials} == {"[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"}
    assert all(tok.token_id(t) == i for t, i in fmt.specials) and fmt.special_ids == {i for _, i in fmt.specials}
    template, tok = family(templates, "qwen3")  # user-defined tokens print anyway: nothing to keep
    assert detect(template, tok).specials == ()


def test_a_template_without_tools_is_generic():
    fmt = detect(ChatTemplate.builtin("chatml"))
    assert fmt.kind == "generic" and fmt.system_role and fmt.at_start and fmt.parallel


# -- reading a reply -----------------------------------------------------------------------------------------------

def j(v) -> str:  # noqa: ANN001
    return json.dumps(v, ensure_ascii=False)


REPLIES = [  # template, completion, reply, (reasoning, content, [(name, arguments)])
    ("Qwen-Qwen3-0.6B.jinja", THINK,
     f'<think>\nA <tool_call> in thought is none.\n</think>\n\nLet me check.\n<tool_call>\n{{"name": "get_weather", '
     f'"arguments": {j(A1)}}}\n</tool_call>\n<tool_call>\n{{"arguments": {j(A2)}, "name": "get_time"}}\n</tool_call>',
     ("A <tool_call> in thought is none.", "Let me check.", [("get_weather", j(A1)), ("get_time", j(A2))])),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", THINK, f' {{"name": "get_weather", "parameters": {j(A1)}}}',
     ("", "", [("get_weather", j(A1))])),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", THINK, f'<|python_tag|>{{"name": "get_time", "parameters": {j(A2)}}}',
     ("", "", [("get_time", j(A2))])),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", THINK, 'Use {"name": "x"} like this.', ("", 'Use {"name": "x"} like '
                                                                                         "this.", [])),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", THINK, '{"not": "a call"} but text', ("", '{"not": "a call"} but text',
                                                                                    [])),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", THINK, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": '
     f'{j(A1)}, "id": "abcDEF123"}}, {{"name": "get_time", "arguments": {j(A2)}, "id": "abcDEF124"}}]',
     ("", "", [("get_weather", j(A1)), ("get_time", j(A2))])),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", THINK, f"Sure.[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]"
     f"{j(A1)}[TOOL_CALLS]get_time[CALL_ID]abcDEF124[ARGS]{j(A2)}",
     ("", "Sure.", [("get_weather", j(A1)), ("get_time", j(A2))])),
    ("Qwen3.5-4B.jinja", SimpleNamespace(reasoning_format="think", think_open=True),
     "Plan.\n</think>\n\nOn it.\n\n<tool_call>\n<function=get_weather>\n<parameter=unit>\ncelsius\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=city>\nParis\nsur Seine\n</parameter>\n</function>\n</tool_call>",
     ("Plan.", "On it.", [("get_weather", j({"unit": "celsius", "days": 3, "city": "Paris\nsur Seine"}))])),
    ("google-gemma-4-31B-it-interleaved.jinja", THINK, 'Yes.<|tool_call>call:get_weather{city:<|"|>Par{is, "x"<|"|>,days:3,'
     'unit:<|"|>celsius<|"|>}<tool_call|><|tool_call>call:get_time{utc:true}<tool_call|>',
     ("", "Yes.", [("get_weather", j({"city": 'Par{is, "x"', "days": 3, "unit": "celsius"})),
                   ("get_time", j(A2))])),
    ("openai-gpt-oss-120b.jinja", HARMONY, "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant"
     "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions."
     f"get_weather <|constrain|>json<|message|>{j(A1)}", ("Need it.", "Checking.", [("get_weather", j(A1))])),
    ("openai-gpt-oss-120b.jinja", HARMONY, f" to=functions.get_time<|channel|>commentary json<|message|>{j(A2)}",
     ("", "", [("get_time", j(A2))])),
    ("microsoft-Phi-3.5-mini-instruct.jinja", THINK, f'{{"name": "get_weather", "arguments": {j(A1)}}}\n'
     f'{{"name": "get_time", "arguments": {j(A2)}}}', ("", "", [("get_weather", j(A1)), ("get_time", j(A2))])),
]


@pytest.mark.parametrize("name, completion, text, want", REPLIES, ids=[r[0] for r in REPLIES])
def test_a_reply_reads_the_same_whole_or_cut_anywhere(templates, name, completion, text, want):
    fmt = detect(load(templates, name))
    whole = parse_reply(completion, fmt, text, SCHEMAS)
    assert (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.calls]) == want
    rng = random.Random(0)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(30, len(text) - 1))))
        reply, think, content, args = ToolReply(completion, fmt, SCHEMAS), "", "", {}
        for piece in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] + [None]:
            t, c, events = reply.feed(piece) if piece is not None else reply.finish()
            think, content = think + t, content + c
            for e in events:
                if e[0] == "args":
                    args[e[1]] = args.get(e[1], "") + e[2]
        assert (think.strip(), content) == want[:2]
        assert [(c.name, args.get(c.index, "")) for c in reply.calls] == want[2]


def test_a_reply_cut_inside_a_call_keeps_its_text_as_content(templates):
    fmt = detect(load(templates, "Qwen-Qwen3-0.6B.jinja"))
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "cel'
    reply = parse_reply(THINK, fmt, text, SCHEMAS)
    assert reply.calls == [] and reply.content == text


def test_call_ids_follow_the_template(templates):
    assert all(len(c.id) == 9 and c.id.isalnum() for c in parse_reply(
        THINK, detect(load(templates, "Mistral-Small-3.2-24B-Instruct-2506.jinja")), REPLIES[6][2]).calls)
    calls = parse_reply(THINK, detect(load(templates, "Qwen-Qwen3-0.6B.jinja")), REPLIES[0][2]).calls
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B.jinja", "Qwen3.5-4B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                                  "mistralai-Mistral-Nemo-Instruct-2407.jinja", "Mistral-Small-3.2-24B-Instruct-2506.jinja",
                                  "unsloth-mistral-Devstral-Small-2507.jinja", "google-gemma-4-31B-it-interleaved.jinja",
                                  "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"])
def test_the_parser_reads_what_the_template_writes(templates, name):
    """A call rendered by the template (as an earlier turn) reads back as the same call."""
    template = load(templates, name)
    fmt = detect(template)
    calls = [call("get_weather", A1, "abcDEF123"), call("get_time", A2, "abcDEF124")][: 2 if fmt.parallel else 1]
    text = rendered_calls(template, calls)
    got = parse_reply(THINK, fmt, text, SCHEMAS).calls
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(c["function"]["name"], c["function"]["arguments"])
                                                                for c in calls]


# -- the grammar ---------------------------------------------------------------------------------------------------

class Matcher:
    """llguidance over a byte vocabulary (the grammar check's worker does the same): accepts(text) -> whether the
    grammar lets the text through and may end there."""

    def __init__(self, grammar: str):
        llg = pytest.importorskip("llguidance")

        class Bytes:
            eos_token_id, bos_token_id = 256, None
            tokens = [bytes([i]) for i in range(256)] + [b"\xff<|end|>"]
            special_token_ids = [256]

            def __call__(self, s):  # noqa: ANN001, ANN204
                return list(s.encode() if isinstance(s, str) else s)

        compiled = llg.grammar_from("grammar", grammar)
        bad, messages = llg.LLMatcher.validate_grammar_with_warnings(compiled)
        assert not bad, messages
        self.llg, self.compiled = llg, compiled
        self.tok = llg.LLTokenizer(llg.TokenizerWrapper(Bytes()), n_vocab=257)

    def accepts(self, text: str) -> bool:
        m = self.llg.LLMatcher(self.tok, self.compiled, log_level=0)
        for b in text.encode():
            mask = m.compute_bitmask()
            if not mask[b >> 3] >> (b & 7) & 1:
                return False
            m.consume_token(b)
        mask = m.compute_bitmask()
        return bool(mask[256 >> 3] >> (256 & 7) & 1) or m.is_stopped()


GRAMMAR_TEMPLATES = ["Qwen-Qwen3-0.6B.jinja", "Qwen3.5-4B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                     "mistralai-Mistral-Nemo-Instruct-2407.jinja", "Mistral-Small-3.2-24B-Instruct-2506.jinja",
                     "google-gemma-4-31B-it-interleaved.jinja"]
GOOD1, GOOD2 = {"unit": "celsius", "days": 3}, {"utc": False}
BAD_CALLS = [("get_weather", {"unit": "kelvin", "days": 3}), ("get_weather", {"days": 3}),
             ("get_weather", {"unit": "celsius", "days": 9}), ("get_weather", {"unit": "celsius", "days": 3, "x": 1}),
             ("rm_rf", {})]


@pytest.mark.parametrize("name", GRAMMAR_TEMPLATES)
def test_the_grammar_takes_the_templates_calls_and_refuses_invalid_ones(templates, name):
    template = load(templates, name)
    fmt = detect(template)

    def rendered(*calls) -> str:  # noqa: ANN002
        return rendered_calls(template, [call(n, a, f"abcDEF12{i}") for i, (n, a) in enumerate(calls)])

    one, two = rendered(("get_weather", GOOD1)), rendered(("get_weather", GOOD1), ("get_time", GOOD2))
    auto, required = Matcher(tool_grammar(fmt, TOOLS)), Matcher(tool_grammar(fmt, TOOLS, forced="required"))
    named = Matcher(tool_grammar(fmt, TOOLS, forced="get_time"))
    single = Matcher(tool_grammar(fmt, TOOLS, forced="required", parallel=False))
    assert auto.accepts("The weather is fine.") and auto.accepts("")
    assert auto.accepts(one) and required.accepts(one) and single.accepts(one)
    assert not required.accepts("The weather is fine.")
    if not fmt.at_start:
        assert auto.accepts("Let me look. " + one)
    if fmt.parallel:
        assert auto.accepts(two) and required.accepts(two) and not single.accepts(two)
    assert named.accepts(rendered(("get_time", GOOD2))) and not named.accepts(one)
    for bad in BAD_CALLS:
        text = rendered(bad)
        assert not auto.accepts(text) and not required.accepts(text), bad


def test_the_grammar_compiles_where_llamacli_compiles_grammars(templates):
    """Through sampling.structured's checks (the bounds and the worker process every grammar meets)."""
    structured = pytest.importorskip("llamacli.sampling.structured")
    for name in GRAMMAR_TEMPLATES + ["openai-gpt-oss-120b.jinja", "microsoft-Phi-3.5-mini-instruct.jinja"]:
        fmt = detect(load(templates, name))
        for forced in (None, "required"):
            structured.text_grammar(tool_grammar(fmt, TOOLS, forced=forced))
    fmt = detect(load(templates, "Qwen-Qwen3-0.6B.jinja"))
    for prefix in ("think", "think_open", "harmony"):
        structured.text_grammar(tool_grammar(fmt, TOOLS, forced="get_time", prefix=prefix))


def test_harmony_grammar_lets_the_model_reason_first(templates):
    fmt = detect(load(templates, "openai-gpt-oss-120b.jinja"))
    forced = Matcher(tool_grammar(fmt, TOOLS, forced="required", prefix="harmony"))
    auto = Matcher(tool_grammar(fmt, TOOLS, prefix="harmony"))
    body = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{j(GOOD1)}"
    analysis = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
    assert forced.accepts(body) and forced.accepts(analysis + body)
    assert not forced.accepts(analysis + body.replace("get_weather", "get_clock"))
    assert auto.accepts(analysis + "<|start|>assistant<|channel|>final<|message|>Fine.")
    assert auto.accepts(analysis + body) and not auto.accepts(analysis + body.replace('"celsius"', '"kelvin"'))


def test_schema_refs_are_rebased_where_the_schema_sits(templates):
    fmt = detect(load(templates, "Qwen-Qwen3-0.6B.jinja"))
    params = {"type": "object", "$defs": {"u": {"enum": ["c", "f"]}}, "properties": {"unit": {"$ref": "#/$defs/u"}},
              "required": ["unit"], "additionalProperties": False}
    m = Matcher(tool_grammar(fmt, [("t", params)], forced="required"))
    assert m.accepts('<tool_call>\n{"name": "t", "arguments": {"unit": "c"}}\n</tool_call>')
    assert not m.accepts('<tool_call>\n{"name": "t", "arguments": {"unit": "x"}}\n</tool_call>')


# -- the request ---------------------------------------------------------------------------------------------------

def test_tools_and_tool_choice_are_checked():
    tools = read_tools([{"type": "function", "function": {"name": "a", "parameters": WEATHER}},
                        {"function": {"name": "b"}}])
    assert [t.name for t in tools] == ["a", "b"] and tools[1].parameters["additionalProperties"] is False
    assert read_tools(None) == [] and read_tools([]) == []
    assert read_tool_choice(None, tools).mode == "auto" and read_tool_choice(None, []).mode == "none"
    assert read_tool_choice("auto", []).mode == "none"
    assert read_tool_choice({"type": "function", "function": {"name": "b"}}, tools).forced == "b"
    assert read_tool_choice("required", tools).forced == "required" and read_tool_choice("auto", tools).forced is None
    assert read_parallel(None) is True and read_parallel(False) is False
    deep: dict = {}
    node = deep
    for _ in range(200):
        node["items"] = {}
        node = node["items"]
    for bad in ("x", [None], [{"type": "function", "function": {"name": ""}}],
                [{"type": "function", "function": {"name": "a", "parameters": deep}}],
                [{"function": {"name": "a"}}, {"function": {"name": "a"}}]):
        with pytest.raises(ToolError):
            read_tools(bad)
    for bad in ("any", {"function": {"name": "zz"}}, ["auto"]):
        with pytest.raises(ToolError) as e:
            read_tool_choice(bad, tools)
        assert e.value.param == "tool_choice"
    with pytest.raises(ToolError):
        read_tool_choice("required", [])
    with pytest.raises(ToolError):
        read_parallel(1)
    assert depth(deep) > 64 and depth({"a": [1]}) == 2


def test_messages_reach_the_template_as_transformers_passes_them():
    fields = message_fields({"tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_time", "arguments": '{"utc": true}'}}]}, "messages[1]")
    assert fields["tool_calls"][0]["function"]["arguments"] == {"utc": True}  # an object, as templates want it
    assert message_fields({"tool_calls": []}, "m") == {}  # no key: Llama's template takes its presence for a call
    kept = message_fields({"tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}, "m")
    assert kept["tool_calls"][0]["function"]["arguments"] == "not json"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", **fields},
            {"role": "tool", "content": "noon", "tool_call_id": "c1"}]
    out, tools = template_messages(msgs, ToolFormat("json"), read_tools([{"function": {"name": "get_time"}}]), True)
    assert out[2]["name"] == "get_time" and tools == [{"type": "function", "function": {"name": "get_time"}}]
    assert template_messages(msgs, ToolFormat("json"), [], False)[1] is None
    out, tools = template_messages(msgs, GENERIC, read_tools([{"function": {"name": "get_time"}}]), True)
    assert tools is None and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_time"' in out[0]["content"] and out[2]["content"] == '{"name": "get_time", "arguments": {"utc": true}}'
    assert "tool_calls" not in out[2] and json.loads(out[3]["content"])["tool_response"]["content"] == "noon"
    no_system = template_messages(msgs, ToolFormat("generic", system_role=False), read_tools([{"function": {
        "name": "get_time"}}]), True)[0]
    assert no_system[0]["role"] == "user" and no_system[0]["content"].endswith("\n\nhi")
    for bad in ({"tool_calls": "x"}, {"tool_calls": [{"function": {"name": 1}}]}, {"tool_call_id": 5},
                {"tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}):
        with pytest.raises(ToolError):
            message_fields(bad, "m")


def test_the_stream_decoder_prints_the_control_tokens_it_is_told_to_keep(templates):
    _, tok = family(templates, "mistral")
    ids = tok.encode("[TOOL_CALLS]f[ARGS]{}", special=True, add_bos=False, add_eos=False)
    plain, kept = StreamDecoder(tok, special=False), StreamDecoder(tok, special=False, keep={tok.token_id("[ARGS]")})
    assert "".join(plain.feed(i) for i in ids) == "f{}"
    assert "".join(kept.feed(i) for i in ids) == "f[ARGS]{}"


def test_gemma_arguments_follow_the_schema_in_gemma_syntax(templates):
    fmt = detect(load(templates, "google-gemma-4-31B-it-interleaved.jinja"))
    params = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}}, "when": {"anyOf": [{"type": "string"}, {}]},
        "opts": {"type": "object", "properties": {"deep": {"type": "boolean"}}, "required": ["deep"]},
        "n": {"type": "number", "minimum": 0}}, "required": ["n"]}
    m = Matcher(tool_grammar(fmt, [("f", params)], forced="required"))
    q = '<|"|>'
    assert m.accepts(f"<|tool_call>call:f{{n:2.5,opts:{{deep:true}},tags:[{q}a{q},{q}b{q}],when:{{x:[1,null]}}}}"
                     "<tool_call|>")
    assert m.accepts("<|tool_call>call:f{n:0}<tool_call|>")
    assert not m.accepts("<|tool_call>call:f{n:-1}<tool_call|>")  # the schema's minimum
    assert not m.accepts("<|tool_call>call:f{tags:[]}<tool_call|>")  # n is required
    assert not m.accepts("<|tool_call>call:f{opts:{deep:true},n:1}<tool_call|>")  # keys in the template's order


@pytest.mark.parametrize("name, body", [
    ("Qwen-Qwen3-0.6B.jinja", '<tool_call>\n{{"name": "w", "arguments": {{"text": "{}"}}}}\n</tool_call>'),
    ("Qwen3.5-4B.jinja", "<tool_call>\n<function=w>\n<parameter=text>\n{}\n</parameter>\n</function>\n</tool_call>"),
])
def test_a_call_as_long_as_a_file_reads_in_linear_time(templates, name, body):
    """A call's arguments may be a whole file, streamed a few characters at a time: a megabyte reads in
    seconds (copying what came so far at every piece would take minutes)."""
    import time

    fmt = detect(load(templates, name))
    text = body.format("ab c" * 250_000)
    reply, t0 = ToolReply(THINK, fmt, {}), time.perf_counter()
    for i in range(0, len(text), 4):
        reply.feed(text[i : i + 4])
    reply.finish()
    assert reply.calls[0].complete and len(reply.calls[0].arguments) > 1_000_000
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_feed_events_keeps_the_content_in_its_place_among_the_calls(templates, cut):
    """feed_events gives what feed gives, but with the text after a call after it (feed puts all the text of a
    piece first), however the reply is cut."""
    fmt = detect(load(templates, "Qwen-Qwen3-0.6B.jinja"))
    text = ('<think>\nHm.\n</think>\n\nFirst.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            'Then more.')
    reply, events, think = ToolReply(THINK, fmt, {}), [], ""
    for i in range(0, len(text), cut):
        t, e = reply.feed_events(text[i : i + cut])
        think, events = think + t, events + e
    t, e = reply.finish_events()
    think, events = think + t, events + e
    kinds = []
    for e in events:  # (runs of one kind as one)
        if not kinds or kinds[-1] != e[0]:
            kinds.append(e[0])
    assert think.strip() == "Hm." and kinds == ["content", "call", "args", "content"]
    assert "".join(e[1] for e in events if e[0] == "content") == "First.Then more."
    assert "".join(e[2] for e in events if e[0] == "args") == '{"a": 1}'
