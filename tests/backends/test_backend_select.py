"""Backend selection and the early CUDA start (llamacli/backends/__init__.py, llamacli/gpu_driver.py), without a
GPU: the thread's answer reaches select_backend, what it raises is raised there, and the driver's context is
made only where CuPy is installed, once, and let go where the CUDA backend is not taken; the CLI's entry
starts the driver only for the commands that load a model, and waits for it on every way out."""

from __future__ import annotations

import ctypes
import importlib.util
import sys

import pytest

from llamacli import backends, gpu_driver
from llamacli.errors import BackendError


class FakeCuda:
    """libcuda's four entry points, recording calls; cuInit returns `init`."""

    def __init__(self, init: int = 0):
        self.calls: list[str] = []
        self.init = init

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append(name)
            return self.init if name == "cuInit" else 0

        return call


@pytest.fixture
def fake_driver(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    monkeypatch.setattr(gpu_driver, "PROCESS", gpu_driver.DriverStart())  # as in a fresh process
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "cupy" else real(n, *a))
    return fake


def test_numpy_starts_nothing(fake_driver):
    assert backends.start_early("numpy") is None
    assert backends.start_early("cpu") is None
    assert backends.start_early("bogus") is None


def test_no_cupy_no_driver_call(monkeypatch, fake_driver):
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    ok, reason = backends.start_early("auto")()
    assert not ok and "CuPy is not installed" in reason
    assert fake_driver.calls == []
    with pytest.raises(BackendError, match="CuPy is not installed"):
        backends.select_backend("cuda", early=backends.start_early("cuda"))


def test_context_retained_once_and_released_when_cuda_is_not_taken(monkeypatch, fake_driver):
    monkeypatch.setattr(backends, "cuda_status", lambda context=False: (True, "GPU"))
    assert backends.start_early("auto")() == (True, "GPU")
    assert backends.start_early("cuda")() == (True, "GPU")
    assert fake_driver.calls.count("cuDevicePrimaryCtxRetain") == 1 and gpu_driver.PROCESS.retained is not None
    monkeypatch.setattr(backends, "cuda_status", lambda context=False: (False, "no GPU"))
    assert backends.start_early("auto")() == (False, "no GPU")
    assert fake_driver.calls.count("cuDevicePrimaryCtxRelease") == 1 and gpu_driver.PROCESS.retained is None
    fake_driver.init = 100  # cuInit fails (no device): nothing retained, nothing to release
    assert backends.start_early("auto")() == (False, "no GPU")
    assert fake_driver.calls.count("cuDevicePrimaryCtxRetain") == 1


def test_what_the_thread_raises_is_raised_by_its_status(monkeypatch, fake_driver):
    def boom(context=False):
        raise RuntimeError("boom")

    monkeypatch.setattr(backends, "cuda_status", boom)
    status = backends.start_early("auto")
    with pytest.raises(RuntimeError, match="boom"):
        status()


def test_a_model_that_fails_its_checks_leaves_no_start_thread(random_model):
    import threading

    from llamacli.engine.generate import Model
    from llamacli.errors import UsageError

    with pytest.raises(UsageError, match="context size"):
        Model(random_model("tiny-llama"), backend="auto", ctx=-1)
    assert not [t for t in threading.enumerate() if t.name == "llamacli-cuda-start"]


@pytest.mark.parametrize("argv, want", [
    (["generate", "-m", "m.gguf"], True), (["--debug", "chat"], True), (["run", "m"], True), (["serve"], True),
    (["bench", "-m", "m.gguf", "--kernels"], True),
    (["generate", "--backend", "numpy"], False), (["bench", "--backend=numpy"], False),
    (["generate", "--backend", "cpu"], False), (["run", "m", "--backend=cpu"], False),
    (["generate", "--help"], False), (["chat", "-h"], False), (["inspect", "m.gguf"], False),
    (["tokenize", "generate"], False), (["models"], False), (["--version"], False), ([], False),
    (["--version", "generate", "-m", "m.gguf"], False),
    # --keep-alive: the resident server loads the model, not the command (0: the command does, where none runs)
    (["generate", "-m", "m.gguf", "--keep-alive", "5m"], False), (["run", "m", "--keep-alive=-1"], False),
    (["run", "m", "--keep-alive", "0"], True), (["chat", "--keep-alive", "soon"], True),
    (["keep-alive-server", "--fd", "3", "--backend", "auto"], True),
    (["keep-alive-server", "--fd", "3", "--backend", "numpy"], False),
])
def test_the_cli_starts_the_driver_only_for_commands_that_load_a_model(argv, want, monkeypatch):
    monkeypatch.delenv("LLAMACLI_KEEP_ALIVE", raising=False)
    assert gpu_driver.wanted(argv) is want


