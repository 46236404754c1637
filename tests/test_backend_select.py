"""Backend selection and the early CUDA start (llamacli/backends/__init__.py), without a GPU: the thread's
answer reaches select_backend, what it raises is raised there, and the driver's context is made only where
CuPy is installed, once, and let go where the CUDA backend is not taken."""

from __future__ import annotations

import ctypes
import importlib.util
import sys

import pytest

from llamacli import backends
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
    monkeypatch.setitem(backends._driver, "retained", None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "cupy" else real(n, *a))
    return fake


def test_numpy_starts_nothing():
    assert backends.start_early("numpy") is None
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
    assert fake_driver.calls.count("cuDevicePrimaryCtxRetain") == 1 and backends._driver["retained"] is not None
    monkeypatch.setattr(backends, "cuda_status", lambda context=False: (False, "no GPU"))
    assert backends.start_early("auto")() == (False, "no GPU")
    assert fake_driver.calls.count("cuDevicePrimaryCtxRelease") == 1 and backends._driver["retained"] is None
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

    from llamacli.errors import UsageError
    from llamacli.generate import Model

    with pytest.raises(UsageError, match="context size"):
        Model(random_model("tiny-llama"), backend="auto", ctx=-1)
    assert not [t for t in threading.enumerate() if t.name == "llamacli-cuda-start"]
