"""Fuzzing the GGUF reader: every input loads or raises a LlamacliError, within a time and a memory bound.

"Loads" means every stage a file goes through before generation: open_gguf, Tokenizer.from_metadata (+ an
encode/decode round), the chat template (compile + render), ModelConfig, check_tensors, and for the tiny
synthetic models the NumPy backend's load + one prefill and one decode step (so NaN born of a flipped bit must
end as NumericalError, not as garbage).

- The mutation fuzzer: seeded mutants (gguf_mutate.MUTATORS: bit flips, truncation, huge counts, wrong types,
  duplicates, overlapping or misaligned offsets, bad dimensions, NaN/inf, invalid UTF-8, hostile values,
  inconsistent vocabularies...) of tiny synthetic models and of real files (SmolLM2's header with its data as a
  hole, llama.cpp's vocabulary files), plus the truncation of every synthetic file at every field boundary.
  Cases run in worker processes under RLIMIT_AS (base + MEM_MB) and a per-case alarm (fuzz_worker.py).
  The CI batch is fixed (SEED); `--fuzz-long` runs ~20x more cases with a fresh seed. LLAMACLI_FUZZ_SEED and
  LLAMACLI_FUZZ_CASES override both; the seed, the case counts and a table of outcomes by class are printed in
  the terminal summary. A failing case is written out with the seed and index that rebuild it.
- hypothesis: GGUF files built from strategies (random keys, value types, counts, dims, offsets) and random
  tokenizer metadata, run in-process under a tracemalloc peak bound.
"""

from __future__ import annotations

import collections
import os
import random
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import gguf_bytes as gb
import gguf_mutate as gm
import llamacli.backends.numpy_backend  # noqa: F401,E402  (imported before tracemalloc starts)
import llamacli.chat.template  # noqa: F401,E402
import llamacli.tokenizer.tokenizer  # noqa: F401,E402
from fuzz_runner import Case, Outcome, Summary, run_cases
from fuzz_worker import load_everything

CI_SEED = 20261122
CI_CASES = 10000  # random mutants of the synthetic models (the boundary truncations come on top)
CI_REAL_CASES = 400  # mutants of real files (each costs up to ~0.3 s: their vocabularies are real)
LONG_FACTOR = 20
MEM_MB = 1024  # address space a case may take beyond the worker's baseline
TIME_S = 10.0  # per case (the slowest legitimate case, a real vocabulary, takes ~0.3 s)


@pytest.fixture(scope="session")
def summary(request) -> Summary:
    return Summary.of(request.config)


@pytest.fixture(scope="session")
def long_run(request) -> bool:
    return bool(request.config.getoption("--fuzz-long"))


@pytest.fixture(scope="session")
def seed(long_run) -> int:
    if "LLAMACLI_FUZZ_SEED" in os.environ:
        return int(os.environ["LLAMACLI_FUZZ_SEED"])
    return int.from_bytes(os.urandom(4), "little") if long_run else CI_SEED


@pytest.fixture(scope="session")
def seed_files(tmp_path_factory) -> dict[str, Path]:
    return gm.write_seed_models(tmp_path_factory.mktemp("fuzz-seeds"))


def _table(title: str, rows: list[tuple[str, str, Outcome]]) -> list[str]:
    """One line per class of input: cases, how many loaded, which errors refused the rest, bugs."""
    by_kind: dict[str, list[Outcome]] = collections.defaultdict(list)
    for kind, _, outcome in rows:
        by_kind[kind].append(outcome)
    width = max(len(k) for k in by_kind) + 2
    lines = [title, f"{'class of input':<{width}}{'cases':>7}{'loads':>7}{'refused':>9}{'bugs':>6}{'max ms':>8}  errors raised"]
    for kind, outs in by_kind.items():
        summaries = collections.Counter(o.summary for o in outs)
        bugs = sum(1 for o in outs if o.bug)
        loads = summaries.pop("loads", 0)
        errors = ", ".join(f"{name} {n}" for name, n in summaries.most_common(4) if not name.startswith("BUG"))
        more = len([s for s in summaries if not s.startswith("BUG")]) - 4
        errors += f", +{more} more" if more > 0 else ""
        lines.append(f"{kind:<{width}}{len(outs):>7}{loads:>7}{len(outs) - loads - bugs:>9}{bugs:>6}"
                     f"{max(o.ms for o in outs):>8.0f}  {errors}")
    return lines