def test_the_keep_alive_variable_hands_the_load_to_the_server(monkeypatch):
    monkeypatch.setenv("LLAMACLI_KEEP_ALIVE", "5m")
    assert not gpu_driver.wanted(["generate", "-m", "m.gguf"])
    assert gpu_driver.wanted(["generate", "-m", "m.gguf", "--keep-alive", "0"])  # the option wins
    monkeypatch.setenv("LLAMACLI_KEEP_ALIVE", "0")
    assert gpu_driver.wanted(["generate", "-m", "m.gguf"])


def test_the_driver_thread_runs_once_and_a_numpy_choice_releases_its_context(fake_driver):
    gpu_driver.start()
    gpu_driver.start()
    gpu_driver.wait()
    assert fake_driver.calls.count("cuInit") == 1 and gpu_driver.PROCESS.retained is not None
    assert backends.start_early("numpy") is None  # the NumPy backend after all: the context goes
    assert fake_driver.calls.count("cuDevicePrimaryCtxRelease") == 1 and gpu_driver.PROCESS.retained is None


class Left(Exception):
    """os._exit(status), raised instead of ending pytest."""


@pytest.fixture
def entry(monkeypatch):
    """llamacli.run with os._exit raising Left(status), and without marking its start time in this process
    (which --verbose's start-up line of the in-process CLI tests would count from)."""
    import os

    import llamacli
    from llamacli import startup

    def exit_now(status):
        raise Left(status)

    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr(startup, "mark_start", lambda t: None)
    return llamacli.run


def test_a_model_command_leaves_through_os_exit_without_waiting_for_the_driver(monkeypatch, fake_driver, entry):
    """A model command that fails at once (here: an unknown option) leaves through os._exit with its status
    while the driver's thread is still inside cuInit (os._exit stops it as a kill would); a command that
    loads no model starts no thread and exits the plain way."""
    import threading

    gate = threading.Event()
    real_init = fake_driver.__getattr__("cuInit")

    def slow_init(flags):
        gate.wait(10)
        return real_init(flags)

    fake_driver.cuInit = slow_init
    monkeypatch.setattr(sys, "argv", ["llamacli", "generate", "--no-such-option"])
    try:
        with pytest.raises(Left) as left:
            entry()
        assert left.value.args == (2,)
        assert gpu_driver.PROCESS.thread.is_alive()  # left without waiting
    finally:
        gate.set()
        gpu_driver.release()
    monkeypatch.setattr(gpu_driver, "PROCESS", gpu_driver.DriverStart())
    monkeypatch.setattr(sys, "argv", ["llamacli", "tokenize", "--no-such-option"])
    with pytest.raises(SystemExit) as exc:
        entry()
    assert exc.value.code == 2 and gpu_driver.PROCESS.thread is None


@pytest.mark.parametrize("code, status, err", [(None, 0, ""), (0, 0, ""), (3, 3, ""), (130, 130, ""),
                                               (300, 44, ""), ("bad things", 1, "bad things\n")])
def test_a_model_command_leaves_with_the_status_the_interpreter_would_give(monkeypatch, capsys, entry, code, status,
                                                                           err):
    """A model command's end (os._exit, past the interpreter) turns the CLI's SystemExit into the status and
    message the interpreter would: None is 0, a number is taken modulo 256, a message is printed and is 1."""
    from llamacli import cli

    def main():
        raise SystemExit(code)

    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setattr(sys, "argv", ["llamacli", "generate", "--backend", "numpy"])  # (no driver thread)
    with pytest.raises(Left) as left:
        entry()
    assert left.value.args == (status,)
    assert capsys.readouterr().err == err


