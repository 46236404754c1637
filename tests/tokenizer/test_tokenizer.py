"""Tokenizers built from GGUF metadata: llama.cpp's own test vocabularies and expected ids, transformers'
tokenizer for the same SmolLM2 file, round trips, special tokens, BOS/EOS/EOG and streaming decoding."""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from llamacli.errors import TokenizerError
from llamacli.ggufio.file import open_gguf
from llamacli.tokenizer import text_chunks
from llamacli.tokenizer.bpe import PRE_SPLITS
from llamacli.tokenizer.tokenizer import CONTROL, StreamDecoder, Tokenizer, TokenMatcher, TooManyTokens, cut_points

SEPARATOR = "\n__ggml_vocab_test__\n"

# The vocabularies the issue requires, then the other llama.cpp test vocabularies of a kind we support.
REQUIRED = ["llama-bpe", "llama-spm", "phi-3", "qwen2", "gpt-2"]
BONUS = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "mpt", "qwen35", "refact", "starcoder", "gemma-4"]

# A varied text set: prose, contractions, spaces, code, \r\n, digits, scripts, emoji, URLs, JSON, special-token
# strings, the empty string.
TEXTS = [
    "",
    " ",
    "   ",
    "\n",
    "\t \n ",
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, they'd've gone.",
    "I CAN'T, YOU'RE, WE'VE, SHE'LL, HE'D",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple    spaces\t\ttabs  \n  and newlines\n\n\n",
    "def add(a, b):\n\treturn a + b  # tab-indented\n\nclass X:\n    pass\n",
    "line one\r\nline two\r\n\r\n",
    "3.14159 2718281828 1,234,567 0x1F 42nd 1e-9 m²,١٢٣",
    "日本語のテキストと中文混合，还有标点。",
    "한국어 텍스트입니다. 안녕하세요!",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Café naïve résumé façade Ærøskøbing Đakovo Łódź",
    "👩‍👩‍👧‍👦 family, 👍🏽 thumbs, 🏳️‍🌈 flag, 🦙 llama, ✅",
    "https://example.com/path/to?q=1&x=%20#frag mailto:a@b.co",
    '{"key": [1, 2.5, null, true], "nested": {"s": "a\\nb"}}',
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><s></s>[INST]<|eot_id|><|end|>",
    "<|im_start|> spaces <|im_end|>  after",
    "a" * 200,
    "ÄÖÜ ß ŉ ǅ ﬁ",
    "mixed🦙text日本語and123numbers",
]


