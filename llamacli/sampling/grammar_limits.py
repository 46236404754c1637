"""Static bounds on what reaches llguidance: a JSON schema, a GBNF or Lark grammar, the regexes inside them.

llguidance compiles a schema or grammar by recursion on the native stack: a $ref chain or a chain of rules a
few thousand long overflows it and kills the process (no exception reaches Python), and a huge alternation or
repetition runs for minutes. These checks come first: one pass over the text or the schema, with no recursion
in Python either (every walk keeps its own stack), refusing with a one-line reason whatever is far past what
real schemas and grammars use. The second guard (grammar_sandbox.py) compiles in a worker process under a
deadline and a memory limit, for what a cheap check cannot see.

The limits below are each far above real use (hand-written and generated schemas nest a few to a few dozen
levels and have tens of properties; llama.cpp's bundled GBNF grammars have a few dozen rules), and well below
where llguidance breaks (it overflows a 4 MiB stack, the worker's, at several times MAX_SCHEMA_DEPTH and
MAX_RULE_DEPTH).

Written here rather than taken from a library: none measures a schema's depth with its $refs followed or a
GBNF/Lark grammar's rule depth, and Python's regex parser (re._parser) is private and reads Python's syntax,
not the Rust syntax llguidance takes.
"""

from __future__ import annotations

import json
import re
from typing import Any, Hashable, Iterable, Mapping
from urllib.parse import unquote

from ..errors import GrammarError

MAX_SOURCE_BYTES = 4 << 20  # the JSON text of a schema, the text of a grammar
MAX_JSON_NESTING = 100  # arrays and objects inside one another in a schema (llguidance's JSON reader stops at 128)
MAX_JSON_VALUES = 200_000  # objects, arrays and scalars in a schema
MAX_SCHEMA_DEPTH = 256  # schemas along the deepest path, $refs followed (once each: deepest())
MAX_WIDTH = 1_000  # properties of one object; members of one anyOf, oneOf, allOf, prefixItems
MAX_ENUM = 10_000  # values of one enum
MAX_RULES = 5_000  # rules (and terminals) of a grammar
MAX_RULE_DEPTH = 500  # rules along the deepest chain of references (each rule once: deepest())
MAX_ALTERNATIVES = 10_000  # alternatives of one rule, group or regex
MAX_NESTING = 100  # groups inside one another in one rule or regex
MAX_REPEAT = 10_000  # one repetition count: {n}, {n,m}, ~ n..m
MAX_EXPANSION = 100_000  # elements of one rule or regex once its repetitions are written out

__all__ = ["check_schema", "check_grammar", "check_regex"]


# -- JSON schemas ------------------------------------------------------------------------------------------

_ONE = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then",
        "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")  # keywords whose value is a schema
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")  # ... a list of schemas
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")  # ... a map
_WIDE = ("properties", "patternProperties", "allOf", "anyOf", "oneOf", "prefixItems", "items")  # MAX_WIDTH


def check_schema(schema: Any, what: str = "JSON schema") -> str:
    """The schema's compact JSON text, once its size, nesting, $ref depth, widths and regexes are within the
    bounds above and no $ref leads back to itself without describing anything on the way; GrammarError
    ("invalid JSON schema: ...", one line) otherwise."""
    _check_document(schema, what)
    if isinstance(schema, dict):
        _SchemaGraph(schema, what).check()
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"invalid {what}: it is not JSON ({exc})") from None
    if len(text) > MAX_SOURCE_BYTES:
        raise GrammarError(f"invalid {what}: its JSON text is longer than {MAX_SOURCE_BYTES >> 20} MiB")
    return text


def _check_document(value: Any, what: str) -> None:
    """Nesting and value count of the JSON document (a loop: no recursion, and a Python object that contains
    itself ends at the count)."""
    stack, count = [(value, 1)], 0
    while stack:
        v, depth = stack.pop()
        count += 1
        if count > MAX_JSON_VALUES:
            raise GrammarError(f"invalid {what}: it holds more than {MAX_JSON_VALUES} values")
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            if depth > MAX_JSON_NESTING:
                raise GrammarError(f"invalid {what}: it nests more than {MAX_JSON_NESTING} levels deep")
            stack.extend((c, depth + 1) for c in children)


