"""GGUF metadata values: how the header walk reads one (`read_value`), and how an array is kept once read.

An array stays as compact as the file holds it, numbers in one NumPy array and strings as their UTF-8 bytes
(StringArray), until someone reads its key; Metadata then hands out a list. Every count and length is checked
against the bytes left in the file (the walk's cursor) and against caps no real file comes near.
"""

from __future__ import annotations

import struct
import weakref
from array import array
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import CorruptFileError
from .cursor import MAX_STRING_BYTES, Cursor
from .ggml_types import GGUFValueType

# Bounds that no real file comes near, so that a large file cannot make the header walk build Python objects
# many times its size (a u8 array becomes 8 bytes per item as a list, an empty string 8 bytes of pointer):
# real vocabularies hold <= 262k tokens and <= 500k merges, the longest strings (a whole tokenizer.json some
# converters embed) ~20 MB (MAX_STRING_BYTES, cursor.py).
MAX_ARRAY_ITEMS = 1 << 22

_KNOWN_VALUE_TYPES = {int(t) for t in GGUFValueType}


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

    def count(self, key: str) -> int | None:
        """How many items the array `key` holds, without reading them; None where `key` is absent or no array."""
        value = self._values.get(key)
        return len(value) if isinstance(value, (np.ndarray, StringArray)) else None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Metadata({len(self._values)} keys)"


def array_length(md: Mapping[str, Any], key: str) -> int | None:
    """len() of the array `key` of `md` (a file's Metadata, whose arrays are not decoded for it, or a plain
    dict of lists); None where `key` holds no array. For those who need a vocabulary's size, not its tokens."""
    if isinstance(md, Metadata):
        return md.count(key)
    value = md.get(key)
    return len(value) if isinstance(value, list) else None


class _List(list):
    """A plain list that a weak reference can point at (Metadata's cache of arrays being read)."""

    __slots__ = ("__weakref__",)


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


def read_value(cur: Cursor, vtype: int, key: str) -> Any:
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
        values = np.frombuffer(cur.load(cur.pos + count * dtype.itemsize), dtype=dtype, count=count, offset=cur.pos)
        cur.pos += count * dtype.itemsize
        return (values != 0) if itype == GGUFValueType.BOOL else values.copy()  # a copy: the walk's buffer goes
    # An array of strings: each needs at least its 8-byte length, so `count` is bounded by the file.
    cur.need(count * 8, f"{count} strings of {key!r}")
    _check_items(cur, count, key)
    return _read_strings(cur, count, key)


def _read_strings(cur: Cursor, count: int, key: str) -> StringArray:
    """The walk checks every length against the file; the text is then checked as one piece (valid UTF-8, and
    every item starting on a character) and kept as bytes: a list of str would take ~60 bytes per item."""
    size = cur.size
    unpack = struct.Struct("<Q").unpack_from
    begin = pos = cur.pos
    # The lengths first, unchecked (a vocabulary's 128k-400k items: the loop is most of a file's opening time);
    # a read past what the cursor holds has it read more and the loop go on; a length past the file ends the
    # walk (the next read fails, or it ends beyond the end) and the walk below finds which string and says so.
    found = array("Q")  # (8 bytes an item, as the NumPy array they become)
    add = found.append
    while len(found) < count:
        buf = cur.buf
        try:
            for _ in range(count - len(found)):
                (n,) = unpack(buf, pos)
                add(n)
                pos += 8 + n
        except (struct.error, OverflowError):  # a read past what is held (or past any offset there can be)
            if pos + 8 > size or len(cur.load(pos + 8)) < pos + 8:
                pos = size + 1
                break
    if pos > size or (found and max(found) > MAX_STRING_BYTES):
        _string_error(cur, begin, count, key)
    lengths = np.frombuffer(found, np.uint64).astype(np.int64)
    cur.pos = pos
    # Drop the 8-byte lengths: +1 where an item's bytes start, -1 where they end, summed along the bytes.
    ends = np.cumsum(lengths + 8)
    edges = np.zeros(pos - begin + 1, np.int8)
    edges[ends - lengths] = 1
    edges[ends] -= 1
    region = np.frombuffer(cur.load(pos), np.uint8, count=pos - begin, offset=begin)
    data = region[np.cumsum(edges[:-1], dtype=np.int8) > 0]
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    starts = offsets[:-1][lengths > 0]
    del region  # (a view of the walk's buffer)
    try:
        data.tobytes().decode("utf-8")
        if np.any(data[starts] & 0xC0 == 0x80):  # an item starting mid-character: invalid on its own
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "an item starts inside a character")
    except UnicodeDecodeError:
        raise CorruptFileError(f"{cur.name}: metadata key {key!r} holds invalid UTF-8") from None
    return StringArray(data.tobytes(), offsets)


def _string_error(cur: Cursor, pos: int, count: int, key: str) -> None:
    """The error of the first of `count` strings from offset pos that the file does not hold, or that is longer
    than MAX_STRING_BYTES (_read_strings found one)."""
    unpack = struct.Struct("<Q").unpack_from
    for _ in range(count):
        cur.pos = pos
        cur.need(8, f"a string length of {key!r}")
        (n,) = unpack(cur.load(pos + 8), pos)
        cur.pos = pos = pos + 8
        cur.need(n, f"a string of {key!r}")
        if n > MAX_STRING_BYTES:
            raise CorruptFileError(f"{cur.name}: a string of {key!r} is {n} bytes long (at most {MAX_STRING_BYTES} accepted)")
        pos += n
    raise CorruptFileError(f"{cur.name}: metadata key {key!r}: its strings could not be read")  # (not reached)


def _check_items(cur: Cursor, count: int, key: str) -> None:
    """An array the file does hold, but longer than any real one: refused before a list is built."""
    if count > MAX_ARRAY_ITEMS:
        raise CorruptFileError(f"{cur.name}: metadata key {key!r} holds {count} items (at most {MAX_ARRAY_ITEMS} accepted)")
