"""Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata, behaving as llama.cpp's do.

Three kinds, picked by `tokenizer.ggml.model`:

    gpt2    byte-level BPE (Llama 3, Qwen2, SmolLM2, Mistral-Nemo...): the `tokenizers` library runs the merges,
            after the pre-tokenizer regexes that `tokenizer.ggml.pre` names (llama.cpp's src/llama-vocab.cpp,
            written here in the Oniguruma syntax of the original tokenizer.json files). bpe.py.
    gemma4  the same BPE over raw UTF-8: spaces written "\u2581", <0xXX> byte tokens for what no merge covers.
    llama   SentencePiece BPE (Llama 2, TinyLlama, Mistral 7B, Phi-3): the `sentencepiece` library runs a model
            proto that we serialize from the GGUF's tokens, scores and token types. spm.py.

Around them, the parts llama.cpp does itself (llama_vocab::impl::tokenize):

    text -> split out special tokens (user-defined always; control only with special=True; TokenMatcher)
         -> each plain fragment: [SPM: " " prefix at the start and after a special token]
            -> pieces of a long fragment, cut where the ids cannot change (cut_points) -> BPE -> ids
         -> BOS / EOS per tokenizer.ggml.add_bos_token / add_eos_token (with llama.cpp's defaults)

This module is that driver, the special tokens (which end generation, which eat the whitespace after them) and
decoding; where a text may be cut (TokenMatcher, cut_points) is in text_chunks.py.

Decoding maps every id to bytes (byte-level alphabet undone, "\u2581" -> " ", <0xXX> -> one byte) and decodes
UTF-8 once at the end; StreamDecoder does the same incrementally and never emits half a character.
llama.cpp's `clean_spaces` post-processing (" ," -> ",") is not applied: it is lossy, and
decode(encode(text)) == text is worth more.
"""

from __future__ import annotations

import codecs
import operator
import re
from itertools import repeat
from typing import Any, Collection, Iterable, Iterator

from ..collector import paused
from ..errors import ContextOverflowError, TokenizerError
from .bpe import build_bpe, byte_alphabet, pre_type
from .spm import BYTE, CONTROL, HEX_BYTE, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, build_spm
from .text_chunks import TokenMatcher, cut_points, glued_pairs, pieces

__all__ = [
    "BYTE", "CONTROL", "NORMAL", "SUPPORTED_MODELS", "UNKNOWN", "UNUSED", "USER_DEFINED",
    "StreamDecoder", "TokenMatcher", "Tokenizer", "TooManyTokens", "cut_points",
]

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")

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
_WHITESPACE = re.compile(r"[ \t\n\v\f\r]*")  # what a Phi-3 special token eats after it (_strip_rules)
_UNSET = object()


