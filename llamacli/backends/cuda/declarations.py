"""Every kernel's typed launcher, read from its own declaration in kernels/<family>.cu.

Each `extern "C" __global__` function, including those a macro stamps out per weight type or head size
(`mv1_##name##_swiglu`), is described by its parameter list: names and C types. `signature(family, name)`
gives the Signature of a concrete kernel (`mv1_q4_k_swiglu`); `pack(**args)` takes every argument by the
parameter's own name and converts it to the C type the declaration gives:

- a pointer from a cupy array, a raw address (int) or None (NULL);
- `int` / `long long` / `unsigned int` from an integer (or a bool: a flag) in the type's range (a float is
  refused, not truncated);
- `float` / `double` from a real number (NumPy's rounding: a double past float's range becomes inf);
- a by-value `__grid_constant__` struct (a TMA descriptor) from the NumPy array holding its bytes, of the
  struct's size.

Pointers are not checked against the array's element type: kernels read byte arenas and fp16 pairs through
typed pointers on purpose.

A missing, unknown or ill-typed argument is a TypeError naming the kernel and the parameter, raised before
anything reaches the driver. The declaration is the one source: a parameter added to a kernel is a keyword
every launch must pass, and the order of the arguments is the declaration's, never the caller's.

Why our own parser: the declarations are plain C (no templates in a kernel's parameter list), the macros
only paste the name; a C parser would be a dependency for forty lines of regular expressions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_DECL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?([\w#]+)\s*\(([^)]*)\)')
_PASTE = re.compile(r"##\w+(?:##)?")
_SCALARS = {"int": (np.int32, 31), "long long": (np.int64, 63), "unsigned int": (np.uint32, 32)}
_REALS = {"float": np.float32, "double": np.float64}


_U64 = 1 << 64
_STRUCT_BYTES = {"TmaMap": 128}  # by-value structs a kernel takes: cuda.h's CUtensorMap is 128 opaque bytes


def _pointer(x: Any) -> np.uint64:
    t = type(x)
    if t is int:
        if 0 <= x < _U64:
            return np.uint64(x)
        raise OverflowError("an address outside 0 .. 2**64 - 1")
    if x is None:
        return np.uint64(0)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        address = getattr(getattr(x, "data", None), "ptr", None)
        if type(address) is not int:
            raise TypeError(f"a device array, an address or None, not {t.__name__}")
        return np.uint64(address)
    return _pointer(int(x))


def _integer(ctype: str) -> Callable[[Any], Any]:
    make, bits = _SCALARS[ctype]
    lo, hi = (0, (1 << bits) - 1) if ctype.startswith("unsigned") else (-(1 << bits), (1 << bits) - 1)

    def convert(x: Any) -> Any:
        if type(x) is not int:  # (a bool is an int: a flag such as `early`)
            if not isinstance(x, (int, np.integer, np.bool_)):
                raise TypeError(f"an integer, not {type(x).__name__}")
            x = int(x)
        if lo <= x <= hi:
            return make(x)
        raise OverflowError(f"{x} outside {ctype}'s range")

    return convert


def _real(ctype: str) -> Callable[[Any], Any]:
    make = _REALS[ctype]

    def convert(x: Any) -> Any:
        t = type(x)
        if t is float or t is int or (isinstance(x, (int, float, np.integer, np.floating))
                                      and not isinstance(x, (bool, np.bool_))):
            return make(x)
        raise TypeError(f"a real number, not {t.__name__}")

    return convert


def _by_value(struct: str) -> Callable[[Any], Any]:
    size = _STRUCT_BYTES.get(struct)

    def convert(x: Any) -> Any:
        if not isinstance(x, np.ndarray) or (size is not None and x.nbytes != size):
            what = f"{type(x).__name__} of {x.nbytes} bytes" if isinstance(x, np.ndarray) else type(x).__name__
            raise TypeError(f"the {size} bytes of a {struct} as a NumPy array, not {what}")
        return x

    return convert


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # "pointer", "int", "long long", "unsigned int", "float", "double", or a struct passed by value


def _param(text: str) -> Param:
    words = text.replace("__restrict__", " ").replace("*", " * ").split()
    if len(words) < 2 or not re.fullmatch(r"[A-Za-z_]\w*", words[-1]):
        raise ValueError(f"cannot read the kernel parameter {text!r}")
    name, spec = words[-1], [w for w in words[:-1] if w not in ("const", "__grid_constant__")]
    if "*" in spec:
        return Param(name, "pointer")
    ctype = " ".join(spec)
    if ctype in _SCALARS or ctype in _REALS:
        return Param(name, ctype)
    if "__grid_constant__" in words and len(spec) == 1:
        return Param(name, spec[0])
    raise ValueError(f"kernel parameter {text!r}: no launcher type for {ctype!r}")


def _converter(p: Param) -> Callable[[Any], Any]:
    if p.ctype == "pointer":
        return _pointer
    if p.ctype in _SCALARS:
        return _integer(p.ctype)
    if p.ctype in _REALS:
        return _real(p.ctype)
    return _by_value(p.ctype)


@dataclass(frozen=True)
class Signature:
    """One kernel declaration: its name as written (`mv1_##name##_swiglu`) and its parameters."""

    family: str
    pattern: str
    params: tuple[Param, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_converters", tuple((p.name, _converter(p)) for p in self.params))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def pack(self, kernel: str, args: dict[str, Any]) -> tuple:
        """The kernel's arguments in declaration order, each converted to its C type."""
        try:
            values = tuple([convert(args[name]) for name, convert in self._converters])
        except KeyError:
            raise TypeError(self._mismatch(kernel, args)) from None
        except (TypeError, OverflowError, ValueError) as exc:
            bad = next(n for n, c in self._converters if not _converts(c, args[n]))
            raise TypeError(f"{kernel}: argument {bad}: {exc}") from None
        if len(args) != len(values):
            raise TypeError(self._mismatch(kernel, args))
        return values

    def _mismatch(self, kernel: str, args: dict[str, Any]) -> str:
        missing = [n for n in self.names if n not in args]
        unknown = sorted(set(args) - set(self.names))
        parts = ([f"missing argument(s) {', '.join(missing)}"] if missing else []) + (
            [f"unknown argument(s) {', '.join(unknown)}"] if unknown else [])
        return f"{kernel}: {'; '.join(parts)}"


