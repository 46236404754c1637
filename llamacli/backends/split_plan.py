"""A model split over several devices (issue 43): the options (llama.cpp's --split-mode, --tensor-split,
--main-gpu, -dev), which part of each tensor every device holds, each device's share of the memory, and whether
it fits. Pure arithmetic on the config and the tensors' types and shapes: the NumPy backend's emulation of N
devices (numpy_split.py), `inspect --gpus N`, the memory check's message (memory_fit.py) and the CUDA backend's
loader read the same SplitPlan, so that CI tests the partition a GPU would hold.

The modes are llama.cpp's, with its meanings:

- none: one device (--main-gpu) holds the whole model.
- layer: each device holds a contiguous range of layers with their KV cache (and recurrent states); the hidden
  state crosses at the boundaries. As llama.cpp's llama-model.cpp: with the LM head counted as layer n_layer,
  layer i goes to the first device whose cumulative share exceeds i / (n_layer + 1); the token embeddings go
  with layer 0, the output norm and the LM head with that last unit. A layer that reads another's KV cache
  (gemma4's shared KV) takes that layer, and those between, to its own device.
- tensor: every device holds a slice of every layer (Megatron-style tensor parallelism, as vLLM's): attention
  by whole KV-head groups (a KV head with its query heads, its K/V cache rows and sinks), the dense FFN and the
  shared expert by columns of their width; q/k/v and gate/up are cut by rows (column-parallel), attn_output and
  the down projections by columns (row-parallel), so each device computes a partial output of the branch that
  an all-reduce sums, before the post-norms and the residual add (two all-reduces per layer, three with a
  shared expert). The token embeddings and the LM head are cut by vocabulary rows (an all-reduce after the
  embedding, an all-gather of the logits). Norms, the q/k norms and the MoE router are on every device; a
  row-parallel bias is added by the first device only. MoE layers: each expert's FFN width is cut as a dense
  FFN's ("columns", the default, as vLLM's tensor-parallel MoE: every device works on every token, whatever the
  routing), or whole experts go to each device ("experts": expert parallelism; a device runs the tokens routed
  to its experts, a skewed routing loads one device more). Gated DeltaNet layers (qwen35, qwen3next) are not cut
  (layer split runs them).

Rounding, as llama.cpp's get_row_split for `-sm row` (vLLM instead asks for counts divisible by the devices): a
dimension of N is cut at floor(N * c) for each device's cumulative share c, rounded down to a whole unit, the
last device taking the rest. A unit is what can be cut: a KV-head group (or as many of them as make
attn_output's columns a whole number of its quantization blocks), a quantization block of a down projection's
columns (the dimension its blocks run along), an expert, a vocabulary row. A device given a positive share
that this leaves without any layer, head, column or expert is refused with one line (fewer devices, other
proportions, or the other mode); a share of 0 leaves a device out, as in llama.cpp.

The CUDA side: each rank (a process on its GPU) takes its Share (plan.shares), its config (plan.local_config: the
heads and widths it holds; the fused forms of the programs built from it), its slice of each tensor
(plan.shard(rank, spec); shard_bytes says where it lies in the file, take() cuts it from data in memory: rows,
or whole blocks of columns of the GGUF layout) and the cache of its layers or KV heads, and meets the others at
the collectives (backends/collective.py; backends/cuda/nccl.py), where numpy_split.py's ranks meet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from ..errors import UsageError
from ..ggufio.ggml_types import GGML_QUANT_SIZES
from ..models.config import ModelConfig
from ..models.kv_cache import DEFAULT as DEFAULT_CACHE, cache_row_bytes
from ..models.weights import TensorSpec, model_specs
from ..textio import brief
from ..units import human_bytes

MODES = ("none", "layer", "tensor")
MOE_SPLITS = ("columns", "experts")
MAX_DEVICES = 16  # GGML_CUDA_MAX_DEVICES, the most --tensor-split / -dev take
_DEVICE = re.compile(r"(?i)(?:cuda)?(\d{1,3})")  # -dev's names: llama.cpp's CUDA0, CUDA1 (or the bare ordinals)

# The fields a tensor-split device holds a column slice of (their output is a partial sum: row-parallel), and
# the biases of those outputs, which one device adds.
ROW_PARALLEL = frozenset({"attn_output", "ffn_down", "ffn_down_shexp", "ffn_down_exps", "ssm_out"})
FIRST_ONLY = frozenset({"attn_output_bias"})
WHOLE = frozenset({"attn_norm", "ffn_norm", "attn_post_norm", "ffn_post_norm", "attn_q_norm", "attn_k_norm",
                   "ffn_gate_inp", "ffn_gate_inp_bias", "ffn_gate_inp_shexp", "ffn_gate_inp_scale",
                   "ffn_down_exps_scale", "ffn_post_norm_1", "ffn_pre_norm_2", "ffn_post_norm_2", "per_layer_inp_gate",
                   "per_layer_proj", "per_layer_post_norm", "layer_output_scale"})


# -- the options --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitOptions:
    """How the user asked to split the model (llama.cpp's options), checked but not yet matched to devices."""

    mode: str = "none"  # MODES
    proportions: tuple[float, ...] = ()  # --tensor-split, one per device; (): by free memory (equal: emulated)
    main_gpu: int = 0  # --main-gpu: an index into the devices taking part (into -dev's list when given)
    devices: tuple[int, ...] | None = None  # -dev: device ordinals in that order; None: every one; (): none
    moe: str = "columns"  # MOE_SPLITS: how tensor split cuts the experts

    @property
    def split(self) -> bool:
        return self.mode != "none"

    def as_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "proportions": list(self.proportions), "main_gpu": self.main_gpu,
                "devices": None if self.devices is None else list(self.devices), "moe": self.moe}

    @classmethod
    def from_json(cls, value: Any) -> "SplitOptions":
        """as_json()'s object back, every field checked (ValueError says which is wrong)."""
        if not isinstance(value, dict) or set(value) != {"mode", "proportions", "main_gpu", "devices", "moe"}:
            raise ValueError("split options have the fields mode, proportions, main_gpu, devices and moe")
        props, devices, main = value["proportions"], value["devices"], value["main_gpu"]
        if value["mode"] not in MODES or value["moe"] not in MOE_SPLITS:
            raise ValueError("a split mode or MoE split")
        if not isinstance(props, list) or len(props) > MAX_DEVICES or not all(
                type(p) in (int, float) and math.isfinite(p) and p >= 0 for p in props) or (
                props and not 0 < sum(props) < math.inf):
            raise ValueError("split proportions")
        if devices is not None and (not isinstance(devices, list) or len(devices) > MAX_DEVICES or not all(
                type(d) is int and 0 <= d < 1000 for d in devices)):
            raise ValueError("split devices")
        if type(main) is not int or not 0 <= main < MAX_DEVICES:
            raise ValueError("a main GPU")
        return cls(value["mode"], tuple(float(p) for p in props), main,
                   None if devices is None else tuple(devices), value["moe"])


