"""Broken and hostile GGUF files through the CLI: `inspect`, `tokenize` (with and without --chat) and
`generate --backend numpy` each exit 2 with one stderr line `error: ...` (no traceback), and write nothing:
the working directory, TMPDIR, HOME and the model's directory stay as they were.

The corpus: one file per class of damage (structure, metadata, tensors, tokenizer, template), each naming
the commands that must refuse it (a broken vocabulary does not stop `inspect`; a broken template stops only
what renders it). Then a seeded batch of random mutants (gguf_mutate) through every command: any exit but
0, 2 (bad file) or 1 for NumericalError (NaN born of flipped data bits) is a failure.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import tempfile
from pathlib import Path

import pytest

import gguf_bytes as gb
import gguf_mutate as gm
from clirun import Result, run, run_subprocess
from fuzz_runner import Summary

INSPECT, TOKENIZE, CHAT, GENERATE = "inspect", "tokenize", "tokenize --chat", "generate"
ALL = frozenset({INSPECT, TOKENIZE, CHAT, GENERATE})
MODEL = frozenset({INSPECT, GENERATE})  # config and tensors: tokenize needs only the vocabulary
VOCAB = frozenset({TOKENIZE, CHAT, GENERATE})
TEMPLATE = frozenset({CHAT, GENERATE})


def _argv(command: str, path: Path) -> list[str]:
    return {
        INSPECT: ["inspect", str(path)],
        TOKENIZE: ["tokenize", "-m", str(path), "--text", "Hello the world"],
        CHAT: ["tokenize", "-m", str(path), "--text", "Hello", "--chat"],
        GENERATE: ["generate", "-m", str(path), "--backend", "numpy", "-p", "Hello", "-n", "2", "-q"],
    }[command]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, gm.Sample]:
    files = gm.write_seed_models(tmp_path_factory.mktemp("cli-seeds"))
    return {name: gm.sample_of(path) for name, path in files.items()}


def _edit(sample: gm.Sample, fn) -> gm.Sample:
    lay = gm.parse(sample)
    out = fn(lay)
    return out if isinstance(out, gm.Sample) else lay.build()


def _tensor(lay: gm.Layout, name: str) -> gm.Tensor:
    return next(t for t in lay.tensors if t.name == name.encode())


def _drop(lay: gm.Layout, key: str) -> None:
    lay.kvs = [k for k in lay.kvs if k.key != key.encode()]


def _poke(sample: gm.Sample, kind: str, index: int, data: bytes) -> gm.Sample:
    """Overwrite the start of the index-th field of a kind."""
    f = [f for f in gm.parse(sample).fields if f.kind == kind][index]
    buf = bytearray(sample.prefix)
    buf[f.start : f.start + len(data)] = data
    return gm.Sample(bytes(buf), sample.size)


def corpus(seeds: dict[str, gm.Sample]) -> dict[str, tuple[gm.Sample, frozenset[str]]]:
    """name -> (file, the commands that must refuse it)."""
    bpe = seeds["llama-bpe-f32"]
    spm = seeds["llama3-spm-q4_0"]
    whole = lambda b: gm.Sample(b, len(b))  # noqa: E731
    out: dict[str, tuple[gm.Sample, frozenset[str]]] = {
        # -- structure
        "empty file": (whole(b""), ALL),
        "not a GGUF file": (whole(b"#!/bin/sh\nrm -rf /\n" * 10), ALL),
        "a GGML file": (whole(b"lmgg" + bytes(60)), ALL),
        "truncated header": (gm.Sample(bpe.prefix[:100], 100), ALL),
        "truncated tensor data": (gm.Sample(bpe.prefix[:-100], bpe.size - 100), ALL),
        "version 99": (whole(b"GGUF" + struct.pack("<I", 99) + bpe.prefix[8:]), ALL),
        "big-endian": (whole(b"GGUF" + struct.pack(">I", 3) + bpe.prefix[8:]), ALL),
        "2^64-1 metadata keys": (whole(bpe.prefix[:16] + struct.pack("<Q", 2**64 - 1) + bpe.prefix[24:]), ALL),
        "2^40 tensors": (whole(bpe.prefix[:8] + struct.pack("<Q", 2**40) + bpe.prefix[16:]), ALL),
        "key length 2^63": (_poke(bpe, "strlen", 0, struct.pack("<Q", 2**63)), ALL),
        "array count 2^62": (_poke(bpe, "arrlen", 0, struct.pack("<Q", 2**62)), ALL),
        "unknown value type": (_poke(bpe, "vtype", 3, struct.pack("<I", 77)), ALL),
        "nested array": (_poke(bpe, "itype", 0, struct.pack("<I", gb.ARR)), ALL),
        "invalid UTF-8 key": (_poke(bpe, "str", 2, b"\xff\xfe"), ALL),
        "invalid UTF-8 token": (_poke(bpe, "str", 40, b"\xed\xa0\x80"[: 1]), ALL),
        "duplicate key": (_edit(bpe, lambda l: l.kvs.insert(3, l.kvs[1])), ALL),
        "duplicate tensor name": (_edit(bpe, lambda l: setattr(l.tensors[2], "name", l.tensors[1].name)), ALL),
        "overlapping tensors": (_edit(bpe, lambda l: setattr(l.tensors[2], "offset", l.tensors[1].offset)), ALL),
        "misaligned tensor": (_edit(bpe, lambda l: setattr(l.tensors[2], "offset", l.tensors[2].offset + 4)), ALL),
        "tensor past the end": (_edit(bpe, lambda l: setattr(l.tensors[-1], "offset", 2**63)), ALL),
        "negative dimension": (_edit(bpe, lambda l: _tensor(l, "token_embd.weight").dims.__setitem__(1, 2**64 - 32)), ALL),
        "dimensions overflow": (_edit(bpe, lambda l: setattr(_tensor(l, "output.weight"), "dims", [2**32, 2**32])), ALL),
        "5 dimensions": (_edit(bpe, lambda l: setattr(l.tensors[0], "dims", [1, 1, 1, 1, 1])), ALL),
        "unknown ggml type": (_edit(bpe, lambda l: setattr(l.tensors[0], "ggml_type", 99)), ALL),
        "alignment 3": (_edit(bpe, lambda l: l.set("general.alignment", gb.U32, 3)), ALL),
        # -- model metadata and tensors
        "rms epsilon NaN": (_edit(bpe, lambda l: l.set("llama.attention.layer_norm_rms_epsilon", gb.F32, math.nan)), MODEL),
        "RoPE base inf": (_edit(bpe, lambda l: l.set("llama.rope.freq_base", gb.F32, math.inf)), MODEL),
        "block_count 2^32-1": (_edit(bpe, lambda l: l.set("llama.block_count", gb.U32, 2**32 - 1)), MODEL),
        "context_length 0": (_edit(bpe, lambda l: l.set("llama.context_length", gb.U32, 0)), MODEL),
        "context_length 2^63": (_edit(bpe, lambda l: l.set("llama.context_length", gb.U64, 2**63)), MODEL),
        "head_count 0": (_edit(bpe, lambda l: l.set("llama.attention.head_count", gb.U32, 0)), MODEL),
        "block_count a string": (_edit(bpe, lambda l: l.set("llama.block_count", gb.STR, "2")), MODEL),
        "unknown architecture": (_edit(bpe, lambda l: l.set("general.architecture", gb.STR, "gptj")), MODEL),
        "missing embedding_length": (_edit(bpe, lambda l: _drop(l, "llama.embedding_length")), MODEL),
        "missing tensor": (_edit(bpe, lambda l: l.tensors.remove(_tensor(l, "blk.0.ffn_down.weight"))), MODEL),
        "transposed tensor": (_edit(bpe, lambda l: _tensor(l, "blk.0.ffn_down.weight").dims.reverse()), MODEL),
        "vocab_size larger than the embedding": (_edit(bpe, lambda l: l.set("llama.vocab_size", gb.U32, 100000)), MODEL),
        # -- vocabulary
        "unknown tokenizer model": (_edit(bpe, lambda l: l.set("tokenizer.ggml.model", gb.STR, "bert")), VOCAB),
        "unknown pre-tokenizer": (_edit(bpe, lambda l: l.set("tokenizer.ggml.pre", gb.STR, "no-such-pre")), VOCAB),
        "token_type shorter than tokens": (_edit(bpe, lambda l: l.set("tokenizer.ggml.token_type", gb.ARR, (gb.I32, [1] * 5))), VOCAB),
        "token_type NaN": (_edit(spm, lambda l: l.set("tokenizer.ggml.token_type", gb.ARR, (gb.F32, [math.nan] * 300))), VOCAB),
        "scores of text": (_edit(spm, lambda l: l.set("tokenizer.ggml.scores", gb.ARR, (gb.STR, ["x"] * 300))), VOCAB),
        "malformed merge": (_edit(bpe, lambda l: l.set("tokenizer.ggml.merges", gb.ARR, (gb.STR, ["nospace"]))), VOCAB),
        "duplicate token": (_edit(bpe, lambda l: l.set("tokenizer.ggml.tokens", gb.ARR, (gb.STR, ["a"] * 300))), VOCAB),
        "merge of a 2-token vocabulary": (_edit(bpe, lambda l: (l.set("tokenizer.ggml.tokens", gb.ARR, (gb.STR, ["a", "b"])),
                                                                l.set("tokenizer.ggml.merges", gb.ARR, (gb.STR, ["a b"])))),
                                          frozenset()),  # tokenizers used to panic in Rust here: now any clean outcome
        "tokens of numbers": (_edit(bpe, lambda l: l.set("tokenizer.ggml.tokens", gb.ARR, (gb.U32, list(range(300))))), VOCAB),
        # -- chat template
        "template syntax error": (_edit(bpe, lambda l: l.set("tokenizer.chat_template", gb.STR, "{% for %}")), TEMPLATE),
        "template escapes the sandbox": (_edit(bpe, lambda l: l.set(
            "tokenizer.chat_template", gb.STR, "{{ ''.__class__.__mro__[1].__subclasses__() }}")), TEMPLATE),
        "template raises": (_edit(bpe, lambda l: l.set(
            "tokenizer.chat_template", gb.STR, "{{ raise_exception('no system role') }}")), TEMPLATE),
        "template renders gigabytes": (_edit(bpe, lambda l: l.set(
            "tokenizer.chat_template", gb.STR, "{{ 'x' * 1000000000 }}")), TEMPLATE),
    }
    return out


@pytest.fixture
def sealed(tmp_path, monkeypatch):
    """A clean cwd, TMPDIR, HOME and cache dir for an in-process CLI run; yields a function that asserts all of
    them (and the model's directory) are unchanged."""
    dirs = {name: tmp_path / name for name in ("cwd", "tmp", "home", "cache")}
    for d in dirs.values():
        d.mkdir()
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.chdir(dirs["cwd"])
    monkeypatch.setenv("TMPDIR", str(dirs["tmp"]))
    monkeypatch.setenv("HOME", str(dirs["home"]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(dirs["cache"]))
    monkeypatch.setattr(tempfile, "tempdir", str(dirs["tmp"]))

    def snapshot() -> dict[str, list[str]]:
        return {name: sorted(str(p.relative_to(d)) for p in d.rglob("*")) for name, d in {**dirs, "models": models}.items()}

    class Sealed:
        root = models

        def write(self, name: str, sample: gm.Sample) -> Path:
            path = models / (name.replace(" ", "_").replace("/", "_") + ".gguf")
            with open(path, "wb") as f:
                f.write(sample.prefix)
                f.truncate(sample.size)
            return path

        def snapshot(self) -> dict[str, list[str]]:
            return snapshot()

    return Sealed()


def _expect_refusal(r: Result, what: str) -> str:
    assert r.code == 2, f"{what}: exit {r.code}\n{r.err}"
    line = r.one_line_error()
    assert "internal error" not in line, f"{what}: {line}"
    return line


def test_corpus_through_every_command(seeds, sealed, request):
    files = corpus(seeds)
    paths = {name: sealed.write(name, sample) for name, (sample, _) in files.items()}
    before = sealed.snapshot()
    refused = 0
    for name, (_, must_fail) in files.items():
        for command in sorted(ALL):
            r = run(*_argv(command, paths[name]))
            what = f"{name!r} via {command}"
            if command in must_fail:
                _expect_refusal(r, what)
                refused += 1
            else:  # the damage is elsewhere: this command works, or refuses cleanly all the same
                assert r.code in (0, 2), f"{what}: exit {r.code}\n{r.err}"
                if r.code:
                    _expect_refusal(r, what)
            assert "Traceback" not in r.err + r.out, what
    assert sealed.snapshot() == before, "a command wrote a file"
    assert refused >= 2 * len(files)
    Summary.of(request.config).lines.append(
        f"CLI, curated broken files: {len(files)} files x {len(ALL)} commands = {len(files) * len(ALL)} runs; "
        f"{refused} refused as required (exit 2, one line), the rest ran or refused cleanly; nothing written")


def test_error_lines_name_the_problem(seeds, sealed):
    """Spot checks that the one line says what is wrong (not just that something is)."""
    files = corpus(seeds)
    expect = {
        "truncated header": "truncated", "version 99": "version 99", "duplicate key": "duplicate",
        "overlapping tensors": "overlap", "misaligned tensor": "aligned", "negative dimension": "dimensions",
        "rms epsilon NaN": "epsilon", "unknown architecture": "gptj", "missing tensor": "missing tensor",
        "malformed merge": "merge", "template escapes the sandbox": "template", "template renders gigabytes": "template",
        "invalid UTF-8 key": "UTF-8", "alignment 3": "alignment",
    }
    for name, word in expect.items():
        sample, must_fail = files[name]
        command = INSPECT if INSPECT in must_fail else (CHAT if CHAT in must_fail else TOKENIZE)
        line = _expect_refusal(run(*_argv(command, sealed.write(name, sample))), name)
        assert word.lower() in line.lower(), (name, line)


def test_inspect_shows_hostile_strings_literally(seeds, sealed):
    """Metadata is data: rich markup in a name or a token ('[/INST]') is printed as is, not interpreted (it
    used to end in 'internal error: MarkupError'), and NaN/inf values still give valid JSON."""
    def edit(l: gm.Layout) -> None:
        l.set("general.name", gb.STR, "[/INST] [bold red]pwn[/] [link=file:///etc/passwd]x")
        l.set("tokenizer.ggml.bos_token_id", gb.F32, math.nan)
        l.set("general.weird", gb.ARR, (gb.F32, [math.inf, -math.inf, math.nan]))
        l.set("tokenizer.ggml.tokens", gb.ARR, (gb.STR, ["[/INST]", "[bold]"] + [f"t{i}" for i in range(271)]))

    path = sealed.write("markup", _edit(seeds["llama-bpe-f32"], edit))
    r = run("inspect", str(path), "--metadata", "--tensors")
    assert r.code == 0, r.err
    assert "[/INST] [bold red]pwn[/] [link=file:///etc/passwd]x" in r.out
    r = run("inspect", str(path), "--metadata", "--json")
    assert r.code == 0, r.err

    def no_constants(name: str):
        raise AssertionError(f"{name} is not JSON")

    info = json.loads(r.out, parse_constant=no_constants)
    assert info["name"].startswith("[/INST]")


def test_odd_paths(tmp_path):
    """A directory, a FIFO (opening it would block), device files, a missing file: refused at once."""
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    for path in (tmp_path, fifo, Path("/dev/zero"), Path("/dev/null"), tmp_path / "missing.gguf", Path("/proc/self/environ")):
        for command in sorted(ALL):
            _expect_refusal(run(*_argv(command, path)), f"{path} via {command}")


def test_real_processes(seeds, tmp_path):
    """The same contract from a real process (the console entry point, no in-process shortcuts): exit 2, one
    line, no traceback, nothing written to the private TMPDIR/HOME/cwd."""
    files = corpus(seeds)
    env_dirs = {k: tmp_path / k for k in ("tmp", "home", "cwd")}
    for d in env_dirs.values():
        d.mkdir()
    env = {"TMPDIR": str(env_dirs["tmp"]), "HOME": str(env_dirs["home"]), "XDG_CACHE_HOME": str(env_dirs["home"])}
    for name, command in [("array count 2^62", GENERATE), ("token_type NaN", TOKENIZE),
                          ("template escapes the sandbox", GENERATE), ("not a GGUF file", INSPECT)]:
        sample, _ = files[name]
        path = tmp_path / "m.gguf"
        path.write_bytes(sample.prefix)
        r = run_subprocess(*_argv(command, path), env=env)
        _expect_refusal(r, f"{name} via {command}")
    assert all(not any(d.iterdir()) for d in env_dirs.values())


def test_random_mutants_through_every_command(seeds, sealed, request):
    """Seeded mutants of every class, through every command: exit 0, or 2 with one line; or, for generate only,
    exit 1 with NumericalError's line when flipped data bits made the logits NaN."""
    rng = random.Random(8)
    names = sorted(seeds)
    kinds = list(gm.MUTATORS)
    layouts = {n: gm.parse(s) for n, s in seeds.items()}
    before = None
    outcomes: dict[int, int] = {}
    for i in range(2 * len(kinds)):
        base = names[i % len(names)]
        sample = gm.MUTATORS[kinds[i % len(kinds)]](rng, seeds[base], layouts[base])
        path = sealed.write(f"mutant-{i}", sample)
        if before is None:
            before = sealed.snapshot()
            before["models"] = sorted(set(before["models"]) | {path.name})
        for command in sorted(ALL):
            r = run(*_argv(command, path))
            outcomes[r.code] = outcomes.get(r.code, 0) + 1
            what = f"mutant {i} ({kinds[i % len(kinds)]} of {base}) via {command}"
            assert "Traceback" not in r.err, what
            if r.code == 1 and command == GENERATE:
                assert "NaN" in r.one_line_error() or "inf" in r.one_line_error(), what
            elif r.code:
                _expect_refusal(r, what)
        path.unlink()
    assert sealed.snapshot()["cwd"] == [] and sealed.snapshot()["tmp"] == []
    assert outcomes.get(2, 0) > 0
    Summary.of(request.config).lines.append(
        f"CLI, random mutants (seed 8): {2 * len(kinds)} files x {len(ALL)} commands, exit codes {dict(sorted(outcomes.items()))}")
