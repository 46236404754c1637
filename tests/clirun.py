"""Run the CLI in-process (fast) or as a subprocess (real), capturing exit code, stdout and stderr."""

from __future__ import annotations

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
    code = run_with(args, stdin, out, err)
    return Result(code, out.getvalue(), err.getvalue())


def run_with(args, stdin: str, stdout, stderr) -> int:  # noqa: ANN001 (any text streams)
    """main(args) in-process with the standard streams replaced by these; the exit code."""
    saved = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin), stdout, stderr
    try:
        main(list(args))
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved


def run_subprocess(*args: str, stdin: str = "", timeout: float = 120, env: dict | None = None) -> Result:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    p = subprocess.run([sys.executable, "-m", "llamacli", *args], input=stdin, capture_output=True, text=True,
                       timeout=timeout, env=full_env)
    return Result(p.returncode, p.stdout, p.stderr)