def read_vocab_tests(models: Path, name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's .inp (inputs separated by __ggml_vocab_test__ lines) and .out (one line of ids per input)."""
    stem = models / f"ggml-vocab-{name}.gguf"
    inputs = Path(f"{stem}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    if inputs[-1] == "":  # most files end with a separator; some end with their last input
        inputs.pop()
    lines = Path(f"{stem}.out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines), f"{name}: {len(inputs)} inputs, {len(lines)} outputs"
    return [(text, [int(x) for x in line.split()]) for text, line in zip(inputs, lines)]


@pytest.fixture(scope="module")
def vocab(llama_cpp_models: Path):
    """vocab(name) -> Tokenizer for ggml-vocab-<name>.gguf, built once per module."""
    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = Tokenizer.from_metadata(open_gguf(llama_cpp_models / f"ggml-vocab-{name}.gguf").metadata)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def smol_md(smollm2: Path) -> dict:
    return open_gguf(smollm2).metadata


@pytest.fixture(scope="module")
def smol(smol_md: dict) -> Tokenizer:
    return Tokenizer.from_metadata(smol_md)


# -- llama.cpp's expected ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REQUIRED + BONUS)
def test_llama_cpp_vocab_ids(name: str, vocab, llama_cpp_models: Path) -> None:
    tok = vocab(name)
    cases = read_vocab_tests(llama_cpp_models, name)
    wrong = [(text, want, got) for text, want in cases
             if (got := tok.encode(text, add_bos=False, add_eos=False)) != want]
    detail = "\n".join(f"  {text[:50]!r}: want {want[:12]}, got {got[:12]}" for text, want, got in wrong[:5])
    assert not wrong, f"{name}: {len(cases) - len(wrong)}/{len(cases)} match\n{detail}"


@pytest.mark.parametrize("name", ["bert-bge", "nomic-bert-moe"])
def test_unsupported_kind_is_a_clear_error(name: str, llama_cpp_models: Path) -> None:
    md = open_gguf(llama_cpp_models / f"ggml-vocab-{name}.gguf").metadata
    with pytest.raises(TokenizerError, match=r"unsupported tokenizer model .*supported: gpt2, llama, gemma4"):
        Tokenizer.from_metadata(md)


def test_unknown_pre_tokenizer_lists_the_supported(vocab, llama_cpp_models: Path) -> None:
    md = dict(open_gguf(llama_cpp_models / "ggml-vocab-gpt-2.gguf").metadata)
    md["tokenizer.ggml.pre"] = "no-such-pre"
    with pytest.raises(TokenizerError, match=r"'no-such-pre'.*supported:.*llama-bpe.*qwen2.*smollm"):
        Tokenizer.from_metadata(md)


def test_missing_pieces_are_errors(llama_cpp_models: Path) -> None:
    md = open_gguf(llama_cpp_models / "ggml-vocab-gpt-2.gguf").metadata
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.tokens"})
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_metadata({"general.architecture": "llama"})
    dup = dict(md, **{"tokenizer.ggml.tokens": md["tokenizer.ggml.tokens"][:-1] + ["hello"]})
    with pytest.raises(TokenizerError, match="duplicate token"):
        Tokenizer.from_metadata(dup)


def test_missing_pre_means_default(vocab) -> None:
    tok = vocab("gpt-neox")  # no tokenizer.ggml.pre: llama.cpp's 'default' pre-tokenizer
    assert tok.pre == "default"
    assert tok.decode(tok.encode("Hello, world! 12345")) == "Hello, world! 12345"


def test_construction_is_fast(llama_cpp_models: Path) -> None:
    md = open_gguf(llama_cpp_models / "ggml-vocab-qwen2.gguf").metadata  # 151,936 tokens, 151,387 merges
    start = time.perf_counter()
    tok = Tokenizer.from_metadata(md)
    tok.encode("warm up")
    assert time.perf_counter() - start < 3.0  # about 0.2 s here; "about a second" is the requirement


# -- transformers' tokenizer for the same SmolLM2 file -------------------------------------------------------


@pytest.fixture(scope="module")
def hf_smol(smollm2: Path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_smollm2_matches_transformers(text: str, smol: Tokenizer, hf_smol) -> None:
    # transformers matches special-token strings in text; split_special_tokens=True is our special=False.
    assert smol.encode(text, special=True) == hf_smol.encode(text, add_special_tokens=False)
    assert smol.encode(text, special=False) == hf_smol.encode(text, add_special_tokens=False, split_special_tokens=True)


def test_smollm2_splits_every_numeric_char_like_llama_cpp(smol: Tokenizer, vocab, llama_cpp_models: Path) -> None:
    """'smollm' is llama.cpp's starcoder pre-tokenizer: \\p{N} split one by one, then GPT-2's pattern. So a
    space before '½' stays alone, as in the original tokenizer.json (Digits) and llama.cpp's starcoder .out.
    (transformers' GGUF converter knows no 'smollm' splitter and merges ' ½'; the only divergence we know.)"""
    want = dict(read_vocab_tests(llama_cpp_models, "starcoder"))["ied 4 ½ months"]
    assert vocab("starcoder").encode("ied 4 ½ months") == want
    ids = smol.encode("ied 4 ½ months")
    assert [smol.piece(i) for i in ids][1:4] == ["Ġ", "4", "Ġ"]


def test_smollm2_metadata(smol: Tokenizer) -> None:
    assert (smol.kind, smol.pre, smol.vocab_size) == ("bpe", "smollm", 49152)
    assert (smol.bos_id, smol.eos_id, smol.add_bos, smol.add_eos) == (1, 2, False, False)
    assert {0, 2} <= smol.eog_ids  # <|endoftext|>, <|im_end|> (and <reponame>, a FIM token, as in llama.cpp)
    assert smol.encode("Hello") == smol.encode("Hello", add_bos=False)  # add_bos_token is false
    assert smol.piece(2) == "<|im_end|>" and smol.piece(smol.encode(" world")[0]) == "Ġworld"


# -- special tokens, BOS/EOS, end of generation --------------------------------------------------------------


def test_special_tokens_parse_only_when_asked(vocab) -> None:
    tok = vocab("qwen2")
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text, special=True)[0] == 151644
    assert tok.encode(text, special=True)[-1] == 151645
    plain = tok.encode(text)
    assert 151644 not in plain and 151645 not in plain
    assert tok.decode(plain) == text
    # User-defined tokens are matched whole even in raw text (llama.cpp, HF tokenizers).
    assert tok.token_type(151646) != CONTROL
    assert tok.encode("a[PAD151646]b") == [tok.encode("a")[0], 151646, tok.encode("b")[0]]


def test_spm_special_tokens_and_dummy_prefix(vocab) -> None:
    tok = vocab("llama-spm")
    hello = tok.encode("Hello", add_bos=False)
    assert hello == [15043]  # "▁Hello": the dummy prefix space
    assert tok.encode("<s>Hello", special=True, add_bos=False) == [1] + hello  # a prefix after a special token too
    assert tok.encode("<s>Hello", add_bos=False) != [1] + hello
    assert tok.decode([1] + hello) == "<s> Hello"  # as llama_detokenize and transformers print it
    assert tok.decode([1] + hello, special=False) == "Hello"
    assert tok.decode(hello, strip_dummy_prefix=False) == " Hello"


def test_phi3_special_tokens_eat_following_whitespace(vocab) -> None:
    tok = vocab("phi-3")  # llama.cpp gives Phi-3's special tokens rstrip (by model name)
    assert tok.encode("<|user|>\nhi<|end|>\n", special=True, add_bos=False) == [32010, 7251, 32007]


def test_bos_eos_follow_the_metadata(vocab, llama_cpp_models: Path) -> None:
    spm, bpe3, qwen, gpt2 = vocab("llama-spm"), vocab("llama-bpe"), vocab("qwen2"), vocab("gpt-2")
    assert spm.encode("hi")[0] == 1 and spm.encode("hi", add_bos=False)[0] != 1
    assert spm.encode("") == [1] and spm.encode("", add_bos=False) == []
    assert bpe3.add_bos and bpe3.encode("hi")[0] == 128000  # no key: llama-bpe defaults to BOS, as llama.cpp
    assert not qwen.add_bos and qwen.encode("hi") == qwen.encode("hi", add_bos=False)
    assert not gpt2.add_bos and gpt2.encode("hi", add_bos=True)[0] == 50256
    md = dict(open_gguf(llama_cpp_models / "ggml-vocab-llama-spm.gguf").metadata)
    md["tokenizer.ggml.add_bos_token"], md["tokenizer.ggml.add_eos_token"] = False, True
    tok = Tokenizer.from_metadata(md)
    assert tok.encode("hi") == tok.encode("hi", add_bos=False, add_eos=False) + [2]


def test_end_of_generation_ids(vocab, smol: Tokenizer) -> None:
    assert {128001, 128009} <= vocab("llama-bpe").eog_ids  # <|end_of_text|>, <|eot_id|>
    assert {151643, 151645} <= vocab("qwen2").eog_ids  # <|endoftext|>, <|im_end|>
    assert {32000, 32007} <= vocab("phi-3").eog_ids  # <|endoftext|>, <|end|>
    assert vocab("llama-spm").eog_ids == {2}
    assert vocab("gpt-2").eog_ids == {50256}
    for tok in (vocab("llama-bpe"), vocab("qwen2"), smol):
        assert tok.eos_id in tok.eog_ids
        assert all(tok.token_type(i) == CONTROL for i in tok.eog_ids)
    assert 128000 not in vocab("llama-bpe").eog_ids  # BOS is not an end


def test_piece_and_bad_ids(vocab) -> None:
    tok = vocab("llama-spm")
    assert tok.piece(1) == "<s>" and tok.piece(13) == "<0x0A>" and tok.piece(15043) == "▁Hello"
    for bad in (-1, tok.vocab_size, 10**9):
        with pytest.raises(TokenizerError, match="outside the vocabulary"):
            tok.piece(bad)
        with pytest.raises(TokenizerError):
            tok.decode([bad])


# -- round trips and streaming ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REQUIRED + ["smollm2", "starcoder", "deepseek-llm", "command-r", "gemma-4"])
def test_decode_inverts_encode(name: str, vocab, smol: Tokenizer) -> None:
    tok = smol if name == "smollm2" else vocab(name)
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert tok.decode(ids) == text, (name, text)
        # With special tokens parsed, SentencePiece encodes the text after each one with its own dummy-prefix
        # space, which decode prints (as llama.cpp and transformers do): lossy there, exact for BPE.
        if tok.kind != "spm":
            assert tok.decode(tok.encode(text, special=True, add_bos=False)) == text, (name, text)


@pytest.mark.parametrize("name", ["llama-spm", "phi-3"])
def test_spm_decode_matches_transformers(name: str, vocab, llama_cpp_models: Path) -> None:
    """SentencePiece decoding, special tokens shown or skipped, against transformers' tokenizer built from the
    same GGUF: the first printed piece loses its dummy-prefix space, a space after a special token stays."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(llama_cpp_models, gguf_file=f"ggml-vocab-{name}.gguf")
    tok = vocab(name)
    texts = TEXTS + ["Hello world", "Hi<|end|>\nThere", "<s>Hi", " lead", "  two", "a\n\nb",
                     "<|user|>\nhi<|end|>\n<|assistant|>\nyes", "</s> x <unk>y"]
    for text in texts:
        for parse in (True, False):
            ids = tok.encode(text, special=parse)
            for special in (True, False):
                assert tok.decode(ids, special=special) == hf.decode(ids, skip_special_tokens=not special), (text, ids)


@pytest.mark.parametrize("name", REQUIRED + ["smollm2"])
def test_stream_decoder_equals_decode(name: str, vocab, smol: Tokenizer) -> None:
    tok = smol if name == "smollm2" else vocab(name)
    for text in TEXTS:
        for special in (False, True):
            ids = tok.encode(text, special=special)
            for keep in (True, False):
                stream = StreamDecoder(tok, special=keep)
                chunks = [stream.feed(i) for i in ids] + [stream.flush()]
                assert "".join(chunks) == tok.decode(ids, special=keep)
                for chunk in chunks:
                    chunk.encode("utf-8")  # whole characters only: no lone surrogates, nothing half
                    assert "\ufffd" not in chunk


def test_stream_decoder_holds_back_partial_characters(vocab) -> None:
    tok = vocab("llama-spm")  # no token for the llama emoji: four byte tokens <0xF0><0x9F><0xA6><0x99>
    ids = tok.encode("🦙!", add_bos=False)
    assert [tok.piece(i) for i in ids][-5:-1] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    stream = StreamDecoder(tok)
    assert [stream.feed(i) for i in ids][-5:] == ["", "", "", "🦙", "!"]
    assert stream.flush() == ""
    bpe = vocab("gpt-2")  # byte-level: "日" is three byte tokens
    ids = bpe.encode("日")
    assert len(ids) > 1
    stream = StreamDecoder(bpe)
    assert "".join(stream.feed(i) for i in ids[:-1]) == ""
    assert stream.feed(ids[-1]) == "日"


def test_stream_decoder_flushes_an_incomplete_tail(vocab) -> None:
    tok = vocab("llama-spm")
    stream = StreamDecoder(tok)
    assert stream.feed(tok.token_id("<0xE6>")) == ""
    assert stream.flush() == "\ufffd"
    assert tok.decode([tok.token_id("<0xE6>")]) == "\ufffd"


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_decoder_on_random_byte_tokens(data, vocab) -> None:
    """Any id sequence, valid UTF-8 or not: the stream's text equals decode()'s, chunk by chunk whole."""
    tok = vocab(data.draw(st.sampled_from(["llama-spm", "gpt-2"])))
    if tok.kind == "spm":
        pool = [tok.token_id(f"<0x{b:02X}>") for b in range(256)] + [15043, 29871, 1, 2]
    else:
        pool = list(range(256)) + [50256, tok.encode(" world")[0]]
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=24))
    stream = StreamDecoder(tok)
    chunks = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(chunks) == tok.decode(ids)
    for chunk in chunks[:-1]:
        chunk.encode("utf-8")


# -- long texts in pieces, special tokens among many ---------------------------------------------------------

# Characters that stress the pre-tokenizer regexes at a cut: letters of several scripts and cases, marks,
# digits of several kinds, every kind of whitespace, punctuation the regexes treat apart, contractions.
_HOSTILE_ALPHABET = [*"abcXYZ019 \n\n\r\t\v\f.,;:!?'\"/()[]<>|_-$+=^~`@#%&*{}\\", "日", "本", "ب", "é", "\u0301",
                     "²", "½", "🦙", "▁", "\u00a0", "\u3000", "ǅ", "ʰ", "ﬁ", "١", "Ⅷ", "\x00", "…", "。", "'s", "'T",
                     "'ll", "  ", "\n\n", " \n", "\r\n", "1234", "hello", "World", "The", "a ", "9\n", ".\nb", "。\n日"]


def _random_texts(seed: int, n: int, extra: tuple[str, ...] = ()) -> list[str]:
    rng = random.Random(seed)
    alphabet = _HOSTILE_ALPHABET + list(extra)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(n)]


@pytest.mark.parametrize("family", sorted(set(PRE_SPLITS) - {"gemma4"}))
def test_cut_points_keep_the_pre_tokens(family: str) -> None:
    """Cut at every cut point, a text pre-tokenizes into the same words as whole, for every regex family
    (gemma4's lines are one word: there the vocabulary decides, see the next test)."""
    from tokenizers import Regex, pre_tokenizers

    splitter = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[family]])

    def words(text: str) -> list[str]:
        return [w for w, _ in splitter.pre_tokenize_str(text)]

    n_cuts = 0
    for text in _random_texts(sum(map(ord, family)), 600):
        cuts = [0, *cut_points(text), len(text)]
        n_cuts += len(cuts) - 2
        assert [w for a, b in zip(cuts, cuts[1:]) for w in words(text[a:b])] == words(text), (text, cuts)
    assert n_cuts > 1000  # (about 2 a text)


@pytest.mark.parametrize("name", REQUIRED + BONUS + ["smollm2"])
def test_pieces_give_the_ids_of_the_whole(name: str, vocab, smol: Tokenizer, monkeypatch) -> None:
    """A long text is tokenized in pieces: with a piece at every cut point, the ids are those of the whole."""
    tok = smol if name == "smollm2" else vocab(name)
    specials = ("<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|end|>", "<|endoftext|>", "<|user|>", "[PAD151646]")
    for text in _random_texts(len(name), 120, specials):
        for special in (False, True):
            monkeypatch.setattr(text_chunks, "PIECE_CHARS", 1 << 30)
            whole = tok.encode(text, special=special)
            monkeypatch.setattr(text_chunks, "PIECE_CHARS", 1)
            assert tok.encode(text, special=special) == whole, (text, special)


def test_token_matcher_is_leftmost_longest() -> None:
    """TokenMatcher finds what one regex alternation of the tokens, longest first, finds (the old way),
    including tokens longer than its first window and tokens that are prefixes of others."""
    rng = random.Random(7)
    for _ in range(200):
        alphabet = "ab<|>" if rng.random() < 0.5 else "ab"
        tokens = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 12))}
        if rng.random() < 0.3:
            tokens.add("a" * rng.randint(60, 300))
        text = "".join(rng.choice(alphabet + "c") for _ in range(rng.randint(0, 80))) + "a" * rng.randint(0, 400)
        pattern = re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))
        matcher, pos, found = TokenMatcher(tokens), 0, []
        while (span := matcher.search(text, pos)) is not None:
            found.append(span)
            pos = span[1]
        assert found == [m.span() for m in pattern.finditer(text)], (tokens, text)


