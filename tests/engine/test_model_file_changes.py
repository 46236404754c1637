"""A model file that another program cuts short while llamacli runs (issue 46, class 5): with the tensors in a
memory map, the next touch of a page past the new end killed the process with SIGBUS (exit 135, no message).
The file is read, not mapped: after the load nothing touches it (the reply goes on as if nothing happened),
and during the load a read that comes back short is one `error:` line, exit 1. Real processes, the NumPy
backend, tiny models (llamacli.testing).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clirun import ROOT, run
from llamacli.errors import FileChangedError
from llamacli.ggufio.file import open_gguf
from llamacli.testing import ModelSpec, write_model

MICRO = ModelSpec("llama", 1, 32, 2, 1, 64, context_length=512, name="micro")
SLOW = ModelSpec("llama", 8, 1024, 16, 4, 2816, context_length=4096, name="slow-to-load")  # ~1 s of dequantization


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("changes") / "micro.gguf", MICRO, "F32")  # F32: used in place


@pytest.fixture(scope="module")
def slow(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("changes") / "slow.gguf", SLOW, "Q4_K")


def llamacli(*args: str, stdin: int | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llamacli", *args], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def read_position(pid: int, path: Path) -> int:
    """The offset of `pid`'s open descriptor of `path` (/proc/<pid>/fdinfo), -1 while it has none."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
                return int(text.split("pos:")[1].split()[0])
    except (OSError, IndexError, ValueError):
        pass
    return -1


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and lines and lines[-1].startswith("error: "), err
    assert sum(line.startswith("error:") for line in lines) == 1, err
    return lines[-1]


@pytest.mark.skipif(not Path("/proc/self/fdinfo").exists(), reason="needs Linux")
def test_a_model_cut_short_between_chat_turns_goes_on(micro, tmp_path):
    """Turn 1, then the file is cut to half its size, then turn 2: both replies come, the same as from an
    intact file (the weights were all read at load), exit 0."""
    model = tmp_path / "m.gguf"
    shutil.copy(micro, model)
    args = ("chat", "-m", str(model), "--backend", "numpy", "--greedy", "-n", "6", "--json", "-q")
    expected = run(*args, stdin="hello\nagain\n")
    assert expected.code == 0 and len(expected.out.splitlines()) == 2, expected.err
    p = llamacli(*args, stdin=subprocess.PIPE)
    try:
        p.stdin.write("hello\n")
        p.stdin.flush()
        first = p.stdout.readline()  # turn 1's reply: the model is loaded and has run
        assert json.loads(first)["text"] == json.loads(expected.out.splitlines()[0])["text"]
        os.truncate(model, model.stat().st_size // 2)
        rest, err = p.communicate("again\n", timeout=60)
    finally:
        p.kill()
    assert p.returncode == 0, f"exit {p.returncode}: {err}"  # (SIGBUS: -7, or 135 from a shell)
    texts = [json.loads(line)["text"] for line in (first + rest).splitlines()]
    assert texts == [json.loads(line)["text"] for line in expected.out.splitlines()] and err == ""


@pytest.mark.skipif(not Path("/proc/self/fdinfo").exists(), reason="needs Linux")
def test_a_model_cut_short_while_it_loads_is_one_line(slow, tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(slow, model)
    p = llamacli("generate", "-m", str(model), "--backend", "numpy", "-p", "hello", "-n", "4", "--raw")
    try:
        deadline = time.monotonic() + 60
        while read_position(p.pid, model) < 2 << 20:  # past the header: the weights are being read
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.002)
        os.truncate(model, 3 << 20)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 1 and out == "", f"exit {p.returncode}: {err}"
    assert "is shorter than when it was opened" in one_error_line(err)


def test_reads_past_a_new_end_or_from_a_replaced_file_raise(micro, tmp_path):
    """In-process, the reads themselves: a tensor past the new end, and a file replaced under its name
    (noticed when the file must be opened again)."""
    model = tmp_path / "m.gguf"
    shutil.copy(micro, model)
    g = open_gguf(model)
    last = max(g.tensors.values(), key=lambda t: t.offset)
    os.truncate(model, last.offset + 4)
    with pytest.raises(FileChangedError, match="shorter than when it was opened"):
        g.raw(last.name)
    g.close()
    shutil.copy(micro, model.with_name("new.gguf"))
    os.replace(model.with_name("new.gguf"), model)  # a re-download's atomic rename
    with pytest.raises(FileChangedError, match="changed since it was opened"):
        g.raw(last.name)
    r = run("inspect", str(model))  # (the new file itself is fine)
    assert r.code == 0, r.err


def test_positioned_reads_from_threads_and_a_cut_file(micro, tmp_path):
    """read_at (the CUDA upload's reader threads): the same bytes as read_bytes from several threads at once,
    and FileChangedError for a range the file no longer holds."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    model = tmp_path / "m.gguf"
    shutil.copy(micro, model)
    g = open_gguf(model)
    infos = sorted(g.tensors.values(), key=lambda t: t.offset)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda t: g.read_at(t.offset, t.n_bytes, np.empty(t.n_bytes, np.uint8)).copy(), infos))
    assert all(np.array_equal(a, g.read_bytes(t.offset, t.n_bytes)) for a, t in zip(got, infos))
    last = infos[-1]
    os.truncate(model, last.offset + 4)
    with pytest.raises(FileChangedError, match="shorter than when it was opened"):
        g.read_at(last.offset, last.n_bytes, np.empty(last.n_bytes, np.uint8))
    g.close()
