"""What start-up imports (issue 46): a command imports what it uses, when it uses it. Each case runs in a
fresh interpreter, as the console script does, and names the heavy packages it found loaded.

- The CUDA path (opening the file, the config, the tensor checks, the engine, the CUDA backend's modules and
  its float32 vectors read from the file) imports no `gguf`: its package import loads yaml, sentencepiece and
  every architecture's tables (ggufio/ggml_types.py holds the numbers it needs).
- `--help` and `--version` load no model code, no rich (nothing is printed through it), no logging (--debug's),
  no server (serve's), and not both typer's copy of click and click.
- `tokenize` of a file given by its path loads neither the registry nor the chat templates (jinja2), unless
  --chat asks for a template.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Packages no start-up path below should load before it uses them. (numpy is needed by every model command.)
GGUF_AND_ITS_IMPORTS = ("gguf", "yaml", "sentencepiece")


def run_cli(argv: list[str]) -> str:
    """Code that runs the console script's entry with `argv` (its exit, os._exit included, not the end)."""
    return (
        "import os, sys\n"
        "os._exit = sys.exit\n"  # a model command leaves through os._exit (llamacli._leave): come back instead
        f"sys.argv = ['llamacli', *{argv!r}]\n"
        "import llamacli\n"
        "try:\n"
        "    llamacli.run()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
    )


def loaded_after(code: str) -> set[str]:
    """The modules and packages loaded once `code` has run in a fresh interpreter (top-level names too)."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    names = json.loads(r.stdout.splitlines()[-1])
    return set(names) | {n.split(".")[0] for n in names}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from llamacli.testing import write_model

    return write_model(tmp_path_factory.mktemp("startup") / "tiny.gguf", "tiny-llama", "Q8_0")


def test_the_cuda_path_imports_no_gguf(tiny_model):
    code = (
        "from llamacli.engine.generate import Model\n"
        "from llamacli.ggufio.file import open_gguf\n"
        "from llamacli.models.config import ModelConfig\n"
        "from llamacli.models.weights import check_tensors\n"
        "import llamacli.cli\n"
        "try:\n"
        "    import llamacli.backends.cuda.backend as cb\n"  # (where CuPy is installed: its modules, not a GPU)
        "    runnable = cb.CudaBackend.runnable_types\n"
        "except ImportError:\n"
        "    runnable = None\n"
        f"g = open_gguf({str(tiny_model)!r})\n"
        "cfg = ModelConfig.from_gguf(g.metadata, set(g.tensors))\n"
        "if runnable is not None:\n"
        "    check_tensors(g, cfg, runnable)\n"
        "assert g.dequantize('output_norm.weight').dtype.name == 'float32'\n"  # as the CUDA upload reads vectors
        "assert g.tensors['blk.0.attn_q.weight'].type.name == 'Q8_0'\n"
    )
    assert not set(GGUF_AND_ITS_IMPORTS) & loaded_after(code)


def _vendored_click() -> bool:
    import importlib.util

    return importlib.util.find_spec("typer._click") is not None


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"]])
def test_help_and_version_load_no_model_code_and_no_rich(argv):
    loaded = loaded_after(run_cli(argv))
    heavy = {"numpy", "gguf", "jinja2", "tokenizers", "rich", "logging", "socket", "llamacli.serve",
             "llamacli.registry", "huggingface_hub", "cupy"}
    assert not heavy & loaded
    if _vendored_click():  # typer parses with its own copy of click: click itself is not needed
        assert "click" not in loaded


def test_tokenize_of_a_path_loads_no_registry_and_no_template_engine(tiny_model):
    plain = loaded_after(run_cli(["tokenize", "-m", str(tiny_model), "--text", "Hello world"]))
    assert not {"llamacli.registry", "jinja2", "rich", "gguf", "huggingface_hub"} & plain
    chat = loaded_after(run_cli(["tokenize", "-m", str(tiny_model), "--text", "Hello", "--chat"]))
    assert "jinja2" in chat and "llamacli.registry" not in chat
