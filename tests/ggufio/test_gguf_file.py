"""GGUF reading: agreement with gguf.GGUFReader, and a specific error for every kind of broken file."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from gguf import GGUFReader

import gguf_bytes as gb
from llamacli.errors import (
    CorruptFileError,
    GGUFError,
    ModelNotFoundError,
    NotGGUFError,
    TruncatedFileError,
    UnsupportedTensorTypeError,
    UnsupportedVersionError,
)
from llamacli.ggufio.file import open_gguf


def write(tmp_path, data: bytes, name: str = "m.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def reader_values(path):
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}, r.tensors


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_K_M", "Q6_K", "IQ4_XS"])
def test_matches_gguf_reader_on_random_models(random_model, qtype):
    path = random_model("small-qwen2", qtype)
    g = open_gguf(path)
    md, tensors = reader_values(path)
    assert list(g.metadata) == list(md)
    for k, v in md.items():
        assert g.metadata[k] == v, k
    assert [t.name for t in tensors] == list(g.tensors)
    for t in tensors:
        ours = g.tensors[t.name]
        assert ours.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert (ours.type, ours.n_bytes, ours.offset) == (t.tensor_type, t.n_bytes, t.data_offset)
        assert np.array_equal(np.asarray(g.raw(t.name)).view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel())


def test_matches_gguf_reader_on_real_files(smollm2, llama_cpp_models):
    # (GGUFReader needs ~6 s for a 151k-token vocabulary, so the large BPE files are left to the other test)
    for path in [smollm2, llama_cpp_models / "ggml-vocab-llama-spm.gguf", llama_cpp_models / "ggml-vocab-phi-3.gguf"]:
        md, tensors = reader_values(path)
        g = open_gguf(path)
        assert g.metadata == md
        assert len(g.tensors) == len(tensors)


def test_metadata_value_types(tmp_path):
    kvs = [
        gb.kv("general.architecture", gb.STR, "llama"),
        gb.kv("a.u8", gb.U8, 255), gb.kv("a.i8", gb.I8, -3), gb.kv("a.u16", gb.U16, 65535), gb.kv("a.i16", gb.I16, -2),
        gb.kv("a.u32", gb.U32, 7), gb.kv("a.i32", gb.I32, -7), gb.kv("a.f32", gb.F32, 0.5), gb.kv("a.bool", gb.BOOL, True),
        gb.kv("a.u64", gb.U64, 2**40), gb.kv("a.i64", gb.I64, -(2**40)), gb.kv("a.f64", gb.F64, 1.25),
        gb.kv("a.str", gb.STR, "héllo 🦙"), gb.kv("a.arr", gb.ARR, (gb.I32, [1, -2, 3])),
        gb.kv("a.sarr", gb.ARR, (gb.STR, ["x", "", "ünï"])), gb.kv("a.barr", gb.ARR, (gb.BOOL, [True, False])),
        gb.kv("a.nan", gb.F32, float("nan")),
    ]
    p = write(tmp_path, gb.gguf(kvs))
    md = open_gguf(p).metadata
    assert md["a.u8"] == 255 and md["a.i8"] == -3 and md["a.u16"] == 65535 and md["a.i16"] == -2
    assert md["a.u32"] == 7 and md["a.i32"] == -7 and md["a.f32"] == 0.5 and md["a.bool"] is True
    assert md["a.u64"] == 2**40 and md["a.i64"] == -(2**40) and md["a.f64"] == 1.25
    assert md["a.str"] == "héllo 🦙" and md["a.arr"] == [1, -2, 3] and md["a.sarr"] == ["x", "", "ünï"]
    assert md["a.barr"] == [True, False] and math.isnan(md["a.nan"])


def test_tensor_views(tmp_path):
    p = write(tmp_path, gb.f32_tensor_file(n=8))
    g = open_gguf(p)
    assert g.tensors["t"].shape == (8,)
    assert g.dequantize("t").tolist() == list(range(8))


# -- every kind of broken file: a specific error class and message ---------------------------------------------


def expect(tmp_path, data: bytes, error: type[GGUFError], *words: str):
    p = write(tmp_path, data)
    with pytest.raises(error) as info:
        open_gguf(p)
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        open_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError, match="not a file"):
        open_gguf(tmp_path)


@pytest.mark.parametrize("data", [b"", b"GG", b"PK\x03\x04" + b"\0" * 40, b"GGML" + b"\0" * 40, b"{\"a\": 1}\n" * 5])
def test_not_gguf(tmp_path, data):
    expect(tmp_path, data, NotGGUFError, "not a GGUF file")


@pytest.mark.parametrize("version", [0, 1, 4, 99])
def test_unsupported_version(tmp_path, version):
    expect(tmp_path, gb.gguf([], version=version), UnsupportedVersionError, "version")


def test_big_endian_file(tmp_path):
    data = b"GGUF" + struct.pack(">IQQ", 3, 0, 0)
    expect(tmp_path, data, UnsupportedVersionError, "big-endian")


def test_truncated_at_every_header_boundary(tmp_path):
    full = gb.f32_tensor_file(n=8, extra_kvs=[gb.kv("x.arr", gb.ARR, (gb.STR, ["ab", "cd"]))])
    header_end = len(full) - 32  # the data section is 8 floats
    for cut in range(4, header_end - 31):  # every byte of the header after the magic
        p = write(tmp_path, full[:cut])
        with pytest.raises((TruncatedFileError, CorruptFileError)) as info:
            open_gguf(p)
        assert "\n" not in str(info.value)


def test_truncated_tensor_data(tmp_path):
    full = gb.f32_tensor_file(n=8)
    expect(tmp_path, full[:-4], TruncatedFileError, "truncated", "'t'")


@pytest.mark.parametrize("field", ["tensors", "kv"])
def test_absurd_counts_fail_fast(tmp_path, field):
    kw = {"n_tensors": 1 << 40} if field == "tensors" else {"n_kv": 1 << 40}
    msg = expect(tmp_path, gb.gguf([gb.kv("general.architecture", gb.STR, "llama")], **kw), CorruptFileError, "claims")
    assert str(1 << 40) in msg


def test_absurd_array_and_string_lengths(tmp_path):
    huge_array = gb.string("a.arr") + struct.pack("<IIQ", gb.ARR, gb.U32, 1 << 60)
    expect(tmp_path, gb.gguf([huge_array]), TruncatedFileError, "a.arr")
    huge_strings = gb.string("a.sarr") + struct.pack("<IIQ", gb.ARR, gb.STR, 1 << 40)
    expect(tmp_path, gb.gguf([huge_strings]), TruncatedFileError, "a.sarr")
    huge_string = gb.string("a.str") + struct.pack("<IQ", gb.STR, 1 << 62)
    expect(tmp_path, gb.gguf([huge_string]), TruncatedFileError, "a.str")
    huge_key = struct.pack("<Q", 1 << 63)
    expect(tmp_path, gb.gguf([huge_key], data=b"\0" * 64), TruncatedFileError, "key")


def test_bad_value_types(tmp_path):
    expect(tmp_path, gb.gguf([gb.string("k") + struct.pack("<I", 77)]), CorruptFileError, "unknown value type")
    nested = gb.string("k") + struct.pack("<IIQ", gb.ARR, gb.ARR, 1)
    expect(tmp_path, gb.gguf([nested]), CorruptFileError, "array")


def test_invalid_utf8(tmp_path):
    expect(tmp_path, gb.gguf([gb.kv(b"\xff\xfe", gb.U8, 1)]), CorruptFileError, "UTF-8")
    expect(tmp_path, gb.gguf([gb.kv("k", gb.STR, b"\xc3\x28")]), CorruptFileError, "UTF-8", "'k'")
    expect(tmp_path, gb.gguf([gb.kv("k", gb.ARR, (gb.STR, [b"ok", b"\xed\xa0\x80"]))]), CorruptFileError, "UTF-8")


def test_duplicates(tmp_path):
    kvs = [gb.kv("a", gb.U8, 1), gb.kv("a", gb.U8, 2)]
    expect(tmp_path, gb.gguf(kvs), CorruptFileError, "duplicate metadata key 'a'")
    t = [gb.tensor_info("w", [8], 0, 0), gb.tensor_info("w", [8], 0, 32)]
    expect(tmp_path, gb.gguf([], t, b"\0" * 64), CorruptFileError, "duplicate tensor name 'w'")


def test_tensor_layout_errors(tmp_path):
    data = b"\0" * 128
    overlap = [gb.tensor_info("a", [16], 0, 0), gb.tensor_info("b", [16], 0, 32)]
    expect(tmp_path, gb.gguf([], overlap, data), CorruptFileError, "overlap")
    misaligned = [gb.tensor_info("a", [4], 0, 4)]
    expect(tmp_path, gb.gguf([], misaligned, data), CorruptFileError, "aligned")
    expect(tmp_path, gb.gguf([], [gb.tensor_info("a", [0], 0, 0)], data), CorruptFileError, "empty dimension")
    expect(tmp_path, gb.gguf([], [gb.tensor_info("a", [1] * 5, 0, 0)], data), CorruptFileError, "dimensions")
    expect(tmp_path, gb.gguf([], [gb.tensor_info("a", [1 << 32, 1 << 32], 0, 0)], data), CorruptFileError, "absurd")
    # Q8_0 rows must be whole 32-value blocks
    expect(tmp_path, gb.gguf([], [gb.tensor_info("a", [33], 8, 0)], data), CorruptFileError, "block size")
    # an offset far past the end
    expect(tmp_path, gb.gguf([], [gb.tensor_info("a", [4], 0, 1 << 62)], data), TruncatedFileError, "'a'")


def test_unknown_tensor_type(tmp_path):
    msg = expect(tmp_path, gb.gguf([], [gb.tensor_info("blk.0.attn_q.weight", [32], 99, 0)], b"\0" * 64), UnsupportedTensorTypeError)
    assert "blk.0.attn_q.weight" in msg and "99" in msg


def test_bad_alignment(tmp_path):
    expect(tmp_path, gb.gguf([gb.kv("general.alignment", gb.U32, 3)]), CorruptFileError, "power of two")
    expect(tmp_path, gb.gguf([gb.kv("general.alignment", gb.STR, "32")]), CorruptFileError, "alignment")


def test_custom_alignment_is_honoured(tmp_path):
    kvs = [gb.kv("general.alignment", gb.U32, 64)]
    data = struct.pack("<4f", 1, 2, 3, 4)
    p = write(tmp_path, gb.gguf(kvs, [gb.tensor_info("t", [4], 0, 0)], data, alignment=64))
    g = open_gguf(p)
    assert g.data_offset % 64 == 0 and g.dequantize("t").tolist() == [1, 2, 3, 4]


def test_string_array_errors_name_the_first_bad_item(tmp_path):
    """The walk reads a string array's lengths before it checks them: the error is still the first item's that
    the file lacks or that is too long, after items that are whole."""
    from llamacli.ggufio.cursor import MAX_STRING_BYTES

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gb.string("a.sarr") + struct.pack("<IIQ", gb.ARR, gb.STR, 3)
    ok = struct.pack("<Q", 2) + b"ok"
    expect(tmp_path, head + ok + struct.pack("<Q", 1000) + b"abc" * 40, TruncatedFileError, "a string of 'a.sarr'",
           "needs 1000 bytes")
    expect(tmp_path, head + ok + ok + struct.pack("<Q", 1 << 63), TruncatedFileError, "a string of 'a.sarr'")
    expect(tmp_path, head + ok + ok + b"\x01\x00\x00\x00", TruncatedFileError, "a string length of 'a.sarr'")
    path = tmp_path / "long.gguf"  # the second item longer than the walk accepts, held by the file (a hole)
    with open(path, "wb") as f:
        f.write(head + ok + struct.pack("<Q", MAX_STRING_BYTES + 1))
        f.truncate(f.tell() + MAX_STRING_BYTES + 64)
    with pytest.raises(CorruptFileError, match="accepted"):
        open_gguf(path)


def test_string_arrays_are_checked_item_by_item(tmp_path):
    """String arrays are checked as one piece of text: an item that starts inside a character is still caught
    (b"\\xc3" + b"\\xa9" is "é" joined, invalid apart)."""
    expect(tmp_path, gb.gguf([gb.kv("a", gb.ARR, (gb.STR, [b"ok", b"\xc3", b"\xa9"]))]), CorruptFileError, "invalid UTF-8")
    expect(tmp_path, gb.gguf([gb.kv("a", gb.ARR, (gb.STR, [b"\xff"]))]), CorruptFileError, "invalid UTF-8")
    items = ["", "x", "", "ünï", "🦙", "日本", "", "Ġworld"]
    p = write(tmp_path, gb.gguf([gb.kv("a", gb.ARR, (gb.STR, items)), gb.kv("b", gb.ARR, (gb.STR, []))]))
    md = open_gguf(p).metadata
    assert md["a"] == items and md["b"] == [] and len(md) == 2
