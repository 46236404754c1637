"""The command line's parsing habits, as llama.cpp and ollama users expect them.

- `-ngl 99`, `-fa`, `-ctk q8_0`: llama.cpp spells options with one dash and several letters. Click would
  split an unknown `-ngl` into the short option `-n` with the value `gl`; here a single-dash word that names
  an option (or is one of llama.cpp's, `LLAMA_CPP_WORDS`) is that one name, known or reported as unknown.
  Any other word splits as POSIX short options do only when every letter up to the first option that takes
  a value is a known short option: `-n32`, `-pHello`, `-fprompt.txt` (the rest is the value), `-qv` (two
  flags). Anything else is reported whole: "No such option: -xyz".
- `-fa on` / `-fa 1`: newer llama.cpp gives flag-like options a value; for the flags listed in
  `VALUED_FLAGS` such a word is taken along with the flag instead of becoming a positional argument.
- `-h` is `--help` (set on the app's context); `llamacli` alone prints the help on stdout and exits 0.
- `list`/`ls` name `models` and `show` names `inspect`; `serve` says it does not exist yet.

These are click classes (TyperGroup/TyperCommand subclasses); the parser class is taken from whichever click
typer uses (its own vendored copy in newer versions), so both work.
"""

from __future__ import annotations

import re
from typing import Any

from typer.core import TyperCommand, TyperGroup

ALIASES = {"list": "models", "ls": "models", "show": "inspect"}
VALUED_FLAGS = {"-fa", "--flash-attn"}
FLAG_WORDS = {"on", "off", "auto", "0", "1", "true", "false"}

# llama.cpp's multi-letter single-dash options (common/arg.cpp). Their first letter is often one of our short
# options that take a value (-c, -n, -s, -m, -t ...): read as -c "tk" they would fail as a bad --ctx value;
# as whole words they are named in the error, or found when a command defines them (-ngl, -fa).
LLAMA_CPP_WORDS = frozenset("""
    -ngl -ngld -fa -ctk -ctv -ctkd -ctvd -cb -nocb -cnv -no-cnv -cmoe -ncmoe -cmoed -ncmoed -cram -cml -ub -tb
    -td -ts -sm -mg -np -ns -nkvo -sp -ps -st -sys -sysf -mli -mu -md -mv -mm -mmu -hf -hfr -hff -hfd -hfrd
    -hfv -hffv -hft -lcs -lcd -lv -ot -otd -dev -devd -dio -kvu -rea -jf -dt -gan -gaw -to -bf -if -fit -fitt
    -fitc -dkvc -ofreq -ofname
""".split())
_WORD_OPTION = re.compile(r"-[A-Za-z][A-Za-z-]+")  # -ngl, -fa, -ctk, -no-cnv, -qv, -pHello; not -n32, not --long
_parser_classes: dict[type, type] = {}


def _whole_name_parser(base: type) -> type:
    """A subclass of click's option parser `base` that reads a single-dash word as one option name unless it
    is short options run together (see the module doc)."""
    if base in _parser_classes:
        return _parser_classes[base]

    class WholeNameParser(base):  # type: ignore[misc, valid-type]
        def _process_opts(self, arg: str, state: Any) -> None:
            name, eq, value = arg.partition("=")
            if _WORD_OPTION.fullmatch(name) and not self.ignore_unknown_options and not self._splits(name):
                # Matched as a whole name: "no such option: -ngl" (with close matches) when it is unknown.
                self._match_long_opt(name, value if eq else None, state)
                return
            super()._process_opts(arg, state)

        def _splits(self, word: str) -> bool:
            """Whether a single-dash word is short options run together (-qv, or -pHello: -p with the value
            "Hello"): it names no option of its own, and every letter up to the first option that takes a
            value is a known short option."""
            if word in self._long_opt or word in LLAMA_CPP_WORDS:
                return False
            for letter in word[1:]:
                option = self._short_opt.get("-" + letter)
                if option is None:
                    return False
                if option.takes_value:
                    return True
            return True

        def _match_long_opt(self, opt: str, explicit_value: str | None, state: Any) -> None:
            if opt in VALUED_FLAGS:
                if explicit_value is not None and explicit_value.lower() in FLAG_WORDS:
                    explicit_value = None
                elif explicit_value is None and state.rargs and state.rargs[0].lower() in FLAG_WORDS:
                    state.rargs.pop(0)
            super()._match_long_opt(opt, explicit_value, state)

    _parser_classes[base] = WholeNameParser
    return WholeNameParser


class _WholeNames:
    """Mixin for a click command or group: its parser reads single-dash words as whole option names."""

    def make_parser(self, ctx: Any) -> Any:
        parser = super().make_parser(ctx)  # type: ignore[misc]
        parser.__class__ = _whole_name_parser(type(parser))
        return parser


class HabitCommand(_WholeNames, TyperCommand):
    """A subcommand parsed with llama.cpp's option habits."""


class HabitGroup(_WholeNames, TyperGroup):
    """The `llamacli` group: help without arguments, verb aliases, llama.cpp's option habits."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args and not ctx.resilient_parsing:
            # `llamacli` alone is a request for help, not a mistake: the help on stdout, exit 0.
            print(ctx.get_help())
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        return super().get_command(ctx, ALIASES.get(cmd_name, cmd_name))
