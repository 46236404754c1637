"""What a download shows on stderr: rich progress bars, and one-line notes.

Names and URLs in them come from registries and servers, so they pass through textio.printable first.
"""

from __future__ import annotations

from collections.abc import Callable

from .textio import printable

Advance = Callable[[int], None]


class Bars:
    """Rich progress bars on stderr, or nothing when `enabled` is False."""

    def __init__(self, enabled: bool) -> None:
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )

    def __enter__(self) -> Bars:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def task(self, description: str, total: int | None, done: int = 0) -> Advance:
        """A new bar; returns the function that advances it by a number of bytes."""
        if self.progress is None:
            return lambda n: None
        progress = self.progress
        task = progress.add_task(printable(description), total=total, completed=done)
        return lambda n: progress.advance(task, n)

    def say(self, text: str) -> None:
        """A line above the bars."""
        if self.progress is not None:
            self.progress.console.print(printable(text), markup=False, highlight=False)


def note(text: str) -> None:
    """One `note: ...` line on stderr."""
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"note: {printable(text)}", markup=False)
