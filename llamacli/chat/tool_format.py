"""How a model writes a tool call, read from its own chat template.

A template shows the model's call format where it renders an earlier assistant turn that called a tool. So the
format is found by rendering (llama.cpp's differential "autoparser" does the same): the same conversation twice,
once with an assistant turn of plain text and once with a turn that calls a probe tool, and the call's text is
what differs. Its shape is then one of a few families, and the markers around it are whatever this template
wrote:

    json       a JSON object per call, {"name": ..., "arguments": ...} (the keys as the template writes them),
               between markers (Qwen2.5/3, Hermes: <tool_call>...</tool_call>), bare (Llama 3.x, which may
               also begin with <|python_tag|>), or a JSON list of them (Mistral Nemo: [TOOL_CALLS][...])
    name_args  the name, then the arguments as JSON after a marker (Mistral Small 3.2, Devstral, Ministral:
               [TOOL_CALLS]name[CALL_ID]id[ARGS]{...})
    xml        <function=name> with one <parameter=key> block per argument (Qwen3.5, Qwen3-Coder)
    gemma      call:name{key:<|"|>text<|"|>,...} (Gemma 4; FunctionGemma with its own markers)
    harmony    gpt-oss: a commentary message to=functions.name whose body is the JSON arguments
    generic    a template that shows no tools or no calls (Gemma 2/3, Phi-3, the built-in formats): llamacli
               describes the tools in a system message and the model answers a call as one JSON object
               {"name": ..., "arguments": ...} (llama.cpp's generic format does the same)

Also read from rendering: whether the template lists the tools at all, whether one turn may hold several calls
(and what separates them), and whether call ids must be nine letters and digits (Mistral's templates refuse
others). `detect()` renders a handful of times, once per template (cached).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any

from ..errors import TemplateError
from .json_scan import json_end

PROBE = "probe_tool_fn"  # names that no template prints by itself
PROBE2 = "probe_tool_fn2"
KEY, VALUE, VALUE2 = "probe_key", "probe_value", "probe_value2"
SHORT_ID, SHORT_ID2 = "Pr0beId01", "Pr0beId02"  # nine letters and digits: every template takes these
LONG_ID = "call_" + "0" * 24
TEXT_PROBE = "probe_text_reply"
USER = {"role": "user", "content": "probe_user_turn"}

KINDS = ("json", "name_args", "xml", "gemma", "harmony", "generic")
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1/3.3: a call may begin with it (the templates name it)


@dataclass(frozen=True)
class ToolFormat:
    """The call format of one template (see the module's docstring for the kinds). Marker fields hold the text
    exactly as the template renders it; a control token in it (Mistral's [TOOL_CALLS], Llama's <|python_tag|>)
    is listed in `specials` with its id: the detokenizer must print it for the parser to see it (Model.run's
    keep_special) and the grammar names it by id."""

    kind: str
    open: str = ""  # before each call (json: before the list when `array`)
    close: str = ""  # after each call (or the list)
    sep: str = ""  # between two calls
    array: bool = False  # json: the calls are one JSON list
    keys: tuple[str, ...] = ("name", "arguments")  # json: the call object's keys in the template's order
    name_key: str = "name"
    args_key: str = "arguments"
    id_key: str | None = None  # json: the object also holds the call id (Mistral Nemo)
    id_mid: str | None = None  # name_args: between the name and the id, when the template writes ids
    args_mid: str = ""  # name_args: between the name (or id) and the arguments
    fn_open: str = ""  # xml: "<function=" ...
    fn_name_end: str = ""  # ">\n"
    param_open: str = ""  # "<parameter="
    param_key_end: str = ""  # ">\n"
    param_close: str = ""  # "\n</parameter>\n"
    fn_close: str = ""  # "</function>"
    quote: str = ""  # gemma: what surrounds a string
    parallel: bool = False  # a turn may hold several calls
    short_ids: bool = False  # call ids must be nine letters and digits
    renders_tools: bool = True  # the template lists the tools (else a system message does: generic)
    system_role: bool = True  # generic: the template takes a system message (Gemma's refuse one)
    triggers: tuple[str, ...] = ()  # more texts that begin a call (Llama's <|python_tag|>)
    specials: tuple[tuple[str, int], ...] = ()  # (text, id) of control tokens in the markers

    @property
    def at_start(self) -> bool:
        """A call is told only by where it stands: a JSON object that begins the reply (Llama 3.x, generic)."""
        return self.kind in ("json", "generic") and not self.open.strip() and not self.array

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for _, i in self.specials)


GENERIC = ToolFormat("generic", sep="\n", parallel=True, renders_tools=False)
HARMONY_RECIPIENT = "to=functions."

# template -> {tokenizer (or None): its format}: found once per template and vocabulary
_cache: "weakref.WeakKeyDictionary[Any, dict[Any, ToolFormat]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def call(name: str, args: Any, call_id: str) -> dict[str, Any]:
    """A tool call as transformers passes it to a template (arguments as an object)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def probe_tools() -> list[dict[str, Any]]:
    params = {"type": "object", "properties": {KEY: {"type": "string"}}, "required": [KEY]}
    return [{"type": "function", "function": {"name": n, "description": "probe", "parameters": params}}
            for n in (PROBE, PROBE2)]


def detect(template: Any, tokenizer: Any = None) -> ToolFormat:
    """The tool-call format of a ChatTemplate (cached per template and tokenizer). `tokenizer` (the model's) tells
    which marker texts are control tokens and which end the turn; without it there are no `specials`."""
    key = None if tokenizer is None else id(tokenizer)
    with _lock:  # (the server prepares requests on several threads)
        found = _cache.get(template, {}).get(key)
    if found is None:
        found = _with_specials(_detect(template, _end_texts(tokenizer)), tokenizer)
        with _lock:
            found = _cache.setdefault(template, {}).setdefault(key, found)
    return found


def _end_texts(tokenizer: Any) -> tuple[str, ...]:
    if tokenizer is None:
        return ()
    return tuple(sorted({tokenizer.piece(i) for i in tokenizer.eog_ids}, key=len, reverse=True))


def _render(template: Any, messages: list[dict[str, Any]], generation: bool = False) -> str | None:
    try:
        return template.render(messages, add_generation_prompt=generation, tools=probe_tools())
    except TemplateError:
        return None


def _assistant(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


def rendered_calls(template: Any, calls: list[dict[str, Any]], ends: tuple[str, ...] = ()) -> str | None:
    """The text an assistant turn of `calls` (tool_format.call(...) each) renders to in `template`, without the
    turn's header and end (whitespace, the end of a plain text turn, and the texts in `ends`: end-of-generation
    tokens); None where the template refuses the turn."""
    text = _render(template, [USER, {"role": "assistant", "content": TEXT_PROBE}])
    called = _render(template, [USER, _assistant(*calls)])
    if text is None or called is None or TEXT_PROBE not in text:
        return None
    at = text.rindex(TEXT_PROBE)
    head, end = text[:at], text[at + len(TEXT_PROBE) :]
    n = 0
    while n < min(len(head), len(called)) and head[n] == called[n]:
        n += 1
    while n > 0 and (called[n - 1].isalnum() or called[n - 1] in "_|-:<["):  # not inside a word or a token
        n -= 1
    region = called[n:]
    while True:  # the turn's end: the text turn's, whitespace, end-of-generation tokens
        before = region
        if end.strip() and region.endswith(end):
            region = region[: -len(end)]
        region = region.rstrip()
        for e in ends:
            if e and region.endswith(e):
                region = region[: -len(e)]
        if region == before:
            return region


def _detect(template: Any, ends: tuple[str, ...]) -> ToolFormat:
    fmt = _detect_kind(template, ends)
    if fmt.kind == "generic":
        shown = _render(template, [{"role": "system", "content": TEXT_PROBE}, USER], generation=True)
        fmt = _replace(fmt, system_role=shown is not None and TEXT_PROBE in shown)
    return fmt


def _detect_kind(template: Any, ends: tuple[str, ...]) -> ToolFormat:
    listed = _render(template, [USER], generation=True)
    if listed is None or PROBE not in listed:
        return GENERIC
    one = rendered_calls(template, [call(PROBE, {KEY: VALUE}, SHORT_ID)], ends)
    if not one or PROBE not in one:
        return GENERIC
    two = rendered_calls(template, [call(PROBE, {KEY: VALUE}, SHORT_ID), call(PROBE2, {KEY: VALUE2}, SHORT_ID2)], ends)
    alone2 = rendered_calls(template, [call(PROBE2, {KEY: VALUE2}, SHORT_ID2)], ends)
    short = rendered_calls(template, [call(PROBE, {KEY: VALUE}, LONG_ID)], ends) is None
    fmt = _shape(one, template)
    if fmt is None or any(p in t for t in marker_texts(fmt) for p in (PROBE, KEY, VALUE, SHORT_ID)):
        return GENERIC  # a shape these kinds do not describe (an id before the name, a per-call index)
    sep, parallel = "", False
    if two and alone2 and PROBE2 in two:
        if fmt.array:
            first, second = _json_object(two, PROBE), _json_object(two, PROBE2)
            if first and second:
                sep, parallel = two[first[1] : second[0]], True
        elif two.startswith(one) and two.endswith(alone2) and len(two) >= len(one) + len(alone2):
            sep, parallel = two[len(one) : len(two) - len(alone2)], True
    return _replace(fmt, sep=sep, parallel=parallel, short_ids=short)


def _shape(region: str, template: Any) -> ToolFormat | None:
    """The kind and markers of one call's text."""
    if HARMONY_RECIPIENT + PROBE in region:
        return ToolFormat("harmony")
    m = re.fullmatch(r"(?P<open>.*?)<(?P<f>[\w.-]+)=" + PROBE + r">(?P<a>\s*)<(?P<p>[\w.-]+)=" + KEY
                     + r">(?P<b>\s*)" + VALUE + r"(?P<c>\s*)</(?P=p)>(?P<d>\s*)</(?P=f)>(?P<close>.*)", region, re.S)
    if m:
        return ToolFormat("xml", open=m["open"], close=m["close"], fn_open=f"<{m['f']}=", fn_name_end=">" + m["a"],
                          param_open=f"<{m['p']}=", param_key_end=">" + m["b"], param_close=f"{m['c']}</{m['p']}>"
                          + m["d"], fn_close=f"</{m['f']}>")
    m = re.fullmatch(r"(?P<open>.*?)" + PROBE + r"\{" + KEY + r":(?P<q>.+?)" + VALUE + r"(?P=q)\}(?P<close>.*)",
                     region, re.S)
    if m:
        return ToolFormat("gemma", open=m["open"], close=m["close"], quote=m["q"])
    obj = _json_object(region, PROBE)
    if obj is not None:
        start, end, value = obj
        keys = tuple(value)
        name_key = next(k for k, v in value.items() if v == PROBE)
        args_key = next((k for k, v in value.items() if _is_probe_args(v)), None)
        if args_key is None:
            return None
        id_key = next((k for k, v in value.items() if v == SHORT_ID), None)
        open_, close = region[:start], region[end:]
        array = open_.rstrip().endswith("[") and close.lstrip().startswith("]")
        source = getattr(template, "text", "") or ""
        triggers = (PYTHON_TAG,) if PYTHON_TAG in source and not open_.strip() and not array else ()
        return ToolFormat("json", open=open_, close=close, array=array, keys=keys, name_key=name_key,
                          args_key=args_key, id_key=id_key, triggers=triggers)
    at = region.find(PROBE)
    args = _json_args(region, at + len(PROBE))
    if at < 0 or args is None:
        return None
    mid = region[at + len(PROBE) : args[0]]
    id_mid = None
    if SHORT_ID in mid:
        k = mid.index(SHORT_ID)
        id_mid, mid = mid[:k], mid[k + len(SHORT_ID) :]
    if not mid.strip() and id_mid is None:
        return None  # a name right before its arguments: nothing to tell where the name ends
    return ToolFormat("name_args", open=region[:at], close=region[args[1] :], id_mid=id_mid, args_mid=mid)


def _is_probe_args(value: Any) -> bool:
    if value == {KEY: VALUE}:
        return True
    try:
        return isinstance(value, str) and json.loads(value) == {KEY: VALUE}
    except ValueError:
        return False


def _json_object(text: str, name: str) -> tuple[int, int, dict] | None:
    """(start, end, value) of the outermost JSON object in `text` that holds `name` as a value."""
    for m in re.finditer(r"\{", text):
        end = json_end(text, m.start())
        if end < 0:
            continue
        try:
            value = json.loads(text[m.start() : end])
        except ValueError:
            continue
        if isinstance(value, dict) and name in value.values():
            return m.start(), end, value
    return None


def _json_args(text: str, start: int) -> tuple[int, int] | None:
    """(start, end) of the probe's arguments written as JSON after `start`."""
    for m in re.finditer(r"\{", text[start:]):
        at = start + m.start()
        end = json_end(text, at)
        if end < 0:
            continue
        try:
            if json.loads(text[at:end]) == {KEY: VALUE}:
                return at, end
        except ValueError:
            continue
    return None


def _replace(fmt: ToolFormat, **changes: Any) -> ToolFormat:
    return replace(fmt, **changes)


def marker_texts(fmt: ToolFormat) -> list[str]:
    """Every marker text of the format (those the detokenizer must print and the grammar must name)."""
    texts = [fmt.open, fmt.close, fmt.sep, fmt.id_mid or "", fmt.args_mid, fmt.fn_open, fmt.fn_name_end,
             fmt.param_open, fmt.param_key_end, fmt.param_close, fmt.fn_close, fmt.quote, *fmt.triggers]
    return [t for t in texts if t]


def _with_specials(fmt: ToolFormat, tokenizer: Any) -> ToolFormat:
    """The control tokens in the format's markers, by text and id (none without a tokenizer)."""
    if tokenizer is None:
        return fmt
    control = 3  # tokenizer.ggml.token_type CONTROL
    found: dict[str, int] = {}
    for text in marker_texts(fmt):
        for tid in tokenizer.encode(text, special=True, add_bos=False, add_eos=False):
            if tokenizer.token_type(tid) == control:
                found[tokenizer.piece(tid)] = tid
    return _replace(fmt, specials=tuple(sorted(found.items())))