def parse_split_options(split_mode: str | None = None, tensor_split: str | None = None, main_gpu: int | None = None,
                        device: str | None = None, moe: str = "columns") -> SplitOptions:
    """The options as typed (-sm, -ts, -mg, -dev), checked: a UsageError of one line for a value that cannot
    work. Without --split-mode, a --tensor-split or -dev of several devices means layer (llama.cpp's default),
    anything else none."""
    devices = None if device is None else _parse_devices(device)
    props = () if tensor_split is None else _parse_proportions(tensor_split)
    if split_mode is None:
        several = sum(p > 0 for p in props) > 1 or (devices is not None and len(devices) > 1)
        mode = "layer" if several else "none"
    else:
        mode = split_mode.strip().lower()
        if mode == "row":
            raise UsageError("--split-mode row (llama.cpp's older split of each matrix's rows) is --split-mode tensor "
                             "here")
        if mode not in MODES:
            raise UsageError(f"--split-mode takes none, layer or tensor, got {brief(split_mode)}")
    if mode == "none" and sum(p > 0 for p in props) > 1:
        raise UsageError("--tensor-split shares the model among devices: give --split-mode layer or tensor with it "
                         "(none runs on one GPU, --main-gpu)")
    if devices is not None and props and len(props) > max(len(devices), 1):
        raise UsageError(f"--tensor-split gives {len(props)} proportions for the {len(devices)} devices -dev names")
    if devices == () and mode != "none":
        raise UsageError(f"-dev none runs on no GPU: --split-mode {mode} has no devices to split over")
    main = 0 if main_gpu is None else main_gpu
    if type(main) is not int or not 0 <= main < MAX_DEVICES:
        raise UsageError(f"--main-gpu takes a GPU index from 0 to {MAX_DEVICES - 1}, got {brief(main_gpu)}")
    if devices and main >= len(devices):
        raise UsageError(f"--main-gpu {main} indexes the {len(devices)} devices -dev names (0 to {len(devices) - 1})")
    if moe not in MOE_SPLITS:
        raise UsageError(f"the MoE split is columns or experts, got {brief(moe)}")
    return SplitOptions(mode, props, main, devices, moe)


