"""Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata, behaving as llama.cpp's do.

Three kinds, picked by `tokenizer.ggml.model`:

    gpt2    byte-level BPE (Llama 3, Qwen2, SmolLM2, Mistral-Nemo...): the `tokenizers` library runs the merges,
            after the pre-tokenizer regexes that `tokenizer.ggml.pre` names (llama.cpp's src/llama-vocab.cpp,
            written here in the Oniguruma syntax of the original tokenizer.json files).
    gemma4  the same BPE over raw UTF-8: spaces written "\u2581", <0xXX> byte tokens for what no merge covers.
    llama   SentencePiece BPE (Llama 2, TinyLlama, Mistral 7B, Phi-3): the `sentencepiece` library runs a model
            proto that we serialize from the GGUF's tokens, scores and token types.

Around them, the parts llama.cpp does itself (llama_vocab::impl::tokenize):

    text -> split out special tokens (user-defined always; control only with special=True; TokenMatcher)
         -> each plain fragment: [SPM: " " prefix at the start and after a special token]
            -> pieces of a long fragment, cut where the ids cannot change (cut_points) -> BPE -> ids
         -> BOS / EOS per tokenizer.ggml.add_bos_token / add_eos_token (with llama.cpp's defaults)

Decoding maps every id to bytes (byte-level alphabet undone, "\u2581" -> " ", <0xXX> -> one byte) and decodes
UTF-8 once at the end; StreamDecoder does the same incrementally and never emits half a character.
llama.cpp's `clean_spaces` post-processing (" ," -> ",") is not applied: it is lossy, and
decode(encode(text)) == text is worth more.
"""

from __future__ import annotations

import codecs
import operator
import os
import re
import struct
from bisect import bisect_right
from functools import lru_cache
from itertools import groupby
from typing import Any, Iterable, Iterator

from .errors import TokenizerError

# GGUF token types (gguf.TokenType; the numbers are SentencePiece's too).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")

