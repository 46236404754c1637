"""Byte-level BPE vocabularies (tokenizer.ggml.model gpt2 and gemma4): the pre-tokenizer regexes that
`tokenizer.ggml.pre` names, GPT-2's byte alphabet, and the `tokenizers` engine that runs the merges.

Kept apart from tokenizer.py because this is table data and engine wiring, read when a new `pre` name
arrives, not when following how a text becomes ids.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..errors import TokenizerError

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

PRE_SPLITS: dict[str, tuple[str, ...]] = {
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
PRE_TYPES: dict[str, tuple[str, bool, bool]] = {"default": ("default", False, False)}
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
        PRE_TYPES[_name] = (_family, _ignore, _bos)


def pre_type(pre: str) -> tuple[str, bool, bool]:
    """(split family, ignore_merges, add_bos default) of a `tokenizer.ggml.pre` name, or a TokenizerError."""
    if pre not in PRE_TYPES:
        raise TokenizerError(
            f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre; supported: {', '.join(sorted(PRE_TYPES))})"
        )
    return PRE_TYPES[pre]


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[dict[str, int], list[str]]:
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


def build_bpe(md: dict[str, Any], ids: dict[str, int], family: str, ignore_merges: bool, byte_level: bool) -> Any:
    """The `tokenizers` engine for vocabulary `ids` (token -> id): merges from tokenizer.ggml.merges, the
    split regexes of `family`, then GPT-2's byte alphabet (byte_level) or " " -> "\u2581" with <0xXX> byte
    fallback (gemma4)."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, models, normalizers, pre_tokenizers

    merges = md.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise TokenizerError("missing metadata key 'tokenizer.ggml.merges' (a BPE vocabulary needs its merges)")
    # Each merge is "left right", split at its first space after the first character (a left token may begin
    # with a space). str.partition splits them all at once where none begins with a space (on Llama 3's 280k
    # merges faster than a loop of find(): docs/perf-log.md); otherwise, or for a malformed one, the loop.
    parts = [m.partition(" ") for m in merges] if all(type(m) is str for m in merges) else None
    if parts is None or not all(a and sep for a, sep, _ in parts):
        parts = []
        for m in merges:
            cut = m.find(" ", 1) if isinstance(m, str) else -1
            if cut < 0:
                raise TokenizerError(f"malformed merge {m!r} in tokenizer.ggml.merges")
            parts.append((m[:cut], " ", m[cut + 1 :]))
    # A merge of or into a token the vocabulary lacks can never apply (llama.cpp would fall back to bytes),
    # but `tokenizers` refuses to load it, or with a small vocabulary panics in Rust (a BaseException, and a
    # backtrace on stderr): leave such merges out before it sees them.
    pairs = [(a, b) for a, _, b in parts if a in ids and b in ids and a + b in ids]
    try:
        model = models.BPE(ids, pairs, ignore_merges=ignore_merges, byte_fallback=not byte_level)
        hf = HFTokenizer(model)
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[family]]
        if byte_level:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        else:
            hf.normalizer = normalizers.Replace(" ", "\u2581")
        hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    except Exception as exc:  # tokenizers raises plain Exceptions
        raise TokenizerError(f"cannot build the BPE tokenizer: {exc}") from None
    return hf
