"""What a chat template's operations may build, worked out before they run: layer 1 of the sandbox's bounds
(template_sandbox.py puts the two together; template_watchdog.py is layer 2).

No single operation may build something large. Python runs `'x' * n`, `str.join`, `'%*s' % ...`,
`json.dumps` as one C call that no deadline can interrupt, so every operation a template reaches that can
make its output much larger than its input (string and bytes methods, the `%` and `{}` formats, `*`, `+`,
`~`, `**`, big-integer division, and the filters center, indent, format, replace, join, wordwrap, round,
batch, sum, list, ...) is checked BEFORE it runs: the size it would produce is worked out from
its arguments (a format's widths, precisions and fields; a replacement's count; an indent's lines) and
refused past `max_chars`. What cannot grow by more than a small factor (upper, escape, tojson) is checked
on its result. Quadratic built-ins are replaced by linear ones (`sum` of lists) or refused (division of
two huge integers), and the template source itself is at most MAX_SOURCE_CHARS (real ones are < 20 KB;
the compiler needs about 600 bytes of memory per source character).

Every function here answers "how big would it be?" from the arguments alone; the sandbox refuses what
exceeds its `max_chars` by raising Limit.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Protocol

import jinja2.filters


class Sandbox(Protocol):
    """What the filter checks read of the sandbox's environment (template_sandbox._Sandbox, a jinja2
    Environment): its size limit, and `take`, a bounded list()."""

    max_chars: int

    def take(self, iterable: Any, what: str) -> list[Any]: ...


class Limit(BaseException):
    """A render that ran out of time or size. BaseException, so no `except Exception` inside Jinja's runtime
    swallows it; render() turns it into a TemplateError."""


# -- sizes -----------------------------------------------------------------------------------------------------------


def size_of(value: Any, limit: int) -> int:
    """Roughly len(str(value)), walking containers; stops counting once past `limit` (so it costs at most
    about `limit` steps). Catches a list of a million references to a long string before str() builds it."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, (str, bytes, bytearray)):
            total += len(v)
        elif isinstance(v, (list, tuple)):
            total += 2 + 2 * len(v)
            if total <= limit:
                stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            if total <= limit:
                stack.extend(v.items())
        elif isinstance(v, int) and not isinstance(v, bool):
            total += max(8, v.bit_length() + 2)  # as long as its binary digits: the longest way to print it
        else:
            total += 8
    return total


def _text_size(value: Any, limit: int) -> int:
    """How long a format's field can print `value` before its width and precision: floats print up to
    about 320 digits ('%f' % 1e308)."""
    return 330 if isinstance(value, float) else size_of(value, limit)


def percent_size(fmt: str, args: Any, limit: int) -> int:
    """The longest `fmt % args` can be: the format's text plus, per conversion, its width, precision and the
    printed size of its argument (widths and precisions given as '*' taken from the arguments). Follows
    the parser of Python's printf-style formatting (Objects/unicodeobject.c)."""
    positional = list(args) if isinstance(args, tuple) else [args]
    mapping = args if isinstance(args, dict) else {}
    total, i, n, pos = 0, 0, len(fmt), 0

    def next_arg() -> Any:
        nonlocal pos
        pos += 1
        return positional[pos - 1] if pos <= len(positional) else None

    def number(k: int) -> tuple[int, int]:
        if k < n and fmt[k] == "*":
            value = next_arg()
            return (abs(value) if isinstance(value, int) else 0), k + 1
        start = k
        while k < n and fmt[k].isdigit():
            k += 1
        digits = fmt[start:k]
        return (int(digits) if len(digits) <= 10 else limit + 1) if digits else 0, k

    while (j := fmt.find("%", i)) >= 0 and total <= limit:
        total += j - i
        k, value, keyed = j + 1, None, False
        if k < n and fmt[k] == "(":
            depth, k = 1, k + 1
            start = k
            while k < n and depth:
                depth += {"(": 1, ")": -1}.get(fmt[k], 0)
                k += 1
            value, keyed = mapping.get(fmt[start : k - 1]), True
        while k < n and fmt[k] in "-+ #0":
            k += 1
        width, k = number(k)
        precision = 0
        if k < n and fmt[k] == ".":
            precision, k = number(k + 1)
        while k < n and fmt[k] in "hlL":
            k += 1
        conversion = fmt[k] if k < n else ""
        i = k + 1
        if conversion == "%":
            total += 1 + width
            continue
        if not keyed:
            value = next_arg()
        total += width + precision + _text_size(value, limit)
    return total + max(0, n - i)


def spec_size(spec: str, value: Any, limit: int) -> int:
    """The longest format(value, spec) can be: every number in the spec counted as a width or a precision
    (the fill character may be a digit too: counting it only overestimates), grouping doubling the digits."""
    numbers = re.findall(r"\d+", spec)
    if any(len(d) > 10 for d in numbers):
        return limit + 1
    grouped = "," in spec or "_" in spec
    return sum(map(int, numbers)) + _text_size(value, limit) * (2 if grouped else 1)


# -- what a string, bytes or int method would build ----------------------------------------------------------------


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _pieces(owner: Any, sep: Any, maxsplit: Any) -> int:
    """How many pieces owner.split(sep, maxsplit) makes, at most."""
    n = len(owner)
    count = (n + 1) // 2 + 1 if sep is None else owner.count(sep) + 1
    return min(count, maxsplit + 1) if isinstance(maxsplit, int) and maxsplit >= 0 else count


