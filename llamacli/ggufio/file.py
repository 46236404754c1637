"""Open and validate a GGUF file: metadata as a read-only mapping (metadata.py), tensor data read on demand.

The header is read by one bounded walk (`_scan_header`): every count and length is checked against the
bytes left in the file (and against caps no real file comes near) before anything is allocated or looped
over, every tensor's data range against the file size and against the others. Why not gguf.GGUFReader: it
trusts its header (a count of 2^40 array items makes it loop for ever) and builds one numpy object per
array item, far slower on a 151k-token Qwen2 vocabulary than this reader (docs/perf-log.md). It stays the
independent reference: tests/ggufio/test_gguf_file.py checks that both read the same values.

Nothing is memory-mapped. Opening reads only the header; a tensor's bytes are read (plain reads, READ_CHUNK
at a time, so Ctrl-C is seen between them) when a backend asks for them, and the backends keep what they
read (the NumPy backend in RAM, the CUDA backend on the GPU), so nothing touches the file once a model is
loaded. A map would be one copy less, but a mapped file that another program truncates (a download
re-fetched, an editor, a full disk) kills the process with SIGBUS at the next touch of a page past the new
end, inside NumPy where no Python handler can run (CPython's handler only sets a flag and returns to the
faulting instruction; faulthandler only prints). A read that comes back short is FileChangedError, one
line, and a file replaced under its name is refused the same way (the file stays open, its identity
checked when it must be opened again).

Layout (GGUF v2/v3, little-endian; ggml's docs/gguf.md):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key | u32 type | value)            string = u64 length + UTF-8 bytes
    n_tensors x (string name | u32 n_dims | u64 dims[n_dims] | u32 ggml type | u64 offset)
    padding to general.alignment (default 32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import math
import os
import stat
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import (
    CorruptFileError,
    FileChangedError,
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
READ_CHUNK = 64 << 20  # one read call: Ctrl-C is seen between them

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
    `tensors` maps name -> TensorInfo; `raw`, `dequantize`, `rows` and `read_bytes` read tensor data."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelNotFoundError(f"no such file: {self.path}")
        if not self.path.is_file():
            raise ModelNotFoundError(f"not a file: {self.path}")
        self._lock = threading.Lock()
        self._file = None
        try:
            self._open()
            self.file_size = self._identity[2]
            scan = _scan_header(self, self.file_size)
        except OSError as exc:
            self.close()
            raise ModelNotFoundError(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        except BaseException:
            self.close()
            raise
        self.version: int = scan.version
        self.alignment: int = scan.alignment
        self.data_offset: int = scan.data_offset
        self.metadata = Metadata(scan.metadata)
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in scan.tensors}

    # -- reading -------------------------------------------------------------------------------------

    def _open(self) -> None:
        """Open the file (O_NONBLOCK: a FIFO put in its place does not block), closed with this object. Opened
        again after close(), it must be the same file, of the same size."""
        f = os.fdopen(os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)),
                      "rb", buffering=0)
        finalizer = weakref.finalize(self, f.close)
        info = os.fstat(f.fileno())
        identity = (info.st_dev, info.st_ino, info.st_size)
        if not stat.S_ISREG(info.st_mode):
            finalizer()
            raise ModelNotFoundError(f"not a file: {self.path}")
        if getattr(self, "_identity", identity) != identity:
            finalizer()
            raise FileChangedError(f"{self.path} changed since it was opened (another program replaced or "
                                   "rewrote it); run the command again")
        self._identity, self._file, self._finalizer = identity, f, finalizer

    def read_bytes(self, offset: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
        """`n` bytes of the file from `offset` as a uint8 array (`out[:n]` when given); FileChangedError when
        the file no longer holds them (cut short while it was being read)."""
        buf = np.empty(n, np.uint8) if out is None else out[:n]
        with self._lock:
            f = self._opened()

            def read(view: memoryview, at: int) -> int:
                f.seek(at)
                return f.readinto(view)

            self._fill(buf, offset, read)
        return buf

    def read_at(self, offset: int, n: int, out: np.ndarray) -> np.ndarray:
        """read_bytes for threads: positioned reads (os.preadv) that neither take the lock nor move the file's
        position, so several threads may read different parts at once (the CUDA upload). Where the platform
        has no preadv, read_bytes."""
        if not hasattr(os, "preadv"):
            return self.read_bytes(offset, n, out)
        with self._lock:
            fd = self._opened().fileno()
        buf = out[:n]
        self._fill(buf, offset, lambda view, at: os.preadv(fd, [view], at))
        return buf

    def _opened(self):  # noqa: ANN202 (the open binary file; the caller holds the lock)
        if self._file is None:
            self._open()
        return self._file

    def _fill(self, buf: np.ndarray, offset: int, read: Callable[[memoryview, int], int]) -> None:
        """buf <- the file from `offset`, READ_CHUNK bytes a call of read(view, file position) (Ctrl-C is seen
        between them); FileChangedError where the file ends first or a read fails."""
        view, n, done = memoryview(buf).cast("B"), buf.size, 0
        try:
            while done < n:
                got = read(view[done : done + min(READ_CHUNK, n - done)], offset + done)
                if not got:
                    break
                done += got
        except OSError as exc:
            raise FileChangedError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        if done < n:
            raise FileChangedError(f"{self.path} is shorter than when it was opened: another program cut it to "
                                   f"{offset + done} of {self.file_size} bytes while it was being read")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's data, read into memory: float32/float16/intN arrays of `shape` for the plain types,
        else uint8 [..., row_bytes] (whole blocks per row)."""
        info = self.tensors[name]
        return _typed(self.read_bytes(info.offset, info.n_bytes), info)

    def dequantize(self, name: str) -> np.ndarray:
        """The whole tensor as float32, shape `tensors[name].shape`."""
        from .quants import dequantize

        info = self.tensors[name]
        return dequantize(self.raw(name), info.type).reshape(info.shape)

    def rows(self, name: str, ids: np.ndarray | list[int]) -> np.ndarray:
        """Rows `ids` of a 2-D tensor as float32 [len(ids), cols], reading and dequantizing only those rows."""
        from .quants import dequantize

        info = self.tensors[name]
        idx = np.asarray(ids, dtype=np.int64).reshape(-1)
        n_rows, n_cols = info.shape[0], info.shape[-1]
        if idx.size == 0:
            return np.zeros((0, n_cols), dtype=np.float32)
        if idx.min() < 0 or idx.max() >= n_rows:
            raise IndexError(f"row index out of range [0, {n_rows})")
        data = np.empty((idx.size, info.row_bytes), np.uint8)
        for k, i in enumerate(idx.tolist()):
            self.read_bytes(info.offset + i * info.row_bytes, info.row_bytes, out=data[k])
        dtype = _PLAIN_DTYPES.get(info.type)
        return dequantize(data.view(dtype) if dtype is not None else data, info.type).reshape(idx.size, n_cols)

    # -- convenience ---------------------------------------------------------------------------------

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def close(self) -> None:
        """Close the file (a later read opens it again, if it is still the same file)."""
        with self._lock:
            if self._file is not None:
                self._finalizer()
                self._file = None

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


def _typed(data: np.ndarray, info: TensorInfo) -> np.ndarray:
    """A tensor's bytes as its array: `shape` of its dtype for the plain types, else uint8 [..., row_bytes]."""
    dtype = _PLAIN_DTYPES.get(info.type)
    if dtype is not None:
        return data.view(dtype).reshape(info.shape)
    return data.reshape(*info.shape[:-1], info.row_bytes)


# -- the bounded header walk ---------------------------------------------------------------------------


@dataclass
class _Scan:
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


def _scan_header(gguf: GGUFFile, size: int) -> _Scan:
    name = gguf.path.name
    if size < 4:
        raise NotGGUFError(f"{name}: not a GGUF file (it has only {size} bytes)")
    return _walk(Cursor(b"", size, name, lambda offset, n: gguf.read_bytes(offset, n).tobytes()), name)


def _walk(cur: Cursor, name: str) -> _Scan:
    magic = cur.load(4)[:4]
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
