"""The jinja2 sandbox chat templates run in: compile and render untrusted template code in bounded time and memory.

Templates come from downloaded files, so they are untrusted code. Jinja's ImmutableSandboxedEnvironment keeps
them away from Python's internals (no attribute that starts with '_', no mutation of our data); this module
bounds what they cost. Every failure is a TemplateError.

Why in-process checks plus a watchdog thread, not a subprocess with rlimits: chat renders the conversation at
every turn (and trimming a long one renders it several times), real templates render in a millisecond, and a
fork per render would cost more than the render, fork a process that may hold a CUDA context, and need
per-platform code; resource limits do not exist on Windows. So the bounds are two layers in the process:

1. No single operation may build something large: what it would build is worked out from its arguments
   before it runs, and refused past `max_chars` (template_limits.py).
2. Everything written in Python runs under a watchdog thread that stops the render at the next bytecode
   once the deadline passes or the memory budget is spent (template_watchdog.py). Because layer 1 keeps
   each C call small, the deadline holds to within one such call.

Layer 2 cannot stop a single C call, so layer 1 also covers the calls whose TIME grows faster than their
input: `strip`/`lstrip`/`rstrip`/`trim` with a long set of characters (CPython scans the set once per
character: two million of each is hours in one call) run through a set in Python code, `striptags` is a
linear walk whatever MarkupSafe is installed (2.0's was a backtracking regex), and `urlize` is refused: its regular expressions backtrack quadratically on one long word (`')' * 30000` runs 26 s in
one match), and no chat template makes HTML links.

range() holds at most MAX_RANGE items; the rendered output streams out of generate() and stops at
max_chars; an attribute the sandbox refuses raises at once (Jinja's default would print an empty string).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import re
from datetime import datetime
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import markupsafe
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter, SecurityError

from ..errors import TemplateError
from .template_limits import (
    FILTER_CHECKS,
    RESULT_CHECKED_FILTERS,
    Limit,
    method_size,
    percent_size,
    size_of,
    spec_size,
)
from .template_watchdog import OutOfMemory, Timeout, Watchdog, memory_budget

DEFAULT_MAX_CHARS = 8 * 1024 * 1024  # a rendered prompt (or any string inside one) of at most 8 Mi characters
DEFAULT_TIMEOUT_S = 5.0  # real templates render in milliseconds (1000 turns: well under a second)
MAX_RANGE = 100_000  # jinja2.sandbox.MAX_RANGE
MAX_SOURCE_CHARS = 128 * 1024  # real templates are < 20 KB; 128 Ki characters compile in about a second
MAX_INT_BITS = 4096  # a product, power or quotient of integers larger than this is refused
STRIP_SET_CHARS = 64  # strip() with more characters than this goes through a set (_strip)


# -- compiling and rendering -------------------------------------------------------------------------------------


def compile_template(text: str, source: str, max_chars: int, timeout_s: float) -> jinja2.Template:
    """`text` compiled in the sandbox; a TemplateError naming `source` when it is too long or does not compile."""
    if len(text) > MAX_SOURCE_CHARS:
        raise TemplateError(f"chat template ({source}) is {len(text)} characters long; the limit is "
                            f"{MAX_SOURCE_CHARS} (real templates are a few thousand)")
    watchdog = Watchdog(timeout_s, memory_budget(max_chars))
    try:
        with watchdog:
            return _Sandbox(max_chars).from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template ({source}) has a syntax error at line {exc.lineno}: {exc.message}") from None
    except Limit as exc:  # Jinja folds constant filter calls while compiling; ours check sizes there too
        raise TemplateError(f"chat template ({source}) stopped while compiling: {_why(exc, timeout_s)}") from None
    except (RecursionError, MemoryError):
        raise TemplateError(f"chat template ({source}) does not compile: it nests too deeply") from None
    except Exception as exc:  # anything else the compiler trips on
        raise TemplateError(f"chat template ({source}) does not compile: {exc}") from None
    finally:
        watchdog.close()  # also when its firing landed inside __enter__ (Watchdog.close)


def render(template: jinja2.Template, context: dict[str, Any], source: str, max_chars: int, timeout_s: float) -> str:
    """The template's output for `context`, bounded in time, memory and size."""
    chunks: list[str] = []
    size = 0
    watchdog = Watchdog(timeout_s, memory_budget(max_chars))
    try:
        # The watchdog's exception may land anywhere inside this block, its own __enter__ and __exit__
        # included: all of it sits inside the try, and the finally disarms it in any case.
        with watchdog:
            for chunk in template.generate(**context):
                size += len(chunk)
                if size > max_chars:
                    raise Limit(f"the rendered prompt exceeds {max_chars} characters")
                chunks.append(chunk)
    except Limit as exc:
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
    finally:
        watchdog.close()  # also when its firing landed inside __enter__ (Watchdog.close)
    return "".join(chunks)


