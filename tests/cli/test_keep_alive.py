"""--keep-alive (cli/keep_alive.py, cli/resident.py, cli/rendezvous.py): run/generate/chat hand their task to a
llamacli server that keeps the model loaded. Real processes throughout (the hand-off passes the command's
own descriptors); each test has its own rendezvous directory (XDG_RUNTIME_DIR), and every server a test
starts is killed after it, whatever happened (the `rundir` fixture).

What is checked: a second command is served by the first one's server and prints byte for byte what the
command prints without the option (greedy and seeded; a chat; errors and exit codes); the server leaves after
its idle time, at once with --keep-alive 0, and on `stop`; other models or load options get other servers;
an unsafe rendezvous is not used (the command loads the model itself, with one notice), a bad socket is
replaced, hostile connections do not hurt the server; commands starting at once start one server; Ctrl-C
gives 130 and leaves the server usable; a command killed lets go of its streams, a server killed is one
line."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from clirun import ROOT, Result
from llamacli.cli.generate import Task
from llamacli.cli.keep_alive import model_identity, server_key
from llamacli.cli.rendezvous import FrameError, Rendezvous, recv_frame, send_frame
from llamacli.units import FOREVER, parse_duration

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Unix sockets and /proc: Linux")

NP = ("--backend", "numpy")
PID = re.compile(r"keep-alive: the llamacli server \(pid (\d+), (started for this command|resident)")


# -- fixtures and helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(random_model) -> str:
    return str(random_model("tiny-llama"))


@pytest.fixture(scope="module")
def other(random_model) -> str:
    return str(random_model("tiny-llama", "Q8_0"))


@pytest.fixture
def rundir():
    """A short private XDG_RUNTIME_DIR; every server whose rendezvous is in it is killed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="ka-", dir="/tmp"))
    try:
        yield path
    finally:
        for pid in servers_of(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        gone_within(lambda: not servers_of(path), 10)
        shutil.rmtree(path, ignore_errors=True)


def servers_of(rundir: Path) -> list[int]:
    """The pids of the keep-alive servers whose rendezvous directory is in `rundir`."""
    mark = str(rundir / "llamacli").encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            words = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"keep-alive-server" in words and mark in words:
            found.append(int(entry))
    return found


def gone_within(done, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if done():
            return True
        time.sleep(0.05)
    return done()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def env_for(rundir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LLAMACLI_KEEP_ALIVE"}
    return {**env, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(rundir), **extra}


def cli(rundir: Path, *args: str, stdin: str = "", cwd: str | None = None, timeout: float = 120, **env: str) -> Result:
    p = subprocess.run([sys.executable, "-m", "llamacli", *args], input=stdin.encode(), capture_output=True,
                       timeout=timeout, env=env_for(rundir, **env), cwd=cwd)
    return Result(p.returncode, p.stdout.decode(errors="surrogateescape"), p.stderr.decode(errors="replace"))


def spawn(rundir: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llamacli", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env_for(rundir))


def within(read, seconds: float = 60):
    """read() on a thread: what it returned, or a test failure after `seconds` (no hang on a pipe kept open)."""
    got: list = []
    thread = threading.Thread(target=lambda: got.append(read()), daemon=True)
    thread.start()
    thread.join(seconds)
    if not got:
        pytest.fail(f"nothing came within {seconds} s")
    return got[0]


def long_run(rundir: Path, model: str, wait: bool = True) -> subprocess.Popen:
    p = spawn(rundir, "generate", model, *NP, "-c", "4096", "-p", "Once", "--raw", "-n", "4000", "--ignore-eos",
              "--seed", "1", "--keep-alive", "1m", "-v")
    if wait:
        assert within(lambda: p.stdout.read(8))  # it is generating
    return p


def finish(p: subprocess.Popen, timeout: float = 30) -> Result:
    """Its exit code and the rest of its output, which must end (EOF: no one holds its pipes) within `timeout`."""
    if p.stdin is not None and p.stdin.closed:
        p.stdin = None
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        for pipe in (p.stdin, p.stdout, p.stderr):
            if pipe is not None:
                pipe.close()
        pytest.fail(f"its output did not end within {timeout} s (exit status {p.poll()}): something holds its pipes")
    return Result(p.returncode, (out or b"").decode(errors="surrogateescape"), (err or b"").decode(errors="replace"))


def pid_of(r: Result) -> int:
    found = PID.search(r.err)
    assert found, r.err
    return int(found.group(1))


def masked(text: str) -> str:
    """stderr with its numbers (timings) blanked, and the padding before them."""
    return re.sub(r" *\d+(\.\d+)?", " N", text)


def key_for(model: str, ctx: int | None = None) -> str:
    """The rendezvous key of a server for `model` with these options, as the commands compute it."""
    import llamacli

    assert Path(llamacli.__file__).resolve().parent == ROOT / "llamacli"  # the commands' llamacli
    load = {"backend": "numpy", "ctx": ctx, "swa_full": False}
    return server_key(model_identity(Path(model), load, ("f16", "f16")))


def generate(model: str, *extra: str) -> list[str]:
    return ["generate", model, *NP, "-p", "Hello there", "-n", "12", "--greedy", *extra]


@pytest.fixture(scope="module")
def expected(tiny) -> Result:
    """What `generate` prints without --keep-alive."""
    r = cli(Path("/nonexistent"), *generate(tiny))
    assert r.code == 0 and r.out, r.err
    return r


# -- the hand-off ---------------------------------------------------------------------------------------------


def test_a_second_command_is_served_by_the_first_ones_server_and_prints_the_same(tiny, rundir):
    pids = set()
    for sampling in (["--greedy"], ["--seed", "7", "--temp", "1.0", "--top-k", "0"]):
        args = ["generate", tiny, *NP, "-p", "Hello there", "-n", "24", *sampling]
        here = cli(rundir, *args)
        cold = cli(rundir, *args, "--keep-alive", "1m", "-v")
        warm = cli(rundir, *args, "--keep-alive", "1m", "-v")
        plain = cli(rundir, *args, "--keep-alive", "1m")
        assert {here.code, cold.code, warm.code, plain.code} == {0}, (cold.err, warm.err)
        assert here.out and here.out == cold.out == warm.out == plain.out
        assert masked(plain.err) == masked(here.err)  # the notices and timing lines, numbers aside
        pids |= {pid_of(cold), pid_of(warm)}
        assert "resident" in warm.err and "hand-off to the llamacli server (pid" in warm.err
        json_here = json.loads(cli(rundir, *args, "--json", "-q").out)
        json_warm = json.loads(cli(rundir, *args, "--json", "-q", "--keep-alive", "1m").out)
        assert json_here["tokens"] == json_warm["tokens"] and json_here["text"] == json_warm["text"]
    assert len(pids) == 1 and servers_of(rundir) == list(pids)
    assert "started for this command" in cold.err or "resident" in cold.err


def test_a_chat_through_the_server(tiny, rundir, tmp_path):
    """Lines from a pipe, the replies and /save (relative to the command's directory) as without the option;
    the environment variable asks for it too."""
    lines = "Hi!\nWhat now?\n/save conv.json\n"
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    args = ["chat", tiny, *NP, "--greedy", "-n", "8"]
    here = cli(rundir, *args, stdin=lines, cwd=str(tmp_path / "here"))
    there = cli(rundir, *args, "-v", stdin=lines, cwd=str(tmp_path / "there"), LLAMACLI_KEEP_ALIVE="1m")
    assert here.code == there.code == 0, there.err
    assert there.out == here.out and len(here.out.splitlines()) == 2
    assert pid_of(there) in servers_of(rundir)
    saved = (tmp_path / "there" / "conv.json").read_text()
    assert saved == (tmp_path / "here" / "conv.json").read_text() and len(json.loads(saved)) == 4
    run = cli(rundir, "run", tiny, *NP, "--greedy", "-n", "8", "--keep-alive", "1m", "-v", stdin="Hi!\n")
    assert run.code == 0 and run.out.splitlines()[0] == here.out.splitlines()[0]
    assert pid_of(run) == pid_of(there)


def test_errors_exit_codes_and_odd_streams_are_the_commands(tiny, rundir):
    long = "word " * 400
    here = cli(rundir, "generate", tiny, *NP, "-c", "64", "-p", long)
    there = cli(rundir, "generate", tiny, *NP, "-c", "64", "-p", long, "--keep-alive", "1m")
    assert here.code == there.code == 2 and here.one_line_error() == there.one_line_error()
    assert servers_of(rundir)  # (the server stays: a bad request is the command's failure, not the server's)
    r = cli(rundir, "generate", tiny, *NP, "-p", "hi", "--keep-alive", "soon")
    assert r.code == 2 and "--keep-alive (or LLAMACLI_KEEP_ALIVE) takes a duration" in r.one_line_error()
    r = cli(rundir, "keep-alive-server", "--fd", "0", "--lock-fd", "1", "--dir", str(rundir))  # by hand
    assert r.code == 2 and "started by --keep-alive, not by hand" in r.one_line_error()
    r = cli(rundir, "chat", tiny, *NP, LLAMACLI_KEEP_ALIVE="9" * 500 + "x")
    assert r.code == 2 and "... (503 characters)" in r.one_line_error()  # (its repr, cut)
    # an encoding that cannot hold the text: escapes, as without the option
    args = ("generate", tiny, *NP, "-c", "64", "-p", "hi", "-n", "8", "--greedy")
    here, there = cli(rundir, *args, PYTHONIOENCODING="ascii"), cli(rundir, *args, "--keep-alive", "1m",
                                                                     PYTHONIOENCODING="ascii")
    assert here.code == there.code == 0 and there.out == here.out and "\\u" in here.out and here.out.isascii()
    # stdout closed (>&-): one line, exit 1, as without the option
    p = subprocess.run([sys.executable, "-m", "llamacli", "generate", tiny, *NP, "-c", "64", "-p", "hi", "-n", "4",
                        "--keep-alive", "1m"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       preexec_fn=lambda: os.close(1), env=env_for(rundir), timeout=120)
    err = [line for line in p.stderr.decode().splitlines() if line.strip()]
    assert p.returncode == 1 and err[-1] == "error: standard output is closed", p.stderr
    # a reader that leaves (| head): exit 0, nothing on stderr
    p = subprocess.Popen([sys.executable, "-m", "llamacli", "generate", tiny, *NP, "-c", "64", "-p", "hi", "-n", "200",
                          "--ignore-eos", "-q", "--keep-alive", "1m"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env_for(rundir))
    within(lambda: p.stdout.read(1))
    p.stdout.close()
    p.stdout = None
    r = finish(p, 60)
    assert r.code == 0 and r.err == ""


def test_idle_time_keep_alive_0_other_options_ps_and_stop(tiny, other, rundir):
    for command in (["ps"], ["ps", "--json"], ["stop", "--all"], generate(tiny, "--keep-alive", "0")):
        r = cli(rundir, *command)
        assert r.code == 0 and not (rundir / "llamacli").exists(), r.err  # nothing made where nothing runs
    first = cli(rundir, *generate(tiny, "-c", "64", "--keep-alive", "1s", "-v"))
    assert first.code == 0, first.err
    assert gone_within(lambda: not alive(pid_of(first)), 15)
    assert not list((rundir / "llamacli").glob("*.sock"))
    zero = cli(rundir, *generate(tiny, "-c", "64", "--keep-alive", "0", "-v"))  # nothing resident: nothing starts
    assert zero.code == 0 and not PID.search(zero.err) and not servers_of(rundir)
    a = cli(rundir, *generate(tiny, "-c", "64", "--keep-alive", "5m", "-v"))
    b = cli(rundir, *generate(tiny, "-c", "128", "--keep-alive", "-1", "-v"))
    c = cli(rundir, *generate(other, "-c", "64", "--keep-alive", "5m", "-v"))
    pids = [pid_of(a), pid_of(b), pid_of(c)]
    assert len(set(pids)) == 3 and sorted(servers_of(rundir)) == sorted(pids)
    listed = json.loads(cli(rundir, "ps", "--json").out)
    assert sorted(s["pid"] for s in listed) == sorted(pids)
    assert {s["ctx"] for s in listed} == {64, 128} and any(s["expires_in"] is None for s in listed)  # -1: forever
    table = cli(rundir, "ps").out
    assert table.startswith("NAME") and "forever" in table and str(pids[0]) in table
    # 0 unloads: served by the resident server, which leaves after it
    unload = cli(rundir, *generate(tiny, "-c", "64", "--keep-alive", "0", "-v"))
    assert unload.code == 0 and pid_of(unload) == pids[0] and unload.out == a.out
    assert gone_within(lambda: not alive(pids[0]), 10)
    r = cli(rundir, "stop", tiny)
    assert r.code == 0 and f"(pid {pids[1]})" in r.err and gone_within(lambda: not alive(pids[1]), 10)
    assert alive(pids[2])
    r = cli(rundir, "stop", tiny)
    assert r.code == 1 and "no llamacli server keeps" in r.one_line_error()
    assert cli(rundir, "stop", "--all").code == 0 and gone_within(lambda: not alive(pids[2]), 10)
    assert json.loads(cli(rundir, "ps", "--json").out) == []


def test_commands_starting_at_once_start_one_server(tiny, rundir):
    procs = [spawn(rundir, *generate(tiny, "--keep-alive", "1m", "-v")) for _ in range(3)]
    results = [finish(p, 120) for p in procs]
    assert [r.code for r in results] == [0, 0, 0], [r.err for r in results]
    assert len({r.out for r in results}) == 1
    assert len({pid_of(r) for r in results}) == 1 and servers_of(rundir) == [pid_of(results[0])]
    assert sum("started for this command" in r.err for r in results) == 1


# -- interruptions and failures ------------------------------------------------------------------------------


def test_ctrl_c_ends_the_command_and_the_server_goes_on(tiny, rundir):
    # a chat holds the server (its stdin stays open); a command queued behind it ends at once on Ctrl-C, its
    # pipes let go (not when its turn would have come)
    chat = subprocess.Popen([sys.executable, "-m", "llamacli", "chat", tiny, *NP, "-c", "4096", "--greedy", "-n", "4",
                             "--keep-alive", "1m", "-v"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env_for(rundir))
    chat.stdin.write(b"Hi!\n")
    chat.stdin.flush()
    assert within(chat.stdout.readline)  # its first reply
    queued = long_run(rundir, tiny, wait=False)
    assert "1 command ahead" in within(queued.stderr.readline).decode()
    queued.send_signal(signal.SIGINT)
    r = finish(queued, 10)
    assert r.code == 130 and r.err.splitlines() == ["error: interrupted"] and r.out == "", r.err
    assert chat.poll() is None
    chat.stdin.close()
    assert finish(chat).code == 0
    # Ctrl-C while a reply is generated: 130, and the server goes on
    running = long_run(rundir, tiny)
    running.send_signal(signal.SIGINT)
    r = finish(running)
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert r.code == 130 and lines[-1] == "error: interrupted" and "Traceback" not in r.err, r.err
    after = cli(rundir, "generate", tiny, *NP, "-c", "4096", "-p", "Once", "--raw", "-n", "4", "--keep-alive", "1m",
                "-v")
    assert after.code == 0 and pid_of(after) == pid_of(r) and "resident, 2 commands served" in after.err


def test_a_killed_command_lets_go_and_a_killed_server_is_one_line(tiny, rundir):
    p = long_run(rundir, tiny)
    p.kill()
    assert finish(p, 10).code == -signal.SIGKILL  # its output ends: the server no longer holds its pipes
    (server,) = servers_of(rundir)
    p = long_run(rundir, tiny)
    os.kill(server, signal.SIGKILL)
    r = finish(p)
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert r.code == 1 and lines[-1] == (f"error: the llamacli server (pid {server}) that ran this command ended "
                                         "unexpectedly"), r.err
    r = cli(rundir, "generate", tiny, *NP, "-c", "4096", "-p", "Once", "--raw", "-n", "4", "--keep-alive", "1m", "-v")
    assert r.code == 0 and pid_of(r) != server and "started for this command" in r.err  # the stale socket replaced


def test_an_interactive_chat_through_the_server(tiny, rundir):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "llamacli", "chat", tiny, *NP, "--greedy", "-n", "6", "-v",
                                           "--keep-alive", "1m"], env=env_for(rundir, PYTHONUNBUFFERED="1"),
                          encoding="utf-8", timeout=60, dimensions=(40, 200))
    try:
        child.expect(PID)
        pid = int(child.match.group(1))
        child.expect_exact(">>> ")
        child.sendline("Hi!")
        child.expect(r"tokens/s")  # the reply's speed line: the turn ran
        child.expect_exact(">>> ")
        child.sendintr()  # Ctrl-C at the prompt: the line is dropped, the chat goes on
        child.expect_exact("Ctrl-C again")
        child.expect_exact(">>> ")
        child.sendcontrol("d")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0 and servers_of(rundir) == [pid]


# -- the rendezvous --------------------------------------------------------------------------------------------


def damage_rendezvous(rundir: Path, model: str, damage: str) -> None:
    d = rundir / "llamacli"
    if damage == "directory is a symlink":
        (rundir / "elsewhere").mkdir(mode=0o700)
        d.symlink_to(rundir / "elsewhere")
        return
    d.mkdir(mode=0o700)
    key = key_for(model)
    if damage == "directory mode 0755":
        d.chmod(0o755)
    elif damage == "directory of another user":
        os.chown(d, 65534, 65534)
    elif damage == "lock is a symlink":
        (rundir / "target").write_text("")
        (d / f"{key}.lock").symlink_to(rundir / "target")
    elif damage == "lock of another user":
        (d / f"{key}.lock").write_text("")
        os.chown(d / f"{key}.lock", 65534, 65534)
    elif damage == "lock is a fifo":
        os.mkfifo(d / f"{key}.lock", 0o600)


@pytest.mark.parametrize("damage", ["directory is a symlink", "directory mode 0755", "directory of another user",
                                    "lock is a symlink", "lock of another user", "lock is a fifo"])
def test_an_unsafe_rendezvous_is_not_used(tiny, rundir, expected, damage):
    if "another user" in damage and os.getuid() != 0:
        pytest.skip("needs root to give a file to another user")
    damage_rendezvous(rundir, tiny, damage)
    r = cli(rundir, *generate(tiny, "--keep-alive", "1m"))
    notices = [line for line in r.err.splitlines() if line.startswith("--keep-alive:")]
    assert r.code == 0 and r.out == expected.out, r.err
    assert len(notices) == 1 and notices[0].endswith("; the model loads in this process"), r.err
    assert not servers_of(rundir)
    assert not (rundir / "elsewhere").exists() or not os.listdir(rundir / "elsewhere")


class Decoy:
    """A listener of this user on a socket: it counts connections and answers each with `reply` bytes."""

    def __init__(self, path: Path, reply: bytes = b""):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.reply, self.connections = reply, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            try:
                conn.sendall(self.reply)
                time.sleep(0.2)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("case", ["symlink to a decoy", "regular file", "stale socket", "garbage listener",
                                  "wrong-key listener"])
def test_a_bad_socket_is_replaced_never_used(tiny, rundir, expected, case):
    d = rundir / "llamacli"
    d.mkdir(mode=0o700)
    path = d / f"{key_for(tiny)}.sock"
    decoy = None
    if case == "symlink to a decoy":
        decoy = Decoy(rundir / "decoy.sock", b"\x00\x00\x00\x02{}")
        path.symlink_to(rundir / "decoy.sock")
    elif case == "regular file":
        path.write_text("not a socket")
    elif case == "stale socket":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        s.close()
    elif case == "garbage listener":
        decoy = Decoy(path, b"HTTP/1.1 200 OK\r\n\r\nhello")
    else:
        body = json.dumps({"hello": "another key", "pid": 1}).encode()
        decoy = Decoy(path, struct.pack(">I", len(body)) + body)
    try:
        r = cli(rundir, *generate(tiny, "--keep-alive", "1m", "-v"))
    finally:
        if decoy is not None:
            decoy.close()
    assert r.code == 0 and r.out == expected.out, r.err
    assert "started for this command" in r.err and servers_of(rundir) == [pid_of(r)]
    if case == "symlink to a decoy":
        assert decoy.connections == 0  # never connected through the link
    with Rendezvous(d) as rv:
        assert rv.socket_state(key_for(tiny))[0] == "socket"


def test_the_server_shrugs_off_hostile_connections(tiny, rundir):
    first = cli(rundir, *generate(tiny, "--keep-alive", "1m", "-v"))
    assert first.code == 0, first.err
    pid, key = pid_of(first), key_for(tiny)
    path = rundir / "llamacli" / f"{key}.sock"

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(str(path))
        return s

    def answer(s: socket.socket) -> bytes:
        """What the server says before it closes the connection (a reset: it had not read all we sent)."""
        chunks = []
        while True:
            try:
                chunk = s.recv(4096)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    def descriptors() -> list[str]:
        found = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
        return sorted(found)

    def settled() -> bool:
        """No connection left open: the only socket is the one it listens on."""
        return sum(target.startswith("socket:") for target in descriptors()) == 1

    assert gone_within(settled, 10), descriptors()
    before = descriptors()
    silent = connect()  # says nothing: the others are served meanwhile
    for garbage in (b"GET / HTTP/1.1\r\n\r\n", struct.pack(">I", 1 << 31), struct.pack(">I", 5) + b"[[[[[",
                    os.urandom(4096)):
        with connect() as s:
            s.sendall(garbage)
            s.shutdown(socket.SHUT_WR)
            assert b"hello" not in answer(s)
    with connect() as s:  # a hello, then a request of the wrong shape (descriptors it must close)
        send_frame(s, {"op": "hello", "llamacli": 1, "key": key})
        assert recv_frame(s)[0] == {"hello": key, "pid": pid}
        r, w = os.pipe()
        send_frame(s, {"op": "run", "task": {"kind": "complete"}}, [r, w, w, r])
        os.close(r)
        os.close(w)
        assert "error" in recv_frame(s)[0]
    with connect() as s:  # another key
        send_frame(s, {"op": "hello", "llamacli": 1, "key": "0" * 32})
        assert recv_frame(s)[0] == {"error": "this server holds another model"}
    for bad in ("../../elsewhere", "", 7, key.upper()):  # not a key: never a file name
        with connect() as s:
            send_frame(s, {"op": "hello", "llamacli": 1, "key": bad})
            assert recv_frame(s)[0] == {"error": "not this protocol"}
    if os.getuid() == 0:  # another user, where the directories and socket let them reach it (a misconfiguration)
        for where, mode in ((rundir, 0o711), (rundir / "llamacli", 0o711), (path, 0o666)):
            os.chmod(where, mode)
        try:
            child = os.fork()
            if child == 0:  # (only the standard library, then _exit)
                try:
                    os.setgroups([])
                    os.setgid(65534)
                    os.setuid(65534)
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(5)
                    s.connect(str(path))
                    body = json.dumps({"op": "hello", "llamacli": 1, "key": key}).encode()
                    s.sendall(struct.pack(">I", len(body)) + body)
                    os._exit(0 if s.recv(100) == b"" else 3)  # closed without a word
                except (BrokenPipeError, ConnectionResetError):  # closed before or without reading the hello
                    os._exit(0)
                except BaseException:
                    os._exit(4)
            assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
        finally:
            for where, mode in ((rundir, 0o700), (rundir / "llamacli", 0o700), (path, 0o600)):
                os.chmod(where, mode)
    r = cli(rundir, *generate(tiny, "--keep-alive", "1m", "-v"))
    silent.close()
    assert r.code == 0 and pid_of(r) == pid and r.out == first.out
    assert gone_within(lambda: descriptors() == before, 10), (before, descriptors())  # every one given back


def test_a_silent_or_garbled_peer_is_not_a_server(monkeypatch):
    """In the process: the hand-off's deadline on a peer that says nothing, and frames that are not ours."""
    from llamacli.cli import keep_alive

    monkeypatch.setattr(keep_alive, "HANDSHAKE_S", 0.3)
    ours, theirs = socket.socketpair()
    with theirs:
        began = time.monotonic()
        with pytest.raises(keep_alive.NotOurs):
            keep_alive.exchange(ours, "k", b"{}", [], True, None)
        assert time.monotonic() - began < 3
    for raw in (struct.pack(">I", 1 << 30), struct.pack(">I", 3) + b"[1]", struct.pack(">I", 4) + b"\xff\xfe{}",
                struct.pack(">I", 10) + b"{}"):
        a, b = socket.socketpair()
        with a, b:
            b.sendall(raw)
            b.shutdown(socket.SHUT_WR)
            with pytest.raises(FrameError):
                recv_frame(a)
    a, b = socket.socketpair()
    with a, b:
        r, w = os.pipe()
        send_frame(b, {"x": 1}, [r, w])
        os.close(r)
        os.close(w)
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(FrameError):
            recv_frame(a, max_fds=1)  # more descriptors than asked for: all closed
        assert len(os.listdir("/proc/self/fd")) == before


# -- the parts ---------------------------------------------------------------------------------------------------


def test_durations_are_ollamas():
    assert parse_duration("5m") == 300 and parse_duration("1h30m") == 5400 and parse_duration("1.5h") == 5400
    assert parse_duration("30s") == 30 and parse_duration("300ms") == 0.3 and parse_duration("3600") == 3600
    assert parse_duration("0") == 0 and parse_duration("0s") == 0
    assert parse_duration("-1") == FOREVER and parse_duration("-5m") == FOREVER and parse_duration("9" * 400) == FOREVER
    for bad in ("", "soon", "5 m", "1e3", "inf", "nan", "m", "5d", "--1"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_a_task_from_another_process_is_checked():
    good = Task("complete", {"temperature": 0.0}, {
        "text": "hi", "max_tokens": 4, "stop": [], "raw": False, "system": None, "truncate": False, "as_json": False,
        "verbose": False, "quiet": False, "think": None, "logprobs": None, "ignore_eos": False}, None)
    assert Task.from_json(json.loads(json.dumps(good.as_json()))) == good
    for change in ({"kind": "exec"}, {"params": {"temperature": 0.0, "evil": 1}}, {"grammar": 7},
                   {"options": {**good.options, "max_tokens": True}}, {"options": {**good.options, "stop": [1]}},
                   {"options": {**good.options, "extra": 1}}, {"options": {"text": "hi"}}):
        with pytest.raises(ValueError):
            Task.from_json({**good.as_json(), **change})
    with pytest.raises(ValueError):
        Task.from_json([1, 2])


# -- on a GPU (the lead's machine) -------------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_a_gpu_a_warm_command_skips_the_start_up_and_answers_the_same(smollm2, rundir):
    """SmolLM2 on CUDA, 64 tokens: the command without --keep-alive, a cold one (it starts the server) and warm
    ones print the same text; a warm one takes a fraction of the time. The times are printed (-s or -rP)."""
    pytest.importorskip("cupy")
    from llamacli.backends.cuda import cuda_available

    ok, why = cuda_available()
    if not ok:
        pytest.skip(why)
    args = ["generate", str(smollm2), "--backend", "cuda", "-p", "The history of the Roman Empire began", "--raw",
            "-n", "64", "--ignore-eos", "--seed", "1"]

    def timed(*extra: str) -> tuple[float, Result]:
        began = time.perf_counter()
        r = cli(rundir, *args, *extra)
        assert r.code == 0, r.err
        return time.perf_counter() - began, r

    here = [timed() for _ in range(2)]
    cold = timed("--keep-alive", "5m", "-v")
    warm = [timed("--keep-alive", "5m", "-v") for _ in range(3)]
    assert len({r.out for _, r in (*here, cold, *warm)}) == 1 and here[0][1].out
    assert len({pid_of(r) for _, r in (cold, *warm)}) == 1 and "started for this command" in cold[1].err
    seconds = {"in the process": [round(t, 3) for t, _ in here], "cold (server start)": round(cold[0], 3),
               "warm": [round(t, 3) for t, _ in warm]}
    print(f"\nSmolLM2 64 tokens on CUDA, wall seconds: {seconds}")
    for line in warm[-1][1].err.splitlines():
        if line.startswith(("start-up:", "to the first token:", "eval time")):
            print(line)
    assert max(t for t, _ in warm) < min(t for t, _ in here), seconds