def test_spm_engine_holds_every_piece_as_given() -> None:
    """spm.build_spm writes the SentencePiece model proto by hand, with one-byte varints inlined (it runs once per
    token): the engine built from it must hold every piece, its score and its type as given, for pieces of any
    length (varints past one byte), every token type (as SentencePiece takes them: one unknown, BYTE only for
    <0xXX>, control stays control, the rest normal), scores past float32 (clamped), with and without an
    unknown token (without one, ours comes last), with and without the 256 byte pieces."""
    import random
    import struct

    from llamacli.tokenizer import spm as S

    def float32(x: float) -> float:
        return struct.unpack("<f", struct.pack("<f", min(max(x, -3.4e38), 3.4e38)))[0]

    def kind(sp, i: int) -> str:
        return ("unknown" if sp.is_unknown(i) else "byte" if sp.is_byte(i) else "control" if sp.is_control(i)
                else "unused" if sp.is_unused(i) else "normal")

    rng = random.Random(7)
    for case in range(40):
        n = rng.randint(1, 120)
        tokens: list[str] = []
        while len(tokens) < n:  # (distinct: SentencePiece refuses a piece twice)
            text = "".join(chr(rng.choice((rng.randint(32, 126), rng.randint(0xA0, 0xD7FF))))
                           for _ in range(rng.choice((1, 3, 42, 130, 300))))
            if text not in tokens and not S.HEX_BYTE.fullmatch(text):
                tokens.append(text)
        types = [rng.choice((S.NORMAL, S.UNKNOWN, S.CONTROL, S.USER_DEFINED, S.UNUSED, S.BYTE)) for _ in range(n)]
        unk = rng.choice((None, 0, n - 1))
        if case % 2:  # byte fallback: SentencePiece wants all 256
            tokens += [f"<0x{b:02X}>" for b in range(256)]
            types += [S.BYTE] * 256
        scores = [rng.uniform(-3.5e38, 3.5e38) for _ in tokens]
        sp = S.build_spm({"tokenizer.ggml.scores": scores}, tokens, types, unk)
        assert sp.get_piece_size() == len(tokens) + (unk is None)
        for i, (text, score, ttype) in enumerate(zip(tokens, scores, types)):
            want = ("unknown" if i == unk else "byte" if ttype == S.BYTE and S.HEX_BYTE.fullmatch(text)
                    else "control" if ttype in (S.CONTROL, S.UNKNOWN, S.BYTE) else "normal")
            assert (sp.id_to_piece(i), sp.get_score(i), kind(sp, i)) == (text, float32(score), want), i
        if unk is None:
            assert kind(sp, len(tokens)) == "unknown"