class _SchemaGraph:
    """Every schema reachable from the root (by subschema keywords and local $refs), with two kinds of edge:
    all (for the depth) and the aliasing ones, $ref and allOf, that add no structure (a cycle of those alone
    describes no value: llguidance accepts it and then cannot produce a single token)."""

    def __init__(self, root: dict, what: str):
        self.root, self.what = root, what
        self.where: dict[int, str] = {}  # id(schema) -> JSON pointer
        self.edges: dict[int, list[int]] = {}
        self.alias: dict[int, list[int]] = {}
        self.anchors: dict[str, dict] = {}

    def check(self) -> None:
        stack: list[tuple[Any, str]] = [(self.root, "#")]
        refs: list[tuple[int, str]] = []
        while stack or refs:
            while stack:
                self._visit(*stack.pop(), stack, refs)
            unresolved = []
            for source, ref in refs:  # after the walk: an anchor may sit in a schema met later
                target = self._resolve(ref)
                if target is None:
                    if not ref.startswith("#/") and ref.startswith("#"):
                        unresolved.append((source, ref))
                    continue  # remote or broken: llguidance says so
                if isinstance(target, dict):
                    self.edges[source].append(id(target))
                    self.alias[source].append(id(target))
                    if id(target) not in self.where:
                        stack.append((target, ref))
            refs = unresolved if stack else []
        self._check_cycles()
        depth, start = deepest([id(self.root)], self.edges)
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"invalid {self.what}: its schemas nest {depth} deep from {self.where[start]}, "
                               f"$refs followed (at most {MAX_SCHEMA_DEPTH})")

    def _visit(self, node: Any, where: str, stack: list, refs: list) -> None:
        if not isinstance(node, dict) or id(node) in self.where:
            return
        me = id(node)
        self.where[me] = where
        out: list[int] = []
        alias: list[int] = []
        self.edges[me], self.alias[me] = out, alias
        for key in _ONE:
            if isinstance(node.get(key), dict):
                out.append(id(node[key]))
                stack.append((node[key], f"{where}/{key}"))
        for key in _LIST:
            members = node.get(key)
            if isinstance(members, list):
                for i, sub in enumerate(members):
                    if isinstance(sub, dict):
                        out.append(id(sub))
                        if key == "allOf":
                            alias.append(id(sub))
                        stack.append((sub, f"{where}/{key}/{i}"))
        for key in _MAP:
            members = node.get(key)
            if isinstance(members, dict):
                for name, sub in members.items():
                    if isinstance(sub, dict):
                        out.append(id(sub))
                        stack.append((sub, f"{where}/{key}/{_pointer_part(name)}"))
        for key in _WIDE:
            if isinstance(node.get(key), (list, dict)) and len(node[key]) > MAX_WIDTH:
                raise GrammarError(f"invalid {self.what}: {where}/{key} has {len(node[key])} members "
                                   f"(at most {MAX_WIDTH})")
        if isinstance(node.get("enum"), list) and len(node["enum"]) > MAX_ENUM:
            raise GrammarError(f"invalid {self.what}: {where}/enum has {len(node['enum'])} values (at most {MAX_ENUM})")
        if isinstance(node.get("pattern"), str):
            check_regex(node["pattern"], f"invalid {self.what}: the pattern at {where}")
        if isinstance(node.get("patternProperties"), dict):
            for pattern in node["patternProperties"]:
                check_regex(pattern, f"invalid {self.what}: a patternProperties key at {where}")
        options = node.get("x-guidance")
        if isinstance(options, dict) and isinstance(options.get("whitespace_pattern"), str):
            check_regex(options["whitespace_pattern"], f"invalid {self.what}: x-guidance.whitespace_pattern")
        for key in ("$anchor", "$id"):  # "$id": "#name" is draft 6/7's anchor
            name = node.get(key)
            if isinstance(name, str) and name:
                self.anchors.setdefault(name.lstrip("#"), node)
        if isinstance(node.get("$ref"), str):
            refs.append((me, node["$ref"]))

    def _resolve(self, ref: str) -> Any:
        """The target of a local $ref ("#", "#/json/pointer", "#anchor", or those after the root's own $id), or
        None."""
        base, sep, fragment = ref.partition("#")
        if not sep or (base and base != self.root.get("$id")):
            return None
        if not fragment.startswith("/"):
            return self.root if not fragment else self.anchors.get(fragment)
        node: Any = self.root
        for part in fragment[1:].split("/"):
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and len(part) < 10 and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def _check_cycles(self) -> None:
        cycle = find_cycle(self.where, self.alias)
        if cycle:
            path = " -> ".join(self.where[m] for m in cycle[:4]) + (" -> ..." if len(cycle) > 4 else "")
            raise GrammarError(f"invalid {self.what}: {self.where[cycle[0]]} refers to itself through $ref or "
                               f"allOf alone ({path} -> {self.where[cycle[0]]}), so it describes no value")


