"""The grammar that makes a tool call valid while it is generated: llguidance's Lark syntax with each tool's
JSON schema inlined (`%json {...}`), written for one ToolFormat. The text is compiled by
llamacli.sampling.structured (text_grammar / constraint_for), which applies the bounds every grammar gets.

    tool_choice auto      free text, until the text that begins a call (the format's opening marker, or a JSON
                          object that opens the reply); from there the call must be complete and valid, and
                          only more calls (if parallel) may follow. llguidance's lazy lexemes do this: `[lazy]`
                          ends the free text at the first occurrence of the marker (its docs, "Tool calling").
    required / a name     the reply is the call(s) (after a reasoning block where the model reasons first):
                          the markers exactly as the template renders them, the name among the tools' names (or
                          the one named), the arguments valid against its parameters.

Markers that are control tokens are named by id (`<[id]>`): llguidance matches them as tokens, not text.
Whitespace is bounded wherever it may go (inside a call's JSON: a space, or a line break and at most 20 of
indentation, as in llama.cpp's schema grammars; between and after calls: at most 8 characters), so that a
model cannot fill its reply with it; the JSON ignores schema keywords llguidance does not know (`lenient`), so that a client's schema with an unknown `format` is
not refused; a client's `$ref`s are rebased to where its schema sits in the call's.
"""

from __future__ import annotations

import json
from typing import Any

from .reasoning import CHANNEL_CLOSE, CHANNEL_OPEN
from .tool_format import HARMONY_RECIPIENT, ToolFormat

# JSON whitespace as llama.cpp's schema grammars allow it: a space, or a line break and up to 20 of indentation
X_GUIDANCE = {"whitespace_pattern": "( |\\n[ \\t]{0,20})", "lenient": True}
HARMONY_CALL = "<|channel|>commentary " + HARMONY_RECIPIENT  # how a forced call's header begins
HARMONY_BODY = " <|constrain|>json<|message|>"  # ... and ends (openai/harmony's own examples)
HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant")
PREFIXES = ("none", "think", "think_open", "harmony", "channel")
MAX_GEMMA_DEPTH = 32  # schema levels written out for Gemma's syntax; deeper ones take any value


def tool_grammar(fmt: ToolFormat, tools: list[tuple[str, Any]], *, forced: str | None = None,
                 parallel: bool = True, prefix: str = "none") -> str:
    """The Lark grammar for a reply with `tools` ([(name, parameters schema)]): tool_choice auto when `forced`
    is None, else "required" or the one tool's name. `prefix`: "think" (an optional <think> block first),
    "think_open" (the prompt opened one: the reply begins inside it), "harmony" (an optional analysis message
    first, forced calls only), "channel" (an optional Gemma 4 channel block first), "none"."""
    if prefix not in PREFIXES:
        raise ValueError(f"prefix must be one of {PREFIXES}, got {prefix!r}")
    return _Writer(fmt, tools, forced, parallel and fmt.parallel, prefix).text()