# -- a limit on the ids: refused before tokenizing a long text whole --------------------------------------------


@pytest.mark.parametrize("name", REQUIRED + BONUS + ["smollm2"])
def test_min_tokens_bounds_the_ids_and_a_limit_refuses_only_what_passes_it(name: str, vocab, smol: Tokenizer) -> None:
    """min_tokens (from the text's bytes alone) never exceeds the real count, with or without special tokens;
    encode(limit=N) gives the same ids when they number N or fewer, and TooManyTokens when one more."""
    tok = smol if name == "smollm2" else vocab(name)
    specials = ("<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|end|>", "<|endoftext|>", "\x04\x06\x13", "\xff")
    texts = _random_texts(len(name) + 7, 60, specials) + TEXTS + ["☃" * 300, " " * 2000, "\n" * 900, "a" * 5000]
    assert tok.max_token_bytes is not None  # each of these vocabularies gives a bound
    for text in texts:
        for special in (False, True):
            ids = tok.encode(text, special=special)
            assert tok.min_tokens(text) + tok.add_bos + tok.add_eos <= len(ids), (text, special)
            assert tok.encode(text, special=special, limit=len(ids)) == ids
            with pytest.raises(TooManyTokens):
                tok.encode(text, special=special, limit=len(ids) - 1)
    prose = TEXTS[6] * 2000  # every byte of plain prose counts (Phi-3: but its spaces)
    assert tok.min_tokens(prose) >= len(prose.replace(" ", "")) // tok.max_token_bytes > 0