class TooManyTokens(ContextOverflowError):
    """encode(text, limit=N) found more than N ids: before tokenizing (the text's length alone says so, see
    Tokenizer.min_tokens) or partway (tokenizing stops at the piece that passes N). `at_least`: the ids
    counted or bounded when it stopped."""

    def __init__(self, limit: int, at_least: int):
        super().__init__(f"the text has more than {limit:,} tokens (at least {at_least:,})")
        self.limit, self.at_least = limit, at_least


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Build with `Tokenizer.from_metadata(md)`."""

    kind: str  # 'bpe' | 'spm'
    pre: str  # tokenizer.ggml.pre ('default' when absent)

    def __init__(self, md: dict[str, Any]):
        with paused():  # ~1M strings, tuples and dicts that stay: no collection walks them (llamacli.collector)
            self._build(md)

    def _build(self, md: dict[str, Any]) -> None:
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("the file has no tokenizer (missing metadata key 'tokenizer.ggml.model')")
        if model not in SUPPORTED_MODELS:
            raise TokenizerError(
                f"unsupported tokenizer model {model!r} "
                f"(tokenizer.ggml.model; supported: {', '.join(SUPPORTED_MODELS)})"
            )
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(map(isinstance, tokens, repeat(str))):
            raise TokenizerError("missing or invalid metadata key 'tokenizer.ggml.tokens'")
        n = len(tokens)
        if "" in tokens:  # llama.cpp renames empty tokens
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        # Else the metadata's own list, never changed here: while the tokenizer holds it, Metadata keeps it for
        # the vocabulary's other readers (the chat template's special tokens) instead of decoding it again.
        self._tokens: list[str] = tokens
        self._ids: dict[str, int] = dict(zip(tokens, range(n)))
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
            family, ignore_merges, self.add_bos = pre_type(self.pre)
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
        self._bound: Any = _UNSET  # _byte_bound(), found when first needed

        if self.kind == "bpe":
            self._bpe = build_bpe(md, self._ids, family, bool(ignore_merges), self._byte_level)
        else:
            self._spm = build_spm(md, self._tokens, self._types, self.unk_id)

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
        self, text: str, *, add_bos: bool | None = None, special: bool = False, add_eos: bool | None = None,
        limit: int | None = None,
    ) -> list[int]:
        """Token ids of `text`. add_bos/add_eos None: as the file says (tokenizer.ggml.add_bos_token...).
        special=True turns control tokens written in the text (<|im_start|>, <s>) into their ids; user-defined
        tokens always are (as in llama.cpp and HF tokenizers).

        `limit=N`: a text with more than N ids (BOS and EOS counted) raises TooManyTokens, without tokenizing
        it whole: at once where its length alone says so (min_tokens), else at the piece that passes N. So a
        prompt that cannot fit a context costs at most a context's worth of tokenizing, whatever its size."""
        if not isinstance(text, str):
            raise TokenizerError(f"can only tokenize text, got {type(text).__name__}")
        add_bos = self.add_bos if add_bos is None else add_bos
        add_eos = self.add_eos if add_eos is None else add_eos
        if add_bos and self.bos_id is None:
            raise TokenizerError("the vocabulary has no BOS token")
        if add_eos and self.eos_id is None:
            raise TokenizerError("the vocabulary has no EOS token")
        ends = int(add_bos) + int(add_eos)
        if limit is not None and (least := self.min_tokens(text) + ends) > limit:
            raise TooManyTokens(limit, least)
        ids: list[int] = [self.bos_id] if add_bos else []  # type: ignore[list-item]
        # SPM (llama.cpp): a space before the first fragment and before every fragment after a special token.
        prefix = self.kind == "spm" and self.add_space_prefix
        after_special = True
        same: dict[int, int] = {}  # one int object per distinct id: a long text's list holds pointers, not ints
        room = None if limit is None else limit - int(add_eos)  # ids allowed before the EOS
        for part in self._partition(text, special):
            if isinstance(part, int):
                ids.append(part)
                after_special = True
            else:
                for k, piece in enumerate(pieces(part, self._cut_is_safe)):
                    piece_ids = self._encode_piece(" " + piece if k == 0 and prefix and after_special else piece)
                    ids.extend(map(same.setdefault, piece_ids, piece_ids))
                    if room is not None and len(ids) > room:
                        break
                after_special = False
            if room is not None and len(ids) > room:
                raise TooManyTokens(limit, len(ids) + int(add_eos))  # type: ignore[arg-type]
        if add_eos:
            ids.append(self.eos_id)  # type: ignore[arg-type]
        return ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on the ids of `text` (BOS and EOS aside), from its length alone: the UTF-8 bytes that
        the vocabulary can spell, over max_token_bytes; 0 where the vocabulary gives no such bound."""
        bound = self._byte_bound()
        if bound is None or not text:
            return 0
        most, dropped = bound
        data = text.encode("utf-8", "surrogatepass")
        return -(-len(data.translate(None, dropped) if dropped else data) // most)

    @property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token can stand for, where every byte of a text ends up in a token, so
        that a text of B bytes has at least B / max_token_bytes ids (min_tokens); None where the vocabulary
        gives no such bound (see _byte_bound)."""
        bound = self._byte_bound()
        return None if bound is None else bound[0]

    def _byte_bound(self) -> tuple[int, bytes] | None:
        """(max_token_bytes, the bytes of a text that may end up in no token), found once. A token's spelling is
        at least as long in UTF-8 as the text it matches (a byte-level character is one byte of text, "\u2581"
        one space, <0xXX> one byte), so its length bounds what it covers. Bytes that may end up in no token
        are not counted: those a byte-level vocabulary cannot spell (`tokenizers` leaves them out; SmolLM2
        lacks a few control bytes and the bytes UTF-8 never uses), and whitespace where special tokens eat the
        whitespace after them (Phi-3). No bound where SentencePiece or gemma4 lacks some of the 256 <0xXX> byte
        tokens: a run of unknown characters becomes one <unk>."""
        if self._bound is _UNSET:
            self._bound = None
            dropped = b" \t\n\v\f\r" if self._rstrip else b""
            if self._byte_level:
                dropped += bytes(b for b, c in enumerate(byte_alphabet()[1]) if c not in self._ids)
                complete = True
            else:
                hexes = (self._ids.get(f"<0x{b:02X}>") for b in range(256))
                complete = all(i is not None and (self.kind != "spm" or self._types[i] == BYTE) for i in hexes)
            if complete:
                self._bound = (max(len(t.encode("utf-8", "surrogatepass")) for t in self._tokens), dropped)
        return self._bound  # type: ignore[return-value]

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

    def _cut_is_safe(self, text: str, i: int) -> bool:
        """Whether the vocabulary lets a long text be cut at cut point `i` (see text_chunks.glued_pairs)."""
        if self._byte_level:
            return True
        if self._glued is None:
            self._glued = glued_pairs(self._tokens)
        return (text[i - 1], text[i]) not in self._glued

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
            m = HEX_BYTE.fullmatch(text)
            return bytes([int(m.group(1), 16)]) if m else text.encode("utf-8")
        if ttype != NORMAL:  # unused / undefined tokens print nothing (llama_vocab::token_to_piece)
            return b""
        if not self._byte_level:  # SentencePiece and gemma4
            return text.replace("\u2581", " ").encode("utf-8")
        to_byte, _ = byte_alphabet()
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

    def __init__(self, tokenizer: Tokenizer, *, special: bool = True, strip_dummy_prefix: bool = True,
                 keep: Collection[int] = ()):
        self._tok = tokenizer
        self._special = special
        self._keep = frozenset(keep)  # control tokens printed even with special=False
        self._enabled = strip_dummy_prefix
        self._strip = tokenizer._strips_prefix(strip_dummy_prefix)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        special = self._special or token_id in self._keep
        piece, self._strip = self._tok._decode_step(token_id, special, self._strip, self._enabled)
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