def _pointer_part(name: Any) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


# -- graphs ------------------------------------------------------------------------------------------------


def _walk(starts: Iterable[Hashable], edges: Mapping[Any, list]):
    """Depth-first over the graph from each of `starts` in turn (an explicit stack), each node once: yields
    ("back", v, w, path) for an edge v -> w that closes a cycle (w is on the current path, `path` the nodes
    from the first start to v) and ("done", v, None, None) as each node is finished, after its successors."""
    state: dict[Any, int] = {}  # 1: on the current path, 2: finished
    for start in starts:
        if start in state:
            continue
        state[start] = 1
        path, work = [start], [(start, 0)]
        while work:
            v, i = work[-1]
            succ = edges.get(v, ())
            if i < len(succ):
                work[-1] = (v, i + 1)
                w = succ[i]
                if w not in state:
                    state[w] = 1
                    path.append(w)
                    work.append((w, 0))
                elif state[w] == 1:
                    yield "back", v, w, path
                continue
            work.pop()
            path.pop()
            state[v] = 2
            yield "done", v, None, None


def deepest(starts: Iterable[Hashable], edges: Mapping[Any, list]) -> tuple[int, Any]:
    """The longest path (in nodes) from `starts` once each edge that closes a cycle, in depth-first order, is
    cut, and the node it starts from; (0, None) for no nodes. That is how deep a compiler recurses if it
    follows each definition once, in the order written (llguidance does, for $refs and rules); where its
    order differs, the worker process (grammar_sandbox.py) is the guard."""
    longest: dict[Any, int] = {}
    for event, v, _, _ in _walk(starts, edges):
        if event == "done":  # successors finished (or cut: on the path still, so not in `longest` yet)
            longest[v] = 1 + max((longest.get(w, 0) for w in edges.get(v, ())), default=0)
    if not longest:
        return 0, None
    top = max(longest, key=longest.__getitem__)
    return longest[top], top


def find_cycle(starts: Iterable[Hashable], edges: Mapping[Any, list]) -> list | None:
    """The nodes of one cycle (in order, from where it begins), or None."""
    for event, v, w, path in _walk(starts, edges):
        if event == "back":
            return path[path.index(w):]
    return None


# -- sizes of regexes and rule bodies ----------------------------------------------------------------------


class _Shape:
    """The written-out size of a rule body or regex, fed one piece at a time (an element, a repetition, an
    alternative bar, a group's opening or closing) and checked as each arrives, so that a refusal comes
    before the end of a huge input. Sizes: an element 1, a sequence the sum, alternatives the sum (the
    compiler builds each), x{n,m} m times x's (x* and x+ once)."""

    def __init__(self, where: str):
        self.where = where
        self.frames = [[0, 0, 0, 1]]  # per open group: [closed alternatives, current one, its last element, count]

    def element(self, size: int = 1) -> None:
        f = self.frames[-1]
        f[1] += size
        f[2] = size
        self._bound(f)

    def repeat(self, low: int, high: int | None) -> None:
        n = max(low, 1) if high is None else max(low, high)
        if n > MAX_REPEAT:
            raise GrammarError(f"{self.where} repeats something {n} times (at most {MAX_REPEAT})")
        f = self.frames[-1]
        f[1] += f[2] * (n - 1)
        f[2] *= n
        self._bound(f)

    def alternative(self) -> None:
        f = self.frames[-1]
        f[0], f[1], f[2], f[3] = f[0] + f[1], 0, 0, f[3] + 1
        if f[3] > MAX_ALTERNATIVES:
            raise GrammarError(f"{self.where} has more than {MAX_ALTERNATIVES} alternatives in one place")

    def open(self) -> None:
        self.frames.append([0, 0, 0, 1])
        if len(self.frames) - 1 > MAX_NESTING:
            raise GrammarError(f"{self.where} nests groups more than {MAX_NESTING} deep")

    def close(self) -> None:
        if len(self.frames) > 1:  # (an unbalanced one is llguidance's to report)
            f = self.frames.pop()
            self.element(f[0] + f[1])

    def finish(self) -> int:
        while len(self.frames) > 1:
            self.close()
        return self.frames[0][0] + self.frames[0][1]

    def _bound(self, f: list[int]) -> None:
        if f[0] + f[1] > MAX_EXPANSION:
            raise GrammarError(f"{self.where} has more than {MAX_EXPANSION} elements, its repetitions written out")


_COUNT = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")  # {n} {n,} {n,m} {,m}
_TILDE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")  # Lark's x ~ n and x ~ n..m


