"""Memory (and time) in proportion to the input: a long prompt, a GGUF of large metadata arrays, a vocabulary
of many user-defined tokens. Each case runs in a child process, which measures its own peak resident memory
(the peak is reset just before the step measured, where Linux allows), and the assertions compare two input
sizes, or the step with the work the input needs anyway, rather than absolute numbers."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gguf_bytes as gb

ROOT = Path(__file__).resolve().parents[2]

_PEAK = """
import json, os, resource, sys, time
def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak RSS to the current one (Linux 4.0+)
    except OSError:
        pass
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""


def child(code: str, *args: str) -> dict:
    """Run `code` (after the helpers above) in a fresh interpreter; it prints one JSON object."""
    p = subprocess.run([sys.executable, "-c", _PEAK + textwrap.dedent(code), *args], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def cli_peak(*args: str) -> tuple[int, str]:
    """Peak RSS of the real command (`python -m llamacli ...`), as its parent process sees it: (bytes, stderr)."""
    code = """
    import subprocess
    p = subprocess.run([sys.executable, "-m", "llamacli", *sys.argv[1:]], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    print(json.dumps({"rc": p.returncode, "err": p.stderr,
                      "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
    """
    r = child(code, *args)
    assert r["rc"] == 0 and "Traceback" not in r["err"], r["err"]
    return r["peak"], r["err"]


def prose(n_chars: int, seed: int = 0) -> str:
    """Text of about n_chars: words, numbers, punctuation, some non-ASCII, line breaks."""
    rng = random.Random(seed)
    words = "the of and to in is it that was for on are with as by this be at from prompt token model 7 42 1999 " \
            "café naïve 日本語 Привет , . ; ! ? ( ) \n".split(" ")
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


# -- a long prompt ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt-2", "llama-spm"])  # byte-level BPE (tokenizers), SentencePiece
def test_long_text_tokenizes_in_memory_proportional_to_it(name: str, llama_cpp_models: Path) -> None:
    """Tokenizing whole, the engines took 40-200 bytes per character (a 57 MB prompt needed 10 GB); in pieces,
    and with one int object per distinct id, a text costs its ids' list (8 bytes each) and a bounded piece."""
    code = """
    from llamacli.ggufio.file import open_gguf
    from llamacli.tokenizer.tokenizer import Tokenizer
    sys.path[:0] = ["tests", "tests/tokenizer"]
    from test_memory_bounds import prose
    tok = Tokenizer.from_metadata(open_gguf(sys.argv[1]).metadata)
    tok.encode("warm up")
    out = {}
    for label, n in (("small", 200_000), ("large", 1_200_000)):
        text = prose(n)
        before = rss()
        reset_peak()
        ids = tok.encode(text)
        out[label] = {"chars": len(text), "bytes": len(text.encode()), "extra": peak() - before, "ids": len(ids)}
        del ids, text
    print(json.dumps(out))
    """
    r = child(code, str(llama_cpp_models / f"ggml-vocab-{name}.gguf"))
    small, large = r["small"], r["large"]
    grown = large["extra"] - small["extra"]
    assert grown < 16 * (large["bytes"] - small["bytes"]), r


def test_tokenize_command_on_a_long_file(tmp_path: Path, llama_cpp_models: Path) -> None:
    """The real command: a prompt file five times longer costs memory in proportion (the old whole-text
    encode alone took some 200 bytes per character here)."""
    vocab = str(llama_cpp_models / "ggml-vocab-gpt-2.gguf")
    peaks = []
    for n in (100_000, 1_100_000):
        path = tmp_path / f"prompt-{n}.txt"
        path.write_text(prose(n), encoding="utf-8")
        peaks.append(cli_peak("tokenize", "-m", vocab, "--file", str(path))[0])
    # What the command itself prints costs ~60 bytes a token (a str per id); 80 per input byte bounds all of it.
    assert peaks[1] - peaks[0] < 80 * 1_000_000, peaks


def test_a_stretch_that_cannot_be_cut_is_refused(llama_cpp_models: Path) -> None:
    from llamacli.errors import TokenizerError
    from llamacli.ggufio.file import open_gguf
    from llamacli.tokenizer import text_chunks as t
    from llamacli.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(open_gguf(llama_cpp_models / "ggml-vocab-gpt-2.gguf").metadata)
    old = t.MAX_STRETCH_CHARS, t.PIECE_CHARS
    try:
        t.MAX_STRETCH_CHARS, t.PIECE_CHARS = 1000, 100
        assert tok.decode(tok.encode("word " * 1000)) == "word " * 1000  # cut every ~100 characters
        with pytest.raises(TokenizerError, match="in one stretch"):
            tok.encode("," * 1001)
    finally:
        t.MAX_STRETCH_CHARS, t.PIECE_CHARS = old


# -- a GGUF file of large metadata arrays -------------------------------------------------------------------


def arrays_file(path: Path, items: int, n_arrays: int = 16) -> int:
    """A vocabulary-free file whose metadata is n_arrays arrays (int32, float32, strings) of `items` each."""
    rng = np.random.default_rng(0)
    kvs = [gb.kv("general.architecture", gb.STR, "llama"), gb.kv("general.name", gb.STR, "arrays")]
    for i in range(n_arrays):
        if i % 4 == 3:
            data = b"".join(struct.pack("<Q", 2) + b"%02d" % (j % 100) for j in range(items // 2))
            kvs.append(gb.string(f"x.s{i}") + struct.pack("<IIQ", gb.ARR, gb.STR, items // 2) + data)
        else:
            itype, dtype = (gb.I32, np.int32) if i % 2 else (gb.F32, np.float32)
            values = rng.integers(1 << 20, 1 << 30, items).astype(dtype)
            kvs.append(gb.string(f"x.a{i}") + struct.pack("<IIQ", gb.ARR, itype, items) + values.tobytes())
    data = gb.gguf(kvs)
    path.write_bytes(data)
    return len(data)


@pytest.mark.parametrize("flags", [(), ("--metadata", "--json")])
def test_inspect_of_large_metadata_arrays(tmp_path: Path, flags: tuple[str, ...]) -> None:
    """Arrays stay as compact as the file until read: `inspect` of 16 MB of arrays takes about the file's size
    (its pages while the header is read, plus the arrays' copy), not the 8-50 bytes per item of Python lists
    (1.4 GB for a 32 MB file); --metadata reads one array at a time, to show its first items."""
    small = arrays_file(tmp_path / "small.gguf", 1_000)
    large = arrays_file(tmp_path / "large.gguf", 250_000)
    peak_small, _ = cli_peak("inspect", str(tmp_path / "small.gguf"), *flags)
    peak_large, _ = cli_peak("inspect", str(tmp_path / "large.gguf"), *flags)
    assert peak_large - peak_small < 4 * (large - small), (peak_small, peak_large, large)


def test_large_arrays_read_as_before(tmp_path: Path) -> None:
    from llamacli.ggufio.file import open_gguf

    arrays_file(tmp_path / "m.gguf", 10)
    md = open_gguf(tmp_path / "m.gguf").metadata
    assert "x.a1" in md and "x.b" not in md and len(md) == 18
    a1, s3 = md["x.a1"], md["x.s3"]
    assert isinstance(a1, list) and len(a1) == 10 and all(type(v) is int for v in a1)
    assert isinstance(md["x.a0"], list) and all(type(v) is float for v in md["x.a0"])
    assert s3 == ["00", "01", "02", "03", "04"]
    assert md["x.a1"] is a1  # shared while held, as a dict's value was
    assert dict(md)["x.s3"] == s3 and md == dict(md)


# -- a vocabulary of many user-defined tokens ---------------------------------------------------------------


def test_many_user_defined_tokens(tmp_path: Path) -> None:
    """Special and user-defined tokens were found with one regex alternation of all of them: with millions,
    "hello world" took 110 s and 6.9 GB to compile it. Now the first encode costs less than building the
    tokenizer, in time and in memory, whatever the vocabulary's size."""
    code = """
    from llamacli.testing import tiny_vocab
    from llamacli.tokenizer.tokenizer import Tokenizer
    n = int(sys.argv[1])
    md = dict(tiny_vocab())
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + [f"<user {i}>" for i in range(n)]
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [4] * n
    before, start = rss(), time.perf_counter()
    reset_peak()
    tok = Tokenizer.from_metadata(md)
    build = {"s": time.perf_counter() - start, "extra": peak() - before}
    before, start = rss(), time.perf_counter()
    reset_peak()
    ids = tok.encode("hello world<user 12345>!")
    encode = {"s": time.perf_counter() - start, "extra": peak() - before}
    print(json.dumps({"build": build, "encode": encode, "ids": ids, "n_vocab": tok.vocab_size}))
    """
    r = child(code, "200000")
    assert r["ids"][-2] == r["n_vocab"] - 200_000 + 12345  # <user 12345>
    assert r["encode"]["s"] < 2 * r["build"]["s"], r  # was 30 times as long
    assert r["encode"]["extra"] < r["build"]["extra"], r
