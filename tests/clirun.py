"""Run the CLI in-process (fast) or as a subprocess (real), capturing exit code, stdout and stderr."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from llamacli.cli import main

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    code: int
    out: str
    err: str

    def one_line_error(self) -> str:
        """The error contract: exactly one non-empty stderr line starting 'error:', no traceback."""
        lines = [l for l in self.err.splitlines() if l.strip()]
        assert "Traceback" not in self.err, self.err
        assert len(lines) == 1 and lines[0].startswith("error: "), self.err
        return lines[0]


def run(*args: str, stdin: str = "") -> Result:
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.stdin = old_stdin
    return Result(code, out.getvalue(), err.getvalue())


def run_subprocess(*args: str, stdin: str = "", timeout: float = 120, env: dict | None = None) -> Result:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    p = subprocess.run([sys.executable, "-m", "llamacli", *args], input=stdin, capture_output=True, text=True,
                       timeout=timeout, env=full_env)
    return Result(p.returncode, p.stdout, p.stderr)
