"""The header walk's cursor: little-endian values read from a memory map, never past its end, and strings no
longer than MAX_STRING_BYTES. file.py walks the header with it; metadata.py reads each value through it."""

from __future__ import annotations

import mmap
import struct
from typing import Any

from ..errors import CorruptFileError, TruncatedFileError

# The longest string accepted (the longest real ones, a whole tokenizer.json some converters embed, are ~20 MB):
# a bound no real file comes near, as metadata.py's on arrays.
MAX_STRING_BYTES = 1 << 26


class Cursor:
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