class _Writer:
    def __init__(self, fmt: ToolFormat, tools: list[tuple[str, Any]], forced: str | None, parallel: bool,
                 prefix: str):
        self.fmt, self.forced, self.parallel, self.prefix = fmt, forced, parallel, prefix
        self.tools = [(n, s) for n, s in tools if forced in (None, "required", n)]
        self.rules: list[str] = []
        self.specials = sorted(fmt.specials, key=lambda t: -len(t[0]))
        self.n = 0

    # -- pieces ---------------------------------------------------------------------------------------------
    def lit(self, text: str) -> str:
        """`text` as grammar elements: string literals, and control tokens by id."""
        out, at = [], 0
        while at < len(text):
            hit = min(((text.find(s, at), s, i) for s, i in self.specials if text.find(s, at) >= 0), default=None)
            end = hit[0] if hit else len(text)
            if end > at:
                out.append(json.dumps(text[at:end], ensure_ascii=False))
            if hit is None:
                break
            out.append(f"<[{hit[2]}]>")
            at = hit[0] + len(hit[1])
        return " ".join(out)

    def rule(self, body: str, options: str = "") -> str:
        self.n += 1
        name = f"r{self.n}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def until(self, marker: str) -> str:
        """Any text, then the first occurrence of `marker` (lazily: free text ends there)."""
        parts = self.lit(marker).split(" ", 1)
        first, rest = parts[0], (parts[1] if len(parts) > 1 else "")
        if first.startswith("<["):  # free text cannot hold a control token: it ends where the token comes
            return f"TEXT {first} {rest}".strip()
        return f"{self.rule('TEXT ' + first, '[lazy]')} {rest}".strip()

    def json(self, schema: Any) -> str:
        body = dict(schema) if isinstance(schema, dict) else {}
        body["x-guidance"] = X_GUIDANCE
        return self.rule("%json " + json.dumps(body, ensure_ascii=False))

    # -- the grammar ----------------------------------------------------------------------------------------
    def text(self) -> str:
        if not self.tools:
            raise ValueError("no tools to call")
        body = self._auto() if self.forced is None else self._forced()
        head = ["%llguidance {}", f"start: {self._prefix()} {body}".replace("  ", " "), r"TEXT: /(.|\n)*/",
                r"WS: /[ \t\r\n]{1,8}/", r"PLAIN: /[ \t\r\n]*([^{ \t\r\n](.|\n)*)?/", "ID9: /[A-Za-z0-9]{9}/"]
        return "\n".join(head + self.rules) + "\n"

    def _prefix(self) -> str:
        if self.prefix == "think_open":
            return f"{self.until('</think>')} WS?"
        if self.prefix == "think":
            return f"({self.lit('<think>')} {self.until('</think>')} WS?)?"
        if self.prefix == "channel":
            return f"({self.lit(CHANNEL_OPEN)} {self.until(CHANNEL_CLOSE)} WS?)?"
        if self.prefix == "harmony" and self.forced is not None:
            opening, end, start = HARMONY_ANALYSIS
            return f"({self.lit(opening)} {self.until(end)} {self.lit(start)})?"
        return ""

    def _auto(self) -> str:
        fmt = self.fmt
        if fmt.kind == "harmony":
            return f"TEXT | {self.until(HARMONY_RECIPIENT)} {self._alts(self._harmony_call)}"
        if fmt.at_start:
            alts = ["PLAIN", f"WS? {self._calls(first_open='')}"]
            alts += [f"{self.lit(t)} WS? {self._calls(first_open='')}" for t in fmt.triggers]
            return " | ".join(alts)
        trigger = fmt.open.strip()
        rest_of_open = fmt.open[fmt.open.index(trigger) + len(trigger) :]
        return f"TEXT | {self.until(trigger)} {self._calls(first_open=rest_of_open)} WS?"

    def _forced(self) -> str:
        if self.fmt.kind == "harmony":
            return f"{self.lit(HARMONY_CALL)} {self._alts(self._harmony_call)}"
        return f"{self._calls(first_open=self.fmt.open)} WS?"

    def _calls(self, first_open: str) -> str:
        """One call or more (if parallel) with their markers; the first call's opening marker is `first_open`
        (what is left of it after the text that began the call)."""
        fmt, call = self.fmt, self._alts(self._call)
        if fmt.array:
            more = f"({self.lit(fmt.sep)} {call})*" if self.parallel else ""
            return f"{self.lit(first_open)} {call} {more} {self.lit(fmt.close)}"
        first = f"{self.lit(first_open)} {call} {self.lit(fmt.close)}"
        if not self.parallel:
            return first
        return f"{first} ({self.lit(fmt.sep) or 'WS?'} {self.lit(fmt.open)} {call} {self.lit(fmt.close)})*"

    def _alts(self, one) -> str:  # noqa: ANN001 (a method of this class)
        return self.rule(" | ".join(one(name, schema) for name, schema in self.tools))

    # -- one call of each kind ------------------------------------------------------------------------------
    def _call(self, name: str, params: Any) -> str:
        fmt = self.fmt
        params = params if isinstance(params, dict) and params else {"type": "object"}
        if fmt.kind in ("json", "generic"):
            props: dict[str, Any] = {}
            for key in fmt.keys:
                if key == fmt.name_key:
                    props[key] = {"const": name}
                elif key == fmt.args_key:
                    props[key] = rebase(params, "#/properties/" + _pointer(key))
                elif key == fmt.id_key:
                    props[key] = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}
            return self.json({"type": "object", "properties": props, "required": list(props),
                              "additionalProperties": False})
        if fmt.kind == "name_args":
            ident = f"{self.lit(fmt.id_mid)} ID9" if fmt.id_mid is not None else ""
            return f"{self.lit(name)} {ident} {self.lit(fmt.args_mid)} {self.json(params)}"
        if fmt.kind == "xml":
            return f"{self.lit(fmt.fn_open + name + fmt.fn_name_end)} {self._xml_params(params)} {self.lit(fmt.fn_close)}"
        if fmt.kind == "gemma":
            return f"{self.lit(name)} {_Gemma(self).value(params, 0)}"
        raise ValueError(f"no grammar for tool-call format {fmt.kind!r}")

    def _harmony_call(self, name: str, params: Any) -> str:
        params = params if isinstance(params, dict) and params else {"type": "object"}
        if self.forced is not None:
            return f"{self.lit(name + HARMONY_BODY)} {self.json(params)}"
        header = self.rule(r'/([ <](.|\n)*)?/ ' + json.dumps("<|message|>"), "[lazy]")
        return f"{self.lit(name)} {header} {self.json(params)}"

    def _xml_params(self, params: dict[str, Any]) -> str:
        """One <parameter=key> block per property, in the schema's order; the required ones must be there."""
        fmt = self.fmt
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or []) if isinstance(params.get("required"), list) else set()
        close = fmt.param_close
        parts = []
        for key, schema in props.items():
            opening = self.lit(fmt.param_open + str(key) + fmt.param_key_end)
            if _string_only(schema):
                value = self.rule("TEXT " + self.lit(close), "[lazy]")
                block = f"{opening} {value}"
            else:
                value = _enum_literals(schema)
                if value:
                    value = " | ".join(self.lit(v) for v in value)
                elif isinstance(schema, dict) and schema.get("type") == "boolean":  # (JSON's, or the template's)
                    value = '"true" | "false" | "True" | "False"'
                else:
                    value = self.json({"$defs": {"p": rebase(params, "#/$defs/p")},
                                       "$ref": "#/$defs/p/properties/" + _pointer(key)})
                block = f"{opening} ({value}) {self.lit(close)}"
            parts.append(block if key in required else f"({block})?")
        return " ".join(parts)


