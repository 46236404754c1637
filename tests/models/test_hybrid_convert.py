"""llamacli.testing.hf_qwen's files against llama.cpp's own convert_hf_to_gguf.py on the same transformers
checkpoints (the tiny random models of test_hybrid.py, an MTP block included): the same tensor names, shapes,
types and values, and the same architecture keys. That is what lets test_hybrid.py compare llamacli with
transformers through hf_qwen's files.

The converter: $LLAMACLI_LLAMA_CPP (a llama.cpp source tree holding convert_hf_to_gguf.py, conversion/ and gguf-py/),
else the one in llama-cpp-python 0.3.36's source package (llamacli.testing.data.llama_cpp_converter_dir: pip
download, cached as the other test data). It runs in a subprocess of this Python (it needs torch, transformers,
safetensors and its own gguf-py, which must not meet the installed gguf package in this process), with the
vocabulary step stubbed out: a tiny model has no tokenizer the converter knows, and the vocabulary is not what is
compared. Skipped, with the reason, where the converter cannot be had or cannot import what it needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_hybrid import hf_model, state_of  # noqa: E402

from llamacli.ggufio.file import open_gguf  # noqa: E402
from llamacli.testing.hf_qwen import write_hf_model  # noqa: E402

# Runs the converter with TextModel.set_vocab a no-op: argv = converter dir, then the converter's own arguments.
WRAPPER = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion.base import TextModel
TextModel.set_vocab = lambda self: None
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def converter() -> Path:
    root = os.environ.get("LLAMACLI_LLAMA_CPP")
    if root:
        path = Path(root)
    else:
        from llamacli.testing import data

        try:
            path = data.llama_cpp_converter_dir()
        except Exception as exc:  # no network, no pip index
            pytest.skip(f"llama.cpp's converter is not at hand (set LLAMACLI_LLAMA_CPP to a llama.cpp tree): {exc}")
    if not (path / "convert_hf_to_gguf.py").is_file() or not (path / "gguf-py" / "gguf").is_dir():
        pytest.skip(f"{path} holds no convert_hf_to_gguf.py with gguf-py/ (LLAMACLI_LLAMA_CPP)")
    return path


def convert(converter: Path, model_dir: Path, out: Path, outtype: str, mtp: bool) -> Path:
    script = model_dir.parent / "convert_novocab.py"
    script.write_text(WRAPPER)
    args = [sys.executable, str(script), str(converter), str(model_dir), "--outfile", str(out), "--outtype", outtype]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(args + ([] if mtp else ["--no-mtp"]), capture_output=True, text=True, timeout=300, env=env)
    if p.returncode != 0:
        tail = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        if "ModuleNotFoundError" in tail or "ImportError" in tail:
            pytest.skip(f"the converter cannot run here: {tail}")
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{p.stderr[-3000:]}")
    return out


def add_mtp(model_dir: Path, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An MTP block for the saved checkpoint (mtp_num_hidden_layers 1; its layer a copy of the last attention
    layer, its fc and norms random), as Qwen3.5's released checkpoints carry one: the state with it."""
    import json

    from safetensors.numpy import save_file

    config = json.loads((model_dir / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(9)
    d, last = config["hidden_size"], f"model.layers.{config['num_hidden_layers'] - 1}."
    mtp = {"mtp.fc.weight": rng.standard_normal((d, 2 * d)).astype(np.float32)}
    mtp.update({f"mtp.{n}.weight": (0.1 * rng.standard_normal(d)).astype(np.float32)
                for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    mtp.update({"mtp.layers.0." + k[len(last):]: v.copy() for k, v in state.items() if k.startswith(last)})
    state = {**state, **mtp}
    for f in model_dir.glob("*.safetensors*"):
        f.unlink()
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return state


@pytest.mark.parametrize("arch,outtype,mtp", [("qwen35", "f32", True), ("qwen35moe", "f16", False),
                                              ("qwen3next", "f32", False), ("qwen35", "f16", False)])
def test_our_writer_matches_the_converter(tmp_path, converter, arch, outtype, mtp):
    m = hf_model(arch, seed=11)
    model_dir = tmp_path / arch
    m.save_pretrained(model_dir)
    state = state_of(m)
    if mtp:
        state = add_mtp(model_dir, state)
    theirs = open_gguf(convert(converter, model_dir, tmp_path / "theirs.gguf", outtype, mtp))
    ours = open_gguf(write_hf_model(tmp_path / "ours.gguf", arch, m.config.to_dict(), state, outtype.upper()))
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    for name, t in theirs.tensors.items():
        o = ours.tensors[name]
        assert (o.shape, o.type) == (t.shape, t.type), name
        a, b = ours.dequantize(name), theirs.dequantize(name)
        assert np.allclose(a, b, rtol=1e-6, atol=1e-7), (name, float(np.abs(a - b).max()))
    keys = {k for k in theirs.metadata if k.startswith(f"{arch}.")} | {"general.architecture", "general.file_type"}
    assert {k for k in ours.metadata if k.startswith(f"{arch}.")} | {"general.architecture", "general.file_type"} \
        == keys
    for k in keys:
        assert ours.metadata[k] == theirs.metadata[k], k
    if mtp:
        assert theirs.metadata[f"{arch}.nextn_predict_layers"] == 1 and "blk.8.nextn.eh_proj.weight" in theirs.tensors
