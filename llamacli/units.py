"""Human-readable sizes, one spelling for the whole tool: binary units (KiB, MiB, GiB), as llama.cpp prints them.
The model registry lists download sizes in decimal units instead (sizes.human_size), as ollama and Hugging
Face show them. And durations as ollama takes them (--keep-alive)."""

from __future__ import annotations

import math
import re

FOREVER = math.inf  # parse_duration's "never" (a negative duration, as ollama's keep_alive -1)
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_GO_PART = re.compile(rf"({_NUMBER})(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_GO_DURATION = re.compile(rf"(?:{_NUMBER}(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h))+")


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: int) -> str:
    """Parameter counts: 134515008 -> '134.52M'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def parse_duration(text: str) -> float:
    """A duration as ollama's keep_alive takes it, in seconds: Go's syntax ("5m", "30s", "1h30m", "1.5h",
    "300ms") or a bare number of seconds ("3600", "0"); a sign may lead. Any negative duration ("-1", "-1m")
    is FOREVER. ValueError for anything else (an empty string, "5 minutes", "1e3", "inf")."""
    word = text.strip()
    sign, body = (-1.0, word[1:]) if word[:1] == "-" else (1.0, word[1:] if word[:1] == "+" else word)
    if re.fullmatch(_NUMBER, body):
        seconds = float(body)
    elif _GO_DURATION.fullmatch(body):
        seconds = sum(float(number) * _GO_UNITS[unit] for number, unit in _GO_PART.findall(body))
    else:
        raise ValueError("not a duration (examples: 5m, 30s, 1h30m, 0, -1)")
    if not math.isfinite(seconds):  # ("9" * 400 seconds: a float overflows to inf)
        return FOREVER
    return FOREVER if sign < 0 and seconds > 0 else seconds


def human_duration(seconds: float) -> str:
    """90 -> '1m30s', 3600 -> '1h', 0.5 -> '500ms', FOREVER -> 'forever' (the way ollama's durations read)."""
    if seconds == FOREVER:
        return "forever"
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{seconds * 1e3:.0f}ms"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs}s" if secs else "")
    return text or "0s"


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b?)", re.IGNORECASE)
_SIZE_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """A size in bytes: a number with an optional unit, binary as llama.cpp and nvidia-smi count (80G, 80GiB:
    80 x 2^30; 512M, 512MiB) unless written decimal (141GB: 141 x 10^9); a bare number is bytes. ValueError
    for anything else, and for a size past 2^60 bytes."""
    m = _SIZE.fullmatch(text.strip())
    if m is None or m.group(3).lower() == "i" or (m.group(3).lower() == "ib" and not m.group(2)):
        raise ValueError("not a size (examples: 80G, 80GiB, 141GB, 24576M)")
    number, power, suffix = float(m.group(1)), _SIZE_POWER[m.group(2).lower()], m.group(3).lower()
    decimal = suffix == "b" and power > 0
    size = number * (1000 ** power if decimal else 1024 ** power)
    if not size < 2 ** 60:
        raise ValueError("a size past 2^60 bytes")
    return int(size)
