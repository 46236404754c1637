"""A fuzz worker process: loads GGUF files the way llamacli does, under an address-space limit and a per-case
time limit, and answers one JSON line per case. Started (and restarted after a crash) by fuzz_runner.

Protocol: the parent writes, per case, struct "<QQB" (prefix length, file size, run forward?) and the prefix
bytes to stdin; the file is written (the part past the prefix a hole) and loaded; the worker answers
{"stages": [[stage, outcome], ...], "ms": float} where outcome is "ok", a LlamacliError class name, or
"BUG <type>: <message>" for any other exception (which the fuzz test reports with its traceback).

    python tests/fuzz_worker.py WORKDIR MEM_MB TIME_S
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
import sys
import time
import traceback
import warnings


class CaseTimeout(BaseException):
    """The per-case time limit (BaseException: no `except Exception` in the library can swallow it)."""


def load_everything(path: str, run_forward: bool) -> list[list[str]]:
    """Every stage a GGUF file goes through before generation, each one either 'ok' or a LlamacliError."""
    import numpy as np

    from llamacli.backends.numpy_backend import NumpyBackend
    from llamacli.chat.template import ChatTemplate
    from llamacli.errors import LlamacliError
    from llamacli.ggufio.file import open_gguf
    from llamacli.models.block import run as forward
    from llamacli.models.config import ModelConfig
    from llamacli.models.weights import check_tensors
    from llamacli.sampling.sampling import greedy
    from llamacli.tokenizer.tokenizer import Tokenizer

    stages: list[list[str]] = []

    def stage(name, fn):
        try:
            result = fn()
        except LlamacliError as exc:
            stages.append([name, type(exc).__name__])
            return None
        stages.append([name, "ok"])
        return True if result is None else result

    g = stage("open", lambda: open_gguf(path))
    if g is None:
        return stages
    try:
        md = g.metadata
        if "tokenizer.ggml.model" in md:
            tok = stage("tokenizer", lambda: Tokenizer.from_metadata(md))
            if tok is not None:
                stage("encode", lambda: tok.decode(tok.encode("Hello the world <|im_start|>\u00fc\u2581 [INST]", special=True)))
        stage("template", lambda: ChatTemplate.from_metadata(md, timeout_s=2.0).render([{"role": "user", "content": "hi"}]))
        cfg = stage("config", lambda: ModelConfig.from_gguf(md, set(g.tensors)))
        if cfg is not None and stage("tensors", lambda: check_tensors(g, cfg, NumpyBackend.runnable_types)) and run_forward:

            def run() -> None:
                be = NumpyBackend()
                be.load(g, cfg, 16)  # as --ctx 16 (a context_length of 1 is refused by the engine, not here)
                ids = np.array([0, 1 % cfg.vocab_size])
                greedy(be.to_host(forward(be, cfg, be.token_ids(ids), be.positions(0, 2)))[-1])
                be.decode_greedy(0, 2)

            stage("forward", run)
    finally:
        g.close()
    return stages


def _canary(what: bytes, mem_mb: int) -> list[list[str]]:
    """CANARY-MEM allocates past the memory limit, CANARY-LOOP spins past the time limit: both must be caught."""
    if what == b"CANARY-MEM":
        block = bytearray((mem_mb + 256) << 20)
        return [["canary", f"allocated {len(block)} bytes"]]
    while what == b"CANARY-LOOP":
        pass
    return [["canary", "unknown"]]


def main() -> None:
    workdir, mem_mb, time_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the library prints goes to stderr, not into the protocol
    warnings.simplefilter("ignore")
    import sentencepiece  # noqa: F401
    import tokenizers  # noqa: F401

    import llamacli.backends.numpy_backend  # noqa: F401  (import everything before the limit is set)
    import llamacli.chat.template  # noqa: F401
    import llamacli.tokenizer.tokenizer  # noqa: F401

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + (mem_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def on_alarm(signum, frame):
        raise CaseTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    stdin = sys.stdin.buffer
    path = os.path.join(workdir, "case.gguf")
    print(json.dumps({"ready": True, "vm_base_mb": vm >> 20, "limit_mb": limit >> 20}), file=proto)
    while True:
        head = stdin.read(17)
        if len(head) < 17:
            return
        n, size, run_forward = struct.unpack("<QQB", head)
        prefix = stdin.read(n)
        with open(path, "wb") as f:
            f.write(prefix)
            f.truncate(size)
        t0 = time.perf_counter()
        try:
            signal.setitimer(signal.ITIMER_REAL, time_s)
            try:
                if n < 64 and size == n and prefix.startswith(b"CANARY"):  # self-tests of the two limits
                    stages = _canary(prefix, mem_mb)
                else:
                    stages = load_everything(path, bool(run_forward))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except CaseTimeout:
            stages = [["?", f"BUG timeout: more than {time_s:g} s"]]
        except BaseException as exc:  # noqa: BLE001 - this is what the fuzzer looks for
            tb = traceback.format_exc(limit=-8)
            stages = [["?", f"BUG {type(exc).__name__}: {str(exc)[:300]}"], ["traceback", tb]]
        del prefix
        os.unlink(path)
        # The worker's own high-water mark (ru_maxrss would report the pytest parent's RSS at fork time: Linux
        # keeps it across exec; VmHWM belongs to the new address space).
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) >> 10  # MiB
        print(json.dumps({"stages": stages, "ms": (time.perf_counter() - t0) * 1e3, "peak_mb": peak}), file=proto)


if __name__ == "__main__":
    main()