def _line_breaks(owner: Any) -> int:
    breaks = ("\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")
    if not isinstance(owner, str):
        breaks = (b"\n", b"\r")
    return sum(owner.count(b) for b in breaks) + 1


def _translated_size(owner: Any, table: Any) -> int:
    values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
    longest = max((len(v) for v in values if isinstance(v, (str, bytes))), default=1)
    return len(owner) * max(1, longest)


def method_size(owner: Any, name: str, args: tuple, kwargs: dict) -> int | None:
    """The size a str/bytes method (or int.to_bytes) would produce, worked out before it runs; None for the
    methods that cannot produce more than a small multiple of their input."""
    if isinstance(owner, int):
        return _arg(args, kwargs, 0, "length", 1) if name == "to_bytes" else None
    n = len(owner)
    if name in ("center", "ljust", "rjust", "zfill"):
        width = _arg(args, kwargs, 0, "width", 0)
        return max(n, width) if isinstance(width, int) else None
    if name == "expandtabs":
        size = _arg(args, kwargs, 0, "tabsize", 8)
        return n + owner.count("\t" if isinstance(owner, str) else b"\t") * max(size, 0) if isinstance(size, int) else None
    if name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        if not isinstance(old, type(owner)) or not isinstance(new, type(owner)):
            return None
        grow = len(new) - len(old)
        return n + (owner.count(old) if old else n + 1) * max(grow, 0)
    if name == "translate" and args:
        return _translated_size(owner, args[0])
    if name in ("split", "rsplit"):
        sep = _arg(args, kwargs, 0, "sep")
        if sep is not None and not isinstance(sep, type(owner)):
            return None
        return n + 8 * _pieces(owner, sep, _arg(args, kwargs, 1, "maxsplit", -1))
    if name == "splitlines":
        return n + 8 * _line_breaks(owner)
    return None



# -- filters: the size of what each would build ----------------------------------------------------------------------


def _check_join(env: Sandbox, a: dict) -> int:
    """join materializes its items first (through `attribute`), then checks their size with the separator."""
    value = a["value"]
    if a["attribute"] is not None:
        value = map(jinja2.filters.make_attrgetter(env, a["attribute"]), value)
        a["attribute"] = None
    items = a["value"] = env.take(value, "the join filter")
    return size_of(items, env.max_chars) + len(str(a["d"])) * max(len(items) - 1, 0)


def _check_indent(env: Sandbox, a: dict) -> int | None:
    width, s = a["width"], a["s"]
    w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(str(s)) + (str(s).count("\n") + 2) * max(w, 0)


def _check_wordwrap(env: Sandbox, a: dict) -> int:
    """At most one line per character; textwrap holds each word as an object (about 8 characters' worth)."""
    n, wrap = len(str(a["s"])), a["wrapstring"]
    return n * (9 + len(wrap if isinstance(wrap, str) else "\n"))


def _check_round(env: Sandbox, a: dict) -> int | None:
    """round(x, precision) computes 10 ** precision: a precision of millions is a huge power."""
    precision = a["precision"]
    if isinstance(precision, int) and abs(precision) > 400:  # past any float's digits
        raise Limit(f"round() to {precision} digits is out of range")
    return None


def _check_batch(env: Sandbox, a: dict) -> int | None:
    """The last batch is filled up to `linecount` items in one go."""
    linecount = a["linecount"]
    if a["fill_with"] is not None and isinstance(linecount, int):
        return 2 * linecount
    return None


FILTER_CHECKS: dict[str, Callable[[Sandbox, dict], int | None]] = {
    "center": lambda env, a: max(len(str(a["value"])), a["width"]) if isinstance(a["width"], int) else None,
    "indent": _check_indent,
    "format": lambda env, a: percent_size(str(a["value"]), a["kwargs"] or a["args"], env.max_chars),
    "replace": lambda env, a: method_size(str(a["s"]), "replace", (str(a["old"]), str(a["new"])), {}),
    "join": _check_join,
    "wordwrap": _check_wordwrap,
    "round": _check_round,
    "batch": _check_batch,
    "escape": lambda env, a: 5 * len(a["s"]) if isinstance(a["s"], str) else None,
    "e": lambda env, a: 5 * len(a["s"]) if isinstance(a["s"], str) else None,
    "forceescape": lambda env, a: 5 * len(a["value"]) if isinstance(a["value"], str) else None,
    "tojson": lambda env, a: size_of(a["x"], env.max_chars) * (1 + _indent_width(a["indent"])),
    "pprint": lambda env, a: size_of(a["value"], env.max_chars),
    "string": lambda env, a: size_of(a["s"], env.max_chars),
}
RESULT_CHECKED_FILTERS = ("truncate", "slice", "map", "urlencode", "title", "upper", "lower", "capitalize",
                          "striptags", "xmlattr", "filesizeformat")


def _indent_width(indent: Any) -> int:
    """tojson's indent puts every item on its own line, indented: a size factor."""
    if isinstance(indent, str):
        return len(indent) + 1
    return indent + 1 if isinstance(indent, int) and indent > 0 else 0