# -- pre-tokenizer regexes (llama-vocab.cpp, llm_tokenizer_bpe) ---------------------------------------------
# Each list is applied in turn: every regex splits the fragments the previous ones left, keeping both the
# matches and the text between them (HF `Split(behavior="isolated")`).

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
         rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TINY_AYA = (r"\d{1,3}(?=(?:\d{3})*\b)",
            rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_LETTERS = (  # cased letters; the escapes are code points that Unicode normalization would change
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ"
    "\u1f5f-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌ\u1fd0-\u1fd3\u1fd6-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄ"
    "Ⰰ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_DEEPSEEK3_MAIN = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                   r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"

_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (GPT2,),
    "llama3": (LLAMA3,),
    "qwen2": (QWEN2,),
    "qwen35": (QWEN35,),
    "digits+gpt2": (r"\p{N}", GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-llm": (r"[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                     r"[一-龥ࠀ-一가-퟿]+", r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "deepseek3": (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK3_MAIN),
    "tekken": (TEKKEN,),
    "gpt4o": (GPT4O,),
    "tiny-aya": TINY_AYA,
    "poro": (_PORO,),
    "viking": (_PORO, r"\p{N}"),
    "seed-coder": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                   r"|\s+(?!\S)|\s+",),
    "bailingmoe": (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]"
                   r"|\s+(?!\S)|\s+",),
    "gemma4": (r"[^\n]+|[\n]+",),  # after " " -> "\u2581"; BPE on raw UTF-8 (tokenizer.ggml.model gemma4)
    "minicpm5": (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
}

# tokenizer.ggml.pre -> (split family, ignore_merges, add_bos default). llama-vocab.cpp, llama_vocab::impl::load.
_PRE_TYPES: dict[str, tuple[str, bool, bool]] = {"default": ("default", False, False)}
for _names, _family, _ignore, _bos in [
    ("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", "llama3", True, True),
    ("dbrx smaug-bpe glm4 chatglm-bpe", "llama3", False, False),
    ("deepseek-llm", "deepseek-llm", False, False),
    ("deepseek-coder", "deepseek-coder", False, False),
    ("deepseek-v3 hunyuan-dense joyai-llm hy_v4", "deepseek3", False, False),
    ("falcon", "falcon", False, False),
    # "gpt2" is not a name llama.cpp writes, but converters and people do: an explicit alias of "gpt-2".
    ("gpt-2 gpt2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4 mpt olmo "
     "jais trillion granite-docling jina-v1-en jina-v2-code roberta-bpe", "gpt2", False, False),
    ("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", "digits+gpt2", False, False),
    ("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open", "qwen2", False, False),
    ("qwen35", "qwen35", False, False),
    ("tekken", "tekken", True, True),
    ("gpt-4o llama4 kanana2 talkie minimax-m2", "gpt4o", False, False),
    ("tiny_aya cohere2moe", "tiny-aya", False, False),
    ("poro-chat bloom gpt3-finnish", "poro", False, False),
    ("viking", "viking", False, False),
    ("seed-coder", "seed-coder", False, False),
    ("bailingmoe bailingmoe2 llada-moe", "bailingmoe", False, False),
    ("minicpm5", "minicpm5", True, False),
]:
    for _name in _names.split():
        _PRE_TYPES[_name] = (_family, _ignore, _bos)

# End-of-generation tokens found by their text (llama-vocab.cpp: "maintain a list of tokens that cause
# end-of-generation"), and the FIM tokens llama.cpp also stops on.
_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
])
# FIM tokens by their text, used when the metadata key is absent (then they also become control tokens);
# llama.cpp stops generation on pad, repo and file-separator.
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[dict[str, int], list[str]]:
    """GPT-2's reversible byte <-> printable character map: (char -> byte, byte -> char)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = [""] * 256
    extra = 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in enumerate(chars)}, chars


_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# -- long texts in pieces ----------------------------------------------------------------------------------
# Where a text may be cut so that the ids of the pieces are the ids of the whole: before a space or line break
# that follows an ASCII letter or digit, and after a lone line break between a non-space and a letter or digit.
# Every pre-tokenizer regex above ends a match there and starts the next one afresh (none looks behind, and
# none lets a letter run, a digit run or a space run reach across), so BPE, which never merges across
# pre-tokens, sees the same words; tests/test_tokenizer.py checks it for every regex family on random texts.
# SentencePiece and gemma4 merge across spaces, so there the vocabulary has a say too (Tokenizer._next_cut).
_CUT = re.compile(r"(?<=[A-Za-z0-9])[ \n]|(?<=\S\n)(?=[^\W_])")
PIECE_CHARS = 1 << 16  # a long text is tokenized in pieces of about this many characters
# A stretch with no cut is tokenized whole (100-500 bytes per character while it runs): refuse absurd ones.
MAX_STRETCH_CHARS = 1 << 21
_WHITESPACE = re.compile(r"[ \t\n\v\f\r]*")


def cut_points(text: str) -> list[int]:
    """Every position where `text` may be cut without changing its BPE pre-tokens (for tests and tools)."""
    return [m.start() for m in _CUT.finditer(text)]


def _check_stretch(n: int) -> None:
    if n > MAX_STRETCH_CHARS:
        raise TokenizerError(
            f"cannot tokenize {n:,} characters in one stretch (at most {MAX_STRETCH_CHARS:,}): long texts are "
            "tokenized in pieces cut at line breaks and at spaces after letters or digits, and this one has none"
        )


class TokenMatcher:
    """Leftmost-longest search for any of a set of token strings (special and user-defined tokens), in time
    and memory proportional to the text and to the set, not to their product: one regex alternation of a
    vocabulary with millions of user-defined tokens took minutes and gigabytes to compile.

    The tokens stay in one sorted list. A character class of their first characters finds where one may start;
    a binary search finds the longest token the text continues with there: the last token <= the text is
    either a prefix of it (then the longest), or shares a prefix with it that bounds every match (search
    again for that)."""

    WINDOW = 64  # characters of text compared at first; doubled while some token is longer and still matches

    def __init__(self, texts: Iterable[str]):
        self._sorted = sorted(texts)
        if self._sorted and not self._sorted[0]:
            del self._sorted[0]  # the empty string (sorted first) matches nowhere
        # first character -> length of the longest token starting with it (tokens sharing one are adjacent)
        self._longest = {c: max(map(len, group)) for c, group in groupby(self._sorted, key=operator.itemgetter(0))}
        self._starts = re.compile(_char_class(self._longest))

    def search(self, text: str, pos: int = 0) -> tuple[int, int] | None:
        """(start, end) of the first token at or after `pos` (the longest one starting there), or None."""
        while (m := self._starts.search(text, pos)) is not None:
            start = m.start()
            end = self._longest_at(text, start)
            if end:
                return start, end
            pos = start + 1
        return None

    def _longest_at(self, text: str, start: int) -> int:
        """The end of the longest token that `text` holds at `start`, or 0."""
        limit = self._longest[text[start]]
        window = self.WINDOW
        while True:
            head = text[start : start + min(window, limit)]
            end = self._longest_prefix(head)
            if window >= limit or len(head) < window or not self._extends(head):
                return start + end if end else 0
            window *= 2

    def _longest_prefix(self, head: str) -> int:
        tokens = self._sorted
        while head:
            i = bisect_right(tokens, head) - 1
            if i < 0:
                return 0
            if head.startswith(tokens[i]):
                return len(tokens[i])
            head = head[: len(os.path.commonprefix((head, tokens[i])))]
        return 0

    def _extends(self, head: str) -> bool:
        """Whether a token longer than `head` starts with it (then a wider window may find a longer match)."""
        i = bisect_right(self._sorted, head)  # tokens that start with `head` and are longer sort right after it
        return i < len(self._sorted) and self._sorted[i].startswith(head)


def _char_class(chars: Iterable[str]) -> str:
    """A regex character class of `chars`, written as ranges (a vocabulary may start tokens with any of
    thousands of characters)."""
    points = sorted(map(ord, chars))
    parts, i = [], 0
    while i < len(points):
        j = i
        while j + 1 < len(points) and points[j + 1] == points[j] + 1:
            j += 1
        first, last = re.escape(chr(points[i])), re.escape(chr(points[j]))
        parts.append(first if i == j else f"{first}-{last}")
        i = j + 1
    return "[" + "".join(parts) + "]"


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build with `Tokenizer.from_metadata(md)`."""

    kind: str  # 'bpe' | 'spm'
    pre: str  # tokenizer.ggml.pre ('default' when absent)

    def __init__(self, md: dict[str, Any]):
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("the file has no tokenizer (missing metadata key 'tokenizer.ggml.model')")
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} "
                f"(tokenizer.ggml.model; supported: {', '.join(SUPPORTED_MODELS)})"
            )
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("missing or invalid metadata key 'tokenizer.ggml.tokens'")
        n = len(tokens)
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp renames empty tokens
        self._tokens: list[str] = tokens
        self._ids: dict[str, int] = {t: i for i, t in enumerate(tokens)}
        if len(self._ids) != n:
            seen: set[str] = set()
            dup = next(t for t in tokens if t in seen or seen.add(t))  # type: ignore[func-returns-value]
            raise TokenizerError(f"duplicate token in vocabulary: {dup!r}")
        types = md.get("tokenizer.ggml.token_type")
        if types is None:
            types = [NORMAL] * n
        elif not isinstance(types, list) or len(types) < n:
            raise TokenizerError("tokenizer.ggml.token_type is shorter than the vocabulary")
        if not all(type(t) is int for t in types[:n]):  # a float (NaN, inf) or string array from a broken file
            raise TokenizerError("tokenizer.ggml.token_type must hold integers")
        self._types: list[int] = list(types[:n])

        self.kind = "spm" if model == "llama" else "bpe"
        pre = md.get("tokenizer.ggml.pre")
        self.pre = pre if isinstance(pre, str) and pre else "default"
        # gemma4: BPE over raw UTF-8 with spaces written "\u2581" and <0xXX> byte tokens (no byte-level alphabet).
        self._byte_level = model == "gpt2"

        # Defaults as llama.cpp has them before reading the keys.
        if self.kind == "spm":
            bos, eos, unk = 1, 2, 0
            self.add_bos, self.add_eos = True, False
            add_space_prefix = True
            family = ignore_merges = None
        elif model == "gemma4":
            bos = eos = unk = None
            self.pre, family, ignore_merges = "gemma4", "gemma4", False
            self.add_bos, self.add_eos = True, False
            add_space_prefix = False
        else:
            bos, eos, unk = 11, 11, None
            if self.pre not in _PRE_TYPES:
                raise TokenizerError(
                    f"unsupported pre-tokenizer {self.pre!r} (tokenizer.ggml.pre; supported: "
                    f"{', '.join(sorted(_PRE_TYPES))})"
                )
            family, ignore_merges, self.add_bos = _PRE_TYPES[self.pre]
            self.add_eos = False
            add_space_prefix = False
        self.bos_id = self._special_id(md, "bos", bos)
        self.eos_id = self._special_id(md, "eos", eos)
        self.unk_id = self._special_id(md, "unknown", unk)
        self.add_bos = _flag(md, "tokenizer.ggml.add_bos_token", self.add_bos) or model == "gemma4"  # llama.cpp
        self.add_eos = _flag(md, "tokenizer.ggml.add_eos_token", self.add_eos)
        self.add_space_prefix = _flag(md, "tokenizer.ggml.add_space_prefix", add_space_prefix)
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true, but the vocabulary has no BOS token")
        if self.add_eos and self.eos_id is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true, but the vocabulary has no EOS token")

        self.eog_ids: frozenset[int] = self._find_eog(md)
        self._rstrip = self._strip_rules(md)
        self._matchers: dict[bool, TokenMatcher | None] = {}
        self._glued: frozenset[tuple[str, str]] | None = None
        self._piece_cache: dict[int, bytes] = {}

        if self.kind == "bpe":
            self._bpe = self._build_bpe(md, _PRE_SPLITS[family], bool(ignore_merges))
        else:
            self._spm = self._build_spm(md)

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> "Tokenizer":
        return cls(md)

    # -- metadata ------------------------------------------------------------------------------------------

    def _special_id(self, md: dict[str, Any], name: str, default: int | None) -> int | None:
        n = len(self._tokens)
        value = md.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
            return value
        return default if default is not None and default < n else None

    def _find_eog(self, md: dict[str, Any]) -> frozenset[int]:
        """EOS, EOT, EOM, FIM pad/repo/separator and the tokens llama.cpp stops on by their text. Tokens found by
        their text become control tokens, as in llama_vocab::impl::load."""
        found: dict[str, int | None] = {}
        for name, texts in _FIM_TEXTS.items():
            tid = self._special_id(md, name, None)
            if tid is None:
                tid = next((self._ids[t] for t in texts if t in self._ids), None)
                if tid is not None:
                    self._types[tid] = CONTROL
            found[name] = tid
        eog = {found[n] for n in ("fim_pad", "fim_rep", "fim_sep") if found[n] is not None}
        for text in _EOG_TEXTS:
            if text in self._ids:
                eog.add(self._ids[text])
                self._types[self._ids[text]] = CONTROL
        eog.update(t for t in (self.eos_id, found["eot"], found["eom"]) if t is not None)
        # gpt-oss (o200k_harmony) and solar-open: there <|end|> ends a message, not the generation.
        texts = {self._tokens[i] for i in eog}
        if "<|end|>" in texts and (
            {"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts
        ):
            end = self._ids["<|end|>"]
            eog.discard(end)
            self._types[end] = USER_DEFINED
        if "<|tool_response>" in texts and "</s>" in texts:  # gemma4, paddleocr
            eog.discard(self._ids["</s>"])
            self._types[self._ids["</s>"]] = NORMAL
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
            if text in self._ids:
                self._types[self._ids[text]] = USER_DEFINED
        return frozenset(eog)

    def _strip_rules(self, md: dict[str, Any]) -> frozenset[int]:
        """Special tokens that eat the whitespace after them (llama.cpp sets this for Phi-3 by model name)."""
        name = str(md.get("general.name") or "").lower()
        if "phi-3" not in name and "phi3" not in name:
            return frozenset()
        ids = {i for i, t in enumerate(self._types) if t in (CONTROL, USER_DEFINED, UNKNOWN)}
        if "</s>" in self._ids:
            ids.add(self._ids["</s>"])
        ids -= {self._ids[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in self._ids}
        return frozenset(ids)

    # -- building the engines --------------------------------------------------------------------------------

    def _build_bpe(self, md: dict[str, Any], splits: tuple[str, ...], ignore_merges: bool) -> Any:
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, normalizers, pre_tokenizers

        merges = md.get("tokenizer.ggml.merges")
        if not isinstance(merges, list):
            raise TokenizerError("missing metadata key 'tokenizer.ggml.merges' (a BPE vocabulary needs its merges)")
        pairs = []
        for m in merges:
            cut = m.find(" ", 1) if isinstance(m, str) else -1
            if cut < 0:
                raise TokenizerError(f"malformed merge {m!r} in tokenizer.ggml.merges")
            pairs.append((m[:cut], m[cut + 1 :]))
        # A merge of or into a token the vocabulary lacks can never apply (llama.cpp would fall back to bytes),
        # but `tokenizers` refuses to load it, or with a small vocabulary panics in Rust (a BaseException, and a
        # backtrace on stderr): leave such merges out before it sees them.
        ids = self._ids
        pairs = [(a, b) for a, b in pairs if a in ids and b in ids and a + b in ids]
        try:
            model = models.BPE(self._ids, pairs, ignore_merges=ignore_merges, byte_fallback=not self._byte_level)
            hf = HFTokenizer(model)
            steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            if self._byte_level:
                steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
            else:
                hf.normalizer = normalizers.Replace(" ", "\u2581")
            hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
        except Exception as exc:  # tokenizers raises plain Exceptions
            raise TokenizerError(f"cannot build the BPE tokenizer: {exc}") from None
        return hf

    def _build_spm(self, md: dict[str, Any]) -> Any:
        import sentencepiece

        scores = md.get("tokenizer.ggml.scores")
        n = len(self._tokens)
        if scores is None:
            scores = [0.0] * n
        elif not isinstance(scores, list) or len(scores) < n:
            raise TokenizerError("tokenizer.ggml.scores is shorter than the vocabulary")
        if not all(isinstance(x, (int, float)) for x in scores[:n]):
            raise TokenizerError("tokenizer.ggml.scores must hold numbers")
        scores = [min(max(float(x), -3.4e38), 3.4e38) for x in scores[:n]]  # the proto stores float32
        proto = _spm_model_proto(self._tokens, scores, self._types, self.unk_id)
        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except Exception as exc:
            raise TokenizerError(f"cannot build the SentencePiece tokenizer: {exc}") from None
        return sp

    # -- encoding --------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def piece(self, token_id: int) -> str:
        """The token as the vocabulary spells it ('Ġworld', '▁the', '<0x0A>', '<|im_end|>')."""
        return self._tokens[self._check_id(token_id)]

    def token_type(self, token_id: int) -> int:
        """GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), as llama.cpp
        overrides it (end-of-generation tokens are control)."""
        return self._types[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id of a token spelled exactly `text`, or None."""
        return self._ids.get(text)

    def encode(
        self, text: str, *, add_bos: bool | None = None, special: bool = False, add_eos: bool | None = None
    ) -> list[int]:
        """Token ids of `text`. add_bos/add_eos None: as the file says (tokenizer.ggml.add_bos_token...).
        special=True turns control tokens written in the text (<|im_start|>, <s>) into their ids; user-defined
        tokens always are (as in llama.cpp and HF tokenizers)."""
        if not isinstance(text, str):
            raise TokenizerError(f"can only tokenize text, got {type(text).__name__}")
        add_bos = self.add_bos if add_bos is None else add_bos
        add_eos = self.add_eos if add_eos is None else add_eos
        if add_bos and self.bos_id is None:
            raise TokenizerError("the vocabulary has no BOS token")
        if add_eos and self.eos_id is None:
            raise TokenizerError("the vocabulary has no EOS token")
        ids: list[int] = [self.bos_id] if add_bos else []  # type: ignore[list-item]
        # SPM (llama.cpp): a space before the first fragment and before every fragment after a special token.
        prefix = self.kind == "spm" and self.add_space_prefix
        after_special = True
        same: dict[int, int] = {}  # one int object per distinct id: a long text's list holds pointers, not ints
        for part in self._partition(text, special):
            if isinstance(part, int):
                ids.append(part)
                after_special = True
                continue
            for k, piece in enumerate(self._pieces(part)):
                piece_ids = self._encode_piece(" " + piece if k == 0 and prefix and after_special else piece)
                ids.extend(map(same.setdefault, piece_ids, piece_ids))
            after_special = False
        if add_eos:
            ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    def _encode_piece(self, text: str) -> list[int]:
        try:
            if self.kind == "bpe":
                ids = self._bpe.encode(text, add_special_tokens=False).ids
            else:
                ids = self._spm.encode(text)
        except Exception as exc:  # lone surrogates and the like
            raise TokenizerError(f"cannot tokenize this text: {exc}") from None
        if self.unk_id is None and ids and max(ids) >= len(self._tokens):
            raise TokenizerError("the text has characters this vocabulary cannot spell (it has no <unk> token)")
        return ids

    def _pieces(self, text: str) -> Iterator[str]:
        """`text` in pieces of about PIECE_CHARS, cut only where the pieces' ids are the whole text's (see
        cut_points): the engines need some 100-500 bytes per character while they work, so a 50 MB prompt read
        whole would take gigabytes."""
        start = 0
        while len(text) - start > PIECE_CHARS:
            cut = self._next_cut(text, start + PIECE_CHARS)
            if cut is None:
                break
            _check_stretch(cut - start)
            yield text[start:cut]
            start = cut
        _check_stretch(len(text) - start)
        yield text[start:]

    def _next_cut(self, text: str, pos: int) -> int | None:
        """The first safe cut at or after `pos`. SentencePiece and gemma4 merge across spaces and line breaks
        whenever a vocabulary piece spans them: a cut is safe there only where no piece holds its two
        characters side by side."""
        for m in _CUT.finditer(text, pos):
            i = m.start()
            if self._byte_level or (text[i - 1], text[i]) not in self._glued_pairs:
                return i
        return None

    @property
    def _glued_pairs(self) -> frozenset[tuple[str, str]]:
        """Pairs of characters (a space as "\u2581") that a vocabulary piece holds side by side around a
        space or line break."""
        if self._glued is None:
            pairs = set()
            for t in self._tokens:
                if "\u2581" in t or "\n" in t:
                    pairs.update((a, b) for a, b in zip(t, t[1:]) if a in "\u2581\n" or b in "\u2581\n")
            self._glued = frozenset((a.replace("\u2581", " "), b.replace("\u2581", " ")) for a, b in pairs)
        return self._glued

    def _partition(self, text: str, special: bool) -> Iterator[str | int]:
        """`text` around special-token strings: str | id, no empty strings (tokenizer_st_partition). Leftmost
        match first, the longest token at a position (as HF tokenizers' added-token matching)."""
        matcher = self._special_matcher(special)
        pos = 0
        while matcher is not None and (found := matcher.search(text, pos)) is not None:
            start, end = found
            if start > pos:
                yield text[pos:start]
            tid = self._ids[text[start:end]]
            yield tid
            pos = end
            if tid in self._rstrip:
                pos = _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]
        if pos < len(text):
            yield text[pos:]

    def _special_matcher(self, special: bool) -> "TokenMatcher | None":
        if special not in self._matchers:
            kinds = (CONTROL, USER_DEFINED, UNKNOWN) if special else (USER_DEFINED,)
            texts = {token for token, t in zip(self._tokens, self._types) if t in kinds}
            self._matchers[special] = TokenMatcher(texts) if texts else None
        return self._matchers[special]

    # -- decoding --------------------------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], *, special: bool = True, strip_dummy_prefix: bool = True) -> str:
        """Text of `ids`. special=False drops control tokens (BOS, <|im_end|>...). Invalid UTF-8 (a sequence cut
        mid-character) becomes U+FFFD. For SPM the dummy-prefix space of the first piece printed is removed
        (unless strip_dummy_prefix=False); a space after a special token stays, as llama.cpp's
        llama_detokenize and transformers print it ("<s> Hello", "Hi<|end|> There")."""
        out = bytearray()
        strip = self._strips_prefix(strip_dummy_prefix)
        for tid in ids:
            piece, strip = self._decode_step(tid, special, strip, strip_dummy_prefix)
            out += piece
        return out.decode("utf-8", errors="replace")

    def _strips_prefix(self, enabled: bool) -> bool:
        return enabled and self.kind == "spm" and self.add_space_prefix

    def _decode_step(self, tid: int, special: bool, strip: bool, enabled: bool) -> tuple[bytes, bool]:
        """Bytes for one id, and whether the next piece still loses a leading space (until one is printed)."""
        tid = self._check_id(tid)
        ttype = self._types[tid]
        if ttype in (CONTROL, UNKNOWN) and not special:
            return b"", strip  # nothing printed: the next piece is still the first
        piece = self._piece_bytes(tid)
        if not piece:
            return piece, strip
        if strip and piece.startswith(b" "):
            piece = piece[1:]
        return piece, False

    def _piece_bytes(self, tid: int) -> bytes:
        piece = self._piece_cache.get(tid)
        if piece is None:
            piece = self._piece_cache[tid] = self._render_piece(tid)
        return piece

    def _render_piece(self, tid: int) -> bytes:
        text, ttype = self._tokens[tid], self._types[tid]
        if ttype in (CONTROL, USER_DEFINED, UNKNOWN):
            return text.encode("utf-8")
        if ttype == BYTE:
            m = _HEX_BYTE.fullmatch(text)
            return bytes([int(m.group(1), 16)]) if m else text.encode("utf-8")
        if ttype != NORMAL:  # unused / undefined tokens print nothing (llama_vocab::token_to_piece)
            return b""
        if not self._byte_level:  # SentencePiece and gemma4
            return text.replace("\u2581", " ").encode("utf-8")
        to_byte, _ = _byte_alphabet()
        try:
            return bytes(to_byte[c] for c in text)
        except KeyError:  # a token outside the byte alphabet: take its characters as they are
            return b"".join(bytes([to_byte[c]]) if c in to_byte else c.encode("utf-8") for c in text)

    def _check_id(self, tid: Any) -> int:
        """`tid` as an int (NumPy integers welcome), or a TokenizerError."""
        try:
            value = operator.index(tid)
        except TypeError:
            raise TokenizerError(f"a token id must be an integer, got {tid!r}") from None
        if not 0 <= value < len(self._tokens):
            raise TokenizerError(f"token id {value} is outside the vocabulary (0..{len(self._tokens) - 1})")
        return value

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, pre={self.pre!r}, vocab_size={self.vocab_size})"


class StreamDecoder:
    """Turns ids into text one at a time: feed() returns the text completed so far, never half a UTF-8
    character; the concatenation of every feed() and the final flush() equals tokenizer.decode(all ids)."""

    def __init__(self, tokenizer: Tokenizer, *, special: bool = True, strip_dummy_prefix: bool = True):
        self._tok = tokenizer
        self._special = special
        self._enabled = strip_dummy_prefix
        self._strip = tokenizer._strips_prefix(strip_dummy_prefix)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        piece, self._strip = self._tok._decode_step(token_id, self._special, self._strip, self._enabled)
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """What is left (an incomplete character becomes U+FFFD); the decoder starts afresh afterwards."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._strip = self._tok._strips_prefix(self._enabled)
        return text


def _flag(md: dict[str, Any], key: str, default: bool) -> bool:
    value = md.get(key)
    return value if isinstance(value, bool) else default


# -- a SentencePiece model proto, written by hand (protobuf is not a dependency) --------------------------
# sentencepiece_model.proto: ModelProto { repeated SentencePiece pieces = 1 {string piece = 1; float score = 2;
# Type type = 3}; TrainerSpec trainer_spec = 2; NormalizerSpec normalizer_spec = 3 }.


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32 -> ten-byte two's complement, as protobuf writes it
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field_bytes(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _field_int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _spm_model_proto(tokens: list[str], scores: list[float], types: list[int], unk_id: int | None) -> bytes:
    """A BPE ModelProto for sentencepiece. Only plain text reaches it (special tokens are split out before), so
    types are simplified to what it accepts: exactly one UNKNOWN, BYTE only for <0xXX>, control stays control,
    everything else NORMAL (llama.cpp merges into user-defined and unused tokens too)."""
    pieces = bytearray()
    pack_score = struct.Struct("<f").pack
    has_bytes = False
    for i, (text, score, ttype) in enumerate(zip(tokens, scores, types)):
        if i == unk_id:
            sp_type = UNKNOWN
        elif ttype == BYTE and _HEX_BYTE.fullmatch(text):
            sp_type, has_bytes = BYTE, True
        elif ttype in (CONTROL, UNKNOWN, BYTE):  # (a BYTE token not spelled <0xXX>)
            sp_type = CONTROL
        else:
            sp_type = NORMAL
        body = _field_bytes(1, text.encode("utf-8")) + b"\x15" + pack_score(float(score))  # 0x15: field 2, fixed32
        if sp_type != NORMAL:
            body += _field_int(3, sp_type)
        pieces += _field_bytes(1, body)
    if unk_id is None:  # sentencepiece insists on an unknown piece; ours can never be produced from text
        pieces += _field_bytes(1, _field_bytes(1, b"<llamacli-unk>") + _field_int(3, UNKNOWN))
        unk_id = len(tokens)
    trainer = (
        _field_int(3, 2)  # model_type = BPE
        + _field_int(35, int(has_bytes))  # byte_fallback
        + _field_int(40, unk_id) + _field_int(41, -1) + _field_int(42, -1) + _field_int(43, -1)
    )
    normalizer = (
        _field_bytes(1, b"identity")
        + _field_int(3, 0)  # add_dummy_prefix: we add it ourselves, per fragment, as llama.cpp does
        + _field_int(4, 0)  # remove_extra_whitespaces
        + _field_int(5, 1)  # escape_whitespaces: " " -> "\u2581"
    )
    return bytes(pieces) + _field_bytes(2, trainer) + _field_bytes(3, normalizer)
