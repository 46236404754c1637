"""SentencePiece vocabularies (tokenizer.ggml.model llama): the `sentencepiece` engine, run on a model proto
serialized here from the GGUF's tokens, scores and token types (protobuf is not a dependency).

Also the token-type numbers and the <0xXX> byte-token spelling: SentencePiece's, which GGUF reuses for
every vocabulary kind.
"""

from __future__ import annotations

import re
import struct
from typing import Any

from ..errors import TokenizerError

# GGUF token types (gguf.TokenType; the numbers are SentencePiece's too).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def build_spm(md: dict[str, Any], tokens: list[str], types: list[int], unk_id: int | None) -> Any:
    """The `sentencepiece` engine for this vocabulary, scores from tokenizer.ggml.scores (all 0 when absent)."""
    import sentencepiece

    scores = md.get("tokenizer.ggml.scores")
    n = len(tokens)
    if scores is None:
        scores = [0.0] * n
    elif not isinstance(scores, list) or len(scores) < n:
        raise TokenizerError("tokenizer.ggml.scores is shorter than the vocabulary")
    if not all(isinstance(x, (int, float)) for x in scores[:n]):
        raise TokenizerError("tokenizer.ggml.scores must hold numbers")
    scores = [min(max(float(x), -3.4e38), 3.4e38) for x in scores[:n]]  # the proto stores float32
    proto = _spm_model_proto(tokens, scores, types, unk_id)
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto)
    except Exception as exc:
        raise TokenizerError(f"cannot build the SentencePiece tokenizer: {exc}") from None
    return sp


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


_ONE_BYTE = [bytes([v]) for v in range(128)]  # the varints of 0 .. 127


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
    small = _ONE_BYTE  # varints below 128: nearly every length here (this loop runs once per token: 262k for gemma)
    has_bytes = False
    for i, (text, score, ttype) in enumerate(zip(tokens, scores, types)):
        if i == unk_id:
            sp_type = UNKNOWN
        elif ttype == BYTE and HEX_BYTE.fullmatch(text):
            sp_type, has_bytes = BYTE, True
        elif ttype in (CONTROL, UNKNOWN, BYTE):  # (a BYTE token not spelled <0xXX>)
            sp_type = CONTROL
        else:
            sp_type = NORMAL
        raw = text.encode("utf-8")
        n = len(raw)
        # field 1 (piece, length-delimited: 0x0a), field 2 (score, fixed32: 0x15), field 3 (type, varint: 0x18)
        body = b"\x0a" + (small[n] if n < 128 else _varint(n)) + raw + b"\x15" + pack_score(float(score))
        if sp_type != NORMAL:
            body += b"\x18" + small[sp_type]
        m = len(body)
        pieces += b"\x0a" + (small[m] if m < 128 else _varint(m)) + body
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