def _counts(m: re.Match) -> tuple[int, int | None]:
    def number(digits: str | None, empty: int | None) -> int | None:
        if not digits:
            return empty
        return int(digits) if len(digits) < 10 else 10**9  # (int() of thousands of digits is refused anyway)

    low = number(m.group(1), 0)
    if m.group(2) is None:
        return low, low  # type: ignore[return-value]
    return low, number(m.group(3), None)  # type: ignore[return-value]


def check_regex(pattern: str, where: str) -> int:
    """The written-out size of a regex (Rust regex syntax, which llguidance reads; JSON Schema patterns too),
    or GrammarError naming `where` if a repetition, the alternatives, the nesting or the size pass the bounds."""
    shape = _Shape(where)
    i, n = 0, len(pattern)
    if n > MAX_SOURCE_BYTES:
        raise GrammarError(f"{where} is longer than {MAX_SOURCE_BYTES >> 20} MiB")
    while i < n:
        c = pattern[i]
        if c == "\\":
            i = _escape_end(pattern, i)
            shape.element()
        elif c == "[":
            i = _class_end(pattern, i)
            shape.element()
        elif c == "(":
            shape.open()
            i += 1
        elif c == ")":
            shape.close()
            i += 1
        elif c == "|":
            shape.alternative()
            i += 1
        elif c in "*+?":
            i += 1
        elif c == "{" and (m := _COUNT.match(pattern, i)):
            shape.repeat(*_counts(m))
            i = m.end()
        else:
            shape.element()
            i += 1
    return shape.finish()


def _escape_end(p: str, i: int) -> int:
    """Past the escape at p[i] ('\\'): \\p{..}, \\x{..}, \\u{..} or one character."""
    if i + 2 < len(p) and p[i + 1] in "pPxu" and p[i + 2] == "{":
        end = p.find("}", i + 3)
        return len(p) if end < 0 else end + 1
    return i + 2


def _class_end(p: str, i: int) -> int:
    """Past the character class opening at p[i] (Rust syntax: classes nest, [:alpha:] inside, a ']' first is
    literal)."""
    j, n, depth = i + 1, len(p), 1
    if p.startswith("^", j):
        j += 1
    if p.startswith("]", j):
        j += 1
    while j < n:
        c = p[j]
        if c == "\\":
            j += 2
        elif p.startswith("[:", j) and (end := p.find(":]", j + 2)) >= 0:
            j = end + 2
        elif c == "[":
            depth += 1
            j += 1
        elif c == "]":
            depth -= 1
            j += 1
            if depth == 0:
                return j
        else:
            j += 1
    return n


# -- GBNF and Lark grammars --------------------------------------------------------------------------------

_LARK = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")  # llguidance.gbnf_to_lark.is_lark_syntax's test
_GBNF_NAME = re.compile(r"[A-Za-z0-9_\-]+")
_LARK_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*(?:\.[A-Za-z0-9_\-]+)*")
_DIRECTIVE = re.compile(r"%([A-Za-z_]+)\s*")
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"?')  # to the closing quote or the end of the line
_GBNF_CLASS = re.compile(r"\[(?:[^\]\\]|\\.)*\]?", re.S)
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)*)/?[a-z]*")


