"""Run fuzz cases through worker processes (fuzz_worker.py), each under a memory and a time limit.

A worker that dies (a crash, an abort in native code) or stops answering (a loop in C the alarm cannot
interrupt) is counted against the case it was running and replaced; no case goes unaccounted for.
"""

from __future__ import annotations

import json
import os
import queue
import select
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gguf_mutate import Sample

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("fuzz_worker.py")


@dataclass
class Case:
    kind: str  # the class of hostile input
    base: str  # the seed file it was made from
    sample: Sample
    run_forward: bool = False


@dataclass
class Outcome:
    stages: list[list[str]] = field(default_factory=list)
    ms: float = 0.0

    @property
    def bug(self) -> str | None:
        return next((o for _, o in self.stages if o.startswith("BUG")), None)

    @property
    def summary(self) -> str:
        """'loads' when every stage passed, else the first error class."""
        if self.bug:
            return self.bug
        return next((o for _, o in self.stages if o != "ok"), "loads")

    @property
    def traceback(self) -> str:
        return next((o for s, o in self.stages if s == "traceback"), "")


class _Worker:
    def __init__(self, workdir: Path, mem_mb: int, time_s: float):
        self.args = [sys.executable, str(WORKER), str(workdir), str(mem_mb), str(time_s)]
        self.workdir, self.time_s = workdir, time_s
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "MALLOC_ARENA_MAX": "2", "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env)
        line = self._line(120.0)
        if line is None:
            raise RuntimeError("the fuzz worker did not start")
        self.info = json.loads(line)

    def _line(self, timeout: float) -> str | None:
        assert self.proc and self.proc.stdout
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return line.decode() if line else None

    def stop(self) -> None:
        if self.proc:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    pipe.close()
                except OSError:  # a worker that died mid-write leaves a broken pipe
                    pass
        self.proc = None

    def run(self, case: Case) -> Outcome:
        if self.proc is None:
            self.start()
        assert self.proc and self.proc.stdin
        s = case.sample
        try:
            self.proc.stdin.write(struct.pack("<QQB", len(s.prefix), s.size, case.run_forward) + s.prefix)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self._line(self.time_s * 3 + 15)
        if line is None:
            rc = self.proc.poll()
            self.stop()
            what = f"BUG worker died (exit {rc})" if rc is not None else "BUG hang: the worker stopped answering"
            return Outcome([["?", what]])
        out = json.loads(line)
        self.info["peak_mb"] = max(self.info.get("peak_mb", 0), out.get("peak_mb", 0))
        return Outcome(out["stages"], out["ms"])


def run_cases(n: int, make_case: Callable[[int], Case], workdir: Path, *, workers: int = 2, mem_mb: int = 1024,
              time_s: float = 10.0) -> tuple[list[tuple[str, str, Outcome]], dict]:
    """(kind, base, outcome) of cases 0..n-1, in order, and the workers' limits (vm_base_mb, limit_mb).
    Cases are made on demand (make_case(i) must depend on i alone), so a batch never sits in memory."""
    results: list[tuple[str, str, Outcome] | None] = [None] * n
    todo: queue.Queue[int] = queue.Queue()
    for i in range(n):
        todo.put(i)
    info: dict = {}
    errors: list[BaseException] = []

    def serve(w: _Worker) -> None:
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                case = make_case(i)
                results[i] = (case.kind, case.base, w.run(case))
                info.update(w.info, peak_mb=max(info.get("peak_mb", 0), w.info.get("peak_mb", 0)))
        except BaseException as exc:  # noqa: BLE001 - surfaced in the caller
            errors.append(exc)
        finally:
            w.stop()

    pool = [_Worker(workdir / f"w{k}", mem_mb, time_s) for k in range(workers)]
    threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in pool]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert all(r is not None for r in results), "a fuzz case was lost"
    return results, info  # type: ignore[return-value]


class Summary:
    """Lines for pytest's terminal summary (shown even with -q and captured output), shared by the fuzz and
    hostile-input tests: `Summary.of(config).lines.append(...)`."""

    NAME = "llamacli-fuzz-summary"

    def __init__(self) -> None:
        self.lines: list[str] = []

    @classmethod
    def of(cls, config) -> "Summary":
        plugin = config.pluginmanager.get_plugin(cls.NAME)
        if plugin is None:
            plugin = cls()
            config.pluginmanager.register(plugin, cls.NAME)
        return plugin

    def pytest_terminal_summary(self, terminalreporter) -> None:  # pytest hook
        if self.lines:
            terminalreporter.section("GGUF fuzz and hostile input")
            for line in self.lines:
                terminalreporter.write_line(line)