def test_a_vocabulary_that_folds_unknown_text_gives_no_bound(vocab, llama_cpp_models: Path) -> None:
    """SentencePiece without byte tokens turns a run of unknown characters into one <unk>: no bound from the
    length there (a long run of them is a handful of ids, and must not be refused)."""
    from llamacli.tokenizer.tokenizer import BYTE, NORMAL

    md = dict(open_gguf(llama_cpp_models / "ggml-vocab-llama-spm.gguf").metadata)
    md["tokenizer.ggml.token_type"] = [NORMAL if t == BYTE else t for t in md["tokenizer.ggml.token_type"]]
    tok = Tokenizer.from_metadata(md)
    assert tok.max_token_bytes is None and tok.min_tokens("☃" * 5000) == 0
    assert len(tok.encode("☃" * 5000, limit=10)) <= 10


def test_a_limit_stops_tokenizing_partway(smol: Tokenizer) -> None:
    """Past the limit, tokenizing stops at the piece that passes it: here before it reaches a stretch without
    a cut that would be refused whole (so the error is TooManyTokens, not that one)."""
    text = "word " * 30_000 + "x" * (text_chunks.MAX_STRETCH_CHARS + 1)
    assert smol.min_tokens(text) < 20_000  # the length alone does not tell
    with pytest.raises(TokenizerError, match="one stretch"):
        smol.encode(text)
    with pytest.raises(TooManyTokens) as caught:
        smol.encode(text, limit=20_000)
    assert 20_000 < caught.value.at_least < 30_000
