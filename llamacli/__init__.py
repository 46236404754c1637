"""llamacli: GGUF language models on NVIDIA GPUs from readable Python."""

__version__ = "0.1.0"


def load(path, backend: str = "auto", ctx: int | None = None, **kw):
    """Load a GGUF model: `llamacli.load("model.gguf", backend="numpy").generate("Hello")` streams text."""
    from .generate import load as _load

    return _load(path, backend=backend, ctx=ctx, **kw)
