"""The NumPy backend over N emulated devices (issue 43: `--backend numpy --split-mode tensor --tensor-split 1,1`):
the split a SplitPlan describes (split_plan.py), run on the host, so that CI tests the partition, the collectives
and their equality with one device without a GPU.

Each emulated device is a NumpyBackend that holds only its shard: its slice of each tensor, cut from the file's
data as a GPU's loader cuts it (split_plan.take on the GGUF layout: rows, or whole blocks of columns) and then
dequantized, and the KV cache of its layers or of its KV heads. Each runs on a thread of its own (a Rank) and
meets the others at the collectives (collective.HostGroup), as a GPU's process meets its peers through NCCL:

- tensor split: each device embeds the ids of its vocabulary rows (zeros for the others) and an all-reduce sums
  them; it runs every layer's program as its local config builds it (plan.local_config: its heads and widths, so
  the program's splits take its slices' sizes), and the outputs that are partial sums on a shard (attn_output,
  the down projections, the experts: partial_sum) are all-reduced as they come out, before the post-norms and
  the residual add (block.run_layer's `after`); the logits of its vocabulary rows are all-gathered.
- layer split: the device of layer 0 embeds, each runs its range of layers and sends the hidden state to the
  next; the device of the LM head (the last) computes the logits.
"""

from __future__ import annotations

import platform
from typing import Any

import numpy as np

from ..errors import UsageError
from ..ggufio.file import GGUFFile
from ..ggufio.ggml_types import GGML_QUANT_SIZES
from ..ggufio.quants import dequantize
from ..models import rope as rope_tables
from ..models.block import Linear, Moe, Op, per_layer_inputs, programs, run_layer
from ..models.config import ModelConfig
from ..models.kv_cache import DEFAULT as DEFAULT_CACHE
from ..models.weights import model_specs
from .base import LayerWeights, ModelWeights, Progress
from .collective import Collective, HostGroup
from .numpy_backend import NumpyBackend, QuantTable, check_host_memory, shared_ring_chunk
from .split_plan import ROW_PARALLEL, SplitOptions, SplitPlan, emulated_devices, plan_split, take


def partial_sum(op: Op) -> bool:
    """Whether a tensor-split device's output of `op` is its part of a sum over the devices (a row-parallel
    matrix: its columns of attn_output, ffn_down, ...; its experts' or expert columns' share of the MoE FFN)."""
    return isinstance(op, Moe) or (isinstance(op, Linear) and op.weight in ROW_PARALLEL)


class Rank:
    """One emulated device's part of each forward pass: its NumpyBackend (`device`: its shard and caches) and its
    end of the collectives. forward() is what a GPU's process would run on its device."""

    def __init__(self, plan: SplitPlan, rank: int, device: NumpyBackend, comm: Collective):
        self.plan, self.rank, self.device, self.comm = plan, rank, device, comm
        self.share = plan.shares[rank]

    def forward(self, ids: np.ndarray, pos: np.ndarray, all_logits: bool = False) -> np.ndarray | None:
        """ids [T] at positions pos [T] -> logits [1, V] of the last (all T with all_logits) on the ranks that
        end with them (tensor: every one; layer: the LM head's), None on the others. NaN and inf flow through as
        IEEE values (the sums of the collectives too), as in NumpyBackend's operations."""
        with np.errstate(all="ignore"):  # (a thread's own: each rank's starts from numpy's default)
            if self.plan.mode == "tensor":
                return self._tensor(ids, pos, all_logits)
            return self._layers(ids, pos, all_logits)

    def _tensor(self, ids: np.ndarray, pos: np.ndarray, all_logits: bool) -> np.ndarray:
        dev, cfg = self.device, self.device.cfg
        v0, v1 = self.share.vocab
        mine = (ids >= v0) & (ids < v1)
        x = np.zeros((ids.size, cfg.n_embd), dtype=np.float32)  # [T, D]: the rows of its vocabulary
        if mine.any():
            x[mine] = dev.embed(ids[mine] - v0)
        x = self.comm.all_reduce(x)
        for i, (ops, layer) in enumerate(zip(programs(cfg), dev.weights.layers)):
            x = run_layer(dev, cfg, i, ops, layer, x, pos, after=self._reduce)
        logits = self._head(x, all_logits)  # [., V_rank]
        return self._capped(self.comm.all_gather(logits, axis=-1))

    def _reduce(self, op: Op, out: np.ndarray) -> np.ndarray:
        return self.comm.all_reduce(out) if partial_sum(op) else out

    def _layers(self, ids: np.ndarray, pos: np.ndarray, all_logits: bool) -> np.ndarray | None:
        dev, cfg = self.device, self.device.cfg
        first, end = self.share.layers
        n_ple = cfg.n_embd_per_layer  # gemma4: each layer's per-layer input [T, P], made with the embeddings
        if self.share.embeddings:
            x = dev.embed(ids)  # [T, D]
            ple = per_layer_inputs(dev, cfg, ids, x) if n_ple else None  # [T, L, P]
        else:
            x = self.comm.recv(self.rank - 1, (ids.size, cfg.n_embd))
            ple = self.comm.recv(self.rank - 1, (ids.size, cfg.n_layer, n_ple)) if n_ple else None
        progs = programs(cfg)
        for i in range(first, end):
            x = run_layer(dev, cfg, i, progs[i], dev.weights.layers[i], x, pos, None if ple is None else ple[:, i])
        if not self.share.head:
            self.comm.send(x, self.rank + 1)
            if ple is not None:
                self.comm.send(ple, self.rank + 1)
            return None
        return self._capped(self._head(x, all_logits))

    def _head(self, x: np.ndarray, all_logits: bool) -> np.ndarray:
        dev, w = self.device, self.device.weights
        if not all_logits:
            x = x[-1:]
        return dev.matmul(dev.rms_norm(x, w.output_norm, dev.cfg.rms_eps), w.output)

    def _capped(self, logits: np.ndarray) -> np.ndarray:
        cap = self.device.cfg.final_softcap
        return self.device.softcap(logits, cap) if cap else logits


