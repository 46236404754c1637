"""Where the package's data lives: inside an installed wheel (force-included under llamacli/), else in the
checkout's top level, as the design card lays it out (kernels/, models.toml)."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{name} not found next to {_PACKAGE}")


def kernels_dir() -> Path:
    """The folder of kernels/*.cu."""
    return _find("kernels")


def builtin_models_toml() -> Path:
    return _find("models.toml")