def test_a_vocabulary_that_fails_to_build_beside_the_load_is_raised_and_frees_the_model(monkeypatch, random_model):
    """The tokenizer is built on a thread while the weights load: what it raises is raised by Model, after
    which the loaded backend and the file are closed at once."""
    from llamacli.engine.generate import Model
    from llamacli.errors import TokenizerError
    from llamacli.tokenizer.tokenizer import Tokenizer

    def broken(md):
        raise TokenizerError("broken vocabulary")

    closed = []
    monkeypatch.setattr(Tokenizer, "from_metadata", staticmethod(broken))
    monkeypatch.setattr(Model, "close", lambda self: closed.append(self.backend.name))
    with pytest.raises(TokenizerError, match="broken vocabulary"):
        Model(random_model("tiny-llama"), backend="numpy")
    assert closed == ["numpy"]


def test_the_entry_holds_closed_descriptors_before_the_driver_starts(monkeypatch, fake_driver, entry):
    """A closed 0-2 (`>&-`) is put on /dev/null before the driver's thread may open files, so that none of
    the driver's own descriptors takes its number (textio._hold)."""
    from llamacli import textio

    order = []
    monkeypatch.setattr(textio, "hold_closed_fds", lambda: order.append("hold"))
    monkeypatch.setattr(gpu_driver, "start", lambda: order.append("start"))
    monkeypatch.setattr(sys, "argv", ["llamacli", "generate", "--no-such-option"])
    with pytest.raises(Left):
        entry()
    assert order == ["hold", "start"]


def test_a_machine_without_an_nvidia_driver_is_told_so(monkeypatch):
    """With CuPy installed and no NVIDIA driver, CUDA reports an "insufficient driver"; the notice says what is
    true: no NVIDIA GPU here. With a driver that fails, the reason and the nvidia-smi hint stay."""
    cupy = pytest.importorskip("cupy")
    from llamacli.backends.cuda import device

    def no_devices():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_devices)
    monkeypatch.setattr(device, "nvidia_driver_present", lambda: False)
    ok, why = device.cuda_available()
    assert not ok and why == "no NVIDIA GPU found (this machine has no NVIDIA driver)"
    monkeypatch.setattr(device, "nvidia_driver_present", lambda: True)
    ok, why = device.cuda_available()
    assert not ok and "insufficient" in why and "nvidia-smi" in why


def test_auto_takes_the_cpu_backend_with_a_notice_for_a_model_the_cuda_kernels_do_not_run(random_model):
    """A GPU that works (faked) and a model whose experts the CUDA kernels do not serve (more chosen per token than
    MOE_KMAX): `auto` takes the CPU backend and says why."""
    import dataclasses

    from llamacli.ggufio.file import open_gguf
    from llamacli.models.config import ModelConfig

    g = open_gguf(random_model("tiny-gemma4-moe"))
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    g.close()
    cfg = dataclasses.replace(cfg, n_expert=64, n_expert_used=33)
    said: list[str] = []
    be = backends.select_backend("auto", said.append, early=lambda: (True, "a GPU"), cfg=cfg)
    assert be.name == "cpu"
    assert len(said) == 1 and said[0].startswith("using the CPU backend (") and "experts" in said[0]


class FakeCudaBackend:
    """What select_backend reads of the CUDA backend it makes (no GPU here)."""

    name, split_modes, any_gpu = "cuda", ("none",), False


@pytest.mark.parametrize("shape", ["tiny-qwen35", "tiny-qwen35moe", "tiny-qwen3next", "tiny-gemma4", "tiny-gemma4-moe"])
def test_auto_takes_cuda_for_the_hybrid_models(random_model, shape, monkeypatch):
    """A GPU that works (faked): the hybrid Qwen models (Gated DeltaNet layers, gated attention, shared experts) and
    Gemma 4 (layers of their own shapes, shared KV, per-layer embeddings, experts beside a dense FFN) run op by op on
    CUDA, so `auto` takes it, without a notice (it took the CPU backend before they had kernels)."""
    import llamacli.backends.cuda as cuda
    from llamacli.ggufio.file import open_gguf
    from llamacli.models.config import ModelConfig

    monkeypatch.setattr(cuda, "CudaBackend", FakeCudaBackend)
    g = open_gguf(random_model(shape))
    cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))
    g.close()
    said: list[str] = []
    be = backends.select_backend("auto", said.append, early=lambda: (True, "a GPU"), cfg=cfg)
    assert isinstance(be, FakeCudaBackend) and said == []
