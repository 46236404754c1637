"""One model of the registry: a table of models.toml (registry.py reads them) with its sources in the order
written. Apart from registry.py so that cache.py and sizes.py, which registry.py builds on, can take one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from . import download as dl


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
    base: bool = False  # a base (pretrained) model: no chat template, it continues text
    origin: str = ""  # the file the table came from
    cache_path: Path | None = field(default=None, compare=False)  # set for hf:// specs; else models/<name>.gguf

    def source(self, kind: str) -> dl.Spec | None:
        return next((spec for k, spec in self.sources if k == kind), None)