def _why(exc: Limit, timeout_s: float) -> str:
    if isinstance(exc, Timeout):
        return f"rendering took longer than {timeout_s:g} s"
    if isinstance(exc, OutOfMemory):
        return "it used more memory than a chat template may"
    return str(exc)


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
        self.total += spec_size(format_spec, value, self.limit)
        if self.total > self.limit:
            raise Limit(f"format() would exceed {self.limit} characters")
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
        self.filters.update(sum=self._sum, list=self._list, wordcount=_wordcount, trim=_trim, striptags=_striptags,
                            urlize=_urlize)
        for name, check in FILTER_CHECKS.items():
            self.filters[name] = self._checked_filter(self.filters[name], name, check)
        for name in RESULT_CHECKED_FILTERS:
            self.filters[name] = self._checked_filter(self.filters[name], name, None)
        self.tests["divisibleby"] = self._divisibleby

    # Refuse outright: Jinja's default returns an Undefined that prints as "" and fails only on use.
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def bound(self, value: Any, what: str, size: int | None = None) -> Any:
        """`value`, or Limit when it (or `size`, the projected size of what is about to be built) is too big."""
        if size is None:
            if isinstance(value, (int, float, bool)) or value is None:
                return value
            size = size_of(value, self.max_chars)
        if size > self.max_chars:
            raise Limit(f"{what} would exceed {self.max_chars} characters")
        return value

    def _output(self, value: Any) -> Any:  # finalize: every {{ ... }} before str()
        return self.bound(value, "an output expression")

    def _range(self, *args: int) -> range:
        rng = range(*args)
        if len(rng) > MAX_RANGE:
            raise Limit(f"range() of {len(rng)} items exceeds the limit of {MAX_RANGE}")
        return rng

    def _strftime_now(self, fmt: Any) -> str:
        fmt = str(fmt)
        self.bound(None, "strftime_now()", 32 * len(fmt))  # one directive prints at most a few dozen characters
        return datetime.now().strftime(fmt)

    def take(self, iterable: Any, what: str) -> list[Any]:
        """list(iterable), stopping as soon as the items are too big: a generator (map, batch, select) may
        yield millions of items that a list would hold at once."""
        if isinstance(iterable, (str, bytes, list, tuple, dict, range)):
            self.bound(None, what, size_of(iterable, self.max_chars) + 2 * len(iterable))
            return list(iterable)
        items, size = [], 2
        for item in iterable:
            size += 2 + size_of(item, self.max_chars)
            self.bound(None, what, size)
            items.append(item)
        return items

    def checked_concat(self, parts: tuple[Any, ...]) -> str:
        self.bound(None, "a string built with '~'", sum(size_of(p, self.max_chars) for p in parts))
        return "".join(map(str, parts))

    def _check_ints(self, operator: str, left: Any, right: Any) -> None:
        """Refuse integer arithmetic whose cost grows with the product of the operands' sizes."""
        if not (isinstance(left, int) and isinstance(right, int)):
            return
        lb, rb = left.bit_length(), right.bit_length()
        if operator == "*" and lb + rb > MAX_INT_BITS:  # repeated squaring: one C call per step
            raise Limit(f"a product of {lb}-bit and {rb}-bit numbers is too large")
        if operator == "**" and abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > MAX_INT_BITS:
            raise Limit(f"a power of a {lb}-bit number to a {rb}-bit exponent is too large")
        if operator in ("//", "%") and lb > MAX_INT_BITS and rb > 64:  # long division: time ~ lb * rb
            raise Limit(f"a division of a {lb}-bit number by a {rb}-bit number is too slow")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        what = f"the result of {operator!r}"
        self._check_ints(operator, left, right)
        if operator == "*":
            seq, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int) and count > 0:
                self.bound(None, what, size_of(seq, self.max_chars // count + 1) * count)
        elif operator == "+":
            if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
                self.bound(None, what, size_of(left, self.max_chars) + size_of(right, self.max_chars))
        elif operator == "%" and isinstance(left, str):
            self.bound(None, what, percent_size(left, right, self.max_chars))
        return self.bound(super().call_binop(context, operator, left, right), what)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        what = f"{name or 'a call'}()"
        if isinstance(owner, (str, bytes, bytearray)) and name in ("strip", "lstrip", "rstrip") and len(args) == 1:
            return _strip(owner, args[0], name)
        if isinstance(owner, markupsafe.Markup) and name == "striptags" and not args:
            return _striptags(owner)
        if isinstance(owner, (str, bytes, bytearray)) and name == "join" and args:
            items = __self.take(args[0], what)
            __self.bound(None, what, size_of(items, __self.max_chars) + len(owner) * max(len(items) - 1, 0))
            args = (items, *args[1:])
        elif isinstance(owner, (str, bytes, bytearray, int)) and not isinstance(owner, bool):
            size = method_size(owner, name, args, kwargs)
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
        self.bound(None, "the sum filter", size_of(start, self.max_chars) + size_of(items, self.max_chars))
        return type(start)(x for part in (start, *items) for x in part)

    def _list(self, value: Any) -> list[Any]:
        return self.take(value, "the list filter")

    def _divisibleby(self, value: Any, num: Any) -> bool:
        self._check_ints("%", value, num)
        return value % num == 0


def _wordcount(s: Any) -> int:
    """Jinja's wordcount without the list of every word (a long text would hold millions of strings)."""
    return sum(1 for _ in re.finditer(r"\w+", str(s)))


# -- calls whose time grows faster than their input, in C ---------------------------------------------------------


def _strip(s: Any, chars: Any, how: str) -> Any:
    """s.strip(chars) (or lstrip, rstrip) in time linear in both: CPython looks each character of `s` up in
    `chars` by scanning it, one C call of len(s) * len(chars) steps. Past STRIP_SET_CHARS characters the
    ends are walked here, against a set, where the watchdog reaches."""
    if not isinstance(chars, (str, bytes, bytearray)) or len(chars) <= STRIP_SET_CHARS or \
            isinstance(chars, str) != isinstance(s, str):
        return getattr(s, how)(chars)  # (None, a short set, or the wrong type: Python's own answer)
    keep = set(chars)
    start, end = 0, len(s)
    if how != "rstrip":
        while start < end and s[start] in keep:
            start += 1
    if how != "lstrip":
        while end > start and s[end - 1] in keep:
            end -= 1
    return s[start:end]


def _trim(value: Any, chars: Any = None) -> str:
    """Jinja's trim filter through _strip."""
    return _strip(jinja2.filters.soft_str(value), chars, "strip")


def _striptags(value: Any) -> str:
    """Jinja's striptags (MarkupSafe's Markup.striptags) as a linear walk with str.find, the way MarkupSafe 3
    does it, whichever MarkupSafe is installed: 2.0 removed tags with the regex (<!--.*?-->|<[^>]*>),
    quadratic on an unclosed '<' repeated, in one C call; 2.1 copied the whole text once per tag."""
    if hasattr(value, "__html__"):
        value = value.__html__()
    text, parts, pos = str(value), [], 0
    while (start := text.find("<", pos)) != -1:
        closer = "-->" if text.startswith("<!--", start) else ">"
        end = text.find(closer, start + 4 if closer == "-->" else start)
        if end == -1:  # unclosed: the rest stays as it is
            break
        parts.append(text[pos:start])
        pos = end + len(closer)
    parts.append(text[pos:])
    return markupsafe.Markup(" ".join("".join(parts).split())).unescape()


def _urlize(*args: Any, **kwargs: Any) -> str:
    raise Limit("the urlize filter is not available in chat templates (its regular expressions can run for "
                "minutes on one long word, in a call the deadline cannot stop)")


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
