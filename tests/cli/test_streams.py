"""Standard streams in every state a shell can leave them: closed (`>&-`, `<&-`, `2>&-`), an encoding that
cannot hold the output (PYTHONIOENCODING=ascii), a reader that leaves early (`| head`). Each ends in the
contract: output, or one `error:` line and its exit code; never a traceback or an "Exception ignored"."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys

import pytest

from clirun import ROOT, Result, run, run_with
from llamacli.testing import write_model

NAME = "café 模型"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny model whose name is not ASCII."""
    return str(write_model(tmp_path_factory.mktemp("streams") / "m.gguf", metadata={"general.name": NAME}))


def spawn(*args: str, close: tuple[int, ...] = (), stdin: bytes = b"", env: dict | None = None,
          stdout: int | None = subprocess.PIPE) -> Result:
    """The real command in a child process whose descriptors `close` are closed, as `>&-` leaves them."""
    def close_fds() -> None:
        for fd in close:
            os.close(fd)

    p = subprocess.run([sys.executable, "-m", "llamacli", *args], input=stdin, stdout=stdout,
                       stderr=subprocess.PIPE, preexec_fn=close_fds, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    return Result(p.returncode, (p.stdout or b"").decode(errors="replace"), p.stderr.decode(errors="replace"))


# -- closed streams ------------------------------------------------------------------------------------------


def test_closed_stdout_is_one_error_line(model):
    r = spawn("inspect", model, close=(1,))
    assert r.code == 1 and "standard output is closed" in r.one_line_error()


def test_closed_stdout_of_a_model_command_on_the_default_backend(model):
    """generate's own backend choice (auto: the GPU driver starts on a thread first, where CuPy is installed)
    with stdout closed: still one error line, exit 1 (after the NumPy fallback's notice where there is no GPU)."""
    r = spawn("generate", "-m", model, "-p", "hi", "-n", "2", "--raw", close=(1,))
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert r.code == 1 and "Traceback" not in r.err and lines[-1] == "error: standard output is closed", r.err


def test_closed_stdout_lets_the_real_error_through(model):
    r = spawn("inspect", model + ".missing", close=(1,))
    assert r.code == 2 and "no such file" in r.one_line_error()


@pytest.mark.parametrize("command", [["generate", "--prompt-file", "-"], ["chat"]])
def test_closed_stdin_is_bad_input(model, command):
    r = spawn(command[0], "-m", model, "--backend", "numpy", "-n", "2", *command[1:], close=(0,))
    assert r.code == 2 and "standard input is closed" in r.one_line_error()


def test_closed_stderr_keeps_exit_codes(model):
    assert spawn("inspect", model + ".missing", close=(2,)).code == 2
    r = spawn("inspect", model, close=(2,))
    assert r.code == 0 and NAME in r.out


# -- encodings -----------------------------------------------------------------------------------------------


def test_ascii_stdout_escapes_instead_of_failing(model):
    ascii_env = {"PYTHONIOENCODING": "ascii"}
    r = spawn("inspect", model, env=ascii_env)
    assert r.code == 0 and r.err == "" and "caf\\xe9 \\u6a21\\u578b" in r.out
    r = spawn("inspect", model, "--json", env=ascii_env)  # JSON stays JSON: \u escapes, not \x
    assert r.code == 0 and json.loads(r.out)["name"] == NAME and r.out.isascii()
    r = spawn("chat", "-m", model, "--backend", "numpy", "-n", "2", stdin=NAME.encode(), env=ascii_env)
    assert r.code == 2 and "not ascii text" in r.one_line_error()


def test_stdin_that_is_not_utf8_is_bad_input(model):
    r = spawn("chat", "-m", model, "--backend", "numpy", "-n", "2", stdin=b"\xff\xfe hello\n")
    assert r.code == 2 and "not utf-8 text" in r.one_line_error()


# -- a reader that leaves (`| head`) ---------------------------------------------------------------------------


class Gone(io.TextIOBase):
    """A stream after `| head` has exited (every write fails with EPIPE), or with another errno: EBADF is a
    descriptor the shell closed after Python had opened it."""

    encoding = "utf-8"

    def __init__(self, code: int = errno.EPIPE):
        self.code = code

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(self.code, os.strerror(self.code))  # OSError picks the subclass: BrokenPipeError for EPIPE


def run_into(stdout: io.TextIOBase, *args: str, stdin: str = "", stderr: io.TextIOBase | None = None) -> Result:
    """The CLI in-process with the given stdout (and stderr), like clirun.run."""
    err = stderr or io.StringIO()
    code = run_with(args, stdin, stdout, err)
    return Result(code, "", err.getvalue() if isinstance(err, io.StringIO) else "")


def commands(model: str) -> list[list[str]]:
    gen = ["-m", model, "--backend", "numpy", "-n", "4", "--seed", "1", "-q"]
    return [
        ["inspect", model], ["inspect", model, "--json"], ["inspect", model, "--metadata", "--tensors"],
        ["tokenize", "-m", model, "-p", "hello"], ["tokenize", "-m", model, "-p", "hello", "-v"],
        ["tokenize", "-m", model, "-p", "hello", "--json"],
        ["generate", *gen, "-p", "hello"], ["generate", *gen, "-p", "hello", "--json"],
        ["chat", *gen], ["chat", *gen, "--json"],
        ["bench", "-m", model, "--backend", "numpy", "-p", "4", "-n", "2", "-r", "1"],
        ["--help"], ["inspect", "--help"], ["--version"],
    ]


def test_every_command_ends_quietly_when_the_reader_leaves(model):
    for argv in commands(model):
        r = run_into(Gone(), *argv, stdin="hello\n")
        assert r.code == 0 and "error" not in r.err, (argv, r)


@pytest.mark.parametrize("code", [errno.EPIPE, errno.EBADF])
def test_an_error_line_that_cannot_be_written_keeps_its_exit_code(model, code):
    assert run_into(io.StringIO(), "inspect", model + ".missing", stderr=Gone(code)).code == 2


@pytest.mark.parametrize("argv", [["inspect", "{model}", "--metadata"], ["generate", "-m", "{model}", "-p", "hi",
                                                                         "--backend", "numpy", "-n", "8", "-q"]])
def test_broken_pipe_in_a_real_process(model, argv):
    """The reader is gone before the first write: exit 0 and nothing on stderr (no "Exception ignored" from
    the interpreter's flush at exit)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = spawn(*(a.format(model=model) for a in argv), stdout=write_end)
    finally:
        os.close(write_end)
    assert (r.code, r.err) == (0, "")


def test_in_process_runs_still_capture_output(model):
    """main() leaves streams it did not find closed alone (tests and embedding programs swap them), and a
    run whose reader left does not leave its unwritten text behind for the next one."""
    run_into(Gone(), "inspect", model)
    r = run("inspect", model)
    assert r.code == 0 and NAME in r.out and r.out.count("architecture") == 1
