"""`llamacli tokenize`: ids and pieces as JSON or text, --chat, --special, --no-bos, --file/stdin, and errors as
one line on stderr with an exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clirun import run, run_subprocess
from llamacli.ggufio.file import open_gguf
from llamacli.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol_tok(smollm2: Path) -> Tokenizer:
    return Tokenizer.from_metadata(open_gguf(smollm2).metadata)


def tokenize_json(*args: str, stdin: str = "") -> dict:
    r = run("tokenize", *args, "--json", stdin=stdin)
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert set(data) == {"ids", "pieces"} and len(data["ids"]) == len(data["pieces"])
    return data


def test_json_on_smollm2(smollm2: Path, smol_tok: Tokenizer) -> None:
    text = "Hello world, it's 2024! 日本語 <|im_end|>"
    data = tokenize_json("--model", str(smollm2), "--text", text)
    assert data["ids"] == smol_tok.encode(text)
    assert data["pieces"] == [smol_tok.piece(i) for i in data["ids"]]
    assert data["pieces"][:2] == ["Hello", "Ġworld"]
    assert 2 not in data["ids"]  # <|im_end|> stays text without --special
    special = tokenize_json("-m", str(smollm2), "--text", text, "--special")
    assert special["ids"][-1] == 2


def test_chat_on_smollm2(smollm2: Path) -> None:
    data = tokenize_json("--model", str(smollm2), "--chat", "--text", "Hi there", "--system", "Be brief")
    assert data["ids"][0] == 1  # <|im_start|>
    assert data["ids"].count(1) == 3 and data["ids"].count(2) == 2
    assert "".join(data["pieces"]).replace("Ċ", "\n").replace("Ġ", " ") == (
        "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    default = tokenize_json("--model", str(smollm2), "--chat", "--text", "Hi there")  # the template's own system
    assert default["ids"].count(1) == 3 and "SmolLM" in "".join(default["pieces"])


def test_plain_and_verbose_output(smollm2: Path, smol_tok: Tokenizer) -> None:
    r = run("tokenize", "-m", str(smollm2), "-p", "Hello world")
    assert r.code == 0 and r.out == " ".join(map(str, smol_tok.encode("Hello world"))) + "\n"
    r = run("tokenize", "-m", str(smollm2), "-p", "Hello world", "--verbose")
    assert r.code == 0
    assert [line.split(None, 1) for line in r.out.splitlines()] == [["19556", '"Hello"'], ["905", '"Ġworld"']]
    r = run("tokenize", "-m", str(smollm2), "--chat", "-p", "x", "--verbose", "--json")
    assert r.code == 0 and "chat template: gguf" in r.err
    json.loads(r.out)


def test_file_and_stdin(smollm2: Path, smol_tok: Tokenizer, tmp_path: Path) -> None:
    text = "line one\r\nline two ✓\n"
    path = tmp_path / "in.txt"
    path.write_bytes(text.encode("utf-8"))
    assert tokenize_json("-m", str(smollm2), "--file", str(path))["ids"] == smol_tok.encode(text)
    assert tokenize_json("-m", str(smollm2), "--file", "-", stdin="from stdin")["ids"] == smol_tok.encode("from stdin")


def test_vocab_only_files_bos_and_fallback_template(llama_cpp_models: Path) -> None:
    spm = str(llama_cpp_models / "ggml-vocab-llama-spm.gguf")  # no tensors, add_bos_token = true
    assert tokenize_json("-m", spm, "-p", "Hello")["ids"] == [1, 15043]
    assert tokenize_json("-m", spm, "-p", "Hello", "--no-bos")["ids"] == [15043]
    r = run("tokenize", "-m", spm, "--chat", "-p", "Hello", "--json", "--verbose")
    assert r.code == 0 and "builtin:llama2" in r.err
    ids = json.loads(r.out)["ids"]
    assert ids[0] == 1 and ids[1] != 1  # the template's <s> is the BOS, once
    qwen = str(llama_cpp_models / "ggml-vocab-qwen2.gguf")
    assert tokenize_json("-m", qwen, "--chat", "-p", "Hello")["ids"][0] == 151644  # <|im_start|>


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model.gguf", "--text", "x"], "no such file"),
        (["--model", "MODEL"], "give the text once"),
        (["--model", "MODEL", "--text", "x", "--file", "y"], "give the text once"),
        (["MODEL", "x", "--text", "y"], "the text is given twice"),
        (["--model", "MODEL", "--file", "/no/such/input.txt"], "no such input file"),
        (["--model", "MODEL", "--file", "BADFILE"], "not UTF-8"),
        (["--model", "MODEL", "--text", "x", "--system", "s"], "--system needs --chat"),
        (["--model", "BERT", "--text", "x"], "unsupported tokenizer model 'bert'"),
        (["--text", "x"], "name the model"),
        (["--model", "MODEL", "--text", "x", "--bogus"], "bogus"),
    ],
)
def test_errors_are_one_line(args: list[str], message: str, smollm2: Path, llama_cpp_models: Path,
                             tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    subst = {"MODEL": str(smollm2), "BADFILE": str(bad), "BERT": str(llama_cpp_models / "ggml-vocab-bert-bge.gguf")}
    r = run("tokenize", *[subst.get(a, a) for a in args])
    assert r.code == 2
    assert message in r.one_line_error()
    assert r.out == ""


def test_not_a_gguf_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    r = run("tokenize", "-m", str(junk), "-p", "x")
    assert r.code == 2 and "not a GGUF file" in r.one_line_error()


def test_subprocess_end_to_end(smollm2: Path, smol_tok: Tokenizer) -> None:
    r = run_subprocess("tokenize", "--model", str(smollm2), "--chat", "--text", "Hi", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["ids"][:3] == smol_tok.encode("<|im_start|>system", special=True)[:1] + [9690, 198]
    r = run_subprocess("tokenize", "--model", str(smollm2))
    assert r.code == 2 and r.one_line_error().startswith("error: give the text")