def _converts(convert: Callable[[Any], Any], x: Any) -> bool:
    try:
        convert(x)
    except (TypeError, OverflowError, ValueError):
        return False
    return True


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """mv1_##name##_swiglu -> mv1_(\\w*)_swiglu: the literal pieces around every pasted macro parameter (a
    paste may be empty: attention_split_step##SFX##_...)."""
    return re.compile(r"\w*".join(re.escape(p) for p in _PASTE.split(pattern)))


def read_declarations(source: str, family: str) -> tuple[Signature, ...]:
    """The kernel declarations of one .cu file's text (comments and line continuations removed first)."""
    text = _COMMENT.sub(" ", source.replace("\\\n", " "))
    out = []
    for m in _DECL.finditer(text):
        pattern, plist = m.group(1), m.group(2).strip()
        params = tuple(_param(p) for p in plist.split(",")) if plist and plist != "void" else ()
        out.append(Signature(family, pattern, params))
    return tuple(out)


@lru_cache(maxsize=None)
def declarations(family: str, directory: Path | None = None) -> tuple[Signature, ...]:
    """The kernels declared in kernels/<family>.cu itself (not in the headers it includes)."""
    from ...paths import kernels_dir

    path = (directory or kernels_dir()) / f"{family}.cu"
    return read_declarations(path.read_text(encoding="utf-8"), family)


@lru_cache(maxsize=None)
def signature(family: str, kernel: str) -> Signature:
    """The declaration that makes kernels/<family>.cu's `kernel`: the declaration of that exact name, else
    the macro pattern it fits with the most literal characters (`mv1_##name##_swiglu` over `mv1_##name`)."""
    best: tuple[int, Signature] | None = None
    for sig in declarations(family):
        if sig.pattern == kernel:
            return sig
        if "##" in sig.pattern and _pattern_regex(sig.pattern).fullmatch(kernel):
            literal = len(_PASTE.sub("", sig.pattern))
            if best is None or literal > best[0]:
                best = (literal, sig)
    if best is None:
        raise TypeError(f"kernels/{family}.cu declares no kernel {kernel}")
    return best[1]