def _parse_proportions(text: str) -> tuple[float, ...]:
    """-ts 3,1 (or 3/1, as llama.cpp splits on both): non-negative finite numbers, at least one positive."""
    if len(text) > 1000:
        raise UsageError(f"--tensor-split is {len(text)} characters long: give at most {MAX_DEVICES} proportions")
    words = re.split(r"[,/]", text.strip())
    if len(words) > MAX_DEVICES:
        raise UsageError(f"--tensor-split gives {len(words)} proportions: at most {MAX_DEVICES} devices")
    values = []
    for word in words:
        try:
            value = float(word)
        except ValueError:
            raise UsageError(f"--tensor-split takes proportions such as 3,1 (one per device), got {brief(text)}") from None
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"--tensor-split's proportions are finite and not negative, got {brief(word.strip())}")
        values.append(value)
    total = sum(values)
    if not total > 0 or not math.isfinite(total):
        raise UsageError(f"--tensor-split needs a positive proportion for at least one device (and a finite sum), "
                         f"got {brief(text)}")
    return tuple(values)


def _parse_devices(text: str) -> tuple[int, ...]:
    """-dev CUDA0,CUDA1 (llama.cpp's names; bare ordinals too) or none: the devices in that order."""
    if len(text) > 1000:
        raise UsageError(f"-dev is {len(text)} characters long: name at most {MAX_DEVICES} devices")
    words = [w.strip() for w in text.split(",")]
    if [w.lower() for w in words] == ["none"]:
        return ()
    if len(words) > MAX_DEVICES:
        raise UsageError(f"-dev names {len(words)} devices: at most {MAX_DEVICES}")
    found = []
    for word in words:
        m = _DEVICE.fullmatch(word)
        if m is None:
            raise UsageError(f"-dev takes devices such as CUDA0,CUDA1 (or none), got {brief(text)}")
        found.append(int(m.group(1)))
    if len(set(found)) != len(found):
        raise UsageError(f"-dev names a device twice: {brief(text)}")
    return tuple(found)


def emulated_devices(options: SplitOptions) -> int:
    """How many devices the NumPy backend emulates for `options`: as many as --tensor-split gives proportions,
    else as -dev names (the emulation has no devices of its own to count)."""
    if not options.split:
        return 1
    n = len(options.proportions) or len(options.devices or ())
    if n == 0:
        raise UsageError(f"the NumPy backend emulates the devices --tensor-split lists (or -dev): give "
                         f"--split-mode {options.mode} --tensor-split 1,1 for two")
    return n


# -- the plan ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMemory:
    """What a device has: `free` and `total` bytes (None: not known, as for an emulated device)."""

    index: int
    free: int | None = None
    total: int | None = None


Range = tuple[int, int]  # [start, end)


@dataclass(frozen=True)
class Share:
    """One device's part of the model, and the memory it takes (bytes; kv for the planned sequences)."""

    device: int  # the device's number: a CUDA ordinal, or an emulated device's
    rank: int  # its place among the devices taking part (the collectives' rank)
    layers: Range  # the layers it runs (layer split: its range; otherwise every one)
    q_heads: Range  # the query heads it computes in each attention layer
    kv_heads: Range  # the KV heads they read (whole groups; one KV head held by several devices where there are
    #                  fewer KV heads than devices)
    ff: Range  # the dense FFN's columns
    ff_exp: Range  # each expert's columns ("columns" MoE split)
    experts: Range  # the experts it holds ("experts" MoE split)
    ff_shexp: Range  # the shared expert's columns
    vocab: Range  # the rows of token_embd / output it holds (tensor split), else all
    embeddings: bool  # holds token_embd (its vocab rows)
    head: bool  # holds the output norm and the LM head (its vocab rows)
    weights: int = 0
    kv: int = 0
    scratch: int = 0
    free: int | None = None
    total: int | None = None

    @property
    def need(self) -> int:
        return self.weights + self.kv + self.scratch

    @property
    def fits(self) -> bool:
        return self.free is None or self.need <= self.free


@dataclass(frozen=True)
class Shard:
    """The part of a tensor one device holds: the whole (axis None), or the ranges `pieces` along `axis`, joined
    in order (a fused [q; k; v] or [gate; up] matrix gives one piece per part)."""

    axis: int | None = None
    pieces: tuple[Range, ...] = ()

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.axis is None:
            return shape
        out = list(shape)
        out[self.axis] = sum(b - a for a, b in self.pieces)
        return tuple(out)