def _check(rows: list[tuple[str, str, Outcome]], rebuild, seed: int, out_dir: Path) -> None:
    bugs = [(i, kind, base, o) for i, (kind, base, o) in enumerate(rows) if o.bug]
    if not bugs:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    report = []
    for i, kind, base, o in bugs[:20]:
        sample = rebuild(i).sample
        path = out_dir / f"case-{seed}-{i}.gguf"
        with open(path, "wb") as f:
            f.write(sample.prefix)
            f.truncate(sample.size)
        report.append(f"case {i} ({kind}, from {base}) -> {o.bug}\n  saved as {path}\n{o.traceback}")
    pytest.fail(f"{len(bugs)} of {len(rows)} fuzz cases (seed {seed}) ended outside LlamacliError:\n" + "\n".join(report))


def _case_maker(bases: dict, cut_kind: str, rng_key: str, limit: int | None, run_forward: bool):
    """-> (make(i) -> Case, the truncation cuts): cases 0 .. len(cuts)-1 cut a base at a field boundary,
    later ones are random mutants, kinds and bases in turn, each rebuilt from (rng_key, i) alone."""
    layouts = {name: gm.parse(s) for name, s in bases.items()}
    cuts = [(name, c.size) for name, s in bases.items() for c in gm.boundary_truncations(s, layouts[name], limit=limit)]
    kinds, names = list(gm.MUTATORS), list(bases)

    def make(i: int) -> Case:
        if i < len(cuts):
            name, cut = cuts[i]
            return Case(cut_kind, name, gm.Sample(bases[name].prefix[:cut], cut))
        j = i - len(cuts)
        kind, name = kinds[j % len(kinds)], names[(j // len(kinds)) % len(names)]
        mutant = gm.MUTATORS[kind](random.Random(f"{rng_key}{i}"), bases[name], layouts[name])
        return Case(kind, name, mutant, run_forward=run_forward)

    return make, cuts


def test_mutation_fuzz(seed_files, seed, long_run, summary, tmp_path):
    """The seeded batch: boundary truncations + random mutants of the synthetic models, then of real files."""
    n_random = int(os.environ.get("LLAMACLI_FUZZ_CASES", CI_CASES * (LONG_FACTOR if long_run else 1)))
    bases = {name: gm.sample_of(path) for name, path in seed_files.items()}
    make, cuts = _case_maker(bases, "truncation at every field boundary", f"{seed}/", None, run_forward=True)
    n = len(cuts) + n_random
    t0 = time.perf_counter()
    rows, info = run_cases(n, make, tmp_path / "work", workers=2, mem_mb=MEM_MB, time_s=TIME_S)
    elapsed = time.perf_counter() - t0
    summary.lines += [
        f"seed {seed}: {n} cases of synthetic models ({len(cuts)} boundary truncations + {n_random} random mutants) "
        f"in {elapsed:.1f} s; per case at most {TIME_S:g} s and {MEM_MB} MiB above the worker's "
        f"{info.get('vm_base_mb')} MiB (RLIMIT_AS {info.get('limit_mb')} MiB); peak RSS of a worker {info.get('peak_mb')} MiB",
        *_table("synthetic models (tiny llama/qwen2/phi3/gpt-oss, BPE and SPM vocabularies, F32/F16/Q8_0/Q4_0/MXFP4, "
                "vocab-only):", rows),
    ]
    _check(rows, make, seed, tmp_path / "failing")


def test_mutation_fuzz_real_files(seed, long_run, summary, request, tmp_path):
    """Mutants of real files: SmolLM2's header (its tensor data a hole in a sparse file) and llama.cpp's
    vocabulary-only GGUFs (SentencePiece and BPE)."""
    try:
        smollm2 = request.getfixturevalue("smollm2")
        vocabs = request.getfixturevalue("llama_cpp_models")
    except Exception as exc:  # the real files come from a package registry; offline, this part is skipped
        pytest.skip(f"real test files unavailable: {exc}")
    bases = {
        "SmolLM2-135M header": gm.sample_of(smollm2, header_only=True),
        **{p: gm.sample_of(vocabs / f"ggml-vocab-{p}.gguf") for p in ("llama-spm", "phi-3", "gpt-2")},
    }
    make, cuts = _case_maker(bases, "truncation at a field boundary", f"{seed}/real/", 30, run_forward=False)
    n_random = CI_REAL_CASES * (LONG_FACTOR if long_run else 1)
    n = len(cuts) + n_random
    t0 = time.perf_counter()
    rows, info = run_cases(n, make, tmp_path / "work", workers=2, mem_mb=MEM_MB, time_s=TIME_S)
    summary.lines += [
        f"seed {seed}: {n} cases of real files ({len(cuts)} truncations + {n_random} random mutants) "
        f"in {time.perf_counter() - t0:.1f} s; peak RSS of a worker {info.get('peak_mb')} MiB",
        *_table("real files (SmolLM2-135M header, ggml-vocab-llama-spm/phi-3/gpt-2):", rows),
    ]
    _check(rows, make, seed, tmp_path / "failing")


@pytest.mark.parametrize("what, item, count, size", [
    ("64M empty strings", gb.STR, 64_000_000, 8),  # 0.5 GB of zeros: a list of 64M references (14 s, 1 GB)
    ("500M bytes", gb.U8, 500_000_000, 1),  # a list of 500M ints (4.3 GB)
    ("a 100 MB string", None, 100_000_000, 1),
    ("2M metadata keys", "keys", 2_000_000, 13),
])
def test_big_files_cannot_make_the_header_walk_allocate(tmp_path, what, item, count, size):
    """Counts the file does hold (its tail is a hole of zeros), but no real file comes near: refused before
    the walk builds Python objects several times the file's size."""
    from llamacli.errors import CorruptFileError
    from llamacli.ggufio.file import open_gguf

    if item == "keys":
        head = b"GGUF" + struct.pack("<IQQ", 3, 0, count)
    elif item is None:
        head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gb.string("general.name") + struct.pack("<IQ", gb.STR, count)
    else:
        head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gb.string("tokenizer.ggml.tokens") + struct.pack("<IIQ", gb.ARR, item, count)
    path = tmp_path / "big.gguf"
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + count * size + 64)
    with pytest.raises(CorruptFileError, match="accepted"):
        _bounded(lambda: open_gguf(path), peak_mb=16, seconds=2.0)


def test_limits_are_live(tmp_path):
    """The worker's bounds hold: a case that allocates past the memory limit or spins past the time limit is
    reported as a bug, not waited out or swapped through."""
    cases = [Case("canary", "-", gm.Sample(b, len(b))) for b in (b"CANARY-MEM", b"CANARY-LOOP")]
    rows, _ = run_cases(2, cases.__getitem__, tmp_path, workers=1, mem_mb=256, time_s=1.0)
    assert "MemoryError" in (rows[0][2].bug or ""), rows[0][2].stages
    assert "timeout" in (rows[1][2].bug or ""), rows[1][2].stages


# -- hypothesis: files from strategies, in-process, under tracemalloc ------------------------------------------

_KEYS = ["general.architecture", "general.alignment", "llama.block_count", "llama.context_length",
         "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
         "llama.attention.head_count_kv", "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base",
         "llama.vocab_size", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
         "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
         "tokenizer.chat_template"]
_TENSORS = ["token_embd.weight", "output.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"]

_u64 = st.one_of(st.integers(0, 300), st.sampled_from([2**32 - 1, 2**32, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
_scalars = st.one_of(
    st.tuples(st.just(gb.U32), st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1))),
    st.tuples(st.just(gb.I32), st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just(gb.U64), _u64),
    st.tuples(st.just(gb.I64), st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just(gb.F32), st.floats(width=32)),
    st.tuples(st.just(gb.F64), st.floats()),
    st.tuples(st.just(gb.BOOL), st.booleans()),
    st.tuples(st.just(gb.U8), st.integers(0, 255)),
    st.tuples(st.just(gb.STR), st.one_of(st.sampled_from(["llama", "qwen2", "phi3", "gpt2", "llama3", "gpt-2"]),
                                         st.text(max_size=12), st.binary(max_size=12))),
)
_arrays = st.one_of(
    st.tuples(st.just(gb.ARR), st.tuples(st.just(gb.STR), st.lists(st.text(max_size=6), max_size=12))),
    st.tuples(st.just(gb.ARR), st.tuples(st.sampled_from([gb.U32, gb.I32, gb.U8]), st.lists(st.integers(0, 255), max_size=12))),
    st.tuples(st.just(gb.ARR), st.tuples(st.just(gb.F32), st.lists(st.floats(width=32), max_size=12))),
)


@st.composite
def _kv(draw) -> bytes:
    key = draw(st.one_of(st.sampled_from(_KEYS), st.text(max_size=10), st.binary(max_size=10)))
    if draw(st.integers(0, 9)) == 0:  # a type id that is not one, and whatever bytes follow
        return gb.string(key) + struct.pack("<I", draw(st.integers(13, 2**32 - 1))) + draw(st.binary(max_size=16))
    if draw(st.integers(0, 9)) == 0:  # an array whose count lies
        itype = draw(st.sampled_from([gb.U8, gb.U32, gb.STR, gb.ARR, 99]))
        return gb.string(key) + struct.pack("<IIQ", gb.ARR, itype, draw(_u64)) + draw(st.binary(max_size=32))
    vtype, value = draw(st.one_of(_scalars, _arrays))
    return gb.kv(key, vtype, value)


@st.composite
def _tensor(draw) -> bytes:
    name = draw(st.one_of(st.sampled_from(_TENSORS), st.text(max_size=8)))
    dims = draw(st.lists(st.one_of(st.sampled_from([1, 8, 32, 64, 273]), _u64), min_size=0, max_size=5))
    ggml_type = draw(st.one_of(st.sampled_from([0, 1, 8, 12, 30]), st.integers(0, 2**32 - 1)))
    offset = draw(st.one_of(st.sampled_from([0, 32, 64, 96]), _u64))
    return gb.tensor_info(name, dims, ggml_type, offset)


@st.composite
def gguf_files(draw) -> bytes:
    kvs = draw(st.lists(_kv(), max_size=10))
    tensors = draw(st.lists(_tensor(), max_size=5))
    lie = draw(st.integers(0, 4))
    return gb.gguf(
        kvs, tensors, draw(st.binary(max_size=512)),
        version=draw(st.sampled_from([3] * 8 + [2, 1, 0x03000000])),
        n_kv=draw(_u64) if lie == 1 else None,
        n_tensors=draw(_u64) if lie == 2 else None,
    )


def _settings(long_run: bool, n: int):
    return settings(max_examples=n * (LONG_FACTOR if long_run else 1), derandomize=not long_run, database=None,
                    deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


def _bounded(fn, peak_mb: int = 64, seconds: float = 5.0):
    """fn() under tracemalloc: its peak allocation and its time must stay small whatever the input claims."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        took = time.perf_counter() - t0
        assert peak < peak_mb << 20, f"peak allocation {peak >> 20} MiB"
        assert took < seconds, f"took {took:.1f} s"


@pytest.fixture(scope="module")
def hypo_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hypothesis-gguf")


def test_hypothesis_gguf_headers(hypo_dir, long_run, summary):
    """Random files: every stage either passes or raises a LlamacliError (anything else propagates and fails)."""
    counts: collections.Counter[str] = collections.Counter()
    path = hypo_dir / "h.gguf"

    @_settings(long_run, 600)
    @given(data=gguf_files())
    def check(data: bytes) -> None:
        path.write_bytes(data)
        stages = _bounded(lambda: load_everything(str(path), run_forward=True))
        counts[next((o for _, o in stages if o != "ok"), "loads")] += 1

    check()
    summary.lines.append(f"hypothesis, GGUF files from strategies: {sum(counts.values())} examples "
                         f"({'random' if long_run else 'derandomized'}), outcomes {dict(counts.most_common(6))}")


def test_hypothesis_field_edits(seed_files, hypo_dir, long_run, summary):
    """A valid tiny model with a few of its header fields overwritten (counts, lengths, types, dims, offsets,
    string bytes) and perhaps cut short: the edits reach every stage, up to the forward pass."""
    base = gm.sample_of(seed_files["llama-bpe-f32"])
    fields = [f for f in gm.parse(base).fields if f.kind != "data"]
    counts: collections.Counter[str] = collections.Counter()
    path = hypo_dir / "edits.gguf"

    @_settings(long_run, 1000)
    @given(edits=st.lists(st.tuples(st.integers(0, len(fields) - 1), _u64, st.binary(min_size=1, max_size=4)),
                          min_size=1, max_size=4),
           cut=st.one_of(st.none(), st.none(), st.integers(0, base.size)))
    def check(edits: list[tuple[int, int, bytes]], cut: int | None) -> None:
        buf = bytearray(base.prefix)
        for index, number, raw in edits:
            f = fields[index]
            if f.kind == "str":
                buf[f.start : f.start + min(len(raw), f.size)] = raw[: f.size]
            else:
                buf[f.start : f.start + f.size] = (number & ((1 << 8 * f.size) - 1)).to_bytes(f.size, "little")
        path.write_bytes(bytes(buf[:cut]) if cut is not None else bytes(buf))
        stages = _bounded(lambda: load_everything(str(path), run_forward=True))
        counts[next((o for _, o in stages if o != "ok"), "loads")] += 1

    check()
    summary.lines.append(f"hypothesis, field edits of a tiny model: {sum(counts.values())} examples, "
                         f"outcomes {dict(counts.most_common(8))}")


_token_text = st.one_of(st.sampled_from(["<s>", "</s>", "<unk>", "<|im_start|>", "<0x41>", "\u2581the", "\u0120t", "a", "b"]),
                        st.text(min_size=0, max_size=6))
_items = st.one_of(st.integers(-3, 9), st.integers(-(2**63), 2**64 - 1), st.floats(), st.booleans(), st.text(max_size=3))


@st.composite
def tokenizer_metadata(draw) -> dict:
    """tokenizer.ggml.* as the GGUF reader could return it: mostly plausible vocabularies with a few values of
    the wrong kind, length or range (any GGUF type can appear under any key)."""
    good = draw(st.integers(0, 9)) > 0  # most examples get past the first checks, to reach the engines
    tokens = draw(st.lists(_token_text, min_size=1 if good else 0, max_size=40, unique=good))
    md: dict = {
        "tokenizer.ggml.model": draw(st.sampled_from(["gpt2", "llama"] * 4 + ["bert", 7])),
        "tokenizer.ggml.pre": draw(st.sampled_from(["gpt-2", "default", "llama3", "qwen2", "smollm"] * 2 + ["", "nope"])),
        "tokenizer.ggml.tokens": tokens if good or draw(st.booleans()) else draw(st.lists(_items, max_size=5)),
    }
    n = len(tokens)
    if draw(st.integers(0, 2)):
        md["tokenizer.ggml.token_type"] = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n + 2) if good
                                                else st.lists(_items, min_size=n, max_size=n + 2))
    if draw(st.integers(0, 2)):
        md["tokenizer.ggml.scores"] = draw(st.lists(st.floats(width=32) if good else st.one_of(st.floats(), _items),
                                                    min_size=n, max_size=n + 2))
    if md["tokenizer.ggml.model"] == "gpt2" or draw(st.booleans()):
        pairs = st.tuples(st.sampled_from(tokens), st.sampled_from(tokens)).map(" ".join) if tokens else st.just("a b")
        md["tokenizer.ggml.merges"] = draw(st.lists(pairs if good else st.one_of(pairs, st.text(max_size=5)), max_size=8))
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "eot_token_id", "add_bos_token", "add_eos_token",
                "add_space_prefix"):
        if draw(st.integers(0, 3)) == 0:
            md[f"tokenizer.ggml.{key}"] = draw(st.one_of(st.integers(0, max(n - 1, 0)), st.booleans(), _items))
    if draw(st.integers(0, 3)) == 0:
        md["general.name"] = draw(st.sampled_from(["Phi-3-mini", "x", 5]))
    return md


def test_hypothesis_tokenizer_metadata(long_run, summary):
    """Tokenizer.from_metadata on arbitrary tokenizer.ggml.* values: a tokenizer that encodes and decodes, or a
    TokenizerError; never another exception."""
    from llamacli.errors import LlamacliError
    from llamacli.tokenizer.tokenizer import Tokenizer

    counts: collections.Counter[str] = collections.Counter()

    @_settings(long_run, 500)
    @given(md=tokenizer_metadata(), text=st.text(max_size=24))
    def check(md: dict, text: str) -> None:
        def run() -> str:
            try:
                tok = Tokenizer.from_metadata(md)
                ids = tok.encode(text, special=True)
                tok.decode(ids)
                for i in ids:
                    tok.piece(i)
            except LlamacliError as exc:
                return type(exc).__name__
            return "builds"

        counts[_bounded(run)] += 1

    check()
    summary.lines.append(f"hypothesis, tokenizer metadata: {sum(counts.values())} examples, outcomes {dict(counts)}")
