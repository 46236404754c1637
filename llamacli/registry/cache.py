"""The cache: where models live, the locks that keep processes out of each other's way, and `rm`.

The cache is $LLAMACLI_HOME, else $XDG_CACHE_HOME/llamacli, else ~/.cache/llamacli: models/<name>.gguf for
registry names, hf/owner/repo/file.gguf for Hugging Face files. It is the only place llamacli writes or
deletes in. Every path into it is checked with its folders resolved, so a symbolic link planted inside it
(`hf/owner`, `models`) never leads a download or `rm` outside; `rm` never expands a pattern.

One model is downloaded or removed by one process at a time: each holds an flock on
`.locks/<hash of the model's path>` (a second `pull` waits, `rm` refuses while a download runs), so no
process sees another's `.part` file half-written. A download also holds `.locks/folders.lock` shared from
before it makes its folder until its file is in place; `rm` prunes the folders it left empty only when it
can hold that lock alone, so it never removes a folder a download (of this model or a sibling) is using.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ..errors import DownloadError, ModelNotFoundError, UsageError
from ..paths import cache_home
from ..progress import note
from ..textio import printable
from .entry import ModelEntry

try:
    import fcntl
except ImportError:  # pragma: no cover (not POSIX: no locks)
    fcntl = None  # type: ignore[assignment]


def _home_source() -> str:
    return next((f" (${v})" for v in ("LLAMACLI_HOME", "XDG_CACHE_HOME") if os.environ.get(v)), "")


def make_folder(folder: Path) -> None:
    """mkdir -p inside the cache, as a usage error (exit 2) when the cache or a folder in it cannot be one."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"cannot use the cache{_home_source()}: {folder} or a folder above it is a file") from None
    except OSError as exc:
        raise UsageError(f"cannot create the cache folder {folder}{_home_source()}: {exc.strerror or exc}") from None


def in_cache(path: Path) -> Path:
    """`path` with its folders resolved; UsageError if they lead outside the cache (a link planted in it)."""
    root = cache_home().resolve()
    folder = path.parent.resolve()
    if folder != root and root not in folder.parents:
        raise UsageError(f"{path} leads outside the cache {root} (through a symbolic link); refusing to touch it")
    return folder / path.name


def model_path(entry: ModelEntry) -> Path:
    """Where `entry` lives in the cache (whether or not it is there)."""
    return entry.cache_path or cache_home() / "models" / f"{entry.name}.gguf"


def is_cached(entry: ModelEntry) -> bool:
    """Whether the model is in the cache, whole: a regular file (or our link to one) of the declared size,
    reached without leaving the cache."""
    try:
        path = in_cache(model_path(entry))
        return path.is_file() and (entry.size is None or path.stat().st_size == entry.size)
    except (UsageError, OSError, ValueError):
        return False


# -- locks ---------------------------------------------------------------------------------------------------


def _lock_fd(key: str) -> int:
    """An open descriptor of .locks/<key>.lock, made if missing (never through a planted link)."""
    locks = in_cache(cache_home().resolve() / ".locks" / "x").parent
    make_folder(locks)
    try:
        return os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UsageError(f"cannot create a lock file in {locks}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def cache_lock(path: Path, *, wait: bool) -> Iterator[None]:
    """Hold the model's lock: flock on .locks/<sha256 of its path in the cache>. Without `wait`, a lock held
    elsewhere is a DownloadError at once; with it, a note and a wait (the holder's download is bounded)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    key = hashlib.sha256(str(path.relative_to(cache_home().resolve())).encode()).hexdigest()[:32]
    fd = _lock_fd(key)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise DownloadError(f"{path.name} is being downloaded by another llamacli; try again when it is done") from None
            note(f"waiting for another llamacli that is downloading {path.name}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def folders_in_use() -> Iterator[None]:
    """Hold the cache's folders (shared) while a download makes and uses its folder: no `rm` prunes one meanwhile."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = _lock_fd("folders")
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


# -- rm ------------------------------------------------------------------------------------------------------


def remove_cached(path: Path, spec: str) -> list[Path]:
    """Delete the model file at `path` (already checked to lie in the cache) and the leftovers of its
    interrupted downloads, under its lock; `spec` is what the user named it. A link is removed as a link,
    and a folder where the model file should be is left alone."""
    with cache_lock(path, wait=False):
        doomed = leftovers(path)
        if path.is_symlink() or path.is_file():
            doomed.insert(0, path)
        elif path.is_dir():
            raise UsageError(f"{path} is a folder, not a model file; remove it yourself if you mean to")
        elif os.path.lexists(path):
            raise UsageError(f"{path} is not a regular file, so not a model llamacli downloaded")
        if not doomed:
            raise ModelNotFoundError(f"model {printable(spec)} is not downloaded")
        shared = path.is_symlink() or (path.is_file() and path.stat().st_nlink > 1)
        for p in doomed:
            p.unlink(missing_ok=True)
        _prune(path.parent)
    if shared:
        note("the Hugging Face cache keeps its own copy (`hf cache` or `huggingface-cli delete-cache` frees it)")
    return doomed


def leftovers(path: Path) -> list[Path]:
    """Partial files of `path`'s interrupted downloads, matched by exact name (never a glob): .<name>.part and
    its .json, .<name>.whl.part, .<name>.link, and .<name>.<8 random characters>.part of older versions."""
    prefix = f".{path.name}."
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    found = []
    for n in sorted(names):
        middle = n[len(prefix):] if n.startswith(prefix) else None
        if middle is not None and (middle in ("part", "part.json", "whl.part", "whl.part.json", "link")
                                   or re.fullmatch(r"[a-z0-9_]{8}\.part", middle)):  # fmt: skip
            p = path.parent / n
            if p.is_symlink() or p.is_file():
                found.append(p)
    return found


def _prune(folder: Path) -> None:
    """Remove folders the removal left empty (hf/owner/repo/), up to the cache, never the cache itself; not at
    all while a download holds the folders (an empty folder may be one it has just made)."""
    if fcntl is None:  # pragma: no cover
        _remove_empty(folder)
        return
    fd = _lock_fd("folders")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        _remove_empty(folder)
    finally:
        os.close(fd)


def _remove_empty(folder: Path) -> None:
    root = cache_home().resolve()
    while folder != root and root in folder.parents and not folder.is_symlink():
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
