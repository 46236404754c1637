"""The collectives of a model split over devices (split_plan.py): what the ranks exchange, one rank per device.

Every rank runs the same program on its own shard and calls these in the same order (SPMD, as NCCL's and
torch.distributed's ranks do):

- all_reduce(x): the elementwise sum of the ranks' x, on every rank (tensor split: a branch's partial outputs,
  the embedding rows of each rank's vocabulary slice);
- all_gather(x, axis): the ranks' x joined along `axis` in rank order, on every rank (tensor split: the logits
  of each rank's vocabulary slice);
- send(x, dst) / recv(src): the hidden state from one rank to the next (layer split, at a range's boundary).

HostGroup is the NumPy backend's: N ranks as threads of one process, meeting at a barrier; a sum adds the parts
in rank order, so every rank gets the same bits and a run is repeatable. Written here rather than taken from
torch.distributed's gloo (a 2 GB dependency for four operations on arrays already in memory).

The CUDA backend implements Collective with NCCL (cupy.cuda.nccl: one communicator per rank, one process per GPU
as NCCL advises under graph capture; ncclAllReduce / ncclAllGather on the rank's stream, so that they are
captured inside the decode step's graph; ncclSend / ncclRecv for layer split) in every process with
NCCL_NVLS_ENABLE=0 in its environment before NCCL loads (set_nccl_environment): NVLink multicast objects can put
the host's shared GPUs out of service, so none are created.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np

from ..errors import BackendError

NCCL_ENVIRONMENT = {"NCCL_NVLS_ENABLE": "0"}  # no NVLink multicast (NVLS) objects: see the module doc


def set_nccl_environment(environ: Any = None) -> None:
    """Put NCCL_ENVIRONMENT into `environ` (os.environ by default) before NCCL is loaded or a rank's process is
    started: a process inherits it, and NCCL reads it once, at its first communicator."""
    env = os.environ if environ is None else environ
    for key, value in NCCL_ENVIRONMENT.items():
        env[key] = value


class GroupAborted(BackendError):
    """Another rank failed (or the run was interrupted): this rank's collective will never complete."""


class Collective(ABC):
    """One rank's end of a group of `size` ranks."""

    rank: int
    size: int

    @abstractmethod
    def all_reduce(self, x: Any) -> Any:
        """The elementwise sum over the ranks of x (the same shape on every rank), on every rank."""

    @abstractmethod
    def all_gather(self, x: Any, axis: int = -1) -> Any:
        """The ranks' x joined along `axis` in rank order (other dims equal), on every rank."""

    @abstractmethod
    def send(self, x: Any, dst: int) -> None:
        """x to rank `dst`, which takes it with recv(this rank)."""

    @abstractmethod
    def recv(self, src: int, shape: tuple[int, ...], dtype: str = "float32") -> Any:
        """What rank `src` sent to this rank, in the order it was sent: an array of `shape` and `dtype` (NCCL
        moves bytes: the receiver says what they are)."""


class HostGroup:
    """`size` ranks in one process, each on its own thread (run() starts them): NumPy arrays meet at a barrier.
    abort() makes every pending and later collective raise GroupAborted, so that a rank that failed does not
    leave the others waiting."""

    def __init__(self, size: int):
        if type(size) is not int or size < 1:
            raise ValueError(f"a group has at least one rank, got {size!r}")
        self.size = size
        self._reset()

    def _reset(self) -> None:
        self._barrier = threading.Barrier(self.size)
        self._slots: list[Any] = [None] * self.size
        self._mail: dict[tuple[int, int], list[Any]] = {}
        self._mail_ready = threading.Condition()
        self._aborted = False

    def member(self, rank: int) -> "HostCollective":
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} of a group of {self.size}")
        return HostCollective(self, rank)

    def abort(self) -> None:
        self._aborted = True
        self._barrier.abort()
        with self._mail_ready:
            self._mail_ready.notify_all()

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, once all have given theirs."""
        self._slots[rank] = value
        try:
            self._barrier.wait()  # all written
            values = list(self._slots)
            self._barrier.wait()  # all read: the slots may take the next collective's values
        except threading.BrokenBarrierError:
            raise GroupAborted("another device of the split failed") from None
        return values

    def post(self, src: int, dst: int, value: Any) -> None:
        with self._mail_ready:
            self._mail.setdefault((src, dst), []).append(value)
            self._mail_ready.notify_all()

    def take(self, src: int, dst: int) -> Any:
        with self._mail_ready:
            while not self._mail.get((src, dst)):
                if self._aborted:
                    raise GroupAborted("another device of the split failed")
                self._mail_ready.wait()
            return self._mail[(src, dst)].pop(0)

    def run(self, work: Callable[[int], Any]) -> list[Any]:
        """work(rank) for every rank at once, each on a thread of its own -> their results in rank order. The
        first failure (not a GroupAborted that it caused) is raised once every rank has stopped; Ctrl-C aborts
        the group, waits for the ranks to stop (each at its next collective, or at its end) and is raised."""
        if self.size == 1:
            return [work(0)]
        results: list[Any] = [None] * self.size
        errors: list[tuple[int, BaseException]] = []

        def body(rank: int) -> None:
            try:
                results[rank] = work(rank)
            except BaseException as exc:  # (the rank's own failure: reported below, after every rank stopped)
                errors.append((rank, exc))
                self.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"llamacli-rank-{r}", daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:
            self.abort()
            for t in threads:
                _join(t)
            self._reset()
            raise
        if errors or self._aborted:
            self._reset()
            own = [exc for _, exc in errors if not isinstance(exc, GroupAborted)]
            raise (own or [exc for _, exc in errors])[0]
        return results


def _join(t: threading.Thread) -> None:
    """Join `t`, whatever interrupts the wait (a second Ctrl-C): the rank stops at its next collective."""
    while t.is_alive():
        try:
            t.join()
        except BaseException:
            continue


class HostCollective(Collective):
    """Rank `rank`'s end of a HostGroup."""

    def __init__(self, group: HostGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        parts = self.group.exchange(self.rank, x)
        total = np.array(parts[0], copy=True)
        for part in parts[1:]:  # in rank order on every rank: the same bits everywhere
            total += part
        return total

    def all_gather(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.concatenate(self.group.exchange(self.rank, x), axis=axis)

    def send(self, x: Any, dst: int) -> None:
        self.group.post(self.rank, dst, x)

    def recv(self, src: int, shape: tuple[int, ...], dtype: str = "float32") -> Any:
        x = self.group.take(src, self.rank)
        if tuple(x.shape) != tuple(shape) or x.dtype != np.dtype(dtype):
            raise GroupAborted(f"rank {self.rank} expected {dtype} {list(shape)} from rank {src}, got {x.dtype} "
                               f"{list(x.shape)}")
        return x
