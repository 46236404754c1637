"""The jinja2 sandbox chat templates run in: compile and render untrusted template code in bounded time and memory.

Templates come from downloaded files, so they are untrusted code. Jinja's ImmutableSandboxedEnvironment keeps
them away from Python's internals (no attribute that starts with '_', no mutation of our data); this module
bounds what they cost. Every failure is a TemplateError.

Why in-process checks plus a watchdog thread, not a subprocess with rlimits: chat renders the conversation at
every turn (and trimming a long one renders it several times), real templates render in a millisecond, and a
fork per render would cost more than the render, fork a process that may hold a CUDA context, and need
per-platform code; resource limits do not exist on Windows. So the bounds are two layers in the process:

1. No single operation may build something large. Python runs `'x' * n`, `str.join`, `'%*s' % ...`,
   `json.dumps` as one C call that no deadline can interrupt, so every operation a template reaches that can
   make its output much larger than its input (string and bytes methods, the `%` and `{}` formats, `*`, `+`,
   `~`, `**`, big-integer division, and the filters center, indent, format, replace, join, wordwrap, urlize,
   round, batch, sum, list, ...) is checked BEFORE it runs: the size it would produce is worked out from
   its arguments (a format's widths, precisions and fields; a replacement's count; an indent's lines) and
   refused past `max_chars`. What cannot grow by more than a small factor (upper, escape, tojson) is checked
   on its result. Quadratic built-ins are replaced by linear ones (`sum` of lists) or refused (division of
   two huge integers), and the template source itself is at most MAX_SOURCE_CHARS (real ones are < 20 KB;
   the compiler needs about 600 bytes of memory per source character).
2. Everything written in Python (Jinja's loops, macros, generators, the filters written in Python) runs
   under a watchdog thread that wakes every few milliseconds and raises in the rendering thread, at the
   next bytecode, once the wall-clock deadline passes or the process's anonymous memory (Linux:
   /proc/self/statm) has grown by more than the memory budget since the render began. Because layer 1
   keeps each C call small, the deadline holds to within one such call.

range() holds at most MAX_RANGE items; the rendered output streams out of generate() and stops at
max_chars; an attribute the sandbox refuses raises at once (Jinja's default would print an empty string).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import json
import math
import os
import re
import sys
import threading
import time
from datetime import datetime
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, SecurityError

from .errors import TemplateError

DEFAULT_MAX_CHARS = 8 * 1024 * 1024  # a rendered prompt (or any string inside one) of at most 8 Mi characters
DEFAULT_TIMEOUT_S = 5.0  # real templates render in milliseconds (1000 turns: well under a second)
MAX_RANGE = 100_000  # jinja2.sandbox.MAX_RANGE
MAX_SOURCE_CHARS = 128 * 1024  # real templates are < 20 KB; 128 Ki characters compile in about a second
MAX_INT_BITS = 4096  # a product, power or quotient of integers larger than this is refused
MIN_MEMORY_BYTES = 256 * 1024 * 1024  # the memory budget of a render: this, or 32 bytes per max_chars
POLL_S = 0.01  # how often the watchdog looks at the clock and the memory


class _Limit(BaseException):
    """A render that ran out of time or size. BaseException, so no `except Exception` inside Jinja's runtime
    swallows it; render() turns it into a TemplateError."""


class _Timeout(_Limit):
    """Raised inside the rendering thread by the watchdog: the deadline passed."""


class _OutOfMemory(_Limit):
    """Raised inside the rendering thread by the watchdog: the memory budget is spent."""


# -- compiling and rendering -------------------------------------------------------------------------------------


def compile_template(text: str, source: str, max_chars: int, timeout_s: float) -> jinja2.Template:
    """`text` compiled in the sandbox; a TemplateError naming `source` when it is too long or does not compile."""
    if len(text) > MAX_SOURCE_CHARS:
        raise TemplateError(f"chat template ({source}) is {len(text)} characters long; the limit is "
                            f"{MAX_SOURCE_CHARS} (real templates are a few thousand)")
    try:
        with _Watchdog(timeout_s, _memory_budget(max_chars)):
            return _Sandbox(max_chars).from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template ({source}) has a syntax error at line {exc.lineno}: {exc.message}") from None
    except _Limit as exc:  # Jinja folds constant filter calls while compiling; ours check sizes there too
        raise TemplateError(f"chat template ({source}) stopped while compiling: {_why(exc, timeout_s)}") from None
    except (RecursionError, MemoryError):
        raise TemplateError(f"chat template ({source}) does not compile: it nests too deeply") from None
    except Exception as exc:  # anything else the compiler trips on
        raise TemplateError(f"chat template ({source}) does not compile: {exc}") from None


def render(template: jinja2.Template, context: dict[str, Any], source: str, max_chars: int, timeout_s: float) -> str:
    """The template's output for `context`, bounded in time, memory and size."""
    chunks: list[str] = []
    size = 0
    try:
        # The watchdog's exception may land anywhere inside this block, its own __exit__ included: all of it
        # sits inside the try.
        with _Watchdog(timeout_s, _memory_budget(max_chars)):
            for chunk in template.generate(**context):
                size += len(chunk)
                if size > max_chars:
                    raise _Limit(f"the rendered prompt exceeds {max_chars} characters")
                chunks.append(chunk)
    except _Limit as exc:
        raise TemplateError(f"chat template ({source}) stopped: {_why(exc, timeout_s)}") from None
    except SecurityError as exc:
        raise TemplateError(f"chat template ({source}) blocked by the sandbox: {exc}") from None
    except jinja2.UndefinedError as exc:
        raise TemplateError(f"chat template ({source}) failed: {exc}") from None
    except jinja2.TemplateError as exc:  # raise_exception() and runtime template errors
        raise TemplateError(f"chat template ({source}) raised: {exc}") from None
    except RecursionError:
        raise TemplateError(f"chat template ({source}) recursed too deeply") from None
    except MemoryError:
        raise TemplateError(f"chat template ({source}) ran out of memory") from None
    except Exception as exc:
        raise TemplateError(f"chat template ({source}) failed: {type(exc).__name__}: {exc}") from None
    return "".join(chunks)