def check_grammar(text: str) -> None:
    """GrammarError unless a GBNF or Lark grammar (told apart as llguidance tells them) is within the bounds:
    its size, its number of rules, how deep rules refer to one another, and for each rule (regexes inside it
    too) the alternatives, nesting, repetition counts and written-out size. A Lark grammar's %json schemas
    are checked as schemas."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SOURCE_BYTES:
        raise GrammarError(f"invalid grammar: it is longer than {MAX_SOURCE_BYTES >> 20} MiB")
    _GrammarScan(text, lark=_LARK.search(text) is not None).run()


class _GrammarScan:
    """One pass over a grammar's text: rule definitions and the names each refers to, and each rule body's
    shape. Strings, character classes, regexes, comments, special tokens and JSON blocks are stepped over as
    single elements; whatever else is out of place is left for llguidance's parser to report."""

    def __init__(self, text: str, lark: bool):
        self.text, self.lark = text, lark
        self.rules: dict[str, list[str]] = {}
        self.current: str | None = None
        self.shape = _Shape("invalid grammar: the grammar")

    def run(self) -> None:
        t, n, i = self.text, len(self.text), 0
        while i < n:
            c = t[i]
            if c.isspace():
                i += 1
            elif c == "#" or (self.lark and t.startswith("//", i)):
                end = t.find("\n", i)
                i = n if end < 0 else end
            elif c == '"':
                i = self._quoted_end(i)
                self.shape.element()
            elif c == "[" and not self.lark:
                i = self._gbnf_class_end(i)
                self.shape.element()
            elif c == "/" and self.lark:
                i = self._regex(i)
            elif c == "<" and self.lark:
                end = t.find(">", i)
                i = n if end < 0 else end + 1
                self.shape.element()
            elif c == "%" and self.lark:
                i = self._directive(i)
            elif c in "([":
                self.shape.open()
                i += 1
            elif c in ")]":
                self.shape.close()
                i += 1
            elif c == "|":
                self.shape.alternative()
                i += 1
            elif c == "{" and (m := _COUNT.match(t, i)):
                self.shape.repeat(*_counts(m))
                i = m.end()
            elif c == "~" and self.lark and (m := _TILDE.match(t, i)):
                low = int(m.group(1)) if len(m.group(1)) < 10 else 10**9
                high = low if m.group(2) is None else int(m.group(2)) if len(m.group(2)) < 10 else 10**9
                self.shape.repeat(low, high)
                i = m.end()
            elif (m := (_LARK_NAME if self.lark else _GBNF_NAME).match(t, i)):
                i = self._name(m)
            else:
                i += 1
        self.shape.finish()
        edges = {rule: [r for r in refs if r in self.rules] for rule, refs in self.rules.items()}
        first = [name for name in ("root", "start") if name in self.rules]
        depth, start = deepest(first + list(self.rules), edges)
        if depth > MAX_RULE_DEPTH:
            raise GrammarError(f"invalid grammar: its rules refer to one another {depth} deep from {start!r} "
                               f"(at most {MAX_RULE_DEPTH})")

    def _name(self, m: re.Match) -> int:
        """A rule's definition (GBNF `name ::=`, Lark `name:` with optional [options] or .priority) or a
        reference to one."""
        t, name, j = self.text, m.group(), m.end()
        k = j
        while k < len(t) and t[k] in " \t":
            k += 1
        if self.lark:
            if t.startswith("[", k):
                k = self._bracket_end(k)
            defined = t.startswith(":", k) and not t.startswith("::", k)
            k += 1
        else:
            defined = t.startswith("::=", k)
            k += 3
        if not defined:
            if self.current is not None:
                self.rules[self.current].append(name)
            self.shape.element()
            return j
        self.shape.finish()
        self.current = name.split(".")[0]
        self.rules.setdefault(self.current, [])
        if len(self.rules) > MAX_RULES:
            raise GrammarError(f"invalid grammar: it has more than {MAX_RULES} rules")
        self.shape = _Shape(f"invalid grammar: rule {self.current!r}")
        return k

    def _quoted_end(self, i: int) -> int:
        return _STRING.match(self.text, i).end()  # type: ignore[union-attr]

    def _gbnf_class_end(self, i: int) -> int:
        return _GBNF_CLASS.match(self.text, i).end()  # type: ignore[union-attr]

    def _bracket_end(self, i: int) -> int:
        """Past a Lark rule's [options] (strings inside may hold ']')."""
        t, j = self.text, i + 1
        while j < len(t) and t[j] not in "]\n":
            j = self._quoted_end(j) if t[j] == '"' else j + 1
        k = j + 1
        while k < len(t) and t[k] in " \t":
            k += 1
        return k

    def _regex(self, i: int) -> int:
        """A Lark /regex/flags: checked as a regex, one element of the rule of its written-out size."""
        m = _LARK_REGEX.match(self.text, i)
        where = f"invalid grammar: a regex in rule {self.current!r}" if self.current else "invalid grammar: a regex"
        self.shape.element(check_regex(m.group(1), where))  # type: ignore[union-attr]
        return m.end()  # type: ignore[union-attr]

    def _directive(self, i: int) -> int:
        """%json {schema} is checked as a schema; %regex {...} and %llguidance {...} are stepped over; other
        directives (%import, %ignore) read on as names."""
        m = _DIRECTIVE.match(self.text, i)
        if m is None:
            return i + 1
        if m.group(1) not in ("json", "regex", "llguidance") or not self.text.startswith("{", m.end()):
            return m.end()
        try:
            value, end = json.JSONDecoder().raw_decode(self.text, m.end())
        except RecursionError:
            raise GrammarError(f"invalid grammar: a %{m.group(1)} block nests too deeply") from None
        except ValueError:
            return m.end()  # llguidance's parser will say what is wrong with it
        if m.group(1) == "json":
            check_schema(value, f"grammar: %json schema in rule {self.current!r}")
        self.shape.element()
        return end
