"""Where a command finds the llamacli server that keeps its model loaded (--keep-alive), and how the two talk.

The directory: $XDG_RUNTIME_DIR/llamacli (the per-user runtime directory), else the cache's run/ folder. It is
made 0700 and used only while it is a real directory (not a symbolic link) owned by this user with no
permission for anyone else; anything else is a RendezvousError that says what is wrong and is never
"repaired". It is opened once, and every file in it is reached through that descriptor (dir_fd, and on Linux
/proc/self/fd/N/NAME for the sockets), so a directory renamed or replaced after the check is never followed.

One server per key (a hash of the model file's identity and the load options, cli/keep_alive.py):

    KEY.lock  a regular file of this user holding the server's pid. The server holds an exclusive flock on
              it from before its load to its exit, so a lock that can be taken means that no server lives
              (a KEY.sock left behind is stale), and two commands that start at once start one server: the
              one that takes the lock hands it to the server it spawns (an inherited descriptor keeps the
              lock), the other waits for the socket. A lock file that is not a regular file of this user is
              refused, never replaced (a server may hold a lock on it).
    KEY.sock  the server's Unix socket, bound 0600 (no TCP). Connected to only while it is a socket of this
              user, and the peer must be a process of this user (SO_PEERCRED, on Linux) on both sides. A
              path there that is anything else (a symbolic link, a file, another user's socket, a socket no
              server listens on) is removed and replaced by the command that holds the lock, never used.

Frames, both ways: a 4-byte big-endian length, then a JSON object (UTF-8), at most MAX_FRAME bytes;
descriptors (SCM_RIGHTS) ride with a frame's first bytes. Written here rather than with
multiprocessing.connection, which also passes descriptors: it unpickles what it receives, and nothing from
another process is unpickled here (SECURITY.md).
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import os
import socket
import stat
import struct
from pathlib import Path

from ..errors import LlamacliError
from ..paths import cache_home

MAX_FRAME = 32 << 20  # bytes of one frame's JSON: a request whose prompt is larger runs in the process instead
MAX_FDS = 8  # descriptors one frame may carry (a request: stdin, stdout, stderr and the working directory)
_HEADER = struct.Struct(">I")
_SUN_PATH = 104  # bytes a Unix socket's path may take (108 on Linux, 104 on macOS and the BSDs)


class RendezvousError(LlamacliError):
    """The directory or a file in it is not safe to use (its owner, its mode, a symbolic link): says which."""


class FrameError(Exception):
    """Bytes on a socket that are not a frame of ours: too long, cut short, not a JSON object."""


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/llamacli where XDG_RUNTIME_DIR names an absolute path, else <cache>/run."""
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    if base and os.path.isabs(base):
        return Path(base) / "llamacli"
    return cache_home() / "run"