@dataclass(frozen=True)
class SplitPlan:
    mode: str
    shares: tuple[Share, ...]  # in rank order
    main: int  # the rank that samples (tensor: the logits gathered there; layer: the last rank's)
    moe: str = "columns"
    n_layer: int = 0
    n_head: int = 0
    n_head_kv: int = 0
    units: dict[str, int] = field(default_factory=dict)  # the cut's granule per dimension (kv_heads, ff, ...)
    ctx: int = 0
    slots: int = 1

    @property
    def n(self) -> int:
        return len(self.shares)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.shares)

    def local_config(self, cfg: ModelConfig, rank: int) -> ModelConfig:
        """The config rank `rank` runs (tensor split: the heads and widths it holds; the programs of
        models/block.py built from it take its slices' sizes); the model's own otherwise."""
        if self.mode != "tensor":
            return cfg
        s = self.shares[rank]
        return replace(cfg, n_head=s.q_heads[1] - s.q_heads[0], n_head_kv=s.kv_heads[1] - s.kv_heads[0],
                       n_ff=s.ff[1] - s.ff[0],
                       n_ff_exp=s.ff_exp[1] - s.ff_exp[0], n_ff_shexp=s.ff_shexp[1] - s.ff_shexp[0])

    def holds_layer(self, rank: int, i: int) -> bool:
        a, b = self.shares[rank].layers
        return a <= i < b

    def shard(self, rank: int, spec: TensorSpec, cfg: ModelConfig) -> Shard | None:
        """The part of tensor `spec` (weights.model_specs) rank `rank` holds: None where it holds none of it."""
        s = self.shares[rank]
        name = spec.name
        if name in ("token_embd.weight", "output.weight"):
            keep = s.embeddings if name == "token_embd.weight" else s.head
            if name == "token_embd.weight" and cfg.tied_embeddings:
                keep = s.embeddings or s.head  # (the tied LM head reads token_embd)
            if not keep:
                return None
            return Shard() if self.mode != "tensor" else Shard(0, (s.vocab,))
        if name.startswith("per_layer_"):  # gemma4's per-layer embeddings: with the token embeddings
            return Shard() if s.embeddings else None
        if not name.startswith("blk."):
            return Shard() if s.head or not name.startswith("output") else None
        layer = int(name.split(".")[1])
        if not self.holds_layer(rank, layer):
            return None
        if self.mode != "tensor" or spec.field in WHOLE:
            return Shard()
        if spec.field in FIRST_ONLY:
            return Shard() if s.rank == 0 else None
        return _tensor_shard(cfg, cfg.layers[layer], spec, s, self.moe)

    def lines(self) -> list[str]:
        """The plan in words, a line per device (inspect; the notices of a split load)."""
        out = []
        for s in self.shares:
            if self.mode == "layer":
                a, b = s.layers
                held = [f"layers {a}-{b - 1}" if b > a else "no layer"]
                held += [w for w, on in (("the embeddings", s.embeddings), ("the LM head", s.head)) if on]
                what = " + ".join(held)
            elif self.mode == "tensor":
                parts = [f"query heads {_span(s.q_heads)} of {self.n_head} (KV heads {_span(s.kv_heads)} of "
                         f"{self.n_head_kv})"]
                if "ff" in self.units:
                    parts.append(f"FFN columns {_span(s.ff)}")
                if "ff_exp" in self.units:
                    parts.append(f"expert columns {_span(s.ff_exp)}")
                if "experts" in self.units:
                    parts.append(f"experts {_span(s.experts)}")
                if "ff_shexp" in self.units:
                    parts.append(f"shared-expert columns {_span(s.ff_shexp)}")
                parts.append(f"vocabulary rows {_span(s.vocab)}")
                what = ", ".join(parts)
            else:
                what = "the whole model"
            mem = f"weights {human_bytes(s.weights)} + KV cache {human_bytes(s.kv)}"
            if s.scratch:
                mem += f" + scratch {human_bytes(s.scratch)}"
            if s.free is not None:
                mem += f" = {human_bytes(s.need)} of {human_bytes(s.free)} free" + ("" if s.fits else ": does not fit")
            out.append(f"device {s.device}: {what}; {mem}")
        return out

    def as_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "moe": self.moe, "main": self.main, "fits": self.fits, "ctx": self.ctx,
                "devices": [{"device": s.device, "layers": list(s.layers), "q_heads": list(s.q_heads),
                             "kv_heads": list(s.kv_heads),
                             "ff": list(s.ff), "ff_exp": list(s.ff_exp), "experts": list(s.experts),
                             "vocab": list(s.vocab), "embeddings": s.embeddings, "head": s.head,
                             "weights": s.weights, "kv": s.kv, "scratch": s.scratch, "need": s.need,
                             "free": s.free, "fits": s.fits} for s in self.shares]}


