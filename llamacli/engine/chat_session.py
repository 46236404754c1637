"""A conversation that keeps the model's KV cache between turns: the engine behind `llamacli chat`.

    system? + history[first:] (user, assistant, ..., user)  -> chat template -> ids
      -> Model.run: prefill only the ids past the longest prefix the KV cache already holds -> reply
      -> history += assistant reply (the text as generated; a thinking model's answer only, without its
         <think> block, which is what Qwen3-style templates keep of earlier turns)

Prefix reuse. Every turn renders the whole visible conversation again; nothing is appended by hand. The
cache (`Model.seq`) then holds turn N's prompt plus the reply's ids, and turn N+1's prompt starts with
exactly those ids when the template writes the finished assistant turn as the model wrote it: for ChatML
(SmolLM2, Qwen) the reply is followed by `<|im_end|>`, the end token the model generated (which was never
fed back, so the cache does not hold it), and only `<|im_end|>\n<|im_start|>user ...` is prefilled. Where a
template renders the reply differently (it trims it, or the text re-tokenizes with other merges, or a stop
cut the last token), Model.run keeps the longest common prefix and prefills from the first difference;
`Turn.held` vs `Turn.reused` shows how much of the cache a turn could not use. A model with sliding-window
layers keeps rings there (models/kv_cache.py): where the first difference lies further back than a ring holds (a
harmony reply whose analysis the next turn drops, longer than about 500 tokens on gpt-oss), the whole
prompt is prefilled again, unless the model was loaded with --swa-full.

Trimming. A turn needs its prompt plus room for the reply: `reserve` = min(max_tokens, ctx / 2) tokens.
When the rendered conversation does not fit in ctx - reserve, the oldest exchanges (a user message and the
replies after it) leave the window, never the system prompt nor the new message, until the prompt fills at
most half of that budget (as llama.cpp's context shift discards half): the next turns then extend a stable
prefix instead of re-prefilling at every turn. Dropped messages stay in `history` (and in /save files); the
window only moves forward. A new message that does not fit even alone raises ContextOverflowError and
leaves the conversation as it was.

Interrupted replies (Ctrl-C): as in llama.cpp, the partial reply stays in the conversation as the
assistant's message; a reply interrupted before it produced any text takes its user message with it, so
the roles keep alternating.

Files: the OpenAI messages shape, a JSON list of {"role": "system"|"user"|"assistant", "content": str},
with the system message (if any) first. `load` validates everything before it changes anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..errors import BadInputError, ContextOverflowError
from ..sampling.sampling import SamplingParams
from ..textio import read_text
from ..tokenizer.tokenizer import TooManyTokens
from .generate import Completion, Model

ROLES = ("system", "user", "assistant")


class ConversationFileError(BadInputError):
    """A conversation file that cannot be read, written or understood."""


@dataclass
class Turn:
    """What one reply cost: how much of its prompt came from the cache, and the engine's timings."""

    prompt_tokens: int  # the rendered conversation
    held: int  # ids the cache held before the turn
    reused: int  # of the prompt, read from the cache (held - reused: cache entries the new prompt contradicted)
    generated: int
    finish_reason: str | None
    completion: Completion = field(repr=False)

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.reused