def _why(exc: _Limit, timeout_s: float) -> str:
    if isinstance(exc, _Timeout):
        return f"rendering took longer than {timeout_s:g} s"
    if isinstance(exc, _OutOfMemory):
        return "it used more memory than a chat template may"
    return str(exc)


def _memory_budget(max_chars: int) -> int:
    return max(MIN_MEMORY_BYTES, 32 * max_chars)


# -- the watchdog --------------------------------------------------------------------------------------------------


def _anonymous_memory() -> Callable[[], int] | None:
    """A cheap reader of the process's resident anonymous memory in bytes (resident minus file-backed pages,
    so touching a memory-mapped model does not count), or None where /proc is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None
    os.close(fd)
    page = os.sysconf("SC_PAGE_SIZE")

    def read() -> int:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * page

    return read


_MEMORY = _anonymous_memory()


class _Watchdog:
    """Raises _Timeout in the current thread once `seconds` have passed, or _OutOfMemory once the process's
    anonymous memory has grown by `budget` bytes, at the next bytecode boundary: it stops any Python-level
    loop, at little cost while it waits (unlike sys.settrace). A long single C call is not interrupted: the
    sandbox's size checks keep those small. Use as a context manager."""

    def __init__(self, seconds: float, budget: int):
        self.deadline = time.monotonic() + seconds
        self.budget = budget
        self.thread_id = threading.get_ident()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.done = self.fired = False
        self.base = _MEMORY() if _MEMORY else 0
        self.thread = threading.Thread(target=self._watch, daemon=True, name="template-watchdog")

    def _watch(self) -> None:
        while not self.stop.wait(max(0.0, min(POLL_S, self.deadline - time.monotonic()))):
            if time.monotonic() >= self.deadline:
                return self._fire(_Timeout)
            if _MEMORY and _MEMORY() - self.base > self.budget:
                return self._fire(_OutOfMemory)
        return None

    def _fire(self, exc: type[_Limit]) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), ctypes.py_object(exc))

    def __enter__(self) -> "_Watchdog":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.done = True
            if self.fired:  # fired, but maybe not delivered yet: withdraw it (NULL clears a pending one)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
        self.stop.set()


