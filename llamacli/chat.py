"""Chat templates: a conversation -> the prompt text the model was trained on.

The template is the file's `tokenizer.chat_template` (Jinja, as in the model's tokenizer_config.json), rendered
the way transformers' apply_chat_template renders it: an ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`, and a `tojson` that keeps
non-ASCII text. A file without one gets a built-in format chosen by architecture and vocabulary (ChatML,
Llama 3, Phi-3, Llama 2 [INST]); `.source` says which ('gguf' or 'builtin:<name>').

Templates come from downloaded files, so they are untrusted code. Besides Jinja's sandbox (no attribute that
starts with '_', no mutation of our data), rendering is bounded:
- any attribute the sandbox refuses raises at once (Jinja's default would print an empty string);
- range() holds at most MAX_RANGE items; `*`, `**`, `+`, `%`, `~`, string methods and filters may not build a
  string or list longer than max_chars;
- the output streams out of generate() and stops at max_chars; a watchdog thread stops the render at a
  wall-clock deadline, loops that print nothing included.
Every failure is a TemplateError.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import re
import threading
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import TemplateError

DEFAULT_MAX_CHARS = 8 * 1024 * 1024  # a rendered prompt (or any string inside one) of at most 8 Mi characters
DEFAULT_TIMEOUT_S = 5.0  # real templates render in milliseconds (1000 turns: well under a second)
MAX_RANGE = 100_000  # jinja2.sandbox.MAX_RANGE

# -- built-in formats ------------------------------------------------------------------------------------------

BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        " + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "phi3": (
        "{% for message in messages %}"
        "{% if message['role'] in ('system', 'user', 'assistant') and message['content'] %}"
        "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
    ),
    "llama2": (
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
        "{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
        "{% for message in turns %}"
        "{% if message['role'] == 'user' %}"
        "{% set content = message['content'] %}"
        "{% if loop.first and system %}"
        "{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + content %}"
        "{% endif %}"
        "{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
        "{% endif %}"
        "{% endfor %}"
    ),
}


def builtin_for(md: dict[str, Any], arch: str | None = None) -> str:
    """The built-in format for a file without a template: by architecture, then by vocabulary."""
    arch = arch or md.get("general.architecture")
    tokens = md.get("tokenizer.ggml.tokens")
    has = set(tokens if isinstance(tokens, list) else ()).__contains__
    if arch == "qwen2":
        return "chatml"
    if has("<|eot_id|>") or has("<|start_header_id|>"):
        return "llama3"
    if arch == "phi3":
        return "phi3"
    if md.get("tokenizer.ggml.model") == "llama" and not has("<|im_start|>"):
        return "llama2"
    return "chatml"  # llama.cpp's default too


# -- the template ---------------------------------------------------------------------------------------------


class ChatTemplate:
    """A compiled chat template. `render(messages)` -> prompt text; `source` is 'gguf' or 'builtin:<name>'."""

    def __init__(
        self,
        text: str,
        *,
        source: str = "custom",
        special_tokens: dict[str, str] | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if not isinstance(text, str):
            raise TemplateError(f"a chat template must be text, got {type(text).__name__}")
        self.text = text
        self.source = source
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... as the template sees them
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        env = _Sandbox(max_chars)
        try:
            self._template = env.from_string(text)
        except jinja2.TemplateSyntaxError as exc:
            where = f"chat template ({source}) has a syntax error at line {exc.lineno}"
            raise TemplateError(f"{where}: {exc.message}") from None
        except _Limit as exc:  # Jinja folds constant filter calls while compiling; ours check sizes there too
            raise TemplateError(f"chat template ({source}) stopped: {exc}") from None
        except Exception as exc:  # anything else the compiler trips on
            raise TemplateError(f"chat template ({source}) does not compile: {exc}") from None

    @classmethod
    def from_metadata(cls, md: dict[str, Any], arch: str | None = None, **limits: Any) -> "ChatTemplate":
        """The file's tokenizer.chat_template, else the built-in format for its architecture/vocabulary."""
        special = _special_token_texts(md)
        text = md.get("tokenizer.chat_template")
        if isinstance(text, str) and text.strip():
            return cls(text, source="gguf", special_tokens=special, **limits)
        name = builtin_for(md, arch)
        return cls(BUILTIN_TEMPLATES[name], source=f"builtin:{name}", special_tokens=special, **limits)

    @classmethod
    def builtin(cls, name: str, special_tokens: dict[str, str] | None = None, **limits: Any) -> "ChatTemplate":
        if name not in BUILTIN_TEMPLATES:
            raise TemplateError(f"no built-in chat template {name!r} (have: {', '.join(BUILTIN_TEMPLATES)})")
        return cls(BUILTIN_TEMPLATES[name], source=f"builtin:{name}", special_tokens=special_tokens, **limits)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt for `messages` ([{'role': 'user', 'content': '...'}, ...]). Extra variables (tools,
        enable_thinking, ...) reach the template as they are, after conversion to plain JSON-like data."""
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise TemplateError("chat messages must be a list of {'role': ..., 'content': ...} dicts")
        context: dict[str, Any] = {
            "messages": _plain([_alias_reasoning(m) for m in messages]),
            "tools": None,
            "documents": None,
            "add_generation_prompt": bool(add_generation_prompt),
            **self.special_tokens,
            **_plain(variables),
        }
        return _render_bounded(self._template, context, self.source, self.max_chars, self.timeout_s)

    def __repr__(self) -> str:
        return f"ChatTemplate(source={self.source!r}, {len(self.text)} chars)"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is the one most templates read


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by, as transformers passes it: Qwen3-style
    templates read `reasoning_content`, gpt-oss reads `thinking`; callers write either, or `reasoning`."""
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(
    md: dict[str, Any], messages: list[dict[str, Any]], add_generation_prompt: bool = True, arch: str | None = None
) -> str:
    """One-shot: ChatTemplate.from_metadata(md, arch).render(messages, add_generation_prompt)."""
    return ChatTemplate.from_metadata(md, arch).render(messages, add_generation_prompt)


