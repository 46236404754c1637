"""Faults at run time, with the NumPy backend: Ctrl-C in every phase, a context that does not fit in RAM,
and NaN/inf in the logits of a broken model.

- SIGINT to a real `llamacli generate` process while it loads (dequantizing a 50 MB Q4_K model), while it
  prefills (a ~400-token prompt) and while it decodes: exit 130, `error: interrupted` as the last stderr line,
  no traceback.
- `--ctx` far beyond the machine: HostMemoryError before anything is allocated (exit 1, one line) naming a
  --ctx that fits, and that one does load.
- NaN weights (F32) or inf weights (F16) make NaN logits: NumericalError (exit 1, one line) on the greedy path,
  the sampling path and the penalties path; and a NaN that appears only in a decode step is caught too.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from clirun import ROOT, run, run_subprocess
from llamacli.backends import numpy_backend
from llamacli.errors import HostMemoryError, NumericalError
from llamacli.ggufio.file import open_gguf
from llamacli.testing import ModelSpec, write_model

MICRO = ModelSpec("llama", 1, 32, 2, 1, 64, context_length=512, name="micro")
SLOW = ModelSpec("llama", 8, 1024, 16, 4, 2816, context_length=4096, name="slow-to-load")  # ~1 s of dequantization


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("faults") / "micro.gguf", MICRO, "F32")


@pytest.fixture(scope="module")
def slow(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("faults") / "slow.gguf", SLOW, "Q4_K")


# -- Ctrl-C ----------------------------------------------------------------------------------------------------


class _Proc:
    """A `llamacli` subprocess whose stdout and stderr are collected as they come."""

    def __init__(self, *args: str):
        self.p = subprocess.Popen([sys.executable, "-m", "llamacli", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._pump, args=(s, b), daemon=True)
                         for s, b in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, buf: list[str]) -> None:
        while True:
            chunk = stream.read(1)
            if not chunk:
                return
            buf.append(chunk)

    def wait_for(self, cond, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.p.poll() is None, f"exited early ({self.p.returncode}): {''.join(self.err)}"
            assert time.monotonic() < deadline, f"timed out; stderr so far: {''.join(self.err)}"
            time.sleep(0.01)

    def interrupt(self) -> tuple[int, str, str]:
        self.p.send_signal(signal.SIGINT)
        code = self.p.wait(timeout=60)
        for t in self._threads:
            t.join(timeout=10)
        self.p.stdout.close()
        self.p.stderr.close()
        return code, "".join(self.out), "".join(self.err)

    def read_position(self, path: Path) -> int:
        """The offset of the process's open descriptor of `path` (/proc/<pid>/fdinfo), -1 while it has none."""
        try:
            for fd in os.listdir(f"/proc/{self.p.pid}/fd"):
                if os.readlink(f"/proc/{self.p.pid}/fd/{fd}") == str(path):
                    return int(Path(f"/proc/{self.p.pid}/fdinfo/{fd}").read_text().split("pos:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            pass
        return -1


def _interrupted_cleanly(code: int, err: str) -> None:
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert lines and lines[-1] == "error: interrupted", err


GEN = ("generate", "--backend", "numpy", "--raw", "--greedy", "-q", "-v")


def test_ctrl_c_while_loading(slow):
    proc = _Proc(*GEN, "-m", str(slow), "-p", "hello", "-n", "4")
    proc.wait_for(lambda: proc.read_position(slow) > 2 << 20)  # past the header: the weights are being read
    time.sleep(0.1)
    code, out, err = proc.interrupt()
    _interrupted_cleanly(code, err)
    assert "backend numpy" not in err, "the load had finished: the signal did not land in it"
    assert out == ""


def test_ctrl_c_while_prefilling(slow):
    proc = _Proc(*GEN, "-m", str(slow), "-p", "hello " * 80, "-n", "4")
    proc.wait_for(lambda: "backend numpy" in "".join(proc.err))  # printed between load and prefill
    time.sleep(0.3)
    code, out, err = proc.interrupt()
    _interrupted_cleanly(code, err)
    assert out.strip() == "", "a token was generated: the signal did not land in the prefill"


def test_ctrl_c_while_decoding(micro):
    proc = _Proc(*GEN, "-m", str(micro), "-p", "hello", "-n", "100000", "--ctx", "100000")
    proc.wait_for(lambda: len("".join(proc.out)) > 20)  # text is streaming: we are in the decode loop
    code, out, err = proc.interrupt()
    _interrupted_cleanly(code, err)
    assert "finish reason: interrupted" in err
    assert len(out) > 20


# -- memory ------------------------------------------------------------------------------------------------------


def test_absurd_ctx_fails_before_allocating(micro):
    t0 = time.perf_counter()
    r = run("generate", "-m", str(micro), "--backend", "numpy", "-p", "hi", "-n", "1", "--ctx", str(10**12))
    assert time.perf_counter() - t0 < 20
    assert r.code == 1
    line = r.one_line_error()
    assert "not enough host memory" in line and "try --ctx" in line, line


def test_the_suggested_ctx_fits(micro, monkeypatch):
    """With 64 MiB 'available', the message names a context that then loads, and one 256 larger does not."""
    monkeypatch.setattr(numpy_backend, "available_host_memory", lambda: 64 << 20)
    r = run("generate", "-m", str(micro), "--backend", "numpy", "-p", "hi", "-n", "1", "--ctx", "10000000")
    assert r.code == 1
    fit = int(re.search(r"try --ctx (\d+)", r.one_line_error()).group(1))
    assert fit >= 256  # the KV cache and a whole-context prompt's scratch share the 64 MiB
    ok = run("generate", "-m", str(micro), "--backend", "numpy", "-p", "hi", "-n", "1", "-q", "--ctx", str(fit))
    assert ok.code == 0, ok.err
    too_big = run("generate", "-m", str(micro), "--backend", "numpy", "-p", "hi", "-n", "1", "--ctx", str(fit + 512))
    assert too_big.code == 1 and "host memory" in too_big.one_line_error()


def test_weights_that_cannot_fit_at_all(micro, monkeypatch):
    monkeypatch.setattr(numpy_backend, "available_host_memory", lambda: 1000)
    with pytest.raises(HostMemoryError, match="the weights alone do not fit"):
        numpy_backend.NumpyBackend().load(open_gguf(micro), _cfg(micro), 16)


def test_host_bytes_match_what_load_allocates(micro):
    cfg = _cfg(micro)
    be = numpy_backend.NumpyBackend()
    be.load(open_gguf(micro), cfg, 64)
    w = be.weights
    arrays = [w.output_norm, w.output] + [a for L in w.layers for a in vars(L).values() if a is not None]
    weights, kv = numpy_backend.host_bytes(cfg, 64)
    assert weights == sum(a.nbytes for a in arrays)
    assert kv == sum(a.nbytes for a in be.k_cache + be.v_cache)


def test_inspect_with_huge_ctx_only_computes(micro):
    r = run("inspect", str(micro), "--ctx", str(10**12), "--json")
    assert r.code == 0, r.err


def _cfg(path: Path):
    from llamacli.models.config import ModelConfig

    g = open_gguf(path)
    return ModelConfig.from_gguf(g.metadata, set(g.tensors))


# -- NaN and inf --------------------------------------------------------------------------------------------------


def _poison(src: Path, dst: Path, tensor: str, value: float) -> Path:
    """A copy of `src` with every value of one tensor set to `value` (NaN, inf) in its own type."""
    g = open_gguf(src)
    info = g.tensors[tensor]
    dtype = {"F32": np.float32, "F16": np.float16}[info.type.name]
    data = bytearray(src.read_bytes())
    data[info.offset : info.offset + info.n_bytes] = np.full(info.n_elements, value, dtype=dtype).tobytes()
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def broken(tmp_path_factory, micro) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nan")
    f16 = write_model(root / "micro-f16.gguf", MICRO, "F16")
    return {
        "NaN output weights (F32)": _poison(micro, root / "nan-output.gguf", "output.weight", math.nan),
        "NaN attention weights (F32)": _poison(micro, root / "nan-attn.gguf", "blk.0.attn_q.weight", math.nan),
        "inf embeddings (F16)": _poison(f16, root / "inf-embd.gguf", "token_embd.weight", math.inf),
        "inf FFN weights (F16)": _poison(f16, root / "inf-ffn.gguf", "blk.0.ffn_down.weight", math.inf),
    }


SAMPLING = {
    "greedy": ("--greedy",),
    "sampling": ("--temp", "0.8", "--seed", "1"),
    "greedy + penalties": ("--greedy", "--repeat-penalty", "1.3"),
}


@pytest.mark.parametrize("mode", list(SAMPLING))
def test_nan_logits_are_reported_not_sampled(broken, mode):
    for name, path in broken.items():
        r = run("generate", "-m", str(path), "--backend", "numpy", "-p", "hello", "-n", "4", "-q", *SAMPLING[mode])
        assert r.code == 1, f"{name}, {mode}: exit {r.code}, out {r.out!r}"
        line = r.one_line_error()
        assert "NaN" in line or "inf" in line, line
        assert r.out.strip() == "", f"{name}: text was generated from broken logits: {r.out!r}"


def test_nan_model_in_a_real_process(broken):
    """A real process shows what in-process runs hide: numpy's RuntimeWarnings would add lines to stderr."""
    r = run_subprocess("generate", "-m", str(broken["inf embeddings (F16)"]), "--backend", "numpy", "-p", "hello",
                       "-n", "4", "-q")
    assert r.code == 1
    assert "NaN" in r.one_line_error()


def test_nan_in_a_decode_step(micro, monkeypatch):
    """Logits that turn NaN only after the prefill: both decode paths (greedy in-step and sampled) stop."""
    real = numpy_backend.NumpyBackend.decode
    steps = {"n": 0}

    def decode(self, token, pos):
        steps["n"] += 1
        logits = real(self, token, pos)
        return np.full_like(logits, np.nan) if steps["n"] >= 3 else logits

    monkeypatch.setattr(numpy_backend.NumpyBackend, "decode", decode)
    for mode in SAMPLING:
        steps["n"] = 0
        r = run("generate", "-m", str(micro), "--backend", "numpy", "-p", "hello", "-n", "20", "-q", *SAMPLING[mode])
        assert r.code == 1, (mode, r.err)
        assert "NaN" in r.one_line_error()
        assert steps["n"] == 3  # it stopped at the first broken step


def test_engine_raises_numerical_error(broken):
    from llamacli.engine.generate import Model

    with Model(broken["NaN output weights (F32)"], backend="numpy", ctx=64) as m:
        with pytest.raises(NumericalError):
            m.complete("hello", max_tokens=4, temperature=0.0)
        with pytest.raises(NumericalError):
            m.complete("hello", max_tokens=4, temperature=1.0, seed=3)


@pytest.mark.parametrize("gpu", [True, False])
def test_out_of_memory_at_run_time_is_one_line(micro, monkeypatch, gpu):
    """An allocation that fails after the load-time check: CuPy's OutOfMemoryError (a MemoryError) names the
    GPU, a plain MemoryError the host; exit 1, one line, no 'internal error'."""
    from llamacli.cli import generate as cli_generate

    if gpu:
        cupy = pytest.importorskip("cupy")
        exc = cupy.cuda.memory.OutOfMemoryError(1 << 30, 1 << 29, 0)
    else:
        exc = MemoryError()

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(cli_generate, "read_prompt", fail)
    r = run("generate", "-m", str(micro), "--backend", "numpy", "-p", "hi")
    assert r.code == 1
    line = r.one_line_error()
    if gpu:
        assert line.startswith("error: out of GPU memory (Out of memory allocating 1,073,741,824 bytes") and "--ctx" in line
    else:
        assert line == "error: out of host memory"
