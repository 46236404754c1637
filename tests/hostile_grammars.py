"""Hostile JSON schemas and grammars, built by class (issue 46, class 1), for tests/sampling/test_grammar_bounds.py
and tests/serve/test_serve_grammar.py: what reached llguidance as it was and overflowed its native stack, ran
for minutes, or compiled and then could not produce a token. Each entry: (the input, a phrase its one-line
refusal holds)."""

from __future__ import annotations

import json
from typing import Any


def ref_chain(n: int) -> dict[str, Any]:
    """#/$defs/d0 -> d1 -> ... -> dn (an integer): a $ref chain n long."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _wrap(inner: dict[str, Any], keyword: str) -> dict[str, Any]:
    if keyword == "properties":
        return {"type": "object", "properties": {"a": inner}, "required": ["a"]}
    if keyword == "anyOf":
        return {"anyOf": [inner, {"type": "null"}]}
    if keyword == "allOf":
        return {"allOf": [inner]}
    return {"type": "array", "items": inner}  # "items"


def nested_through_refs(n: int, keyword: str) -> dict[str, Any]:
    """n levels of properties / anyOf / allOf / items, each level a definition that refers to the next (so
    the JSON text itself stays flat)."""
    defs = {f"d{i}": _wrap({"$ref": f"#/$defs/d{i + 1}"}, keyword) for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_literally(n: int, keyword: str) -> dict[str, Any]:
    """n levels of properties / anyOf / allOf / items written out inside one another."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        schema = _wrap(schema, keyword)
    return schema


def ring(n: int) -> dict[str, Any]:
    """T0 -> T1 -> ... -> T(n-1) -> T0, each an object with an optional `next`: a legal recursive schema whose
    every compile order recurses n deep."""
    defs = {f"T{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/T{(i + 1) % n}"}}} for i in range(n)}
    return {"$ref": "#/$defs/T0", "$defs": defs}


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(n)) + f'r{n}: "x"\n'


def gbnf_alternation(n: int) -> str:
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"


def lark_alternation(n: int) -> str:
    return "start: WORD\nWORD: " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"


SELF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
MUTUAL = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}

# Schemas the static bounds refuse (sampling/grammar_limits.py).
SCHEMAS: dict[str, tuple[Any, str]] = {
    "ref_chain": (ref_chain(3000), "nest"),
    **{f"{kw}_through_refs": (nested_through_refs(2000, kw), "nest") for kw in ("properties", "anyOf", "allOf", "items")},
    **{f"{kw}_literally": (nested_literally(300, kw), "nests more than")
       for kw in ("properties", "anyOf", "allOf", "items")},
    "ring": (ring(2000), "nest"),
    "self_reference": (SELF, "refers to itself"),
    "mutual_reference": (MUTUAL, "refers to itself"),
    "root_reference": ({"$ref": "#"}, "refers to itself"),
    "all_of_itself": ({"type": "object", "allOf": [{"$ref": "#"}]}, "refers to itself"),
    "pattern_repetition": ({"type": "string", "pattern": "^a{1000000}$"}, "repeats something 1000000 times"),
    "pattern_huge_count": ({"type": "string", "pattern": "^a{" + "9" * 5000 + "}$"}, "repeats something"),
    "nested_repetition": ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "has more than 100000 elements"),
    "pattern_alternation": ({"type": "string", "pattern": "|".join(f"w{i}" for i in range(20000))}, "alternatives"),
    "pattern_properties_key": ({"type": "object", "patternProperties": {"^[a-z]{99999}$": {"type": "integer"}}},
                               "repeats something"),
    "whitespace_pattern": ({"type": "object", "x-guidance": {"whitespace_pattern": " {0,1000000}"}}, "repeats"),
    "wide_any_of": ({"anyOf": [{"const": i} for i in range(5000)]}, "members"),
    "wide_properties": ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}},
                        "members"),
    "huge_enum": ({"enum": list(range(50000))}, "values"),
}

# Grammars (--grammar) the static bounds refuse.
GRAMMARS: dict[str, tuple[str, str]] = {
    "gbnf_chain": (gbnf_chain(4000), "refer to one another"),
    "gbnf_many_rules": (gbnf_chain(50000), "more than 5000 rules"),
    "gbnf_alternation": (gbnf_alternation(200000), "alternatives"),
    "gbnf_repetition": ('root ::= A\nA ::= "a"{1000000}\n', "repeats something 1000000 times"),
    "gbnf_nested_repetition": ('root ::= (("ab"{400}){400})\n', "has more than 100000 elements"),
    "gbnf_deep_groups": ("root ::= " + "(" * 500 + '"x"' + ")" * 500 + "\n", "nests groups"),
    "lark_chain": (lark_chain(3000), "refer to one another"),
    "lark_alternation": (lark_alternation(200000), "alternatives"),
    "lark_regex_repetition": ("start: /a{1000000}/\n", "repeats something 1000000 times"),
    "lark_tilde_repetition": ('start: "a" ~ 1000000\n', "repeats something 1000000 times"),
    "lark_json_ref_chain": ("start: %json " + json.dumps(ref_chain(3000)) + "\n", "nest"),
    "lark_json_self_reference": ("start: %json " + json.dumps(SELF) + "\n", "refers to itself"),
}

# Schemas within the static bounds that llguidance compiles and then cannot follow: the worker's short walk
# finds them (500 from the server before, mid-generation).
UNUSABLE: dict[str, tuple[Any, str]] = {
    "optional_properties": ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(800)}},
                            "llguidance cannot go on"),
}

# Ordinary schemas and grammars, recursion included, that must still compile.
ORDINARY_SCHEMAS: dict[str, Any] = {
    "tree": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
             "required": ["v"]},
    "any_of_itself_or_integer": {"anyOf": [{"$ref": "#"}, {"type": "integer"}]},
    "union_of_many_node_types": {  # every type refers back to the union: a cycle through 600 schemas, not deep
        "$ref": "#/$defs/Node",
        "$defs": {"Node": {"anyOf": [{"$ref": f"#/$defs/T{i}"} for i in range(150)]},
                  **{f"T{i}": {"type": "object", "properties": {"k": {"const": i}, "child": {"$ref": "#/$defs/Node"}},
                               "required": ["k"]} for i in range(150)}}},
    "ref_chain_50": ref_chain(50),
    "nested_30": nested_literally(30, "properties"),
    "patterns": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                   "note": {"type": "string", "pattern": "^.{0,1000}$"}}},
    "enum_2000": {"enum": [f"v{i}" for i in range(2000)]},
}
ORDINARY_GRAMMARS: dict[str, str] = {
    "gbnf_digits": 'root ::= "id-" [0-9]{3} ("!" | "?")\n',
    "gbnf_json_like": ('root ::= value\nvalue ::= object | array | "1"\nobject ::= "{" (pair ("," pair)*)? "}"\n'
                       'pair ::= "\\"k\\":" value\narray ::= "[" (value ("," value)*)? "]"\n'),
    "gbnf_chain_100": gbnf_chain(100),
    "gbnf_1000_words": gbnf_alternation(1000),
    "lark_choice": 'start: "yes" | "no" | "maybe"\n',
    "lark_regex": "start: NUM\nNUM: /[0-9]{1,12}/\n",
    "lark_json": 'start: "answer: " %json {"type": "object", "properties": {"a": {"type": "integer"}}}\n',
    "lark_special_token": 'start: "x" <|im_end|>\n',
}