def plan_split(cfg: ModelConfig, tensors: Mapping[str, Any] | None, options: SplitOptions, *, ctx: int,
               devices: Sequence[DeviceMemory] | int, cache_types: tuple[str, str] = DEFAULT_CACHE,
               scratch: int = 0, slots: int = 1) -> SplitPlan:
    """The plan for `options` over `devices` (what each visible device has; an int: that many of unknown
    memory, as the emulation's): which devices take part (-dev, the positive proportions), what each holds,
    and its memory at `ctx` positions of `slots` sequences of `cache_types`, with `scratch` bytes each.
    `tensors`: the file's TensorInfo by name (their types give the cut's units; None: unquantized). UsageError
    of one line for a split that cannot be made."""
    visible = [DeviceMemory(i) for i in range(devices)] if isinstance(devices, int) else list(devices)
    if not visible:
        raise UsageError("no device to run the model on")
    by_index = {d.index: d for d in visible}
    if options.devices:
        missing = [d for d in options.devices if d not in by_index]
        if missing:
            raise UsageError(f"-dev names device {missing[0]}, but only {len(visible)} "
                             f"{'is' if len(visible) == 1 else 'are'} here (0 to {len(visible) - 1})")
        chosen = [by_index[d] for d in options.devices]
    else:
        chosen = visible
    if options.main_gpu >= len(chosen):
        raise UsageError(f"--main-gpu {options.main_gpu}: there {'is' if len(chosen) == 1 else 'are'} "
                         f"{len(chosen)} device{'s' * (len(chosen) != 1)} (0 to {len(chosen) - 1})")
    main_dev = chosen[options.main_gpu]
    if options.mode == "none":
        plan = SplitPlan("none", (_whole(cfg, main_dev, 0),), 0, options.moe, cfg.n_layer, cfg.n_head,
                         cfg.n_head_kv, ctx=ctx, slots=slots)
        return _with_memory(cfg, tensors, plan, cache_types, scratch, [main_dev])
    props = list(options.proportions)
    if len(props) > len(chosen):
        raise UsageError(f"--tensor-split gives {len(props)} proportions, for {len(chosen)} device"
                         f"{'s' * (len(chosen) != 1)}")
    if not props:  # llama.cpp: by free memory; equal where it is unknown
        known = all(d.free is not None for d in chosen)
        props = [float(d.free) if known else 1.0 for d in chosen]  # type: ignore[arg-type]
        if not sum(props) > 0:
            props = [1.0] * len(chosen)
    props += [0.0] * (len(chosen) - len(props))
    taking = [(d, p) for d, p in zip(chosen, props) if p > 0]
    total = sum(p for _, p in taking)
    if not taking or not total < math.inf:
        raise UsageError("--tensor-split needs a positive proportion for at least one device (and a finite sum)")
    cum, acc = [], 0.0
    for _, p in taking:
        acc += p
        cum.append(acc / total)
    cum[-1] = 1.0
    ranks = [d.index for d, _ in taking]
    if options.mode == "layer":
        shares = _layer_shares(cfg, [d for d, _ in taking], cum)
        main = len(shares) - 1  # the LM head's device samples
    else:  # the logits are gathered on the main GPU (the first device taking part, if --main-gpu takes none)
        shares, units = _tensor_shares(cfg, tensors, [d for d, _ in taking], cum, options.moe)
        main = ranks.index(main_dev.index) if main_dev.index in ranks else 0
    plan = SplitPlan(options.mode, tuple(shares), main, options.moe, cfg.n_layer, cfg.n_head, cfg.n_head_kv,
                     units if options.mode == "tensor" else {}, ctx, slots)
    return _with_memory(cfg, tensors, plan, cache_types, scratch, [d for d, _ in taking])


def _span(r: Range) -> str:
    return f"{r[0]}-{r[1] - 1}"


def _whole(cfg: ModelConfig, dev: DeviceMemory, rank: int) -> Share:
    return Share(dev.index, rank, (0, cfg.n_layer), (0, cfg.n_head), (0, cfg.n_head_kv), (0, cfg.n_ff),
                 (0, cfg.n_ff_exp), (0, cfg.n_expert), (0, cfg.n_ff_shexp), (0, cfg.vocab_size), True, True)


