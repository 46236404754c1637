"""Open and validate a GGUF file: metadata as a read-only mapping, tensors as memory-mapped arrays.

The header is read by one bounded walk (`_scan_header`): every count and length is checked against the
bytes left in the file (and against caps no real file comes near) before anything is allocated or looped
over, every tensor's data range against the file size and against the others. Tensor data stays in a
read-only memory map (a multi-GB file is not read into RAM). Why not gguf.GGUFReader: it trusts its header
(a count of 2^40 array items makes it loop for ever) and builds one numpy object per array item, 5.9 s for a
151k-token Qwen2 vocabulary against 0.03 s here. It stays the independent reference: tests/test_gguf_file.py
checks that both read the same values.

Layout (GGUF v2/v3, little-endian; ggml's docs/gguf.md):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key | u32 type | value)            string = u64 length + UTF-8 bytes
    n_tensors x (string name | u32 n_dims | u64 dims[n_dims] | u32 ggml type | u64 offset)
    padding to general.alignment (default 32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import (
    CorruptFileError,
    ModelNotFoundError,
    NotGGUFError,
    TruncatedFileError,
    UnsupportedTensorTypeError,
    UnsupportedVersionError,
)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
MAX_ELEMENTS = 1 << 48  # far beyond any real tensor; keeps byte arithmetic exact in int64
# Bounds that no real file comes near, so that a large file cannot make the header walk build Python objects
# many times its size (a u8 array becomes 8 bytes per item as a list, an empty string 8 bytes of pointer):
# real vocabularies hold <= 262k tokens and <= 500k merges, real files < 100 keys and a few thousand tensors,
# the longest strings (a whole tokenizer.json some converters embed) ~20 MB.
MAX_ARRAY_ITEMS = 1 << 22
MAX_STRING_BYTES = 1 << 26
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20

_SCALAR_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_KNOWN_VALUE_TYPES = {int(t) for t in GGUFValueType}
_KNOWN_TENSOR_TYPES = {int(t) for t in GGMLQuantizationType}


class StringArray:
    """A GGUF array of strings, kept as the UTF-8 of its items one after another (already checked) and their
    byte offsets [count + 1]; `tolist()` decodes them."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: bytes, offsets: np.ndarray):
        self.data, self.offsets = data, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def tolist(self) -> list[str]:
        data, bounds = self.data, self.offsets.tolist()
        if data.isascii():
            data = data.decode("ascii")  # then byte offsets are character offsets: slicing is all it takes
            return [data[a:b] for a, b in zip(bounds, bounds[1:])]
        return [data[a:b].decode("utf-8") for a, b in zip(bounds, bounds[1:])]


class Metadata(Mapping[str, Any]):
    """A file's key/value pairs, read-only. Scalars are plain Python values; an array is kept as compactly as
    the file holds it (numbers in one NumPy array, strings as their bytes) and is read as a new Python list.
    A list of Python objects takes 8 to 90 bytes per item, so a file of large arrays would otherwise need many
    times its size in memory before anyone asked for them (`inspect` reads a few keys; the tokenizer is the one
    that needs the vocabulary as a list). A list stays shared while someone holds it, so repeated reads of the
    vocabulary by the config, the tokenizer and the chat template decode it once."""

    def __init__(self, values: dict[str, Any]):
        self._values = values
        self._lists: weakref.WeakValueDictionary[str, _List] = weakref.WeakValueDictionary()

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if not isinstance(value, (np.ndarray, StringArray)):
            return value
        items = self._lists.get(key)
        if items is None:
            items = self._lists[key] = _List(value.tolist())
        return items

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Metadata({len(self._values)} keys)"


