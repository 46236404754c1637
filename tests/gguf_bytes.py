"""Build GGUF files byte by byte (independently of the gguf package), to craft broken and hostile ones."""

from __future__ import annotations

import struct
from typing import Any

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}


def string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def value(vtype: int, v: Any) -> bytes:
    if vtype == STR:
        return string(v)
    if vtype == ARR:
        itype, items = v
        return struct.pack("<IQ", itype, len(items)) + b"".join(value(itype, x) for x in items)
    return struct.pack(_FMT[vtype], v)


def kv(key: str | bytes, vtype: int, v: Any) -> bytes:
    return string(key) + struct.pack("<I", vtype) + value(vtype, v)


def tensor_info(name: str, dims: list[int], ggml_type: int, offset: int) -> bytes:
    """dims fastest-first, as GGUF stores them."""
    return string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, offset)


def gguf(
    kvs: list[bytes],
    tensors: list[bytes] = (),
    data: bytes = b"",
    *,
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    alignment: int = 32,
    magic: bytes = b"GGUF",
) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * ((-len(body)) % alignment)
    return body + data


def f32_tensor_file(name: str = "t", n: int = 8, arch: str = "llama", extra_kvs: list[bytes] = ()) -> bytes:
    """A valid file with one F32 tensor of n values."""
    return gguf([kv("general.architecture", STR, arch), *extra_kvs], [tensor_info(name, [n], 0, 0)], struct.pack(f"<{n}f", *range(n)))