def _layer_shares(cfg: ModelConfig, devs: list[DeviceMemory], cum: list[float]) -> list[Share]:
    """llama.cpp's layer split: unit i (layer i, the LM head as unit n_layer) on the first device whose cumulative
    share exceeds i / (n_layer + 1)."""
    n = cfg.n_layer + 1
    owner = [next(d for d, c in enumerate(cum) if c > i / n) for i in range(n)]
    # A shared-KV layer reads its source's cache: the two, and the layers between, go to one device (the last one's
    # of each run of overlapping spans: the cut moves before the source).
    spans: list[list[int]] = []
    for a, b in sorted((p.kv_from, i) for i, p in enumerate(cfg.layers) if p.shares_kv):
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    for a, b in spans:
        owner[a : b + 1] = [owner[b]] * (b + 1 - a)
    shares = []
    for rank, dev in enumerate(devs):
        units = [i for i in range(n) if owner[i] == rank]
        if not units:
            raise UsageError(f"--split-mode layer leaves device {dev.index} none of the model's {cfg.n_layer} layers "
                             "and LM head: give it a larger share, or use fewer devices")
        layers = [i for i in units if i < cfg.n_layer]
        span = (layers[0], layers[-1] + 1) if layers else (units[0], units[0])
        base = _whole(cfg, dev, rank)
        shares.append(replace(base, layers=span, embeddings=0 in units, head=cfg.n_layer in units))
    return shares


def block_size(tensors: Mapping[str, Any] | None, name: str) -> int:
    """Values per quantization block of tensor `name` (1 for plain types, or where the tensor is not known)."""
    info = tensors.get(name) if tensors else None
    return GGML_QUANT_SIZES[info.type][0] if info is not None else 1


