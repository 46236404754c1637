"""Human-readable sizes, one spelling for the whole tool: binary units (KiB, MiB, GiB), as llama.cpp prints them.
The model registry lists download sizes in decimal units instead (sizes.human_size), as ollama and Hugging
Face show them."""

from __future__ import annotations


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
