"""The `llamacli chat` loop: read a line, run a command or a turn, stream the reply. CLI layer (rich, stdin,
stdout); the conversation itself is chat_session.ChatSession.

Interactive (stdin is a terminal): a '>>> ' prompt with line editing and history (readline, when Python
has it); a line ending in a backslash continues on the next. Each reply streams to stdout; a dim line on
stderr gives its tokens/s and how much of the prompt came from the KV cache (--quiet hides it).

Non-interactive (stdin is a pipe or a file): each non-empty line is one user message, no prompt is
printed, and stdout carries the replies only: each reply with its trailing whitespace removed and then
exactly one newline (a reply may hold newlines of its own; --json prints one JSON object per line
instead). Commands work here too (a line starting with an unknown /word is a message there, a typo
on a terminal), and the first error ends the run with its exit code.

Ctrl-C during a reply stops that reply; the partial text stays in the conversation (as in llama.cpp).
Ctrl-C at the prompt discards the line; a second Ctrl-C in a row leaves (exit 130), as do Ctrl-D and /exit
(exit 0). Without a terminal Ctrl-C ends the run (exit 130).
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

from ..chat.reasoning import ReplyRouter
from ..engine.chat_session import ChatSession
from ..engine.generate import Completion
from ..errors import Interrupted, LlamacliError, UsageError
from ..textio import json_text, printable, read_line

PROMPT, MORE = ">>> ", "... "

HELP = """commands (ollama's spellings work too):
  /help, /?                  this list
  /exit, /quit, /bye         leave (Ctrl-D does too)
  /reset, /clear             forget the conversation, keep the system prompt
  /system [TEXT]             show the system prompt, or replace it (also: /set system TEXT)
  /set parameter NAME VALUE  change a sampling setting for the next replies: temperature, top_k, top_p,
                             min_p, seed, num_predict (-n), repeat_penalty, repeat_last_n,
                             presence_penalty, frequency_penalty, stop (one or more words; none: no stop)
  /set think, /set nothink   turn a thinking model's think block on or off
  /save FILE                 write the conversation as JSON (a list of {"role", "content"} messages)
  /load FILE                 replace the conversation (and system prompt) with one saved by /save
  /stats                     context use, KV-cache reuse and speed
Ctrl-C stops a reply (its partial text stays in the conversation); at the prompt it discards the line,
and twice in a row it leaves. End a line with \\ to continue the message on the next line."""

COMMANDS = ("/help", "/?", "/exit", "/quit", "/bye", "/reset", "/clear", "/system", "/set", "/save", "/load", "/stats")
ALIASES = {"/?": "/help", "/quit": "/exit", "/bye": "/exit", "/clear": "/reset"}

# /set parameter NAME: ollama's names (and ours, -n's and the option names with - or _) -> the SamplingParams
# field (or "max_tokens", "stop") and the type of its value.
PARAMETERS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float), "temp": ("temperature", float),
    "top_k": ("top_k", int), "top_p": ("top_p", float), "min_p": ("min_p", float), "seed": ("seed", int),
    "repeat_penalty": ("repeat_penalty", float), "repeat_last_n": ("repeat_last_n", int),
    "presence_penalty": ("presence_penalty", float), "frequency_penalty": ("frequency_penalty", float),
    "num_predict": ("max_tokens", int), "n_predict": ("max_tokens", int), "max_tokens": ("max_tokens", int),
    "stop": ("stop", str),
}
SET_USAGE = "/set parameter NAME VALUE, /set system TEXT, /set think or /set nothink (/help lists the names)"


class ChatLoop:
    def __init__(self, session: ChatSession, err: Console, *, interactive: bool, quiet: bool = False,
                 as_json: bool = False):
        self.session = session
        self.err = err
        self.interactive = interactive
        self.quiet = quiet
        self.as_json = as_json
        self._ctrl_c = False  # the last prompt ended in Ctrl-C
        session.notice = self.dim  # context-full notices

    def run(self) -> None:
        if self.interactive:
            _line_editing()
            self.dim("/help for commands, Ctrl-D or /exit to leave")
        while True:
            line = self.read()
            if line is None:
                return
            try:
                if not self.handle(line):
                    return
            except LlamacliError as exc:
                if not self.interactive:
                    raise
                self.err.print("error: " + printable(" ".join(str(exc).split())), markup=False, emoji=False)

    # -- input ------------------------------------------------------------------------------------------------
    def read(self) -> str | None:
        """The next message or command; None at the end of input."""
        if not self.interactive:
            line = read_line(sys.stdin)
            return line.rstrip("\r\n") if line else None
        parts: list[str] = []
        while True:
            try:
                line = input(MORE if parts else PROMPT)
            except EOFError:
                sys.stdout.write("\n")
                return None
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                if self._ctrl_c:
                    raise Interrupted("interrupted") from None
                self._ctrl_c = True
                self.dim("(Ctrl-C again, Ctrl-D or /exit to leave)")
                parts = []
                continue
            self._ctrl_c = False
            if line.endswith("\\"):
                parts.append(line[:-1])
                continue
            return "\n".join(parts + [line])

    def handle(self, line: str) -> bool:
        """Run one line; False means leave."""
        if not line.strip():
            return True
        word, _, arg = line.strip().partition(" ")
        if word in COMMANDS:
            return self.command(ALIASES.get(word, word), arg.strip())
        if word.startswith("/") and self.interactive and "\n" not in line:
            self.err.print(f"unknown command {word} (/help lists them)", markup=False)
            return True
        self.turn(line)
        return True

    def command(self, name: str, arg: str) -> bool:
        s = self.session
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.err.print(HELP, markup=False)
        elif name == "/reset":
            s.reset()
            self.dim("conversation cleared (the system prompt stays)")
        elif name == "/system":
            if not arg:
                self.err.print(f"system prompt: {s.system!r}" if s.system is not None else "no system prompt "
                               "(the template's default applies)", markup=False)
            else:
                s.set_system(arg)
                self.dim("system prompt set")
        elif name in ("/save", "/load"):
            if not arg:
                raise UsageError(f"{name} needs a file name")
            n = s.save(arg) if name == "/save" else s.load(arg)
            self.dim(f"{'saved' if name == '/save' else 'loaded'} {n} messages {'to' if name == '/save' else 'from'} {arg}")
        elif name == "/stats":
            for line in stats_lines(s.stats()):
                self.err.print(line, markup=False)
        elif name == "/set":
            self.set_command(arg)
        return True

    def set_command(self, arg: str) -> None:
        """ollama's /set: parameter NAME VALUE, system TEXT, think, nothink."""
        s = self.session
        what, _, rest = arg.partition(" ")
        rest = rest.strip()
        if what == "system" and rest:
            s.set_system(rest)
            self.dim("system prompt set")
        elif what in ("think", "nothink") and not rest:
            s.think = what == "think"
            self.dim(f"thinking {'on' if s.think else 'off'} for the next replies"
                     + ("" if s.model.thinks else " (the model's chat template has no think block: it changes nothing)"))
        elif what == "parameter":
            name, value = self.set_parameter(rest)
            self.dim(f"set {name} to {value}")
        else:
            raise UsageError(f"usage: {SET_USAGE}")

    def set_parameter(self, arg: str) -> tuple[str, str]:
        """/set parameter NAME VALUE: a sampling setting (checked as the options are) for the next replies."""
        from dataclasses import replace

        name, _, value = arg.partition(" ")
        value = value.strip()
        key = name.lower().replace("-", "_")
        if key == "num_ctx":
            raise UsageError("num_ctx is the context, set when the model loads: --ctx N")
        if key not in PARAMETERS or (not value and key != "stop"):
            raise UsageError(f"usage: /set parameter NAME VALUE, NAME one of {', '.join(sorted(PARAMETERS))}")
        field, kind = PARAMETERS[key]
        s = self.session
        if field == "stop":
            s.stop = tuple(value.split())
            return "stop", " ".join(printable(x) for x in s.stop) or "(none)"
        try:
            number = kind(value)
        except ValueError:
            raise UsageError(f"/set parameter {name} takes {'an integer' if kind is int else 'a number'}, got "
                             f"{value!r}") from None
        if field == "max_tokens":
            if number < -1:
                raise UsageError(f"{name} must be >= 0, or -1 (until the end of the text or a full context)")
            s.max_tokens = s.model.ctx if number == -1 else number
        else:
            s.params = replace(s.params, **{field: number}).validate()
        return field, value

    # -- a turn -----------------------------------------------------------------------------------------------
    def turn(self, text: str) -> None:
        c = Completion()
        writer = _ReplyWriter(enabled=not self.as_json)
        router = ReplyRouter(c, writer.write, None if self.as_json else sys.stderr)  # reasoning to stderr
        pieces = self.session.send(text, c)
        try:
            for piece in pieces:
                router.write(piece)
            router.end()
        except KeyboardInterrupt:
            pieces.close()  # a Ctrl-C that landed here rather than in the engine: end the turn the same way
            router.end()
            writer.end()
            if not self.interactive:
                raise
            self.dim("(interrupted: the partial reply stays in the conversation)" if c.text else "(interrupted)")
            self.report(c)
            return
        writer.end()
        if self.as_json:
            print(json_text(self._json(c)), flush=True)
        self.report(c)

    def _json(self, c: Completion) -> dict[str, Any]:
        t = self.session.turns[-1]
        return {"text": c.text, "reasoning": c.reasoning, "finish_reason": c.finish_reason,
                "prompt_tokens": t.prompt_tokens,
                "reused_tokens": t.reused, "timings": c.timings.as_dict()}

    def report(self, c: Completion) -> None:
        """The dim line under a reply: speed, and how much of the prompt the cache saved."""
        turns = self.session.turns
        if not turns or turns[-1].completion is not c:
            return
        t, tm = turns[-1], c.timings
        cut = "; cut at --max-tokens" if c.finish_reason == "length" else ""
        spec = (f"; {tm.accepted} of {tm.drafted} drafted tokens accepted, {tm.eval_tokens / tm.passes:.2f} per pass"
                if tm.speculative and tm.passes else "")
        self.dim(f"{t.generated} tokens, {tm.eval_tokens_per_s:.1f} tokens/s; prompt {t.prefilled} new + "
                 f"{t.reused} reused tokens, {tm.prompt_tokens_per_s:.1f} tokens/s{cut}{spec}")

    def dim(self, text: str) -> None:
        if not self.quiet:
            self.err.print(f"[dim]{_escape(printable(text))}[/dim]", emoji=False)


def stats_lines(st: dict[str, Any]) -> list[str]:
    lines = [
        f"conversation: {st['messages']} messages" + (f", the oldest {st['dropped']} dropped from the context"
                                                      if st["dropped"] else ""),
        f"KV cache: {st['cached']} of {st['context']} tokens",
    ]
    last = st["last"]
    if last:
        lines.append(f"last reply: {last['generated']} tokens ({last['finish_reason']}), "
                     f"{last['eval_tokens_per_s']:.1f} tokens/s; prompt {last['prompt_tokens']} tokens: "
                     f"{last['reused']} reused of {last['held']} cached, {last['prefilled']} prefilled")
    lines.append(f"session: {st['replies']} replies, {st['generated']} tokens generated, "
                 f"{st['prefilled']} prefilled, {st['reused']} reused from the cache")
    return lines


class _ReplyWriter:
    """Streams a reply to stdout, holding back trailing whitespace so that every reply ends in exactly one
    newline (replies stay separable in a pipe)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.held = ""

    def write(self, piece: str) -> None:
        if not self.enabled:
            return
        text = self.held + piece
        body = text.rstrip()
        self.held = text[len(body):]
        if body:
            sys.stdout.write(body)
            sys.stdout.flush()

    def end(self) -> None:
        if self.enabled:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.enabled = False


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _line_editing() -> None:
    """Arrow keys and history for input(), where Python has readline (not on Windows)."""
    try:
        import readline  # noqa: F401
    except ImportError:
        pass
