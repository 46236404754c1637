"""The LlamacliError hierarchy: every failure a user can cause or meet ends in one of these.

The CLI prints `error: <message>` on one line and exits with `exit_code`: 2 for bad input (a broken file,
a wrong option), 1 for a runtime failure (no GPU, out of memory), 130 for Ctrl-C.
"""

from __future__ import annotations


class LlamacliError(Exception):
    """Base class. `exit_code` is what the CLI exits with."""

    exit_code = 1


# -- bad input (exit 2) ---------------------------------------------------------------------------------


class BadInputError(LlamacliError):
    exit_code = 2


class UsageError(BadInputError):
    """An option value that cannot work (negative -n, top-p outside (0, 1], ...)."""


class ModelNotFoundError(BadInputError):
    """A model path or name that does not resolve to a file."""


class GGUFError(BadInputError):
    """A GGUF file we cannot read or run."""


class NotGGUFError(GGUFError):
    """Bad magic: not a GGUF file at all."""


class UnsupportedVersionError(GGUFError):
    pass


class TruncatedFileError(GGUFError):
    """The header or a tensor's data runs past the end of the file."""


class CorruptFileError(GGUFError):
    """A structural contradiction: absurd counts, bad types, overlapping tensors, invalid UTF-8..."""


class UnknownArchitectureError(GGUFError):
    pass


class UnsupportedTensorTypeError(GGUFError):
    pass


class MissingTensorError(GGUFError):
    pass


class MissingMetadataError(GGUFError):
    pass


class ShapeMismatchError(GGUFError):
    """A tensor whose shape contradicts the model config."""


class TokenizerError(BadInputError):
    """A vocabulary we cannot build, or text/ids it cannot handle."""


class TemplateError(BadInputError):
    """A chat template that fails to render, or tries to escape the sandbox."""


class ContextOverflowError(BadInputError):
    """A prompt longer than the context window."""


class GrammarError(BadInputError):
    """A JSON schema or grammar (--json-schema, --grammar, response_format) that llguidance cannot compile or
    follow, or one past the bounds llamacli puts on them (sampling/grammar_limits.py)."""


# -- runtime failures (exit 1) ---------------------------------------------------------------------------


class BackendError(LlamacliError):
    """A backend that is unavailable (no GPU, no CuPy) or failed (a CUDA error)."""


class DeviceMemoryError(BackendError):
    """Not enough device memory: the message names need and free."""


class HostMemoryError(BackendError):
    """Not enough RAM for what a host backend allocates (NumPy: float32 weights + KV cache): the message names
    need and available, and a --ctx that would fit."""


class KernelCompileError(BackendError):
    """NVRTC rejected a kernels/*.cu file: the message names it and carries the compiler log."""


class NumericalError(LlamacliError):
    """NaN or inf where numbers must be finite (logits of a broken model)."""


class FileChangedError(LlamacliError):
    """A model file that shrank or was replaced while it was being read (another program cut it short)."""


class DownloadError(LlamacliError):
    pass


class OutputError(LlamacliError):
    """Standard output cannot take what the user asked for (the shell closed it: `>&-`)."""


class Interrupted(LlamacliError):
    """Ctrl-C."""

    exit_code = 130
