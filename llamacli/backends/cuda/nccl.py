"""The collectives of a model split over the GPUs of one host (backends/collective.py's interface) through NCCL, by
CuPy's binding (cupy.cuda.nccl): one communicator per rank, one process per GPU, as NCCL advises where the
collectives are captured into CUDA graphs (the decode step's). Each call is enqueued on the rank's current
stream and returns at once; under capture it is recorded into the graph.

Every process that loads NCCL has NCCL_NVLS_ENABLE=0 in its environment first (collective.set_nccl_environment,
called here before cupy.cuda.nccl is imported, and inherited by the rank processes a parent starts): NVLink
multicast (NVLS) objects can put the host's shared GPUs out of service, so NCCL creates none.

all_gather takes parts of different sizes (a vocabulary cut unevenly): NCCL's allGather needs equal counts, so
it is one broadcast per rank inside a group (ncclGroupStart/End), each into its place of the joined buffer.
"""

from __future__ import annotations

import math
from typing import Any

from ...errors import BackendError
from ..collective import Collective, set_nccl_environment

_TYPES = {"float32": "NCCL_FLOAT32", "float16": "NCCL_FLOAT16", "int32": "NCCL_INT32", "int64": "NCCL_INT64",
          "uint8": "NCCL_UINT8", "float64": "NCCL_FLOAT64"}


def _nccl() -> Any:
    set_nccl_environment()
    try:
        from cupy.cuda import nccl
    except ImportError as exc:  # (CuPy without its NCCL binding: a wheel built without it)
        raise BackendError(f"NCCL is not available through CuPy ({exc}); a split over GPUs needs it") from None
    if not getattr(nccl, "available", True):
        raise BackendError("CuPy was built without NCCL; a split over GPUs needs it")
    return nccl


def unique_id() -> Any:
    """A new group's id, made by one process (the parent, or rank 0) and given to every rank's NcclCollective."""
    return _nccl().get_unique_id()


class NcclCollective(Collective):
    """Rank `rank`'s end of a group of `size` ranks, on GPU `device` (made current here), joined through `uid`
    (unique_id()). Creating it waits until every rank has created its own."""

    def __init__(self, rank: int, size: int, uid: Any, device: int):
        import cupy as cp

        self.nccl = _nccl()
        self.cp, self.rank, self.size, self.device = cp, rank, size, device
        cp.cuda.Device(device).use()
        try:
            self.comm = self.nccl.NcclCommunicator(size, uid, rank)
        except self.nccl.NcclError as exc:
            raise BackendError(f"NCCL could not join rank {rank} of {size} on GPU {device}: {exc}") from None

    def _type(self, x: Any) -> int:
        name = _TYPES.get(str(x.dtype))
        if name is None:
            raise BackendError(f"NCCL collectives here take {', '.join(_TYPES)}, not {x.dtype}")
        return getattr(self.nccl, name)

    def _stream(self) -> int:
        return self.cp.cuda.get_current_stream().ptr

    def all_reduce(self, x: Any) -> Any:
        """The sum over the ranks, in place in x (a contiguous device array) and returned."""
        if not x.flags.c_contiguous:
            x = self.cp.ascontiguousarray(x)
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, self._type(x), self.nccl.NCCL_SUM, self._stream())
        return x

    def all_gather(self, x: Any, axis: int = -1) -> Any:
        """The ranks' x joined along `axis` (other dims equal; sizes along it may differ: they are exchanged
        first, a small all-reduce of one count per rank)."""
        cp = self.cp
        x = cp.ascontiguousarray(cp.moveaxis(x, axis, 0))  # the joined axis first: each rank's part contiguous
        sizes = cp.zeros(self.size, dtype=cp.int64)
        sizes[self.rank] = x.shape[0]
        counts = [int(n) for n in self.all_reduce(sizes).get()]  # (a host sync: not inside a captured step)
        return self._joined(x, counts, axis)

    def all_gather_sized(self, x: Any, counts: list[int], axis: int = -1) -> Any:
        """all_gather with every rank's size along `axis` known (the plan's cut): no exchange of sizes, nothing
        that syncs with the host, so it can be captured into a graph."""
        x = self.cp.ascontiguousarray(self.cp.moveaxis(x, axis, 0))
        return self._joined(x, counts, axis)

    def _joined(self, x: Any, counts: list[int], axis: int) -> Any:
        cp = self.cp
        rest = x.shape[1:]
        out = cp.empty((sum(counts), *rest), dtype=x.dtype)
        row = math.prod(rest)
        start, t, stream = 0, self._type(x), self._stream()
        self.nccl.groupStart()
        try:
            for root, n in enumerate(counts):
                part = out[start : start + n]
                send = x.data.ptr if root == self.rank else part.data.ptr
                self.comm.broadcast(send, part.data.ptr, n * row, t, root, stream)
                start += n
        finally:
            self.nccl.groupEnd()
        return cp.moveaxis(out, 0, axis)

    def send(self, x: Any, dst: int) -> None:
        x = self.cp.ascontiguousarray(x)
        self.comm.send(x.data.ptr, x.size, self._type(x), dst, self._stream())

    def recv(self, src: int, shape: tuple[int, ...], dtype: str = "float32") -> Any:
        out = self.cp.empty(shape, dtype=dtype)
        self.comm.recv(out.data.ptr, out.size, self._type(out), src, self._stream())
        return out

    def close(self) -> None:
        """Free the communicator (every rank closes its own)."""
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None:
            comm.destroy()
