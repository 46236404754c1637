"""llamacli.testing.hf_gemma4's files against llama.cpp's own convert_hf_to_gguf.py (its conversion/gemma.py
Gemma4Model) on the same transformers checkpoints (the tiny random models of test_gemma4.py, and variants): the same
tensor names, shapes, types and values, and the same `gemma4.*` keys. That is what lets test_gemma4.py compare
llamacli with transformers through hf_gemma4's files.

The converter as test_hybrid_convert.py finds it ($LLAMACLI_LLAMA_CPP, else llama-cpp-python 0.3.36's source
package), run in a subprocess with the vocabulary step stubbed out (Gemma4Model.set_vocab reads a real tokenizer;
the vocabulary is not what is compared) and a tokenizer.json of the checkpoint's size beside it (Gemma3Model's
tensor step reads it to trim the embedding rows). Skipped, with the reason, where the converter cannot be had or
cannot import what it needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_gemma4 import hf_model, state_of  # noqa: E402
from test_hybrid_convert import converter  # noqa: E402, F401  (the fixture)

from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.testing.hf_gemma4 import write_hf_model  # noqa: E402

# Runs the converter with the vocabulary steps no-ops: argv = converter dir, then the converter's own arguments.
WRAPPER = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion.base import TextModel
from conversion import gemma
TextModel.set_vocab = lambda self: None
gemma.Gemma4Model.set_vocab = lambda self: None
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(converter_dir: Path, model_dir: Path, out: Path, outtype: str) -> Path:
    script = model_dir.parent / "convert_novocab.py"
    script.write_text(WRAPPER)
    args = [sys.executable, str(script), str(converter_dir), str(model_dir), "--outfile", str(out), "--outtype", outtype]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    if p.returncode != 0:
        tail = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        if "ModuleNotFoundError" in tail or "ImportError" in tail:
            pytest.skip(f"the converter cannot run here: {tail}")
        if "Gemma4" in p.stderr and ("not supported" in p.stderr or "KeyError" in p.stderr):
            pytest.skip(f"this converter has no Gemma 4: {tail}")
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{p.stderr[-3000:]}")
    return out


@pytest.mark.parametrize("kind,outtype,changes", [
    ("e", "f32", {}),
    ("e", "f16", dict(use_double_wide_mlp=True, tie_word_embeddings=False)),
    ("moe", "f32", {}),
    ("moe", "f16", dict(attention_k_eq_v=False, num_global_key_value_heads=None, final_logit_softcapping=None)),
])
def test_our_writer_matches_the_converter(tmp_path, converter, kind, outtype, changes):  # noqa: F811
    m = hf_model(kind, seed=11, **changes)
    model_dir = tmp_path / kind
    m.save_pretrained(model_dir)
    vocab = m.config.vocab_size
    (model_dir / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(vocab)}},
                                                          "added_tokens": []}))
    theirs = open_gguf(convert(converter, model_dir, tmp_path / "theirs.gguf", outtype))
    ours = open_gguf(write_hf_model(tmp_path / "ours.gguf", m.config.to_dict(), state_of(m), outtype.upper()))
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name, t in theirs.tensors.items():
        o = ours.tensors[name]
        assert (o.shape, o.type) == (t.shape, t.type), name
        a, b = ours.dequantize(name), theirs.dequantize(name)
        assert np.allclose(a, b, rtol=1e-6, atol=1e-7), (name, float(np.abs(a - b).max()))
    keys = {k for k in theirs.metadata if k.startswith("gemma4.")} | {"general.architecture", "general.file_type"}
    assert {k for k in ours.metadata if k.startswith("gemma4.")} | {"general.architecture", "general.file_type"} == keys
    for k in keys:
        assert ours.metadata[k] == theirs.metadata[k], k
