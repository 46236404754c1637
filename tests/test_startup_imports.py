"""What start-up imports (issue 46): a command imports what it uses, when it uses it. Each case runs in a
fresh interpreter, as the console script does, and names the heavy packages it found loaded.

- The CUDA path (opening the file, the config, the tensor checks, the engine, the CUDA backend's modules and
  its float32 vectors read from the file) imports no `gguf`: its package import loads yaml, sentencepiece and
  every architecture's tables (ggufio/ggml_types.py holds the numbers it needs).
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


def loaded_after(code: str) -> set[str]:
    """The top-level packages loaded once `code` has run in a fresh interpreter."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.splitlines()[-1]))


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
