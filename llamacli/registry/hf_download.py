"""Hugging Face sources: `owner/repo/path/file.gguf`, fetched with huggingface_hub into its own cache.

That cache is shared with other tools and resumes by itself; `dest` becomes a hard link to the verified
blob (download.py links it). A file already in that cache is used without the network; when it fails the
size or sha256 check (a damaged blob, a file changed upstream), it is downloaded again once, with
force_download, instead of failing the same way on every later run.

One metadata request without retries goes first, so that without a network the answer is one line at once
instead of huggingface_hub's 25 s of retries, and so the size is known before the download starts (and
checked against the declared one and the free space of huggingface_hub's cache). The
transfer is held to download.py's bounds through the progress hook huggingface_hub calls for every chunk:
no more than the expected bytes, and the same stall rule as a URL download (a window of TIMEOUT_S seconds
must bring STALL_BYTES). For that hook to see a trickle, chunks are handed over as they arrive instead of
in huggingface_hub's 10 MB pieces. HF_TOKEN and HF_ENDPOINT are honoured.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ..errors import DownloadError
from ..progress import Bars
from . import download as dl

_HF_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"


def split_hf(spec: str) -> tuple[str, str]:
    """'owner/repo/path/file.gguf' (an hf:// prefix allowed) -> ('owner/repo', 'path/file.gguf')."""
    body = spec.removeprefix("hf://")
    parts = body.split("/")
    bad = len(parts) < 3 or any(p in ("", ".", "..") or not p.isprintable() or "\\" in p for p in parts)
    if bad or not all(re.fullmatch(_HF_PART, p) for p in parts[:2]):
        raise DownloadError(f"a Hugging Face source reads owner/repo/file.gguf, got {spec!r}")
    return "/".join(parts[:2]), "/".join(parts[2:])


@contextlib.contextmanager
def quiet_hf() -> Iterator[object]:
    """huggingface_hub with its logger at ERROR (unless --debug) for the duration: yields the module.

    Its functions are imported first, because importing the module that holds them configures the library's
    logger (WARNING) and would undo a level set before.
    """
    try:
        import huggingface_hub
        from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url  # noqa: F401
    except ImportError:
        raise DownloadError("Hugging Face downloads need the huggingface_hub package (pip install huggingface_hub)") from None
    logger = logging.getLogger("huggingface_hub")
    old = logger.level
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logger.setLevel(logging.ERROR)
    try:
        yield huggingface_hub
    finally:
        logger.setLevel(old)


@contextlib.contextmanager
def _chunks_as_they_arrive() -> Iterator[None]:
    """huggingface_hub reads the body in DOWNLOAD_CHUNK_SIZE (10 MB) pieces and calls the progress hook once a
    piece is whole, so a server trickling a byte a second would not reach the hook for months. None hands
    over each network read as it comes (httpx's iter_bytes), so the stall rule runs between reads."""
    from huggingface_hub import constants

    if not hasattr(constants, "DOWNLOAD_CHUNK_SIZE"):
        yield
        return
    old = constants.DOWNLOAD_CHUNK_SIZE
    constants.DOWNLOAD_CHUNK_SIZE = None
    try:
        yield
    finally:
        constants.DOWNLOAD_CHUNK_SIZE = old


def hf_endpoint() -> str | None:
    """HF_ENDPOINT, read at each call (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def hf_file_size(repo_id: str, filename: str, timeout: float) -> int | None:
    """The file's size as the hub states it, one request without retries (errors as DownloadError)."""
    with quiet_hf() as hub:
        try:
            url = hub.hf_hub_url(repo_id, filename, endpoint=hf_endpoint())
            return hub.get_hf_file_metadata(url, timeout=timeout).size
        except Exception as exc:  # noqa: BLE001 (httpx, requests and huggingface_hub errors alike)
            raise _hf_error(exc, repo_id, filename) from None


def fetch_hf(spec: str, dest: Path, *, bars: Bars, size: int | None) -> dl.Got:
    """The file's blob in huggingface_hub's cache: the copy already there (with a way to fetch it afresh,
    should it fail its checks), else a new download."""
    repo_id, filename = split_hf(spec)
    cached = _cached_copy(repo_id, filename)
    if cached is not None:
        afresh = lambda: _download(repo_id, filename, bars=bars, size=size, force=True)  # noqa: E731
        return dl.Got(cached, owned=False, refetch=afresh)
    return _download(repo_id, filename, bars=bars, size=size, force=False)


def _cached_copy(repo_id: str, filename: str) -> Path | None:
    """The blob another tool (or an earlier run) left in the Hugging Face cache, found without the network."""
    with quiet_hf() as hub:
        try:
            return Path(hub.hf_hub_download(repo_id, filename, endpoint=hf_endpoint(), local_files_only=True)).resolve()
        except Exception:  # noqa: BLE001 (not there, offline, a broken cache entry: download it)
            return None


def _download(repo_id: str, filename: str, *, bars: Bars, size: int | None, force: bool) -> dl.Got:
    with quiet_hf() as hub, _chunks_as_they_arrive():
        offered = hf_file_size(repo_id, filename, dl.TIMEOUT_S)
        where = hf_endpoint() or "huggingface.co"
        from huggingface_hub import constants

        limit = dl.byte_limit(size, offered, where, folder=Path(constants.HF_HUB_CACHE))  # where the blob goes
        try:
            got = hub.hf_hub_download(
                repo_id,
                filename,
                endpoint=hf_endpoint(),
                etag_timeout=dl.TIMEOUT_S,
                force_download=force,
                tqdm_class=_tqdm_class(bars, Path(filename).name, limit, where),
            )
        except DownloadError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _hf_error(exc, repo_id, filename) from None
    return dl.Got(Path(got).resolve(), owned=False)


def _tqdm_class(bars: Bars, label: str, limit: dl.Limit, where: str) -> type:
    """A tqdm class for huggingface_hub that draws nothing itself, feeds a bar of `bars` instead, and stops the
    transfer (by raising before the chunk is written) once more than `limit` bytes have come, or when the
    server stalls (download.StallWatch, the rule of every route)."""
    from tqdm.std import tqdm

    class ForwardingTqdm(tqdm):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["disable"] = True
            kwargs.pop("name", None)
            super().__init__(*args, **kwargs)
            self._count = int(kwargs.get("initial") or 0)  # type: ignore[call-overload]
            self._advance = bars.task(label, kwargs.get("total"), self._count)  # type: ignore[arg-type]
            self._stall = dl.StallWatch(where)

        def update(self, n: float | None = 1) -> bool | None:
            n = int(n or 0)
            self._count += n
            if self._count > limit.bytes:
                raise dl.CorruptDownload(f"the server sent more than the {limit.bytes} bytes {limit.what}")
            self._advance(n)
            self._stall.add(max(n, 0))
            return None

    return ForwardingTqdm


def _hf_error(exc: Exception, repo_id: str, filename: str) -> DownloadError:
    """One sentence for whatever huggingface_hub (or the HTTP library under it) raised."""
    from huggingface_hub import errors as hf

    where = hf_endpoint() or "huggingface.co"
    if isinstance(exc, DownloadError):
        return exc
    if isinstance(exc, hf.GatedRepoError):
        return DownloadError(f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id} and set HF_TOKEN")
    if isinstance(exc, hf.RepositoryNotFoundError):
        return DownloadError(f"{where} has no repository {repo_id} that you can read (if it is private or gated, set HF_TOKEN)")
    if isinstance(exc, hf.RevisionNotFoundError):
        return DownloadError(f"{repo_id} has no such revision on {where}")
    if isinstance(exc, getattr(hf, "RemoteEntryNotFoundError", hf.EntryNotFoundError)):
        return DownloadError(f"{repo_id} on {where} has no file {filename}")
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return DownloadError("HF_HUB_OFFLINE is set, so nothing can be downloaded from Hugging Face")
    if isinstance(exc, hf.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return DownloadError(f"{where} answered HTTP {status} for {repo_id}/{filename}")
    cause = exc.__cause__ or exc.__context__ if isinstance(exc, hf.LocalEntryNotFoundError) else exc
    if isinstance(cause, OSError) and not isinstance(cause, (TimeoutError, ConnectionError)) and cause.errno:
        return DownloadError(f"downloading {repo_id}/{filename} failed: {cause.strerror or cause}")
    why = f": {_first_line(cause)}" if cause else ""
    return DownloadError(f"cannot reach {where}{why}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
