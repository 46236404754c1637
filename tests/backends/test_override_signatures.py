"""Every backend's operations accept what the base Backend's signature promises: models/block.run calls them by
the base's parameters, so an override that lags behind (a parameter the base gained) fails only when that
backend runs the operation, which on CUDA is a GPU machine. Checked here without one."""

from __future__ import annotations

import inspect

import pytest

from llamacli.backends.base import Backend
from llamacli.backends.cuda.backend import CudaBackend
from llamacli.backends.numpy_backend import NumpyBackend


def _public_methods(cls: type) -> list[str]:
    return [n for n, f in vars(cls).items() if callable(f) and not n.startswith("_")]


@pytest.mark.parametrize("cls", [NumpyBackend, CudaBackend], ids=lambda c: c.__name__)
def test_overrides_take_the_base_parameters(cls):
    checked = 0
    for name in _public_methods(Backend):
        base, mine = getattr(Backend, name), getattr(cls, name)
        if mine is base or not inspect.isfunction(base) or not inspect.isfunction(mine):
            continue
        have = inspect.signature(mine).parameters
        varargs = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in have.values())
        for p in inspect.signature(base).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            assert p.name in have or varargs, f"{cls.__name__}.{name} lacks the base's parameter {p.name!r}"
            if p.default is not p.empty and p.name in have:
                assert have[p.name].default is not p.empty, \
                    f"{cls.__name__}.{name}: {p.name!r} is optional in the base, required here"
        checked += 1
    assert checked >= 10  # the operations block.run calls are among them