class _List(list):
    """A plain list that a weak reference can point at (Metadata's cache of arrays being read)."""

    __slots__ = ("__weakref__",)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major, slowest dim first (GGUF stores dims fastest-first: reversed here)
    type: GGMLQuantizationType
    n_bytes: int
    offset: int  # absolute byte offset of the data in the file

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def type_name(self) -> str:
        return self.type.name

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.type][0]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last, fastest dim): quantized blocks never straddle rows."""
        block, size = GGML_QUANT_SIZES[self.type]
        return self.shape[-1] // block * size


class GGUFFile:
    """A validated GGUF file. `metadata` maps keys to plain Python values (arrays read as lists, see Metadata);
    `tensors` maps name -> TensorInfo."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelNotFoundError(f"no such file: {self.path}")
        if not self.path.is_file():
            raise ModelNotFoundError(f"not a file: {self.path}")
        try:
            self.file_size = self.path.stat().st_size
            scan = _scan_header(self.path, self.file_size)
        except OSError as exc:
            raise ModelNotFoundError(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        self.version: int = scan.version
        self.alignment: int = scan.alignment
        self.data_offset: int = scan.data_offset
        self.metadata = Metadata(scan.metadata)
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in scan.tensors}
        self._map: np.memmap | None = None

    # -- tensor data ---------------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's data as a view into the memory map (nothing is read yet): float32/float16/intN
        arrays of `shape` for the plain types, else uint8 [..., row_bytes] (whole blocks per row)."""
        info = self.tensors[name]
        if self._map is None:
            self._map = np.memmap(self.path, mode="r")
        data = self._map[info.offset : info.offset + info.n_bytes]
        dtype = _PLAIN_DTYPES.get(info.type)
        if dtype is not None:
            return data.view(dtype).reshape(info.shape)
        return data.reshape(*info.shape[:-1], info.row_bytes)

    def dequantize(self, name: str) -> np.ndarray:
        """The whole tensor as float32, shape `tensors[name].shape`."""
        from .quants import dequantize

        info = self.tensors[name]
        return dequantize(self.raw(name), info.type).reshape(info.shape)

    def rows(self, name: str, ids: np.ndarray | list[int]) -> np.ndarray:
        """Rows `ids` of a 2-D tensor as float32 [len(ids), cols], dequantizing only those rows."""
        from .quants import gather_rows

        info = self.tensors[name]
        return gather_rows(self.raw(name), info.type, ids, info.shape[-1])

    # -- convenience ---------------------------------------------------------------------------------

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def close(self) -> None:
        self._map = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    return GGUFFile(path)


_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


# -- the bounded header walk ---------------------------------------------------------------------------


@dataclass
class _Scan:
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    """Reads little-endian values from a memory map, refusing to step past its end."""

    def __init__(self, buf: mmap.mmap | bytes, size: int, name: str):
        self.buf, self.size, self.name, self.pos = buf, size, name, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise TruncatedFileError(
                f"{self.name}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                f"the file has {self.size - self.pos} left"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value[0] if len(value) == 1 else value

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", what)

    def string(self, what: str) -> bytes:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        if n > MAX_STRING_BYTES:
            raise CorruptFileError(f"{self.name}: {what} is {n} bytes long (at most {MAX_STRING_BYTES} accepted)")
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return data

    def text(self, what: str) -> str:
        data = self.string(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptFileError(f"{self.name}: {what} is not valid UTF-8") from None


def _scan_header(path: Path, size: int) -> _Scan:
    name = path.name
    if size < 4:
        raise NotGGUFError(f"{name}: not a GGUF file (it has only {size} bytes)")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _walk(_Cursor(buf, size, name), name)
    finally:
        buf.close()


def _walk(cur: _Cursor, name: str) -> _Scan:
    magic = bytes(cur.buf[0:4])
    if magic != GGUF_MAGIC:
        raise NotGGUFError(f"{name}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version != 0:
        raise UnsupportedVersionError(f"{name}: big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"{name}: GGUF version {version} is not supported (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})"
        )
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    left = cur.size - cur.pos
    # Each key/value takes at least 13 bytes (u64 key length, u32 type, 1-byte value); each tensor info at
    # least 24 (u64 name length, u32 n_dims, u32 type, u64 offset). A count the file cannot hold fails here.
    for count, what, least in ((n_kv, "metadata keys", 13), (n_tensors, "tensors", 24)):
        if count * least > left:
            # A plausible count in a short file is a truncation; an absurd one is corruption or hostility.
            error = TruncatedFileError if count < 1 << 24 else CorruptFileError
            kind = "truncated" if count < 1 << 24 else "corrupt"
            raise error(f"{name}: {kind}: header claims {count} {what}, but only {left} bytes follow")
    for count, what, limit in ((n_kv, "metadata keys", MAX_KV), (n_tensors, "tensors", MAX_TENSORS)):
        if count > limit:
            raise CorruptFileError(f"{name}: corrupt: header claims {count} {what} (at most {limit} accepted)")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.text(f"metadata key #{i}")
        if key in metadata:
            raise CorruptFileError(f"{name}: duplicate metadata key {key!r}")
        vtype = cur.u32(f"type of {key!r}")
        metadata[key] = _read_value(cur, vtype, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and (
        type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 20
    ):
        raise CorruptFileError(f"{name}: general.alignment {alignment!r} is not a power of two up to 2^20")

    tensors: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        tname = cur.text(f"name of tensor #{i}")
        if tname in names:
            raise CorruptFileError(f"{name}: duplicate tensor name {tname!r}")
        names.add(tname)
        n_dims = cur.u32(f"dimension count of {tname!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise CorruptFileError(f"{name}: tensor {tname!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [cur.u64(f"dimensions of {tname!r}") for _ in range(n_dims)]
        if any(d == 0 for d in dims):
            raise CorruptFileError(f"{name}: tensor {tname!r} has an empty dimension {dims}")
        n_el = 1
        for d in dims:
            n_el *= d
            if n_el > MAX_ELEMENTS:
                raise CorruptFileError(f"{name}: tensor {tname!r} has absurd dimensions {dims}")
        raw_type = cur.u32(f"type of {tname!r}")
        if raw_type not in _KNOWN_TENSOR_TYPES or GGMLQuantizationType(raw_type) not in GGML_QUANT_SIZES:
            raise UnsupportedTensorTypeError(f"{name}: tensor {tname!r} has unknown ggml type {raw_type}")
        ttype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ttype]
        if dims[0] % block:
            raise CorruptFileError(
                f"{name}: tensor {tname!r} ({ttype.name}) has rows of {dims[0]} values, "
                f"not a multiple of its block size {block}"
            )
        offset = cur.u64(f"offset of {tname!r}")
        tensors.append((tname, tuple(reversed(dims)), ttype, n_el // block * type_size, offset))

    data_offset = cur.pos + (-cur.pos) % alignment
    infos = []
    for tname, shape, ttype, n_bytes, offset in tensors:
        if offset % alignment:
            raise CorruptFileError(f"{name}: tensor {tname!r} data offset {offset} is not aligned to {alignment}")
        start = data_offset + offset
        if start + n_bytes > cur.size:
            raise TruncatedFileError(
                f"{name}: truncated: tensor {tname!r} needs bytes {start}..{start + n_bytes}, "
                f"the file ends at {cur.size}"
            )
        infos.append(TensorInfo(tname, shape, ttype, n_bytes, start))
    ordered = sorted(infos, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.n_bytes > b.offset:
            raise CorruptFileError(f"{name}: tensors {a.name!r} and {b.name!r} overlap in the file")
    return _Scan(version, alignment, data_offset, metadata, infos)


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_ARRAY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    """One metadata value: str, int, float or bool, or an array as it is kept (see Metadata)."""
    if vtype not in _KNOWN_VALUE_TYPES:
        raise CorruptFileError(f"{cur.name}: metadata key {key!r} has unknown value type {vtype}")
    gtype = GGUFValueType(vtype)
    if gtype in _SCALAR_FORMATS:
        if gtype == GGUFValueType.BOOL:
            return cur.unpack("<B", f"value of {key!r}") != 0
        return cur.unpack(_SCALAR_FORMATS[gtype], f"value of {key!r}")
    if gtype == GGUFValueType.STRING:
        return cur.text(f"value of {key!r}")
    item = cur.u32(f"item type of {key!r}")
    count = cur.u64(f"length of {key!r}")
    if item not in _KNOWN_VALUE_TYPES or GGUFValueType(item) == GGUFValueType.ARRAY:
        raise CorruptFileError(f"{cur.name}: metadata key {key!r} is an array of unsupported type {item}")
    itype = GGUFValueType(item)
    if itype in _ARRAY_DTYPES:
        dtype = np.dtype(_ARRAY_DTYPES[itype])
        cur.need(count * dtype.itemsize, f"{count} items of {key!r}")
        _check_items(cur, count, key)
        values = np.frombuffer(cur.buf, dtype=dtype, count=count, offset=cur.pos)
        cur.pos += count * dtype.itemsize
        return (values != 0) if itype == GGUFValueType.BOOL else values.copy()  # a copy: the map closes
    # An array of strings: each needs at least its 8-byte length, so `count` is bounded by the file.
    cur.need(count * 8, f"{count} strings of {key!r}")
    _check_items(cur, count, key)
    return _read_strings(cur, count, key)


def _read_strings(cur: _Cursor, count: int, key: str) -> StringArray:
    """The walk checks every length against the file; the text is then checked as one piece (valid UTF-8, and
    every item starting on a character) and kept as bytes: a list of str would take ~60 bytes per item."""
    buf, size = cur.buf, cur.size
    lengths = np.empty(count, np.int64)
    unpack = struct.Struct("<Q").unpack_from
    begin = pos = cur.pos
    try:
        for i in range(count):
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > size:
                cur.pos = pos
                cur.need(n, f"a string of {key!r}")
            if n > MAX_STRING_BYTES:
                raise CorruptFileError(f"{cur.name}: a string of {key!r} is {n} bytes long (at most {MAX_STRING_BYTES} accepted)")
            lengths[i] = n
            pos += n
    except struct.error:
        cur.pos = pos
        cur.need(8, f"a string length of {key!r}")
    cur.pos = pos
    # Drop the 8-byte lengths: +1 where an item's bytes start, -1 where they end, summed along the bytes.
    ends = np.cumsum(lengths + 8)
    edges = np.zeros(pos - begin + 1, np.int8)
    edges[ends - lengths] = 1
    edges[ends] -= 1
    region = np.frombuffer(buf, np.uint8, count=pos - begin, offset=begin)
    data = region[np.cumsum(edges[:-1], dtype=np.int8) > 0]
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    starts = offsets[:-1][lengths > 0]
    del region  # (a view of the map, which closes after the walk)
    try:
        data.tobytes().decode("utf-8")
        if np.any(data[starts] & 0xC0 == 0x80):  # an item starting mid-character: invalid on its own
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "an item starts inside a character")
    except UnicodeDecodeError:
        raise CorruptFileError(f"{cur.name}: metadata key {key!r} holds invalid UTF-8") from None
    return StringArray(data.tobytes(), offsets)


def _check_items(cur: _Cursor, count: int, key: str) -> None:
    """An array the file does hold, but longer than any real one: refused before a list is built."""
    if count > MAX_ARRAY_ITEMS:
        raise CorruptFileError(f"{cur.name}: metadata key {key!r} holds {count} items (at most {MAX_ARRAY_ITEMS} accepted)")
