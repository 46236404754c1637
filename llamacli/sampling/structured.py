"""Structured output: constraints that mask sampling to the tokens that keep the output valid.

    schema / grammar -> llguidance grammar -> LLMatcher over our vocabulary
        each step: allowed_words() -> bit mask [vocab / 32] -> logits of the rest set to -inf -> sample
                   -> advance(id)

The mask is computed on the host while the device runs the step that produces the logits it applies to (the
step's input token is known then); Backend.sample_allowed applies it: on CUDA the words go to the device and
the masked logits to the device sampler, so only the id comes back (greedy or sampled).

The grammar engine is llguidance (guidance-ai, MIT, the engine behind llama.cpp's `--llguidance` and
vLLM/SGLang's structured output), chosen over xgrammar and outlines-core because:
- it installs here as one binary wheel with no dependency (xgrammar pulls in torch; outlines-core needs a
  HF hub tokenizer, not a vocabulary list);
- it takes any vocabulary given as token byte strings (`TokenizerWrapper`), which is what our GGUF tokenizer
  has for BPE and SentencePiece alike, so no HF tokenizer has to be rebuilt;
- it compiles JSON Schema, Lark and llama.cpp's GBNF; the mask costs well under a millisecond a step, and
  masks are computed lazily (no precompilation over the vocabulary).

llguidance is an optional extra (`pip install 'llamacli[structured]'`), imported only when a constraint is
built: the rest of the library works without it.

Every schema and grammar, whichever way it comes (--json-schema, --grammar, the server's response_format, a
Lark grammar's %json), goes the same way before llguidance sees it in this process: static bounds
(grammar_limits.py), then a worker process that compiles it and computes its first masks under a deadline and
a memory limit (grammar_sandbox.py); only then is it compiled here, in a thread with a large stack. A schema or
grammar that fails any of these is a GrammarError: one line, exit 2 on the command line, 400 from the server.

A Constraint is stateful (it tracks the text so far); `Model.run` calls `reset()` before it starts, so one
constraint can serve successive runs, one at a time.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import numpy as np

from ..errors import BackendError, GrammarError, LlamacliError, UsageError
from ..textio import printable
from . import grammar_limits, grammar_sandbox

if TYPE_CHECKING:
    from ..tokenizer.tokenizer import Tokenizer

__all__ = [
    "Constraint",
    "GrammarConstraint",
    "json_schema_constraint",
    "json_object_constraint",
    "grammar_constraint",
    "load_json_schema",
    "require_llguidance",
    "schema_grammar",
    "text_grammar",
    "constraint_for",
]

_CONTROL = 3  # tokenizer.ggml.token_type of control tokens (<|im_end|>, <s>): never text a grammar can match


class ConstraintError(LlamacliError):
    """A token the constraint had not allowed reached it (a runtime failure, not bad input: the sampler's)."""


class Model(Protocol):
    """What a constraint is built over: a loaded model (engine.generate.Model) and its vocabulary. The
    llguidance view of the vocabulary is kept on it (`_lltokenizer`), made once per model."""

    tokenizer: Tokenizer


@runtime_checkable
class Constraint(Protocol):
    """What the decode loop needs from a constraint."""

    def reset(self) -> None:
        """Start over, at the beginning of the output."""

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens that may come next (end-of-generation ids once the output may end)."""

    def allowed_words(self) -> np.ndarray:
        """The same set as uint32 [ceil(vocab / 32)] bit words (bit i % 32 of word i // 32 = id i; the bits past
        the vocabulary clear), the form the masked sampler takes (Backend.sample_allowed). May be a buffer the
        next call overwrites. Optional: the engine packs allowed() where a constraint lacks it (mask_words)."""

    def advance(self, token_id: int) -> None:
        """Record the token that was chosen."""

    @property
    def is_done(self) -> bool:
        """Whether the output is complete and nothing may follow it."""


class GrammarConstraint:
    """A Constraint backed by an llguidance LLMatcher over `grammar` (the form schema_grammar/text_grammar
    give). An LLMatcher that failed stays failed, so reset() builds a new one then (about a millisecond)."""

    def __init__(self, lltokenizer: Any, grammar: str, vocab_size: int):
        self._tokenizer, self._grammar = lltokenizer, grammar
        self._m = self._matcher()
        self._vocab = vocab_size
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)

    def _matcher(self) -> Any:
        llg = require_llguidance()
        # (on a large stack: the worker compiled this grammar on a much smaller one, grammar_sandbox.py)
        matcher = grammar_sandbox.compile_with_stack(lambda: llg.LLMatcher(self._tokenizer, self._grammar, log_level=0))
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {_first_line(matcher.get_error())}")
        return matcher

    def reset(self) -> None:
        if self._m.is_error() or not self._m.reset():
            self._m = self._matcher()

    def allowed(self) -> np.ndarray:
        return unpack_words(self.allowed_words(), self._vocab)

    def allowed_words(self) -> np.ndarray:
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self._m.is_error():  # the grammar, not the sampler: one of llguidance's own limits, a dead end
            raise GrammarError(f"the output constraint failed: {_first_line(self._m.get_error())}")
        if self._vocab % 32:  # llguidance's words cover its own vocabulary size: no id past ours
            self._words[-1] &= np.uint32((1 << (self._vocab % 32)) - 1)
        return self._words

    def advance(self, token_id: int) -> None:
        self._m.consume_token(int(token_id))
        self._check()

    @property
    def is_done(self) -> bool:
        return bool(self._m.is_stopped())

    def _check(self) -> None:
        if self._m.is_error():
            raise ConstraintError(f"the output constraint failed: {_first_line(self._m.get_error())}")


def check_words(words: Any, vocab: int) -> np.ndarray:
    """A constraint's mask words for a vocabulary of `vocab` ids (uint32 [ceil(vocab / 32)]), or BackendError."""
    if not isinstance(words, np.ndarray) or words.dtype != np.uint32 or words.shape != (-(-vocab // 32),):
        what = f"{words.dtype} {words.shape}" if isinstance(words, np.ndarray) else type(words).__name__
        raise BackendError(f"a constraint mask must be uint32 [{-(-vocab // 32)}] bit words, got {what}")
    return words


def unpack_words(words: np.ndarray, vocab: int) -> np.ndarray:
    """uint32 bit words (Constraint.allowed_words) -> bool [vocab]."""
    bits = np.unpackbits(np.ascontiguousarray(check_words(words, vocab)).view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)


def pack_words(allowed: np.ndarray) -> np.ndarray:
    """bool [vocab] -> uint32 bit words (bit i % 32 of word i // 32 = id i)."""
    bits = np.concatenate([np.asarray(allowed, bool), np.zeros(-len(allowed) % 32, dtype=bool)])
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)


def mask_words(constraint: Constraint) -> Callable[[], np.ndarray]:
    """The constraint's allowed_words, or, for a Constraint written before that method, its allowed() packed."""
    words = getattr(constraint, "allowed_words", None)
    return words if callable(words) else (lambda: pack_words(constraint.allowed()))


# llguidance takes a list of end tokens (LLTokenizer's eos_token, which _lltokenizer passes every
# end-of-generation id) from 1.7 on, and the tool calls' grammars (chat/tool_grammar.py) run whole from 1.8
# (1.7.6 leaves a forced call unfinished); pyproject.toml's `structured` extra asks for the same.
LLGUIDANCE_MIN = (1, 8)


def require_llguidance() -> Any:
    """The llguidance module, or a one-line UsageError saying how to install it (or a new enough one)."""
    try:
        import llguidance
    except ImportError:
        raise UsageError(
            "structured output (--json-schema, --grammar) needs the optional package llguidance: "
            "pip install 'llamacli[structured]'"
        ) from None
    installed = _installed_version("llguidance")
    release = re.match(r"(\d+)\.(\d+)", installed or "")
    if release and (int(release[1]), int(release[2])) < LLGUIDANCE_MIN:
        need = ".".join(map(str, LLGUIDANCE_MIN))
        raise UsageError(
            f"structured output needs llguidance {need} or newer, found {printable(installed)}: "
            f"pip install 'llguidance>={need}' (its Linux wheels need glibc 2.31 or newer)"
        )
    return llguidance


def _installed_version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:  # a build that pip has no record of: taken as it is
        return None


class _VocabTokenizer:
    """Our tokenizer in the shape llguidance.TokenizerWrapper reads: token byte strings (control tokens
    marked with a leading 0xFF, as llguidance's llama.cpp adapter does) and a text -> ids function."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids, default=0)
        self.bos_token_id = tok.bos_id
        self.tokens = [self._bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.token_type(i) == _CONTROL]

    def _bytes(self, i: int) -> bytes:
        piece = self._tok._piece_bytes(i)
        return b"\xff" + piece if self._tok.token_type(i) == _CONTROL else piece

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        # The plain spelling: no BOS, and no SentencePiece dummy-prefix space (llguidance tokenizes fragments
        # of the output, which must not gain a leading space); user-defined tokens (Qwen's <tool_call>, <think>)
        # as themselves, as the model writes them: llguidance allows only this spelling of a forced string.
        ids: list[int] = []
        for part in self._tok._partition(text, False) if text else ():
            ids.extend([part] if isinstance(part, int) else self._tok._encode_piece(part))
        if b"".join(self._tok._piece_bytes(i) for i in ids) != text.encode("utf-8"):  # (a token that eats the
            return self._tok._encode_piece(text)  # whitespace after it, Phi-3's: the plain spelling then)
        return ids


def _lltokenizer(model: Model) -> Any:
    """The llguidance view of the model's vocabulary, built once per model (slow to build: docs/perf-log.md)."""
    cached = getattr(model, "_lltokenizer", None)
    if cached is None:
        llg = require_llguidance()
        tok = model.tokenizer
        eos = sorted(tok.eog_ids) or ([tok.eos_id] if tok.eos_id is not None else None)
        cached = llg.LLTokenizer(llg.TokenizerWrapper(_VocabTokenizer(tok)), n_vocab=tok.vocab_size, eos_token=eos)
        model._lltokenizer = cached
    return cached


def _one_line(message: str) -> str:
    return " ".join(str(message).split())[:500]


def _first_line(message: str) -> str:
    """llguidance's runtime errors carry a parser-state dump after the first line: keep the first."""
    return _one_line(str(message).strip().split("\n", 1)[0])


def schema_grammar(schema: dict[str, Any] | str) -> str:
    """The llguidance grammar for a JSON schema (a dict, or its JSON text), checked: within the static bounds,
    then compiled and started in the worker process (cached by content). GrammarError otherwise."""
    if isinstance(schema, str):
        schema = load_json_schema(schema)
    require_llguidance()
    return grammar_sandbox.tried("schema", grammar_limits.check_schema(schema), "JSON schema")


def text_grammar(grammar_text: str) -> str:
    """The llguidance grammar for a GBNF or Lark grammar text, checked as schema_grammar checks a schema."""
    require_llguidance()
    grammar_limits.check_grammar(grammar_text)
    return grammar_sandbox.tried("grammar", grammar_text, "grammar")


def constraint_for(model: Model, grammar: str) -> GrammarConstraint:
    """A constraint over the model's vocabulary from a grammar that schema_grammar or text_grammar made."""
    return GrammarConstraint(_lltokenizer(model), grammar, model.tokenizer.vocab_size)


def load_json_schema(text: str) -> dict[str, Any]:
    """A JSON schema from its text; UsageError unless it is a JSON object."""
    try:
        schema = json.loads(text)
    except RecursionError:
        raise GrammarError("invalid JSON schema: it nests arrays and objects too deeply to read") from None
    except ValueError as e:
        raise UsageError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise UsageError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return schema


def json_schema_constraint(model: Model, schema: dict[str, Any] | str) -> GrammarConstraint:
    """Output that is one JSON value valid against `schema` (llguidance's JSON Schema subset: types,
    properties/required, items, enum/const, anyOf/oneOf, $ref, min/max, patterns, formats; see
    https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md)."""
    return constraint_for(model, schema_grammar(schema))


def json_object_constraint(model: Model) -> GrammarConstraint:
    """Output that is one JSON object, any keys (OpenAI's response_format {"type": "json_object"})."""
    return json_schema_constraint(model, {"type": "object"})


def grammar_constraint(model: Model, grammar_text: str) -> GrammarConstraint:
    """Output that matches a grammar in llama.cpp's GBNF or in Lark syntax (llguidance's dialect: `start:`
    rule, regexes in /.../); which one is told from the text."""
    return constraint_for(model, text_grammar(grammar_text))