def _string_only(schema: Any) -> bool:
    """A parameter written as raw text in the XML form: a string without an enum."""
    return isinstance(schema, dict) and schema.get("type") == "string" and "enum" not in schema


def _enum_literals(schema: Any) -> list[str]:
    """A string enum's values (written raw in the XML form), or []."""
    values = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return []


def _pointer(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def rebase(schema: Any, at: str) -> Any:
    """A copy of `schema` whose local $refs ("#/...") point where the schema now sits (`at`, a JSON pointer
    fragment like "#/properties/arguments"). A loop, not recursion: the depth is the client's."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(schema, root, 0)]
    while stack:
        value, parent, key = stack.pop()
        if isinstance(value, dict):
            copy: Any = dict.fromkeys(value)  # (the keys' order kept: llguidance writes properties in it)
            for k, v in value.items():
                if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                    copy[k] = at + v[1:]
                else:
                    stack.append((v, copy, k))
        elif isinstance(value, list):
            copy = [None] * len(value)
            stack.extend((v, copy, i) for i, v in enumerate(value))
        else:
            copy = value
        parent[key] = copy
    return root[0]


class _Gemma:
    """A JSON schema as Gemma's argument syntax: strings between quote tokens, bare keys in sorted order (the
    template's dictsort), lists, objects; numbers, booleans and null as in JSON (so their schema holds there). What it does not describe (a $ref, anyOf, deeper
    than MAX_GEMMA_DEPTH) takes any value."""

    def __init__(self, writer: _Writer):
        self.w, self.q = writer, writer.fmt.quote
        self.any_rule: str | None = None

    def string(self) -> str:
        q = self.w.lit(self.q)
        if q.startswith("<["):
            return f"{q} TEXT {q}"
        return f"{q} {self.w.rule('TEXT ' + q, '[lazy]')}"

    def value(self, schema: Any, depth: int) -> str:
        if not isinstance(schema, dict) or depth > MAX_GEMMA_DEPTH:
            return self.any()
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, (str, int, float, bool)) for v in enum):
            return "(" + " | ".join(self.literal(v) for v in enum) + ")"
        kind = schema.get("type")
        if kind == "string":
            return self.string()
        if kind in ("integer", "number", "boolean", "null"):  # written as in JSON: the schema's bounds hold
            return self.w.json(schema)
        if kind == "array":
            item = self.value(schema.get("items"), depth + 1)
            return self.w.rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" or (kind is None and isinstance(schema.get("properties"), dict)):
            return self.obj(schema, depth)
        return self.any()

    def literal(self, v: Any) -> str:
        if isinstance(v, str):
            return f"{self.w.lit(self.q)} {json.dumps(v, ensure_ascii=False)} {self.w.lit(self.q)}"
        return json.dumps(json.dumps(v))

    def obj(self, schema: dict[str, Any], depth: int) -> str:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        if not props:
            return self.any_object()
        required = set(schema.get("required") or []) if isinstance(schema.get("required"), list) else set()
        keys = sorted(props, key=str)
        pairs = [f"{json.dumps(str(k) + ':', ensure_ascii=False)} {self.value(props[k], depth + 1)}" for k in keys]
        # later[j]: properties j.. after one was written (each one ",key:value"); first[j]: none written yet.
        later: list[str] = [""] * (len(keys) + 1)
        first: list[str] = [""] * (len(keys) + 1)
        for j in range(len(keys) - 1, -1, -1):
            nxt_later, nxt_first = later[j + 1], first[j + 1]
            take_l = f'"," {pairs[j]} {nxt_later}'.strip()
            take_f = f"{pairs[j]} {nxt_later}".strip()
            if keys[j] in required:
                later[j], first[j] = self.w.rule(take_l), self.w.rule(take_f)
            else:
                later[j] = self.w.rule(f"({take_l}) | {nxt_later}" if nxt_later else f"({take_l})?")
                first[j] = self.w.rule(f"({take_f}) | {nxt_first}" if nxt_first else f"({take_f})?")
        return f'"{{" {first[0]} "}}"'

    def any(self) -> str:
        if self.any_rule is None:
            self.any_rule = self.w.rule("GEMMA_ANY_PLACEHOLDER")
            s = self.string()
            body = (f'{s} | /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/ | "true" | "false" | "null"'
                    f' | "[" ({self.any_rule} ("," {self.any_rule})*)? "]" | {self.any_object()}')
            self.w.rules = [r.replace("GEMMA_ANY_PLACEHOLDER", body) for r in self.w.rules]
        return self.any_rule

    def any_object(self) -> str:
        key = r"/[A-Za-z_][A-Za-z0-9_]*/"
        pair = f'{key} ":" {self.any()}'
        return f'"{{" ({pair} ("," {pair})*)? "}}"'

