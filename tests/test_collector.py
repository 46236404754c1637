"""llamacli.collector: the garbage collector paused while start-up builds objects that stay, and left as it was
found; where start-up uses it (the CLI's imports, a tokenizer's tables)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llamacli.collector import paused
from llamacli.errors import TokenizerError
from llamacli.testing import tiny_vocab
from llamacli.tokenizer import bpe
from llamacli.tokenizer.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def collector_on():
    assert gc.isenabled()
    yield
    gc.enable()  # whatever a failing test left


def test_paused_and_restored_also_after_an_exception():
    with paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), paused():
        raise KeyError("x")
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    with paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_pauses_in_two_threads_end_with_the_collector_on():
    """Thread A pauses, B pauses, A ends (the collector stays off: B is still building), B ends (on again); and
    the other order of ends."""
    for a_ends_first in (True, False):
        a_in, b_in, a_go, b_go, b_done = (threading.Event() for _ in range(5))
        seen: list[bool] = []

        def a():
            with paused():
                a_in.set()
                a_go.wait(10)
            seen.append(gc.isenabled())  # right after A's end

        def b():
            a_in.wait(10)
            with paused():
                b_in.set()
                b_go.wait(10)
            b_done.set()

        ta, tb = threading.Thread(target=a), threading.Thread(target=b)
        ta.start(), tb.start()
        assert b_in.wait(10)
        (a_go if a_ends_first else b_go).set()
        (ta if a_ends_first else tb).join(10)
        if a_ends_first:
            assert seen == [False]  # B still builds: no collection yet
        else:
            assert not gc.isenabled()  # A still builds
        (b_go if a_ends_first else a_go).set()
        ta.join(10), tb.join(10)
        assert gc.isenabled()


def test_a_tokenizer_is_built_with_the_collector_paused(monkeypatch):
    """While the BPE tables are built; on after a good vocabulary and after a broken one."""
    states: list[bool] = []
    build = bpe.build_bpe

    def watched(*args, **kw):
        states.append(gc.isenabled())
        return build(*args, **kw)

    monkeypatch.setattr("llamacli.tokenizer.tokenizer.build_bpe", watched)
    Tokenizer.from_metadata(tiny_vocab())
    assert states == [False] and gc.isenabled()
    with pytest.raises(TokenizerError):
        Tokenizer.from_metadata({**tiny_vocab(), "tokenizer.ggml.merges": ["nospace"]})
    assert gc.isenabled()


def test_the_cli_leaves_the_collector_on_and_its_modules_frozen():
    """After the entry's imports (paused), the collector runs again, and the modules loaded meanwhile are in
    the permanent generation (gc.freeze): later collections do not walk them."""
    code = (
        "import gc, sys\n"
        "sys.argv = ['llamacli', '--version']\n"
        "import llamacli\n"
        "try:\n"
        "    llamacli.run()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(gc.isenabled(), gc.get_freeze_count() > 10000)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "True True"