def _unit(tensors: Mapping[str, Any] | None, names: Iterable[str], width: int = 1) -> int:
    """The fewest items of `width` columns whose columns fill whole blocks of every tensor in `names`."""
    u = 1
    for name in names:
        blk = block_size(tensors, name)
        u = math.lcm(u, blk // math.gcd(blk, width))
    return u


def cuts(n: int, cum: list[float], unit: int) -> list[Range]:
    """[0, n) cut for devices of cumulative shares `cum` (the last 1.0): at floor(n * c), rounded down to a
    multiple of `unit`, the last device taking the rest (llama.cpp's get_row_split)."""
    bounds = [0] + [int(n * c) // unit * unit for c in cum[:-1]] + [n]
    return [(bounds[i], max(bounds[i], bounds[i + 1])) for i in range(len(cum))]


def _tensor_shares(cfg: ModelConfig, tensors: Mapping[str, Any] | None, devs: list[DeviceMemory], cum: list[float],
                   moe: str) -> tuple[list[Share], dict[str, int]]:
    recurrent = [i for i, p in enumerate(cfg.layers) if p.recurrent]
    if recurrent and len(devs) > 1:
        raise UsageError("--split-mode tensor does not cut Gated DeltaNet layers (this model's linear-attention "
                         "layers): --split-mode layer splits it")
    if len(devs) > 1 and any(p.head_dim or p.n_head_kv or p.n_ff for p in cfg.layers):
        raise UsageError(f"--split-mode tensor does not cut layers whose heads or widths differ from layer to layer "
                         f"(this {cfg.architecture} model's): --split-mode layer splits it")
    att = [i for i, p in enumerate(cfg.layers) if not p.recurrent]
    dims: dict[str, tuple[int, int, str]] = {}  # dimension -> (size, unit, what a device may not lack)
    q_heads, q_unit = _head_cut(cfg, tensors, [f"blk.{i}.attn_output.weight" for i in att], devs, cum)
    dense = [i for i, p in enumerate(cfg.layers) if not p.moe]
    if dense:
        dims["ff"] = (cfg.n_ff, _unit(tensors, (f"blk.{i}.ffn_down.weight" for i in dense)), "FFN column")
    moe_layers = [i for i, p in enumerate(cfg.layers) if p.moe]
    if moe_layers and moe == "columns":
        dims["ff_exp"] = (cfg.n_ff_exp, _unit(tensors, (f"blk.{i}.ffn_down_exps.weight" for i in moe_layers)),
                          "expert column")
    elif moe_layers:
        dims["experts"] = (cfg.n_expert, 1, "expert")
    shexp = [i for i, p in enumerate(cfg.layers) if p.shared_expert]
    if shexp:
        dims["ff_shexp"] = (cfg.n_ff_shexp, _unit(tensors, (f"blk.{i}.ffn_down_shexp.weight" for i in shexp)),
                            "shared-expert column")
    dims["vocab"] = (cfg.vocab_size, 1, "vocabulary row")
    ranges: dict[str, list[Range]] = {}
    for key, (n, unit, what) in dims.items():
        ranges[key] = cuts(n, cum, unit)
        for dev, (a, b) in zip(devs, ranges[key]):
            if b <= a:
                cut = f" (cut in whole groups of {unit}, the quantization blocks' grain)" if unit > 1 else ""
                raise UsageError(f"--split-mode tensor leaves device {dev.index} no {what}: the model has {n}{cut}; "
                                 f"use fewer devices or other --tensor-split proportions, or --split-mode layer")
    shares = []
    g = cfg.n_group
    for rank, dev in enumerate(devs):
        q0, q1 = q_heads[rank]
        base = replace(_whole(cfg, dev, rank), q_heads=(q0, q1), kv_heads=(q0 // g, -(-q1 // g)))
        shares.append(replace(base, **{key: r[rank] for key, r in ranges.items()}))
    return shares, {"q_heads": q_unit, **{key: unit for key, (n, unit, what) in dims.items()}}


def _head_cut(cfg: ModelConfig, tensors: Mapping[str, Any] | None, outputs: list[str], devs: list[DeviceMemory],
              cum: list[float]) -> tuple[list[Range], int]:
    """The query heads of each device: whole KV-head groups (a unit: as many groups as fill whole blocks of
    attn_output's columns, `outputs`); where that leaves a device none (fewer KV heads than devices), as vLLM does,
    query heads within one group, the group's KV head on each device that reads it (its K/V rows held twice)."""
    g, dh = cfg.n_group, cfg.head_dim
    unit = g * _unit(tensors, outputs, g * dh)
    heads = cuts(cfg.n_head, cum, unit)
    if all(b > a for a, b in heads):
        return heads, unit
    fine = _unit(tensors, outputs, dh)
    within = cuts(cfg.n_head, cum, fine)
    if all(b > a and (a // g == (b - 1) // g or (a % g == 0 and b % g == 0)) for a, b in within):
        return within, fine
    dev = next(d for d, (a, b) in zip(devs, heads) if b <= a)
    grain = f", cut in groups of {unit} query heads (whole KV-head groups filling attn_output's blocks)"
    raise UsageError(f"--split-mode tensor leaves device {dev.index} no attention head: the model has {cfg.n_head} "
                     f"query heads over {cfg.n_head_kv} KV heads{grain}; use fewer devices or other --tensor-split "
                     "proportions, or --split-mode layer")


def _tensor_shard(cfg: ModelConfig, plan: Any, spec: TensorSpec, s: Share, moe: str) -> Shard | None:
    """A tensor-split device's slice of a layer's tensor (the module doc says which way each is cut)."""
    dh, f = cfg.head_dim, spec.field
    k0, k1 = s.kv_heads
    q = (s.q_heads[0] * dh, s.q_heads[1] * dh)  # its query heads' rows of attn_q, columns of attn_output
    kv = (k0 * dh, k1 * dh)
    if f == "attn_q":
        return Shard(0, ((2 * q[0], 2 * q[1]),) if plan.attn_gate else (q,))  # (rows per head [q; gate])
    if f == "attn_q_bias":
        return Shard(0, (q,))
    if f in ("attn_k", "attn_v", "attn_k_bias", "attn_v_bias"):
        return Shard(0, (kv,))
    if f == "attn_qkv":  # rows [q; k; v]
        qd, kd = cfg.q_dim, cfg.kv_dim
        return Shard(0, (q, (qd + kv[0], qd + kv[1]), (qd + kd + kv[0], qd + kd + kv[1])))
    if f == "attn_sinks":
        return Shard(0, (s.q_heads,))
    if f == "attn_output":
        return Shard(1, (q,))
    f0, f1 = s.ff
    if f in ("ffn_gate", "ffn_up"):
        if f == "ffn_up" and plan.fused_gate_up:  # rows [gate; up]
            return Shard(0, ((f0, f1), (cfg.n_ff + f0, cfg.n_ff + f1)))
        return Shard(0, ((f0, f1),))
    if f == "ffn_down":
        return Shard(1, ((f0, f1),))
    if f.endswith("_exps") or f.endswith("_exps_bias"):
        if moe == "experts":  # whole experts, their biases with them
            return Shard(0, (s.experts,))
        if f == "ffn_down_exps_bias":  # (added once, as a row-parallel bias)
            return Shard() if s.rank == 0 else None
        if f == "ffn_down_exps":
            return Shard(2, (s.ff_exp,))
        if f == "ffn_gate_up_exps":  # [E, 2 F_exp, D], rows [gate; up]
            a, b = s.ff_exp
            return Shard(1, ((a, b), (cfg.n_ff_exp + a, cfg.n_ff_exp + b)))
        return Shard(1, (s.ff_exp,))  # gate/up [E, F_exp, D] and their biases [E, F_exp]
    s0, s1 = s.ff_shexp
    if f in ("ffn_gate_shexp", "ffn_up_shexp"):
        return Shard(0, ((s0, s1),))
    if f == "ffn_down_shexp":
        return Shard(1, ((s0, s1),))
    raise UsageError(f"--split-mode tensor has no cut for {spec.name}")  # (the delta-net's: refused before)


def take(data: Any, shard: Shard, block: int = 1, type_size: int = 0) -> Any:
    """Shard `shard` of a tensor's data: a float array of the tensor's shape, or GGUFFile.raw's uint8 [...,
    row_bytes] of a block type (`block` values of `type_size` bytes; cuts along the last axis fall on whole
    blocks, as the plan's units make them)."""
    import numpy as np

    if shard.axis is None:
        return data
    axis = shard.axis % data.ndim
    last = axis == data.ndim - 1
    parts = []
    for a, b in shard.pieces:
        if last and type_size:
            if a % block or b % block:
                raise ValueError(f"a cut at columns {a}..{b} splits a {block}-value block")
            a, b = a // block * type_size, b // block * type_size
        parts.append(np.take(data, np.arange(a, b), axis=axis))
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def shard_bytes(shape: tuple[int, ...], row_bytes: int, shard: Shard, block: int = 1, type_size: int = 0) -> list[Range]:
    """Where shard `shard` of a tensor of `shape` (rows of `row_bytes` in the file; `block` values of `type_size`
    bytes for a block type) lies in the tensor's data: [start, end) byte ranges, in the order take() joins them,
    runs that touch merged. What a loader reads from the file for one device (GGUFFile.read_bytes at the tensor's
    offset plus each start): a row cut is one range, a column cut one per row."""
    rows = math.prod(shape[:-1])
    if shard.axis is None:
        return [(0, rows * row_bytes)]
    axis = shard.axis % len(shape)
    runs: list[Range] = []
    if axis == len(shape) - 1:  # columns: a range of each row
        per = (lambda a: a // block * type_size) if type_size else (lambda a: a * (row_bytes // shape[-1]))
        for r in range(rows):
            for a, b in shard.pieces:
                runs.append((r * row_bytes + per(a), r * row_bytes + per(b)))
    else:  # whole rows: a range of each index of the dims before the axis
        inner = math.prod(shape[axis + 1:-1]) * row_bytes  # bytes of one step along the axis
        outer = math.prod(shape[:axis])
        for o in range(outer):
            for a, b in shard.pieces:
                base = o * shape[axis] * inner
                runs.append((base + a * inner, base + b * inner))
    merged: list[Range] = []
    for a, b in runs:
        if b <= a:
            continue
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


# -- memory --------------------------------------------------------------------------------------------------


def _tensor_bytes(info: Any, spec: TensorSpec, shard: Shard) -> int:
    """A shard's bytes on a device: matrices in the file's layout, vectors as float32 (as the CUDA backend
    keeps them)."""
    whole = 4 * math.prod(spec.shape) if spec.vector else (info.n_bytes if info is not None else
                                                            4 * math.prod(spec.shape))
    if shard.axis is None:
        return whole
    return whole * math.prod(shard.shape(spec.shape)) // max(1, math.prod(spec.shape))


def layer_kv_bytes(cfg: ModelConfig, ctx: int, cache_types: tuple[str, str] = DEFAULT_CACHE) -> list[int]:
    """Each layer's K and V bytes at `ctx` (config.cache_rows; a recurrent layer: its state, per sequence)."""
    n_rec = sum(p.recurrent for p in cfg.layers)
    state = cfg.recurrent_state_bytes() // n_rec if n_rec else 0
    return [state if p.recurrent else
            int(rows * cfg.layer_kv_heads(i) * sum(cache_row_bytes(t, cfg.layer_head_dim(i)) for t in cache_types))
            for i, (rows, p) in enumerate(zip(cfg.cache_rows(ctx), cfg.layers))]


def _with_memory(cfg: ModelConfig, tensors: Mapping[str, Any] | None, plan: SplitPlan, cache_types: tuple[str, str],
                 scratch: int, devs: list[DeviceMemory]) -> SplitPlan:
    specs = model_specs(cfg)
    kv_layers = layer_kv_bytes(cfg, plan.ctx, cache_types)
    shares = []
    for rank, (s, dev) in enumerate(zip(plan.shares, devs)):
        weights = 0
        for spec in specs:
            info = tensors.get(spec.name) if tensors else None
            if tensors and info is None:  # (optional tensors the file leaves out)
                continue
            shard = plan.shard(rank, spec, cfg)
            if shard is not None:
                weights += _tensor_bytes(info, spec, shard)
        a, b = s.layers
        kv = sum(kv_layers[a:b])
        if plan.mode == "tensor":
            kv = kv * (s.kv_heads[1] - s.kv_heads[0]) // max(1, cfg.n_head_kv)
        shares.append(replace(s, weights=weights, kv=kv * plan.slots, scratch=scratch, free=dev.free,
                              total=dev.total))
    return replace(plan, shares=tuple(shares))