class ChatSession:
    """Messages, the window the model sees, and one `send` per turn."""

    def __init__(
        self,
        model: Model,
        *,
        system: str | None = None,
        params: SamplingParams | None = None,
        max_tokens: int = 512,
        stop: str | Sequence[str] = (),
        notice: Callable[[str], None] | None = None,
        think: bool | None = None,
        constraint: Any = None,
        ignore_eos: bool = False,
        speculative: Any = None,
    ):
        self.model = model
        self.ignore_eos = ignore_eos  # replies run to max_tokens (Model.run's ignore_eos)
        self.speculative = speculative  # engine.speculative.SpecSettings (None: the model's own)
        self.constraint = constraint  # structured.Constraint: every reply follows it
        self.think = think  # enable_thinking for the template (None: its default)
        self.params = (params or SamplingParams()).validate()
        self.max_tokens = max_tokens
        self.stop = (stop,) if isinstance(stop, str) else tuple(stop)  # one string is one stop string
        self.notice = notice or (lambda message: None)
        self.system = system
        self.history: list[dict[str, str]] = []  # user and assistant messages, oldest first
        self.first = 0  # history[first:] is what the model sees
        self.turns: list[Turn] = []

    # -- the conversation -------------------------------------------------------------------------------------
    @property
    def messages(self) -> list[dict[str, str]]:
        """The whole conversation, dropped turns included (what /save writes)."""
        return self._with_system(self.history)

    def window(self) -> list[dict[str, str]]:
        """The messages the next prompt renders: the system prompt and the turns still in the context."""
        return self._with_system(self.history[self.first :])

    @property
    def dropped(self) -> int:
        return self.first

    def _with_system(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + [dict(m) for m in messages]

    def reset(self) -> None:
        """Forget the conversation, keep the system prompt. The cache stays: the next prompt reuses its
        common prefix (the rendered system prompt), where the rings of a sliding-window model still hold it."""
        self.history, self.first = [], 0

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt; the next turn prefills everything after the first changed token."""
        self.system = text

    @property
    def reserve(self) -> int:
        """Tokens kept free for the reply."""
        return max(1, min(self.max_tokens, self.model.ctx // 2))

    def fit(self) -> list[int]:
        """The ids of the window, after dropping the oldest exchanges if it does not fit (see the module doc).
        The drop is found by binary search over where the window may start (a prompt gets shorter as the
        window starts later): a few renders, not one per dropped exchange, so a long conversation loaded
        into a small context does not render itself thousands of times. A window that cannot fit is known
        as such from its length or partway through tokenizing it (Tokenizer.encode's limit): a huge pasted
        message costs a context's worth of tokenizing, not its own size's."""
        budget = self.model.ctx - self.reserve
        ids = self._window_ids(budget)
        if ids is not None:
            return ids
        before = self.first
        starts = self._exchange_starts()
        rendered: dict[int, list[int] | None] = {}

        def ids_from(k: int) -> list[int] | None:  # (None: more than the budget)
            if k not in rendered:
                self.first = starts[k]
                rendered[k] = self._window_ids(budget)
            return rendered[k]

        lo, hi = 0, len(starts) - 1  # the earliest start whose prompt fills at most half the budget, else the last
        while lo < hi:
            mid = (lo + hi) // 2
            found = ids_from(mid)
            if found is not None and len(found) <= budget // 2:
                hi = mid
            else:
                lo = mid + 1
        if starts:
            ids = ids_from(lo)
            self.first = starts[lo]
        if ids is None:
            self.first = before
            raise ContextOverflowError(
                f"the message needs more than {budget} tokens with the system prompt; the context holds "
                f"{self.model.ctx}, {self.reserve} of them kept for the reply: shorten it or raise --ctx"
            )
        self.notice(f"context full: dropped the {self.first - before} oldest messages (the system prompt stays); "
                    f"prefilling the conversation again")
        return ids

    def _window_ids(self, budget: int) -> list[int] | None:
        """The window's ids, or None where they number more than `budget`."""
        try:
            return self.model.chat_ids(self.window(), think=self.think, limit=budget)
        except TooManyTokens:
            return None

    def _exchange_starts(self) -> list[int]:
        """Where the window may start once exchanges leave it, oldest drop first: each user message after
        the window's first, up to the newest one (the message being answered, which always stays)."""
        last_user = max((i for i, m in enumerate(self.history) if m["role"] == "user"), default=-1)
        return [i for i in range(self.first + 1, last_user + 1) if self.history[i]["role"] == "user"]

    # -- a turn -----------------------------------------------------------------------------------------------
    def send(self, text: str, completion: Completion | None = None) -> Iterator[str]:
        """Add a user message and stream the reply; the reply joins the history when it ends (or is
        interrupted: KeyboardInterrupt and closing the iterator early both keep the partial reply)."""
        c = completion if completion is not None else Completion()
        self.history.append({"role": "user", "content": text})
        held, ids, first = len(self.model.seq), None, self.first
        try:
            ids = self.fit()
            extra = {"ignore_eos": True} if self.ignore_eos else {}
            if self.speculative is not None:
                extra["speculative"] = self.speculative
            yield from self.model.run(ids, completion=c, max_tokens=self.max_tokens, stop=self.stop, params=self.params,
                                      constraint=self.constraint, **extra)
        except (KeyboardInterrupt, GeneratorExit):
            if c.finish_reason is None:  # closed after the reply had ended: its own reason stands
                c.finish_reason = "interrupted"
            self._end_turn(c, ids, held)
            raise
        except BaseException:
            self.history.pop()  # the turn did not happen: neither did a trim that made room for it
            self.first = first
            raise
        self._end_turn(c, ids, held)

    def _end_turn(self, c: Completion, ids: list[int] | None, held: int) -> None:
        if c.text or c.finish_reason != "interrupted":
            self.history.append({"role": "assistant", "content": c.text})
        else:
            self.history.pop()  # interrupted before any text: the question goes too
        if ids is not None and c.timings.prompt_tokens:  # the prefill finished (a Ctrl-C may come sooner)
            n = len(ids)
            self.turns.append(Turn(n, held, n - c.timings.prompt_tokens, len(c.tokens), c.finish_reason, c))

    def reply(self, text: str) -> Completion:
        """One whole turn: send `text`, return the completion."""
        c = Completion()
        for _ in self.send(text, c):
            pass
        return c

    def stats(self) -> dict[str, Any]:
        """Numbers for /stats."""
        t = self.turns
        last = t[-1] if t else None
        return {
            "messages": len(self.messages),
            "dropped": self.dropped,
            "context": self.model.ctx,
            "cached": len(self.model.seq),
            "replies": len(t),
            "generated": sum(x.generated for x in t),
            "prefilled": sum(x.prefilled for x in t),
            "reused": sum(x.reused for x in t),
            "last": None if last is None else {
                "prompt_tokens": last.prompt_tokens, "held": last.held, "reused": last.reused,
                "prefilled": last.prefilled, "generated": last.generated, "finish_reason": last.finish_reason,
                "prompt_tokens_per_s": last.completion.timings.prompt_tokens_per_s,
                "eval_tokens_per_s": last.completion.timings.eval_tokens_per_s,
            },
        }

    # -- files ------------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> int:
        """Write the conversation as JSON; returns the number of messages. The file is replaced atomically:
        the text goes to a temporary file beside it, reaches the disk (fsync), then takes the file's name, so
        a full disk or a crash leaves the previous conversation intact. Only a regular file or a new path is
        written: the rename would turn a device, a FIFO or a socket into a regular file, and put a file in
        place of a symbolic link (or, through it, replace whatever it points to)."""
        messages = self.messages
        data = (json.dumps(messages, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
        target = _checked_path(path)
        try:
            kind = _not_regular(target)
            if kind:
                raise ConversationFileError(f"cannot write {path}: it is {kind}, not a regular file (save to a "
                                            "regular file or a new path)")
            _replace_atomically(target, data)
        except OSError as exc:
            raise ConversationFileError(f"cannot write {path}: {exc.strerror or exc}") from None
        return len(messages)

    def load(self, path: str | Path) -> int:
        """Replace the conversation (system prompt included) with the one in a JSON file; returns the
        number of messages. Nothing changes if the file is bad."""
        name = _checked_path(path)
        name = "./-" if name == "-" else name  # a file named "-", not standard input
        text = read_text(name, "conversation file", ConversationFileError)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConversationFileError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
        except RecursionError:  # [[[[... nested deeper than Python's parser recurses
            raise ConversationFileError(f"{path} nests JSON too deeply to be a conversation") from None
        except ValueError:  # an integer of thousands of digits (Python's int-string conversion limit)
            raise ConversationFileError(f"{path} holds a number too long to be part of a conversation") from None
        messages = check_messages(data, str(path))
        self.load_messages(messages)
        return len(messages)

    def load_messages(self, messages: list[dict[str, Any]]) -> None:
        messages = check_messages(messages)
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        self.system = system
        self.history = messages[1:] if system is not None else messages
        self.first = 0


def _checked_path(path: str | Path) -> str:
    """The path as text; a NUL byte (which no file name holds) is a bad-input error, not a ValueError."""
    name = os.fspath(path)
    if "\0" in name:
        raise ConversationFileError(f"{name!r} is not a file name: it holds a NUL byte")
    return name


def _not_regular(path: str) -> str | None:
    """What `path` is when it exists and is not a regular file ("a symbolic link", "a directory", ...); None for
    a regular file or a path that does not exist (the link itself is looked at, not what it points to)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _replace_atomically(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same directory, fsync'ed, then os.replace: the
    old file stays whole until the new one is complete on disk. A new file gets the usual permissions (0o666
    less the umask, which os.open applies itself: reading the umask means changing it, for every thread), an
    existing one keeps its own."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = None
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _create_temporary(path: str) -> tuple[int, str]:
    """A new file beside `path`, as (descriptor, name): O_EXCL, so never one that is already there (a random
    64-bit name makes a clash all but impossible; one would fail as "cannot write")."""
    directory, base = os.path.split(path)
    tmp = os.path.join(directory or ".", f".{base}.{secrets.token_hex(8)}.tmp")
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    return os.open(tmp, flags, 0o666), tmp


def check_messages(data: Any, where: str = "conversation") -> list[dict[str, str]]:
    """Validate the OpenAI messages shape; return plain {"role", "content"} copies (other keys dropped)."""
    if not isinstance(data, list):
        raise ConversationFileError(
            f'{where}: expected a JSON list of {{"role", "content"}} messages, got {_json_type(data)}'
        )
    out = []
    for i, m in enumerate(data, 1):
        if not isinstance(m, dict):
            raise ConversationFileError(f"{where}: message {i} is {_json_type(m)}, not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ConversationFileError(f"{where}: message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ConversationFileError(f"{where}: message {i} has no text content (\"content\" must be a string)")
        if role == "system" and i != 1:
            raise ConversationFileError(f"{where}: message {i} is a system message; only the first may be")
        out.append({"role": role, "content": content})
    return out


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