class Rendezvous:
    """The directory, checked and held open; its files by key. With `create` False a missing directory is
    FileNotFoundError (ps, stop and --keep-alive 0 make nothing)."""

    def __init__(self, path: Path | None = None, create: bool = True):
        self.path = Path(path) if path is not None else runtime_dir()
        self.fd = _private_dir(self.path, create)
        # Sockets are named through the held descriptor where /proc shows it (Linux): no path that could be
        # swapped, and no length limit from a deep directory.
        self._proc = os.path.isdir(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Rendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def address(self, name: str) -> str:
        """The path to bind or connect to for the file `name` in the directory."""
        if self._proc:
            return f"/proc/self/fd/{self.fd}/{name}"
        full = str(self.path / name)
        if len(os.fsencode(full)) >= _SUN_PATH:
            raise RendezvousError(f"the keep-alive directory's path is too long for a socket ({full}): set "
                                  "XDG_RUNTIME_DIR to a shorter directory")
        return full

    def keys(self) -> list[str]:
        """The keys of the sockets in the directory, live or not."""
        return sorted(name[:-5] for name in os.listdir(self.fd) if name.endswith(".sock") and is_key(name[:-5]))

    # -- the lock ------------------------------------------------------------------------------------------
    def lock(self, key: str) -> int | None:
        """KEY.lock (made 0600 where missing) locked exclusively without waiting: its descriptor (a server
        spawned with it, Popen's pass_fds, keeps the lock), or None where another process holds it."""
        _check(key)
        fd = self._open_file(f"{key}.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def holder(self, key: str) -> int | None:
        """The pid the server (or the one starting) wrote into KEY.lock; None where there is none."""
        _check(key)
        try:
            fd = self._open_file(f"{key}.lock", os.O_RDONLY)
        except (FileNotFoundError, RendezvousError):
            return None
        try:
            text = os.read(fd, 32).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        return int(text) if text.isdigit() else None

    @staticmethod
    def write_pid(fd: int, pid: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(pid).encode(), 0)

    def _open_file(self, name: str, flags: int) -> int:
        """A regular file of this user in the directory, never through a symbolic link."""
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RendezvousError(f"{self.path / name} is a symbolic link: remove it") from None
            if exc.errno == errno.ENOENT:
                raise
            raise RendezvousError(f"cannot open {self.path / name}: {exc.strerror or exc}") from None
        st = os.fstat(fd)
        why = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"belongs to another user (uid {st.st_uid})" if st.st_uid != os.getuid() else None)
        if why:
            os.close(fd)
            raise RendezvousError(f"{self.path / name} {why}: remove it")
        return fd

    # -- the socket ----------------------------------------------------------------------------------------
    def socket_state(self, key: str) -> tuple[str, int]:
        """("none" | "socket" | "other", inode) of KEY.sock: a socket of this user, or anything else there."""
        _check(key)
        try:
            st = os.stat(f"{key}.sock", dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return "none", 0
        ok = stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid()
        return ("socket" if ok else "other"), st.st_ino

    def connect(self, key: str, timeout: float) -> socket.socket | None:
        """A connection to KEY.sock's server: None where nothing listens there (no file, or a stale socket).
        RendezvousError where the path is not a socket of this user or the peer is another user's process;
        TimeoutError where connecting takes longer than `timeout`."""
        _check(key)
        state, _ = self.socket_state(key)
        if state == "none":
            return None
        if state == "other":
            raise RendezvousError(f"{self.path / (key + '.sock')} is not a socket of this user")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.address(f"{key}.sock"))
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None
        except TimeoutError:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            raise RendezvousError(f"cannot connect to {self.path / (key + '.sock')}: {exc.strerror or exc}") from None
        peer = peer_credentials(sock)
        if peer is not None and peer[1] != os.getuid():
            sock.close()
            raise RendezvousError(f"the process on {self.path / (key + '.sock')} belongs to another user "
                                  f"(uid {peer[1]})")
        return sock

    def clear(self, key: str) -> None:
        """Remove whatever KEY.sock is (only while holding KEY.lock: no server lives)."""
        _check(key)
        try:
            os.unlink(f"{key}.sock", dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a directory, say
            raise RendezvousError(f"cannot remove {self.path / (key + '.sock')}: {exc.strerror or exc}") from None

    def listen(self, key: str, backlog: int = 64) -> tuple[socket.socket, int]:
        """A socket listening on KEY.sock (0600; what was there removed first), and its inode."""
        _check(key)
        self.clear(key)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.address(f"{key}.sock"))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        sock.listen(backlog)
        return sock, self.socket_state(key)[1]

    def unlink_if(self, key: str, inode: int) -> None:
        """Remove KEY.sock if it is still the socket `inode` (a server leaving)."""
        _check(key)
        state, ino = self.socket_state(key)
        if state != "none" and ino == inode:
            self.clear(key)


def is_key(text: object) -> bool:
    """Whether `text` is a key (cli/keep_alive.py server_key: 32 hex digits), and so a safe file name."""
    return isinstance(text, str) and len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def _check(key: str) -> None:
    if not is_key(key):
        raise RendezvousError(f"not a key: {key!r:.60}")


def _private_dir(path: Path, create: bool = True) -> int:
    """The directory `path`, made 0700 where missing (with `create`; the cache's folders above it too, but
    never $XDG_RUNTIME_DIR itself), opened and checked: a real directory of this user that no one else may
    enter or write to. Its descriptor, or RendezvousError saying what is wrong."""
    if create:
        try:
            if not os.environ.get("XDG_RUNTIME_DIR"):
                path.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise RendezvousError(f"cannot make the keep-alive directory {path}: {exc.strerror or exc}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise RendezvousError(f"the keep-alive directory {path} has gone") from None
        raise
    except OSError as exc:
        why = "is a symbolic link" if exc.errno in (errno.ELOOP, errno.ENOTDIR) and path.is_symlink() else \
            "is not a directory" if exc.errno == errno.ENOTDIR else f"cannot be opened ({exc.strerror or exc})"
        raise RendezvousError(f"the keep-alive directory {path} {why}") from None
    st = os.fstat(fd)
    why = (f"belongs to another user (uid {st.st_uid})" if st.st_uid != os.getuid() else
           f"may be used by other users (mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700)"
           if st.st_mode & 0o077 else None)
    if why:
        os.close(fd)
        raise RendezvousError(f"the keep-alive directory {path} {why}")
    return fd


def peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of a Unix socket, as the kernel recorded them when it
    connected (or listened); None where the system has no SO_PEERCRED (the directory's mode is then the
    only check)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    return pid, uid, gid


# -- frames ------------------------------------------------------------------------------------------------


def encode(message: dict) -> bytes:
    """A message's JSON as UTF-8 (lone surrogates, which stdin may carry, passed through)."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def send_frame(sock: socket.socket, message: dict | bytes, fds: tuple[int, ...] | list[int] = ()) -> None:
    """One frame (`message` or its encode()d bytes), with `fds` passed along (SCM_RIGHTS)."""
    data = message if isinstance(message, bytes) else encode(message)
    if len(data) > MAX_FRAME:
        raise FrameError(f"a frame of {len(data)} bytes (at most {MAX_FRAME})")
    head = _HEADER.pack(len(data))
    if fds:
        sent = sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        sock.sendall(head[sent:] + data)
    else:
        sock.sendall(head + data)


def recv_frame(sock: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]]:
    """The next frame: (message, the descriptors that came with it, at most `max_fds`; the caller closes
    them). EOFError where the peer closed before a frame began; FrameError for anything not a frame of ours
    (descriptors received with it are closed)."""
    fds: list[int] = []
    try:
        head = b""
        while len(head) < _HEADER.size:
            if max_fds:
                chunk, ancillary, flags, _ = sock.recvmsg(_HEADER.size - len(head), socket.CMSG_SPACE(4 * MAX_FDS),
                                                          getattr(socket, "MSG_CMSG_CLOEXEC", 0))
                for level, kind, data in ancillary:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
                if flags & socket.MSG_CTRUNC:
                    raise FrameError("more descriptors than a frame may carry")
            else:
                chunk = sock.recv(_HEADER.size - len(head))
            if not chunk:
                if head or fds:
                    raise FrameError("the frame was cut short")
                raise EOFError
            head += chunk
        (size,) = _HEADER.unpack(head)
        if size > MAX_FRAME:
            raise FrameError(f"a frame of {size} bytes (at most {MAX_FRAME})")
        if len(fds) > max_fds:
            raise FrameError(f"{len(fds)} descriptors with a frame (at most {max_fds})")
        body = bytearray()
        while len(body) < size:
            chunk = sock.recv(min(size - len(body), 1 << 20))
            if not chunk:
                raise FrameError("the frame was cut short")
            body += chunk
        try:
            message = json.loads(bytes(body).decode("utf-8", "surrogatepass"))
        except (ValueError, RecursionError):
            raise FrameError("a frame that is not JSON") from None
        if not isinstance(message, dict):
            raise FrameError("a frame that is not a JSON object")
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
