"""The template watchdog's hook for exceptions Python cannot raise (finalizers): while a template renders,
nothing of the kind reaches stderr, whose only line on failure is the error (a hostile template that recursed to
the end of the stack made a finalizer fail with RecursionError, and the hook itself failed there)."""

from __future__ import annotations

import gc
import sys

from llamacli.chat.template_watchdog import Watchdog


class _FailsWhenCollected:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def __del__(self) -> None:
        raise self.exc


def _collect(exc: BaseException) -> None:
    obj = _FailsWhenCollected(exc)
    del obj
    gc.collect()


def test_a_finalizer_recursion_error_is_not_printed(capsys) -> None:
    seen: list[BaseException] = []
    before = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: seen.append(unraisable.exc_value)  # (stands for the default printer)
    try:
        with Watchdog(5.0, 1 << 30):
            _collect(RecursionError("maximum recursion depth exceeded"))
            _collect(ValueError("not ours"))
        assert sys.unraisablehook is not before  # the previous hook is back after the render
    finally:
        sys.unraisablehook = before
    assert [type(e) for e in seen] == [ValueError]
    assert "Exception ignored" not in capsys.readouterr().err


def test_the_hook_never_raises(capsys) -> None:
    seen: list[BaseException] = []

    def failing(unraisable: "sys.UnraisableHookArgs") -> None:
        seen.append(unraisable.exc_value)
        raise RuntimeError("a hook that fails")

    before = sys.unraisablehook
    sys.unraisablehook = failing
    try:
        with Watchdog(5.0, 1 << 30):
            _collect(ValueError("not ours"))  # passed on to the previous hook, whose failure goes nowhere
    finally:
        sys.unraisablehook = before
    assert [str(e) for e in seen] == ["not ours"]
    assert "Exception ignored" not in capsys.readouterr().err