def chat_messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    """[system?, user] as template messages."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": "user", "content": user}]


def encode_prompt(tokenizer: Any, prompt: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of a rendered chat prompt: special-token strings become their ids, and BOS is added as the
    file says (add_bos None) unless the template already wrote it. No EOS: the model answers next."""
    ids = tokenizer.encode(prompt, special=True, add_bos=False, add_eos=False)
    want_bos = tokenizer.add_bos if add_bos is None else add_bos
    if want_bos and tokenizer.bos_id is not None and not (ids and ids[0] == tokenizer.bos_id):
        ids.insert(0, tokenizer.bos_id)
    return ids


def _special_token_texts(md: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token as transformers passes them: from the file's ids."""
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        return {}
    spm = md.get("tokenizer.ggml.model") == "llama"
    out = {}
    keys = (("bos", "bos", 1), ("eos", "eos", 2), ("unk", "unknown", 0), ("pad", "padding", None))
    for name, key, spm_default in keys:
        tid = md.get(f"tokenizer.ggml.{key}_token_id")
        if not isinstance(tid, int) and spm:
            tid = spm_default  # llama.cpp's defaults for a SentencePiece vocabulary
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            out[f"{name}_token"] = tokens[tid]
    return out


def _plain(value: Any) -> Any:
    """Plain data only (str, int, float, bool, None, dict, list, tuple): no object with methods reaches the
    template. Anything else becomes a '<TypeName>' placeholder, as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


# -- the sandbox -----------------------------------------------------------------------------------------------


class _Limit(BaseException):
    """A render that ran out of time or size. BaseException, so no `except Exception` inside Jinja's runtime
    swallows it; _render_bounded turns it into a TemplateError."""


def _size(value: Any, limit: int) -> int:
    """Roughly len(str(value)), walking containers; stops counting once past `limit` (so it costs at most
    about `limit` steps). Catches a list of a million references to a long string before str() builds it."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple)):
            total += 2 + 2 * len(v)
            if total <= limit:
                stack.extend(v)
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            if total <= limit:
                stack.extend(v.items())
        else:
            total += 8
    return total


class _Codegen(CodeGenerator):
    """Jinja's code generator, with `~` concatenation routed through the environment so its size is checked."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_FORMAT_NUMBER = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?|\{[^{}]*?:[^{}]*?(\d+)[^{}]*\}")
_FORMAT_FROM_ARGS = re.compile(r"%[-#0 +]*\d*(?:\.\d*)?\*|%[-#0 +]*\*|\{[^{}]*\{")  # '%*d', '%.*f', '{:{}}'
_SIZED_FILTERS = ("center", "indent", "format", "replace", "join", "wordwrap", "truncate", "string", "list", "tojson",
                  "pprint", "urlencode", "batch", "slice", "map", "sum")


class _Sandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _Codegen
    intercepted_binops = frozenset({"*", "**", "+", "%"})

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
            strftime_now=_strftime_now,
            dict=_TemplateDict(),
            namespace=_Namespace,
        )
        self.filters["tojson"] = _tojson
        for name in _SIZED_FILTERS:
            self.filters[name] = self._sized_filter(self.filters[name], name)

    # Refuse outright: Jinja's default returns an Undefined that prints as "" and fails only on use.
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    # -- size checks: before an operation where its size is known in advance, else on its result --

    def _bound(self, value: Any, what: str, size: int | None = None) -> Any:
        if size is None:
            if isinstance(value, (int, float, bool)) or value is None:
                return value
            size = _size(value, self.max_chars)
        if size > self.max_chars:
            raise _Limit(f"{what} would exceed {self.max_chars} characters")
        return value

    def _check_format(self, fmt: str, args: Any = ()) -> None:
        for m in _FORMAT_NUMBER.finditer(fmt):
            for number in m.groups():
                if number and int(number) > self.max_chars:
                    raise _Limit(f"a format width of {number} exceeds the limit of {self.max_chars}")
        # A width or precision taken from the arguments ('%*s' % (n, x), '{:{}}'.format(x, n)): check the numbers
        # before Python builds the string.
        if _FORMAT_FROM_ARGS.search(fmt.replace("%%", "").replace("{{", "").replace("}}", "")):
            items = args if isinstance(args, (tuple, list)) else (args,)
            for arg in (v for a in items for v in (a.values() if isinstance(a, dict) else (a,))):
                if isinstance(arg, int) and arg > self.max_chars:
                    raise _Limit(f"a format width of {arg} exceeds the limit of {self.max_chars}")

    def _check_join(self, items: list[Any], sep: Any, what: str) -> None:
        size = _size(items, self.max_chars) + len(str(sep)) * max(len(items) - 1, 0)
        self._bound(None, what, size)

    def _check_replace(self, s: str, old: Any, new: Any, what: str) -> None:
        old, new = str(old), str(new)
        grow = len(new) - len(old)
        if grow > 0:
            self._bound(None, what, len(s) + (s.count(old) if old else len(s) + 1) * grow)

    def _output(self, value: Any) -> Any:  # finalize: every {{ ... }} before str()
        return self._bound(value, "an output expression")

    def _range(self, *args: int) -> range:
        rng = range(*args)
        if len(rng) > MAX_RANGE:
            raise _Limit(f"range() of {len(rng)} items exceeds the limit of {MAX_RANGE}")
        return rng

    def checked_concat(self, parts: tuple[Any, ...]) -> str:
        self._bound(None, "a string built with '~'", sum(_size(p, self.max_chars) for p in parts))
        return "".join(map(str, parts))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        what = f"the result of {operator!r}"
        if operator == "*":
            if isinstance(left, int) and isinstance(right, int):  # repeated squaring: one C call per step
                if left.bit_length() + right.bit_length() > 4096:
                    raise _Limit(f"a product of {left.bit_length()}-bit and {right.bit_length()}-bit numbers is too large")
            seq, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and count > 0:
                self._bound(None, what, _size(seq, self.max_chars // count + 1) * count)
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                if right * math.log2(abs(left)) > 4096:
                    raise _Limit(f"a power of a {abs(left).bit_length()}-bit number to {right.bit_length()}-bit exponent is too large")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                self._bound(None, what, _size(left, self.max_chars) + _size(right, self.max_chars))
        elif operator == "%" and isinstance(left, str):
            self._check_format(left, right)
        return self._bound(super().call_binop(context, operator, left, right), what)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        what = f"{name or 'a call'}()"
        if isinstance(owner, str):
            if name in _WIDTH_METHODS:
                for arg in (*args, *kwargs.values()):
                    if isinstance(arg, int) and arg > __self.max_chars:
                        raise _Limit(f"{name}({arg}) exceeds the limit of {__self.max_chars}")
            elif name == "replace" and len(args) >= 2:
                __self._check_replace(owner, args[0], args[1], what)
            elif name == "join" and args:
                items = list(args[0])
                __self._check_join(items, owner, what)
                args = (items, *args[1:])
        return __self._bound(super().call(__context, __obj, *args, **kwargs), what)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)  # None unless `value` is some str's .format / .format_map
        if wrapped is None:
            return None
        fmt = value.__self__
        self._check_format(fmt)

        def checked(*args: Any, **kwargs: Any) -> Any:
            self._check_format(fmt, (*args, kwargs))
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(checked, wrapped)

    def _sized_filter(self, func: Any, name: str) -> Any:
        env = self
        what = f"the {name} filter"

        def sized(*args: Any, **kwargs: Any) -> Any:
            # Leading Context/EvalContext/Environment arguments (pass_* filters) are not values.
            values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                                            jinja2.Environment))]
            if name in ("center", "indent"):
                for arg in (*values[1:], *kwargs.values()):
                    if isinstance(arg, int) and not isinstance(arg, bool) and arg > env.max_chars:
                        raise _Limit(f"{name}({arg}) exceeds the limit of {env.max_chars}")
            elif name == "format" and values and isinstance(values[0], str):
                env._check_format(values[0], (*values[1:], kwargs))
            elif name == "replace" and len(values) >= 3:
                env._check_replace(str(values[0]), values[1], values[2], what)
            elif name == "join" and values and "attribute" not in kwargs and len(values) < 4:
                items = list(values[0])
                env._check_join(items, values[1] if len(values) > 1 else kwargs.get("d", ""), what)
                args = tuple(items if a is values[0] else a for a in args)
            elif name in ("tojson", "pprint", "string") and values:
                env._bound(values[0], what)
                indent = kwargs.get("indent", values[2] if name == "tojson" and len(values) > 2 else None)
                if isinstance(indent, (int, str)) and indent:  # every item on its own indented line
                    width = indent if isinstance(indent, int) else len(indent)
                    env._bound(None, what, _size(values[0], env.max_chars) * (1 + width))
            return env._bound(func(*args, **kwargs), what)

        if hasattr(func, "jinja_pass_arg"):  # keep Jinja's pass_context / pass_eval_context marker
            sized.jinja_pass_arg = func.jinja_pass_arg  # type: ignore[attr-defined]
        return sized


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


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# -- bounded rendering ---------------------------------------------------------------------------------------


class _Timeout(_Limit):
    """Raised inside the rendering thread by the watchdog (PyThreadState_SetAsyncExc)."""


class _Watchdog:
    """Raises _Timeout in the current thread once `seconds` have passed, at the next bytecode boundary: it
    stops any Python-level loop, at no cost while it waits (unlike sys.settrace). A long single C call (a
    huge str.join) is not interrupted: the size checks keep those small. Use as a context manager."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.thread_id = threading.get_ident()
        self.lock = threading.Lock()
        self.done = self.fired = False
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), ctypes.py_object(_Timeout))

    def __enter__(self) -> "_Watchdog":
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.done = True
            if self.fired:  # fired, but maybe not delivered yet: withdraw it (NULL clears a pending one)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id), None)
        self.timer.cancel()


def _render_bounded(
    template: jinja2.Template, context: dict[str, Any], source: str, max_chars: int, timeout_s: float
) -> str:
    chunks: list[str] = []
    size = 0
    try:
        # The watchdog's exception may land anywhere inside this block, its own __exit__ included: all of it
        # sits inside the try.
        with _Watchdog(timeout_s):
            for chunk in template.generate(**context):
                size += len(chunk)
                if size > max_chars:
                    raise _Limit(f"the rendered prompt exceeds {max_chars} characters")
                chunks.append(chunk)
    except _Timeout:
        raise TemplateError(f"chat template ({source}) stopped: rendering took longer than {timeout_s:g} s") from None
    except _Limit as exc:
        raise TemplateError(f"chat template ({source}) stopped: {exc}") from None
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
