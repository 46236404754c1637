"""Sizes for `llamacli models`: every model's, as far as anyone can tell.

The registry's size, else the cached file's, else what the source answered once (kept in sizes.json in the
cache), else "?". The questions go out in parallel and give up after PROBE_TIMEOUT_S, so without a network
the table still comes at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.parse
from pathlib import Path

from ..errors import DownloadError, UsageError
from ..paths import cache_home
from . import download as dl
from .cache import in_cache, is_cached, make_folder, model_path
from .entry import ModelEntry
from .hf_download import hf_file_size, quiet_hf, split_hf

MAX_MODEL_BYTES = 1 << 42  # 4 TiB: a `size` beyond this is a typo, not a model
PROBE_TIMEOUT_S = 2.0  # how long `llamacli models` waits for sources to state their sizes


def known_sizes(entries: list[ModelEntry]) -> dict[str, int]:
    """name -> bytes for every model whose size can be known: the registry's, the cached file's, an answer
    kept in sizes.json, or one the source gives now (asked in parallel, PROBE_TIMEOUT_S at most)."""
    stored = _read_sizes()
    found: dict[str, int] = {}
    wanted: dict[str, list[str]] = {}
    for entry in entries:
        key = _size_key(entry)
        if entry.size:
            found[entry.name] = entry.size
        elif is_cached(entry):
            found[entry.name] = in_cache(model_path(entry)).stat().st_size
        elif key in stored:
            found[entry.name] = stored[key]
        elif key is not None:
            wanted.setdefault(key, []).append(entry.name)
    answers = _probe(list(wanted)[:64])
    for key, size in answers.items():
        for name in wanted[key]:
            found[name] = size
    if answers:
        _write_sizes({**stored, **answers})
    return found


def _size_key(entry: ModelEntry) -> str | None:
    """The source that can be asked for the size without downloading: 'hf:owner/repo/file' or 'url:...'."""
    return next((f"{kind}:{spec}" for kind, spec in entry.sources if kind in ("hf", "url")), None)


def _probe(keys: list[str]) -> dict[str, int]:
    """Ask each source for its size at once, in daemon threads; what has not answered in time stays unknown."""
    if not keys:
        return {}
    answers: dict[str, int] = {}
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")

    def ask(key: str) -> None:
        try:
            kind, _, spec = key.partition(":")
            if kind == "url":
                size = _url_size(spec)
            else:
                size = None if offline else hf_file_size(*split_hf(spec), PROBE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 (no network, no such file: the size stays "?")
            return
        if isinstance(size, int) and 0 < size <= MAX_MODEL_BYTES:
            answers[key] = size

    with contextlib.ExitStack() as stack:
        with contextlib.suppress(DownloadError):
            stack.enter_context(quiet_hf())
        threads = [threading.Thread(target=ask, args=(k,), daemon=True) for k in keys]
        for t in threads:
            t.start()
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    return dict(answers)


def _url_size(url: str) -> int | None:
    # Here, not at the top: with ssl urllib.request slows every start-up (registry imports this module).
    from urllib.request import Request, url2pathname, urlopen

    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = Path(url2pathname(parts.path))
        return path.stat().st_size if path.is_file() else None
    request = Request(url, method="HEAD", headers={"User-Agent": dl.USER_AGENT})
    with urlopen(request, timeout=PROBE_TIMEOUT_S) as response:
        length = response.headers.get("Content-Length") or ""
    return int(length) if length.isdigit() and len(length) < 16 else None


def _sizes_file() -> Path:
    return cache_home() / "sizes.json"


def _read_sizes() -> dict[str, int]:
    try:
        with open(in_cache(_sizes_file()), "rb") as f:
            data = dl.read_json(f.read(1 << 20))
    except (OSError, ValueError, UsageError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_MODEL_BYTES}


def _write_sizes(sizes: dict[str, int]) -> None:
    """Keep the answers for next time; a cache that cannot be written to only means asking again."""
    try:
        path = in_cache(_sizes_file())
        make_folder(path.parent)
        tmp = path.with_name(f".sizes.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        with dl.open_part(tmp) as f:
            f.write(json.dumps(sizes, indent=0, sort_keys=True).encode())
        os.replace(tmp, path)
    except (OSError, UsageError):
        pass


def human_size(n: float | None) -> str:
    """Decimal units as registries show them; "?" for a size nobody could tell."""
    if n is None:
        return "?"
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB", "TB"):
        n /= 1000
        if n < 1000 or unit == "TB":
            break
    return f"{n:.1f} {unit}"