class NumpySplitBackend(NumpyBackend):
    """The NumPy backend whose forward passes run on emulated devices (the module doc): the engine sees one
    backend; load() cuts the model for them, forward_prompt() and decode() run each step on all of them."""

    split_modes = ("none", "layer", "tensor")

    def __init__(self, options: SplitOptions):
        self.split = options

    def load(self, gguf: GGUFFile, cfg: ModelConfig, ctx: int, progress: Progress | None = None,
             cache_types: tuple[str, str] = DEFAULT_CACHE) -> None:
        check_host_memory(cfg, ctx)  # the devices' shards add up to the one backend's weights and cache
        self.cfg, self.ctx, self.cache_types = cfg, ctx, cache_types
        plan = plan_split(cfg, gguf.tensors, self.split, ctx=ctx, devices=emulated_devices(self.split),
                          cache_types=cache_types)
        self.plan = plan
        weights = _shards(gguf, cfg, plan, progress or (lambda done, total, what: None))
        theta = rope_tables.inv_freq(cfg, gguf, ctx)
        theta_local = rope_tables.inv_freq(cfg, gguf, ctx, local=True)
        self.group = HostGroup(plan.n)
        self.ranks = []
        for r, share in enumerate(plan.shares):
            dev = NumpyBackend()
            experts = share.experts if plan.mode == "tensor" and plan.moe == "experts" else None
            dev.adopt(plan.local_config(cfg, r), ctx, weights[r], theta, theta_local, cache_types,
                      layers=range(*share.layers), experts=experts)
            self.ranks.append(Rank(plan, r, dev, self.group.member(r)))
        self.recurrent_layers = [i for i, p in enumerate(cfg.layers) if p.recurrent]
        self.prefill_chunk = shared_ring_chunk(cfg, ctx)  # (the devices' passes: as one device's)
        self.slots = 1

    # -- slots: every device holds its part of each sequence's cache -----------------------------------------
    def set_slots(self, n: int) -> None:
        if type(n) is not int or n < 1:
            raise UsageError(f"the number of sequences must be a positive integer, got {n!r}")
        if n > self.slots:
            check_host_memory(self.cfg, self.ctx, slots=n, held=self.slots)
        self._forget_slots(min(n, self.slots))
        for rank in self.ranks:
            rank.device.resize_slots(n)
        self.slots = n

    def use_slot(self, slot: int) -> None:
        for rank in self.ranks:
            rank.device.use_slot(slot)

    def resume(self, slot: int, pos: int) -> None:
        for rank in self.ranks:
            rank.device.resume(slot, pos)

    def snapshots(self, slot: int, prompt_end: int | None = None) -> frozenset[int] | None:
        held = [s for s in (rank.device.snapshots(slot, prompt_end) for rank in self.ranks) if s is not None]
        return frozenset.intersection(*held) if held else None

    # -- the prefix cache's pool: each device keeps the rows of its own layers or KV heads -----------------------
    def kv_row_bytes(self) -> int:
        return sum(rank.device.kv_row_bytes() for rank in self.ranks)

    def alloc_kv_pool(self, rows: int) -> None:
        for rank in self.ranks:
            rank.device.alloc_kv_pool(rows)

    def copy_kv_rows(self, slot: int, layers, positions: np.ndarray, rows: np.ndarray, to_pool: bool) -> None:
        for rank in self.ranks:
            held = [i for i in layers if i in rank.device.held]
            if held:
                rank.device.copy_kv_rows(slot, held, positions, rows, to_pool)

    # -- whole steps ------------------------------------------------------------------------------------------
    def forward_prompt(self, ids: np.ndarray, start: int) -> np.ndarray:
        return self.forward(self.token_ids(ids), self.positions(start, int(ids.size)))

    def decode(self, token: int, pos: int) -> np.ndarray:
        return self.forward(self.token_ids(np.asarray([token])), self.positions(pos, 1))

    def forward(self, ids: np.ndarray, pos: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """ids [T] at positions pos [T] through every device -> the main device's logits [1, V] ([T, V] with
        all_logits)."""
        outs = self.group.run(lambda r: self.ranks[r].forward(ids, pos, all_logits))
        return outs[self.plan.main]

    def device_name(self) -> str:
        return (f"CPU ({platform.processor() or platform.machine()}, NumPy), {self.plan.n} emulated devices, "
                f"{self.plan.mode} split")


def _shards(gguf: GGUFFile, cfg: ModelConfig, plan: SplitPlan, report: Progress) -> list[ModelWeights]:
    """Each device's weights: every tensor read once from the file and cut for the devices that hold a part of
    it (split_plan.take on the file's layout), each part dequantized; the token embeddings stay quantized."""
    n = plan.n
    fields: list[list[dict[str, Any]]] = [[{} for _ in range(cfg.n_layer)] for _ in range(n)]
    top: list[dict[str, Any]] = [{} for _ in range(n)]
    specs = [s for s in model_specs(cfg) if s.name in gguf.tensors]
    for done, spec in enumerate(specs, 1):
        info = gguf.tensors[spec.name]
        cut = [plan.shard(r, spec, cfg) for r in range(n)]
        if any(c is not None for c in cut):
            raw = gguf.raw(spec.name)
            block, size = GGML_QUANT_SIZES[info.type]
            for r, shard in enumerate(cut):
                if shard is None:
                    continue
                part = take(raw, shard, block, size if block > 1 else 0)
                shape = shard.shape(info.shape)
                if spec.name in ("token_embd.weight", "per_layer_token_embd.weight"):  # tables: rows gathered
                    top[r][spec.name.removesuffix(".weight")] = QuantTable(np.ascontiguousarray(part), info.type,
                                                                           (shape[0], shape[1]))
                    if spec.name != "token_embd.weight":
                        continue
                    if cfg.tied_embeddings and plan.shares[r].head:  # the LM head: its rows, dequantized once
                        top[r]["output"] = dequantize(part, info.type).reshape(shape)
                elif spec.field:
                    layer = int(spec.name.split(".")[1])
                    fields[r][layer][spec.field] = dequantize(part, info.type).reshape(shape)
                else:
                    top[r][spec.name.removesuffix(".weight")] = dequantize(part, info.type).reshape(shape)
        report(done, len(specs), spec.name)
    out = []
    for r in range(n):
        layers = [LayerWeights(**{"attn_norm": None, **f}) for f in fields[r]]
        out.append(ModelWeights(top[r].get("token_embd"), layers, top[r].get("output_norm"), top[r].get("output"),
                                per_layer_token_embd=top[r].get("per_layer_token_embd"),
                                per_layer_model_proj=top[r].get("per_layer_model_proj"),
                                per_layer_proj_norm=top[r].get("per_layer_proj_norm")))
    return out
