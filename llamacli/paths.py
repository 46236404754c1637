"""Where the package's data lives: inside an installed wheel (force-included under llamacli/), else in the
checkout's top level, as the design card lays it out (kernels/, models.toml). And where llamacli keeps what it
writes: the cache (cache_home: the models, registry/cache.py; the compiled kernels, backends/cuda/loader.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelNotFoundError

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


def cache_home() -> Path:
    """$LLAMACLI_HOME, else $XDG_CACHE_HOME/llamacli, else ~/.cache/llamacli."""
    if os.environ.get("LLAMACLI_HOME"):
        return Path(os.environ["LLAMACLI_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "llamacli"
    return Path.home() / ".cache" / "llamacli"


def local_model(spec: str | None) -> Path | None:
    """The GGUF file that `--model SPEC` names by its path; None where SPEC is a registry name, the default
    (None) or an hf:// address, which llamacli.registry.registry resolves. A directory or a special file is refused
    (never opened: a FIFO would block, /dev/zero never ends). Kept apart from the registry so that a command
    given a path does not import it, its downloaders and its TOML."""
    if spec is None or not spec.strip() or spec.strip().startswith("hf://"):
        return None
    path = Path(spec.strip()).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ModelNotFoundError(f"{spec} is a directory, not a GGUF file")
    if path.exists():
        raise ModelNotFoundError(f"{spec} is not a regular file, so not a GGUF file")
    return None
