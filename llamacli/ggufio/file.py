"""Open and validate a GGUF file: metadata as a read-only mapping (metadata.py), tensors as memory-mapped
arrays.

The header is read by one bounded walk (`_scan_header`): every count and length is checked against the
bytes left in the file (and against caps no real file comes near) before anything is allocated or looped
over, every tensor's data range against the file size and against the others. Tensor data stays in a
read-only memory map (a multi-GB file is not read into RAM). Why not gguf.GGUFReader: it trusts its header
(a count of 2^40 array items makes it loop for ever) and builds one numpy object per array item, far slower
on a 151k-token Qwen2 vocabulary than this reader (docs/perf-log.md). It stays the independent reference:
tests/ggufio/test_gguf_file.py checks that both read the same values.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import (
    CorruptFileError,
    ModelNotFoundError,
    NotGGUFError,
    TruncatedFileError,
    UnsupportedTensorTypeError,
    UnsupportedVersionError,
)
from .cursor import Cursor
from .ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType
from .metadata import Metadata, read_value

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
MAX_ELEMENTS = 1 << 48  # far beyond any real tensor; keeps byte arithmetic exact in int64
# Bounds that no real file comes near (real files hold < 100 keys and a few thousand tensors); those on arrays
# are in metadata.py, those on strings in cursor.py.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20

_KNOWN_TENSOR_TYPES = {int(t) for t in GGMLQuantizationType}


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


def _scan_header(path: Path, size: int) -> _Scan:
    name = path.name
    if size < 4:
        raise NotGGUFError(f"{name}: not a GGUF file (it has only {size} bytes)")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _walk(Cursor(buf, size, name), name)
    finally:
        buf.close()


def _walk(cur: Cursor, name: str) -> _Scan:
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
        metadata[key] = read_value(cur, vtype, key)
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
