"""`llamacli inspect`: what a GGUF file holds, as clear as `ollama show` and as complete as `gguf-dump`."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import GGUFError
from ..ggufio.file import GGUFFile, open_gguf
from ..ggufio.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType
from ..models.base import describe
from ..models.config import ModelConfig
from ..models.kv_cache import cache_type_fits
from ..models.weights import active_share, check_tensors
from ..textio import printable
from ..units import human_bytes, human_count

MAX_LIST_ITEMS = 8  # long arrays are abbreviated in --metadata


def inspect_model(path: str, ctx: int | None = None, with_tensors: bool = False, with_metadata: bool = False,
                  split: dict[str, Any] | None = None) -> dict[str, Any]:
    """What `inspect` shows. `split`: plan the model over GPUs (split_plans' keyword arguments)."""
    from ..backends.numpy_backend import NumpyBackend  # the widest set of runnable types

    with open_gguf(path) as g:
        vocab_only = not g.tensors
        md = g.metadata
        cfg: ModelConfig | None = None
        try:
            cfg = ModelConfig.from_gguf(md, set(g.tensors))
        except GGUFError:
            if not vocab_only:  # a model we cannot run: say why
                raise
        if cfg is not None and not vocab_only:
            check_tensors(g, cfg, NumpyBackend.runnable_types)
        info = _summary(g, cfg)
        if ctx is not None and cfg is not None:
            info["kv_cache_bytes_at_ctx"] = {"ctx": ctx, "bytes": cfg.kv_cache_bytes(ctx)}
            if all(cache_type_fits(d, "q8_0") for d in cfg.head_dims):
                info["kv_cache_bytes_at_ctx"]["bytes_q8_0"] = cfg.kv_cache_bytes(ctx, ("q8_0", "q8_0"))
        if split is not None and cfg is not None and not vocab_only:
            info["split"] = split_plans(g, cfg, ctx=ctx, **split)
        if with_tensors:
            info["tensors"] = [
                {"name": t.name, "type": t.type_name, "shape": list(t.shape), "bytes": t.n_bytes, "offset": t.offset}
                for t in g.tensors.values()
            ]
        if with_metadata:
            info["metadata"] = {k: _abbreviate(v) for k, v in md.items()}
        return info


def split_plans(g: GGUFFile, cfg: ModelConfig, *, options: dict[str, Any], mode_given: bool, gpus: int,
                memory: list[int] | None, ctx: int | None) -> dict[str, Any]:
    """The model over `gpus` GPUs (backends/split_plan.py) at `ctx` (default: the context a model command would
    take) with an fp16 cache: the plan of the mode asked for, or of layer and tensor both where none was (a
    mode that cannot cut this model: the reason); `memory` the bytes of each GPU (one for all), else unknown."""
    from ..backends.split_plan import DeviceMemory, SplitOptions, plan_split
    from ..engine.generate import DEFAULT_CTX_CAP
    from ..errors import UsageError

    ctx = ctx or min(cfg.context_length, DEFAULT_CTX_CAP)
    sizes = (memory * gpus if len(memory) == 1 else memory) if memory else [None] * gpus
    devices = [DeviceMemory(i, size, size) for i, size in enumerate(sizes)]
    base = SplitOptions.from_json(options)
    modes = [base.mode] if mode_given or gpus == 1 else ["layer", "tensor"]
    plans = []
    for mode in modes:
        try:
            plan = plan_split(cfg, g.tensors, SplitOptions(mode, base.proportions, base.main_gpu, base.devices,
                                                           base.moe), ctx=ctx, devices=devices)
            plans.append({**plan.as_json(), "lines": plan.lines()})
        except UsageError as exc:
            plans.append({"mode": mode, "error": str(exc)})
    return {"gpus": gpus, "ctx": ctx, "memory": sizes if memory else None, "plans": plans}


def _summary(g: GGUFFile, cfg: ModelConfig | None) -> dict[str, Any]:
    md = g.metadata
    quant: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "elements": 0})
    for t in g.tensors.values():
        q = quant[t.type_name]
        q["tensors"] += 1
        q["bytes"] += t.n_bytes
        q["elements"] += t.n_elements
    n_params = sum(q["elements"] for q in quant.values())
    weight_bytes = sum(q["bytes"] for q in quant.values())
    tokens = md.get("tokenizer.ggml.tokens")
    info: dict[str, Any] = {
        "path": str(g.path),
        "gguf_version": g.version,
        "architecture": _abbreviate(md.get("general.architecture")),
        "name": _abbreviate(md.get("general.name")),
        "parameters": n_params,
        "file_size": g.file_size,
        "weights_bytes": weight_bytes,
        "bits_per_weight": round(weight_bytes * 8 / n_params, 3) if n_params else None,
        "quantization": {
            name: {"tensors": q["tensors"], "bytes": q["bytes"], "bits_per_weight": _bpw(name)}
            for name, q in sorted(quant.items(), key=lambda kv: -kv[1]["bytes"])
        },
        "tokenizer_model": _abbreviate(md.get("tokenizer.ggml.model")),
        "tokenizer_pre": _abbreviate(md.get("tokenizer.ggml.pre")),
        "vocab_size": cfg.vocab_size if cfg else (len(tokens) if isinstance(tokens, list) else None),
        "bos_token_id": _abbreviate(md.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": _abbreviate(md.get("tokenizer.ggml.eos_token_id")),
        "has_chat_template": isinstance(md.get("tokenizer.chat_template"), str),
        "vocab_only": not g.tensors,
    }
    if cfg is not None:
        info.update(
            context_length=cfg.context_length,
            n_layer=cfg.n_layer,
            n_embd=cfg.n_embd,
            n_head=cfg.n_head,
            n_head_kv=cfg.n_head_kv,
            head_dim=cfg.head_dim,
            n_ff=cfg.n_ff,
            layers=describe(cfg.layers),
            rope_type=cfg.rope_type,
            rope_dim=cfg.rope_dim,
            rope_freq_base=cfg.rope_freq_base,
            rope_scaling=cfg.rope_scaling,
            rms_eps=cfg.rms_eps,
            tied_embeddings=cfg.tied_embeddings,
            kv_cache_bytes=cfg.kv_cache_bytes(cfg.context_length),
        )
        if all(cache_type_fits(d, "q8_0") for d in cfg.head_dims):  # the 8-bit cache: whole 32-value blocks
            info["kv_cache_bytes_q8_0"] = cfg.kv_cache_bytes(cfg.context_length, ("q8_0", "q8_0"))
        rings = [(i, n) for i, (n, p) in enumerate(zip(cfg.cache_rows(cfg.context_length), cfg.layers))
                 if n < cfg.context_length and not p.recurrent and not p.shares_kv]
        if rings:  # sliding-window layers keep a ring of positions (models/kv_cache.py), not the whole context
            info["kv_cache_rings"] = {"layers": len(rings), "rows": sorted({n for _, n in rings})}
        n_recurrent = sum(p.recurrent for p in cfg.layers)
        if n_recurrent:  # Gated DeltaNet layers: a state per sequence that does not grow with the context
            info.update(
                recurrent_layers=n_recurrent,
                recurrent_state_bytes=cfg.recurrent_state_bytes(),
                ssm={"conv_kernel": cfg.ssm_conv_kernel, "state_size": cfg.ssm_state_size,
                     "key_heads": cfg.ssm_group_count, "value_heads": cfg.ssm_time_step_rank},
            )
        if cfg.rope_sections:
            info["rope_sections"] = list(cfg.rope_sections)
        info.update(_attention_layouts(g, cfg))
        if cfg.rope_scaling not in ("none", "proportional"):
            info["rope_scaling_factor"] = cfg.rope_scaling_factor
            info["rope_original_context"] = cfg.rope_original_context
        if cfg.n_expert:  # a mixture of experts: a token runs n_expert_used of the n_expert in each layer, and
            # reads one row of an untied embedding (what gpt-oss's "3.6B active" counts)
            info.update(
                n_expert=cfg.n_expert,
                n_expert_used=cfg.n_expert_used,
                n_ff_exp=cfg.n_ff_exp,
                active_parameters=round(sum(t.n_elements * active_share(cfg, t.name) for t in g.tensors.values())),
                active_weights_bytes=round(sum(t.n_bytes * active_share(cfg, t.name) for t in g.tensors.values())),
            )
    return info


def _attention_layouts(g: GGUFFile, cfg: ModelConfig) -> dict[str, Any]:
    """For a model whose attention layers differ in shape (gemma4: sliding and global layers of their own head size,
    KV heads and RoPE) each kind's layers, and the layers that keep no KV cache but read another layer's."""
    out: dict[str, Any] = {}
    if any(p.head_dim or p.n_head_kv for p in cfg.layers):
        kinds: dict[tuple, list[int]] = defaultdict(list)
        for i, p in enumerate(cfg.layers):
            if not p.recurrent:
                kinds[(p.window, cfg.layer_head_dim(i), cfg.layer_kv_heads(i), p.rope_local)].append(i)
        rotated = _rotated_dims(g, cfg)
        out["attention_kinds"] = [
            {"kind": "sliding" if window else "global", "window": window, "layers": len(layers),
             "head_dim": dh, "n_head_kv": hkv,
             "rope_dims": cfg.local_rope_dim if local else rotated,
             "rope_base": cfg.rope_local_base if local else cfg.rope_freq_base}
            for (window, dh, hkv, local), layers in sorted(kinds.items(), key=lambda kv: kv[1][0])]
    shared = [i for i, p in enumerate(cfg.layers) if p.shares_kv]
    if shared:
        sources: dict[int, list[int]] = defaultdict(list)
        for i in shared:
            sources[cfg.layers[i].kv_from].append(i)
        out["kv_shared"] = {"layers": shared, "reads": {str(src): layers for src, layers in sorted(sources.items())}}
    return out


def _rotated_dims(g: GGUFFile, cfg: ModelConfig) -> int:
    """The dims the global table rotates: rope_dim, less the pairs gemma4's proportional RoPE leaves still (rope_freqs
    factors of 1e30)."""
    if cfg.rope_scaling != "proportional" or "rope_freqs.weight" not in g.tensors:
        return cfg.rope_dim
    factors = g.dequantize("rope_freqs.weight")
    return 2 * int((factors < 1e20).sum())


def _span(layers: list[int]) -> str:
    """3, 4, 5, 9 -> '3-5, 9'."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _bpw(type_name: str) -> float:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return round(size * 8 / block, 3)


def _abbreviate(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    if isinstance(value, list):
        more = [f"... ({len(value)} items)"] if len(value) > MAX_LIST_ITEMS else []
        return [_abbreviate(v) for v in value[:MAX_LIST_ITEMS]] + more
    if isinstance(value, str) and len(value) > 400:
        return value[:400] + f"... ({len(value)} chars)"
    return value


# -- rendering ------------------------------------------------------------------------------------------------


def render_summary(out: Console, info: dict[str, Any]) -> None:
    """The tables of `llamacli inspect`. Every string from the file goes through `_cell`."""
    rows: list[tuple[str, str]] = [
        ("architecture", str(info["architecture"])),
        ("name", str(info.get("name"))),
    ]
    if not info["vocab_only"]:
        active = f" ({human_count(info['active_parameters'])} active per token)" if "n_expert" in info else ""
        rows += [
            ("parameters", human_count(info["parameters"]) + active),
            ("file size", human_bytes(info["file_size"])),
            ("bits per weight", str(info["bits_per_weight"])),
        ]
    else:
        rows.append(("tensors", "none (vocabulary-only file)"))
    if "n_layer" in info:
        rows += [
            ("context length", str(info["context_length"])),
            ("layers", str(info["n_layer"])),
            ("embedding", str(info["n_embd"])),
            ("heads / KV heads", f"{info['n_head']} / {info['n_head_kv']}"),
            ("head dim", str(info["head_dim"])),
            ("feed-forward", str(info["n_ff"]) if info["n_ff"] else "none (experts only)"),
        ]
        if "n_expert" in info:
            rows.append(("experts", f"{info['n_expert']}, {info['n_expert_used']} per token, "
                                    f"feed-forward {info['n_ff_exp']} each"))
        if "ssm" in info:
            m = info["ssm"]
            rows.append(("delta net", f"{m['key_heads']} key / {m['value_heads']} value heads of "
                                      f"{m['state_size']}, convolution width {m['conv_kernel']}"))
        for k in info.get("attention_kinds", ()):  # gemma4: sliding and global layers of their own shapes
            what = f"{k['layers']} sliding-window ({k['window']}) layers" if k["window"] else f"{k['layers']} global layers"
            rows.append(("attention", f"{what}: {k['n_head_kv']} KV heads x {k['head_dim']}, RoPE "
                                      + (f"{k['rope_dims']} of {k['head_dim']}" if k["rope_dims"] != k["head_dim"]
                                         else str(k["rope_dims"])) + f" dims, base {k['rope_base']:g}"))
        if "kv_shared" in info:
            reads = info["kv_shared"]["reads"]
            rows.append(("KV shared", f"{len(info['kv_shared']['layers'])} layers keep no KV cache: "
                                      + "; ".join(f"{_span(layers)} read layer {src}'s" for src, layers in reads.items())))
        rows += [
            ("blocks", info["layers"]),
            ("RoPE", f"{info['rope_type']}, base {info['rope_freq_base']:g}, scaling {info['rope_scaling']}"
                     + (f" x{info['rope_scaling_factor']:g} from {info['rope_original_context']}"
                        if info["rope_scaling"] not in ("none", "proportional") else "")
                     + (f", {info['rope_dim']} of {info['head_dim']} dims" if info["rope_dim"] != info["head_dim"] else "")
                     + (f", sections {info['rope_sections']}" if "rope_sections" in info else "")),
            ("RMS eps", f"{info['rms_eps']:g}"),
        ]
        if not info["vocab_only"]:
            rows.append(("tied embeddings", "yes" if info["tied_embeddings"] else "no"))
    rows += [
        ("tokenizer", f"{info['tokenizer_model']} / {info['tokenizer_pre']}"),
        ("vocab size", str(info["vocab_size"])),
        ("BOS / EOS", f"{info['bos_token_id']} / {info['eos_token_id']}"),
        ("chat template", "yes" if info["has_chat_template"] else "no"),
    ]
    if not info["vocab_only"] and "kv_cache_bytes" in info:
        rows.append(("GPU memory: weights", human_bytes(info["weights_bytes"])))
        if "n_expert" in info:
            rows.append(("active weights", f"{human_bytes(info['active_weights_bytes'])} per token "
                                           f"({info['n_expert_used']} of {info['n_expert']} experts, one "
                                           f"embedding row, all else)"))
        def kv(f16: int, q8: int | None) -> str:
            return human_bytes(f16) + ("" if q8 is None else f" (q8_0: {human_bytes(q8)})")

        rows.append((f"KV cache (fp16) @ {info['context_length']}",
                     kv(info["kv_cache_bytes"], info.get("kv_cache_bytes_q8_0"))))
        if "kv_cache_rings" in info:
            r = info["kv_cache_rings"]
            rows.append(("KV cache rings", f"{r['layers']} sliding-window layers hold "
                                           f"{' / '.join(str(n) for n in r['rows'])} positions each"))
        at = info.get("kv_cache_bytes_at_ctx")
        if at:
            rows.append((f"KV cache (fp16) @ {at['ctx']}", kv(at["bytes"], at.get("bytes_q8_0"))))
        if "recurrent_state_bytes" in info:
            rows.append(("recurrent state", f"{human_bytes(info['recurrent_state_bytes'])} per sequence at any "
                                            f"context ({info['recurrent_layers']} delta-net layers, float32)"))
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, _cell(v))
    out.print(table)

    if info["quantization"]:
        q = Table(title="quantization", title_justify="left")
        for col in ("type", "tensors", "bytes", "bits/weight"):
            q.add_column(col, justify="left" if col == "type" else "right")
        for name, row in info["quantization"].items():
            q.add_row(_cell(name), str(row["tensors"]), human_bytes(row["bytes"]), str(row["bits_per_weight"]))
        out.print(q)
    if "tensors" in info:
        t = Table(title="tensors", title_justify="left")
        for col in ("name", "type", "shape", "bytes"):
            t.add_column(col, justify="right" if col == "bytes" else "left")
        for row in info["tensors"]:
            t.add_row(_cell(row["name"]), _cell(row["type"]), str(row["shape"]), str(row["bytes"]))
        out.print(t)
    if "metadata" in info:
        m = Table(title="metadata", title_justify="left")
        m.add_column("key")
        m.add_column("value", overflow="fold")
        for k, v in info["metadata"].items():
            m.add_row(_cell(k), _cell(repr(v)))
        out.print(m)
    if "split" in info:
        render_split(out, info["split"])


def _cell(value: str) -> Text:
    """A table cell holding a string from the file: escaped (printable), so that a control sequence in a
    model's name cannot act on the terminal, and a Text, so that '[/INST]' is not rich markup."""
    return Text(printable(value))


def render_split(out: Console, split: dict[str, Any]) -> None:
    """The split plans of `inspect --gpus N`: per mode, a line per GPU (what it holds, what it needs)."""
    known = split["memory"] is not None
    out.print(Text(f"\nsplit over {split['gpus']} GPU{'s' * (split['gpus'] != 1)} at --ctx {split['ctx']} (fp16 KV "
                   "cache; the CUDA backend's scratch, a few hundred MiB a GPU, not counted)", style="bold"))
    for plan in split["plans"]:
        if "error" in plan:
            out.print(Text(f"{plan['mode']}: cannot split this model: {plan['error']}"))
            continue
        verdict = ("fits" if plan["fits"] else "does not fit") if known else "needs"
        out.print(Text(f"{plan['mode']}: {verdict}"))
        for line in plan["lines"]:
            out.print(Text("  " + line))
