"""The header walk's cursor: little-endian values read from the file, never past its end, and strings no
longer than MAX_STRING_BYTES. file.py walks the header with it; metadata.py reads each value through it.

The cursor holds the file's first bytes in memory, read (file.py's GGUFFile.read_bytes) as the walk goes
further: at least as much again as it holds, so that the copies add up to twice the header at most. Plain
reads, not a memory map, for the same reason as the tensor data (file.py): a map of a file that another
program cuts short ends the process with SIGBUS at the next touch, where a read comes back short
(FileChangedError).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from ..errors import CorruptFileError, TruncatedFileError

# The longest string accepted (the longest real ones, a whole tokenizer.json some converters embed, are ~20 MB):
# a bound no real file comes near, as metadata.py's on arrays.
MAX_STRING_BYTES = 1 << 26
FIRST_READ = 1 << 20  # a small model's whole header; a 256k-token vocabulary's is some 10 MB


class Cursor:
    """Reads little-endian values from a file of `size` bytes, refusing to step past its end. `buf` holds the
    file's first bytes; `read(offset, n)` (None when `buf` is the whole file) brings more."""

    def __init__(self, buf: bytes, size: int, name: str, read: Callable[[int, int], bytes] | None = None):
        self.buf, self.size, self.name, self.pos, self._read = buf, size, name, 0, read

    def need(self, n: int, what: str) -> None:
        """TruncatedFileError unless the file holds n bytes from the cursor (nothing is read)."""
        if n < 0 or self.pos + n > self.size:
            raise TruncatedFileError(
                f"{self.name}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                f"the file has {self.size - self.pos} left"
            )

    def load(self, end: int) -> bytes:
        """`buf` holding the file's bytes up to `end` at least (end <= size: need() checked it); returns it."""
        have = len(self.buf)
        if end > have and self._read is not None:
            want = min(self.size, max(end, 2 * have, FIRST_READ))
            self.buf += self._read(have, want - have)
        return self.buf

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        buf = self.buf if self.pos + n <= len(self.buf) else self.load(self.pos + n)
        value = struct.unpack_from(fmt, buf, self.pos)
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
        data = self.load(self.pos + n)[self.pos : self.pos + n]
        self.pos += n
        return data

    def text(self, what: str) -> str:
        data = self.string(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptFileError(f"{self.name}: {what} is not valid UTF-8") from None