# -- sizes -----------------------------------------------------------------------------------------------------------


def _size(value: Any, limit: int) -> int:
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
    return 330 if isinstance(value, float) else _size(value, limit)


def _percent_size(fmt: str, args: Any, limit: int) -> int:
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


def _spec_size(spec: str, value: Any, limit: int) -> int:
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


def _method_size(owner: Any, name: str, args: tuple, kwargs: dict) -> int | None:
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


# -- the environment -------------------------------------------------------------------------------------------------


class _Codegen(CodeGenerator):
    """Jinja's code generator, with `~` concatenation routed through the environment so its size is checked."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Formatter(SandboxedFormatter):
    """str.format in the sandbox, checking each field's size before format() builds it, and the total."""

    def __init__(self, env: "_Sandbox"):
        super().__init__(env)
        self.limit = env.max_chars
        self.total = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self.total = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def format_field(self, value: Any, format_spec: str) -> Any:
        self.total += _spec_size(format_spec, value, self.limit)
        if self.total > self.limit:
            raise _Limit(f"format() would exceed {self.limit} characters")
        return super().format_field(value, format_spec)


class _Sandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _Codegen
    intercepted_binops = frozenset({"*", "**", "+", "%", "//", "/"})

    def __init__(self, max_chars: int):
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag],
            autoescape=False,
            finalize=self._output,
        )
        self.max_chars = max_chars
        self.globals.pop("lipsum", None)  # builds text in Python code the deadline does not see; no template uses it
        self.globals.update(
            range=self._range,
            raise_exception=_raise_exception,
            strftime_now=self._strftime_now,
            dict=_TemplateDict(),
            namespace=_Namespace,
        )
        self.filters["tojson"] = _tojson
        self.filters.update(sum=self._sum, list=self._list, wordcount=_wordcount)
        for name, check in _FILTER_CHECKS.items():
            self.filters[name] = self._checked_filter(self.filters[name], name, check)
        for name in _RESULT_CHECKED_FILTERS:
            self.filters[name] = self._checked_filter(self.filters[name], name, None)
        self.tests["divisibleby"] = self._divisibleby

    # Refuse outright: Jinja's default returns an Undefined that prints as "" and fails only on use.
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def bound(self, value: Any, what: str, size: int | None = None) -> Any:
        """`value`, or _Limit when it (or `size`, the projected size of what is about to be built) is too big."""
        if size is None:
            if isinstance(value, (int, float, bool)) or value is None:
                return value
            size = _size(value, self.max_chars)
        if size > self.max_chars:
            raise _Limit(f"{what} would exceed {self.max_chars} characters")
        return value

    def _output(self, value: Any) -> Any:  # finalize: every {{ ... }} before str()
        return self.bound(value, "an output expression")

    def _range(self, *args: int) -> range:
        rng = range(*args)
        if len(rng) > MAX_RANGE:
            raise _Limit(f"range() of {len(rng)} items exceeds the limit of {MAX_RANGE}")
        return rng

    def _strftime_now(self, fmt: Any) -> str:
        fmt = str(fmt)
        self.bound(None, "strftime_now()", 32 * len(fmt))  # one directive prints at most a few dozen characters
        return datetime.now().strftime(fmt)

    def take(self, iterable: Any, what: str) -> list[Any]:
        """list(iterable), stopping as soon as the items are too big: a generator (map, batch, select) may
        yield millions of items that a list would hold at once."""
        if isinstance(iterable, (str, bytes, list, tuple, dict, range)):
            self.bound(None, what, _size(iterable, self.max_chars) + 2 * len(iterable))
            return list(iterable)
        items, size = [], 2
        for item in iterable:
            size += 2 + _size(item, self.max_chars)
            self.bound(None, what, size)
            items.append(item)
        return items

    def checked_concat(self, parts: tuple[Any, ...]) -> str:
        self.bound(None, "a string built with '~'", sum(_size(p, self.max_chars) for p in parts))
        return "".join(map(str, parts))

    def _check_ints(self, operator: str, left: Any, right: Any) -> None:
        """Refuse integer arithmetic whose cost grows with the product of the operands' sizes."""
        if not (isinstance(left, int) and isinstance(right, int)):
            return
        lb, rb = left.bit_length(), right.bit_length()
        if operator == "*" and lb + rb > MAX_INT_BITS:  # repeated squaring: one C call per step
            raise _Limit(f"a product of {lb}-bit and {rb}-bit numbers is too large")
        if operator == "**" and abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > MAX_INT_BITS:
            raise _Limit(f"a power of a {lb}-bit number to a {rb}-bit exponent is too large")
        if operator in ("//", "%") and lb > MAX_INT_BITS and rb > 64:  # long division: time ~ lb * rb
            raise _Limit(f"a division of a {lb}-bit number by a {rb}-bit number is too slow")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        what = f"the result of {operator!r}"
        self._check_ints(operator, left, right)
        if operator == "*":
            seq, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int) and count > 0:
                self.bound(None, what, _size(seq, self.max_chars // count + 1) * count)
        elif operator == "+":
            if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
                self.bound(None, what, _size(left, self.max_chars) + _size(right, self.max_chars))
        elif operator == "%" and isinstance(left, str):
            self.bound(None, what, _percent_size(left, right, self.max_chars))
        return self.bound(super().call_binop(context, operator, left, right), what)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        what = f"{name or 'a call'}()"
        if isinstance(owner, (str, bytes, bytearray)) and name == "join" and args:
            items = __self.take(args[0], what)
            __self.bound(None, what, _size(items, __self.max_chars) + len(owner) * max(len(items) - 1, 0))
            args = (items, *args[1:])
        elif isinstance(owner, (str, bytes, bytearray, int)) and not isinstance(owner, bool):
            size = _method_size(owner, name, args, kwargs)
            if size is not None:
                __self.bound(None, what, size)
        return __self.bound(super().call(__context, __obj, *args, **kwargs), what)

    def wrap_str_format(self, value: Any) -> Any:
        """str.format / format_map through _Formatter (Jinja's own wrapper, with the size checks)."""
        if super().wrap_str_format(value) is None:  # not some str's .format / .format_map
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return str(_Formatter(self).vformat(fmt, args, kwargs))

        return functools.update_wrapper(checked, value)

    # -- filters and tests --

    def _checked_filter(self, func: Any, name: str, check: Callable[..., int | None] | None) -> Any:
        """`func` with `check(env, arguments)` (the projected size, from its bound arguments) run before it,
        and its result's size checked after."""
        signature = inspect.signature(func) if check is not None else None
        what = f"the {name} filter"

        def checked(*args: Any, **kwargs: Any) -> Any:
            if signature is not None:
                try:
                    bound = signature.bind(*args, **kwargs)
                except TypeError:
                    bound = None  # the filter itself reports the bad call
                if bound is not None:
                    bound.apply_defaults()
                    size = check(self, bound.arguments)  # may replace an argument (join: the items it took)
                    if size is not None:
                        self.bound(None, what, size)
                    args, kwargs = bound.args, bound.kwargs
            return self.bound(func(*args, **kwargs), what)

        if hasattr(func, "jinja_pass_arg"):  # keep Jinja's pass_context / pass_eval_context marker
            checked.jinja_pass_arg = func.jinja_pass_arg  # type: ignore[attr-defined]
        return checked

    def _sum(self, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        """Jinja's sum, in linear time: Python's sum() of lists copies the growing total at every step."""
        if attribute is not None:
            iterable = map(jinja2.filters.make_attrgetter(self, attribute), iterable)
        items = self.take(iterable, "the sum filter")
        if not isinstance(start, (list, tuple)):
            return sum(items, start)
        for item in items:
            if type(item) is not type(start):
                raise TypeError(f'can only concatenate {type(start).__name__} (not "{type(item).__name__}") '
                                f"to {type(start).__name__}")
        self.bound(None, "the sum filter", _size(start, self.max_chars) + _size(items, self.max_chars))
        return type(start)(x for part in (start, *items) for x in part)

    def _list(self, value: Any) -> list[Any]:
        return self.take(value, "the list filter")

    def _divisibleby(self, value: Any, num: Any) -> bool:
        self._check_ints("%", value, num)
        return value % num == 0


def _check_join(env: _Sandbox, a: dict) -> int:
    """join materializes its items first (through `attribute`), then checks their size with the separator."""
    value = a["value"]
    if a["attribute"] is not None:
        value = map(jinja2.filters.make_attrgetter(env, a["attribute"]), value)
        a["attribute"] = None
    items = a["value"] = env.take(value, "the join filter")
    return _size(items, env.max_chars) + len(str(a["d"])) * max(len(items) - 1, 0)


def _check_indent(env: _Sandbox, a: dict) -> int | None:
    width, s = a["width"], a["s"]
    w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    return len(str(s)) + (str(s).count("\n") + 2) * max(w, 0)


def _check_wordwrap(env: _Sandbox, a: dict) -> int:
    """At most one line per character; textwrap holds each word as an object (about 8 characters' worth)."""
    n, wrap = len(str(a["s"])), a["wrapstring"]
    return n * (9 + len(wrap if isinstance(wrap, str) else "\n"))


def _check_urlize(env: _Sandbox, a: dict) -> int:
    """Each word may become a link: about 50 characters of markup plus its rel/target, and itself twice."""
    s = str(a["value"])
    words = s.count(" ") + s.count("\n") + s.count("\t") + 1
    extra = sum(len(str(a.get(k) or "")) for k in ("rel", "target"))
    return 2 * len(s) + words * (50 + extra)


def _check_round(env: _Sandbox, a: dict) -> int | None:
    """round(x, precision) computes 10 ** precision: a precision of millions is a huge power."""
    precision = a["precision"]
    if isinstance(precision, int) and abs(precision) > 400:  # past any float's digits
        raise _Limit(f"round() to {precision} digits is out of range")
    return None


def _check_batch(env: _Sandbox, a: dict) -> int | None:
    """The last batch is filled up to `linecount` items in one go."""
    linecount = a["linecount"]
    if a["fill_with"] is not None and isinstance(linecount, int):
        return 2 * linecount
    return None


_FILTER_CHECKS: dict[str, Callable[[_Sandbox, dict], int | None]] = {
    "center": lambda env, a: max(len(str(a["value"])), a["width"]) if isinstance(a["width"], int) else None,
    "indent": _check_indent,
    "format": lambda env, a: _percent_size(str(a["value"]), a["kwargs"] or a["args"], env.max_chars),
    "replace": lambda env, a: _method_size(str(a["s"]), "replace", (str(a["old"]), str(a["new"])), {}),
    "join": _check_join,
    "wordwrap": _check_wordwrap,
    "urlize": _check_urlize,
    "round": _check_round,
    "batch": _check_batch,
    "escape": lambda env, a: 5 * len(a["s"]) if isinstance(a["s"], str) else None,
    "e": lambda env, a: 5 * len(a["s"]) if isinstance(a["s"], str) else None,
    "forceescape": lambda env, a: 5 * len(a["value"]) if isinstance(a["value"], str) else None,
    "tojson": lambda env, a: _size(a["x"], env.max_chars) * (1 + _indent_width(a["indent"])),
    "pprint": lambda env, a: _size(a["value"], env.max_chars),
    "string": lambda env, a: _size(a["s"], env.max_chars),
}
_RESULT_CHECKED_FILTERS = ("truncate", "slice", "map", "urlencode", "title", "upper", "lower", "capitalize",
                           "striptags", "xmlattr", "filesizeformat")


def _indent_width(indent: Any) -> int:
    """tojson's indent puts every item on its own line, indented: a size factor."""
    if isinstance(indent, str):
        return len(indent) + 1
    return indent + 1 if isinstance(indent, int) and indent > 0 else 0


def _wordcount(s: Any) -> int:
    """Jinja's wordcount without the list of every word (a long text would hold millions of strings)."""
    return sum(1 for _ in re.finditer(r"\w+", str(s)))


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names (as transformers' hardened one)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace cannot hold the underscore name {name!r}")


def _raise_exception(message: Any) -> None:
    raise jinja2.TemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
