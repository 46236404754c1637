"""The batched decode step of the CUDA backend: B sequences, one token each, each in its own cache slot.

The step is the fused prefill pass run over rows that are sequences of their own (prefill.PrefillPass.launch_rows,
its `forward`): the layer's launches as a prompt chunk takes them, with each row's K/V stored into its own slot's
cache (rope_store_pfb_*), each row's attention over its slot (attention.AttentionKernels.attend_batch), and the
linear layers through bgemm (kernels/batch_gemm.cu: the weight decoded in the kernel and read once for up to
BG_NMAX rows, on tensor cores), the LM head over every row. A row's arithmetic does not depend on what runs beside
it (bgemm's splits and the attention's depend on the shapes only), so a seeded request draws the same ids in any
company; a mixture of experts groups its rows by expert, and there it does depend (as it does where a product
falls back to cuBLAS: PrefillPass.launch_rows). After the LM head the step
takes each row's argmax and a flag for rows whose logits are not finite; a row whose sequence samples, has a
constraint or asks for its logits is chosen from its logits row as a single step's logits are (Backend._choose).

The inputs (ids, positions, slots) live in device buffers, so a batch size seen before is captured into a CUDA
graph and replayed. The step's intermediate arrays come from a memory pool of its own: a graph keeps the
addresses it was captured with, and only this step allocates from that pool, one run at a time, so those
addresses hold nothing else between runs. What outlives a step (cuBLAS's workspace, the experts' buffers, the
KV tables) is made before the first (CudaBackend.set_slots). Should the pool ever give memory back (CuPy frees
a pool's cached blocks when an allocation in it fails), the graphs are dropped and captured again.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger("llamacli.cuda")

BATCH_GRAPHS = 16  # captured batch sizes kept (least recently used dropped)


class BatchStep:
    """The batched decode step over `slots` cache slots (see the module docstring). `forward(ids, pos, slots,
    logits)` runs the model on device int32 arrays [B] into logits [B, V] (prefill.PrefillPass.launch_rows)."""

    def __init__(self, gpu: Any, options: Any, forward: Callable[[Any, Any, Any, Any], None], slots: int, vocab: int):
        cp = self.cp = gpu.cp
        self.gpu, self.options, self.forward = gpu, options, forward
        self.inputs = cp.zeros(3 * slots, dtype=cp.int32)  # a run of B: ids, positions, slots in its first 3 B
        self.logits = cp.empty((slots, vocab), dtype=cp.float32)
        self.choice = cp.zeros((2, slots), dtype=cp.int32)  # each row's argmax, and 1 where its logits are not finite
        mem = cp.cuda.alloc_pinned_memory(8 * slots)
        self._host = np.frombuffer(mem, np.int32, 2 * slots).reshape(2, slots)
        self._stage = np.zeros(3 * slots, dtype=np.int32)
        self.pool = cp.cuda.MemoryPool()
        self._graphs: dict[int, Any] = {}
        self._seen: set[int] = set()
        self._graph_ok = True
        self._pool_bytes = 0  # the pool's size when the graphs were captured

    def run(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int]) -> tuple[np.ndarray, Any]:
        """One step of B = len(ids) sequences -> (choice [2, B] on the host: argmax ids, non-finite flags; the
        logits [B, V], a device buffer the next run overwrites)."""
        cp, b = self.cp, len(ids)
        self._stage[: 3 * b] = np.concatenate([ids, positions, slots])
        self.inputs[: 3 * b].set(self._stage[: 3 * b])
        if self.pool.total_bytes() < self._pool_bytes:  # blocks the graphs use went back to the device
            self._graphs.clear()
        self._pool_bytes = self.pool.total_bytes()
        graph = self._graphs.get(b)
        if graph is None and self.options.use_graph and self._graph_ok and b in self._seen:
            try:
                graph = self.gpu.capture(lambda: self._launch(b))
            except Exception as exc:  # a capture that fails: this step runs its kernels directly from now on
                log.warning("batched step capture failed (%s: %s); it runs without graphs", type(exc).__name__, exc)
                self._graph_ok = False
            else:
                self._graphs[b] = graph
                while len(self._graphs) > BATCH_GRAPHS:
                    self._graphs.pop(next(iter(self._graphs)))
                if self.pool.total_bytes() < self._pool_bytes:  # (the capture's allocations freed some)
                    self._graphs = {b: graph}
                self._pool_bytes = self.pool.total_bytes()
        stream = cp.cuda.get_current_stream()
        if graph is not None:
            self._graphs[b] = self._graphs.pop(b)  # (most recently used last)
            graph.launch(stream)
        else:
            self._launch(b)
            self._seen.add(b)
            if self.pool.total_bytes() < self._pool_bytes:
                self._graphs.clear()
            self._pool_bytes = self.pool.total_bytes()
        cp.cuda.runtime.memcpy2DAsync(self._host.ctypes.data, self._host.strides[0], self.choice.data.ptr,
                                      self.choice.strides[0], 4 * b, 2, 2, stream.ptr)  # device -> host
        stream.synchronize()
        return self._host[:, :b].copy(), self.logits[:b]

    def _launch(self, b: int) -> None:
        cp = self.cp
        ids, pos, slots = self.inputs[:b], self.inputs[b : 2 * b], self.inputs[2 * b : 3 * b]
        with cp.cuda.using_allocator(self.pool.malloc):
            logits = self.logits[:b]
            self.forward(ids, pos, slots, logits)
            self.choice[0, :b] = cp.argmax(logits, axis=1)
            self.choice[1, :b] = ~cp.isfinite(cp.max(logits, axis=1))
