"""`llamacli bench`: prompt-processing and generation speed in llama-bench's spirit, and how close decode
comes to the memory bandwidth.

Tests (random token ids, no tokenizer):
    pp<P>        prefill P tokens from an empty cache                       t/s = P / time
    tg<N>        N decode steps from an empty cache, greedy argmax included  t/s = N / time
    pp<P>+tg<N>  both in a row                                              t/s = (P + N) / time
    ... @ d<D>   (-d/--n-depth, as llama-bench's) the same test after a D-token context, prefilled
                 untimed before each repetition: a prompt or answer deep into a conversation
Each test runs twice to warm up (compilation; then the CUDA graphs, which the CUDA backend captures when a
prefill length comes round again), then `reps` times; t/s is mean +- sample stddev over the repetitions.

On CUDA the clock is a pair of CUDA events around each repetition (backend.elapsed); elsewhere
synchronize + perf_counter.

Decode reads every weight once per token (a tied embedding counted once, as the LM head; the embedding of
an untied model contributes one row; of a mixture of experts, the k of E experts a token runs) plus the K
and V written so far. GB/s = bytes per token x tokens/s, and % BW is that over the copy bandwidth the
backend measures (bytes read + written by a large copy).

With speculative decoding asked for (--spec-type, -md), bench compares instead a greedy reply to one prompt (-f,
or by default an echo task: rewrite llamacli/units.py with one function renamed) with and without it, through
the engine as `generate` runs it: decode tokens/s (from the first id to the last), the drafts and those
accepted, tokens per decode pass, and whether the replies are the same (they must be, up to near-ties of the
logits where the verification's kernels round otherwise than the decode step's).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..models.block import prefill as prefill_prompt
from ..models.config import ModelConfig
from ..models.kv_cache import DEFAULT as DEFAULT_CACHE, cache_row_bytes
from ..models.weights import active_share
from ..textio import csv_text
from ..units import human_bytes, human_count
from .generate import Model
from .speculative import SpecSettings


@dataclass
class BenchRow:
    model: str
    size: int  # bytes of weights
    params: int
    backend: str
    test: str
    n_prompt: int
    n_gen: int
    samples_ts: list[float] = field(default_factory=list)
    bytes_per_token: float = 0.0  # decode tests only
    bandwidth: float = 0.0  # measured copy bandwidth, bytes/s
    n_depth: int = 0  # tokens already in the KV cache when the test starts (-d)

    @property
    def avg_ts(self) -> float:
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return statistics.stdev(self.samples_ts) if len(self.samples_ts) > 1 else 0.0

    @property
    def gb_per_s(self) -> float | None:
        if not self.n_gen or self.n_prompt:
            return None
        return self.bytes_per_token * self.avg_ts / 1e9

    @property
    def bw_fraction(self) -> float | None:
        gbs = self.gb_per_s
        return gbs * 1e9 / self.bandwidth if gbs is not None and self.bandwidth else None

    def as_dict(self, device: str) -> dict[str, Any]:
        return {
            "model": self.model, "size": self.size, "params": self.params, "backend": self.backend,
            "device": device, "test": self.test, "n_prompt": self.n_prompt, "n_gen": self.n_gen,
            "n_depth": self.n_depth,
            "avg_ts": round(self.avg_ts, 3), "stddev_ts": round(self.stddev_ts, 3),
            "samples_ts": [round(s, 3) for s in self.samples_ts],
            "gb_per_s": None if self.gb_per_s is None else round(self.gb_per_s, 2),
            "bw_fraction": None if self.bw_fraction is None else round(self.bw_fraction, 4),
        }


def decode_bytes_per_token(model: Model, kv_positions: float) -> float:
    """Bytes one decode step reads: the weights (embedding: one row unless it is the LM head; experts: the
    n_expert_used of n_expert a token runs) and the K/V of `kv_positions` cached positions in the model's
    cache types, of at most the window's on a sliding-window layer."""
    cfg = model.cfg
    total = sum(t.n_bytes * active_share(cfg, t.name) for t in model.gguf.tensors.values())
    return total + sum(kv_read_bytes(cfg, kv_positions, model.cache_types))


class Bench:
    def __init__(self, model: Model, seed: int = 0):
        self.m, self.be, self.cfg = model, model.backend, model.cfg
        model.seq.clear()  # the runs below fill the KV cache with random ids: a later generate starts afresh
        self.rng = np.random.default_rng(seed)

    def _ids(self, n: int) -> list[int]:
        return self.rng.integers(0, self.cfg.vocab_size, size=n).tolist()

    def _timed(self, fn: Callable[[], None]) -> float:
        be = self.be
        timer = getattr(be, "elapsed", None)  # CUDA: events around fn on the GPU timeline
        if timer is not None:
            be.synchronize()
            return timer(fn)
        be.synchronize()
        t0 = time.perf_counter()
        fn()
        be.synchronize()
        return time.perf_counter() - t0

    def prefill(self, n: int, start: int = 0) -> None:
        be = self.be
        logits = prefill_prompt(be, self.cfg, self._ids(n), start)  # as generate runs a prompt
        be.to_host(logits[:, :1])  # the result must exist before the clock stops

    def generate(self, n: int, start: int = 0) -> None:
        token = self._ids(1)[0]
        for pos in range(start, start + n):
            token = self.be.decode_greedy(token, pos)

    def run(self, n_prompt: int, n_gen: int, reps: int, depth: int = 0) -> list[float]:
        if depth + n_prompt + n_gen > self.m.ctx:
            from ..errors import UsageError

            raise UsageError(f"test {test_name(n_prompt, n_gen, depth)} needs a context of "
                             f"{depth + n_prompt + n_gen}, have {self.m.ctx} (--ctx)")

        def once() -> None:
            if n_prompt:
                self.prefill(n_prompt, start=depth)
            if n_gen:
                self.generate(n_gen, start=depth + n_prompt)

        def timed() -> float:
            if depth:  # the context the test starts from, written into the cache outside the clock
                self.prefill(depth)
            return self._timed(once)

        # Warm-up, twice: compilation, cuBLAS plans and caches; then the CUDA graphs, captured when a step or
        # a prefill length comes round again (CudaBackend.forward_prompt).
        timed()
        timed()
        return [(n_prompt + n_gen) / timed() for _ in range(reps)]


def test_name(n_prompt: int, n_gen: int, depth: int = 0) -> str:
    if n_prompt and n_gen:
        name = f"pp{n_prompt}+tg{n_gen}"
    else:
        name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    return f"{name} @ d{depth}" if depth else name


def run_bench(model: Model, prompts: list[int], gens: list[int], pg: list[tuple[int, int]], reps: int,
              progress: Callable[[str], None] | None = None, depths: list[int] | None = None,
              ) -> tuple[list[BenchRow], float]:
    bench = Bench(model)
    bandwidth = model.backend.memory_bandwidth()
    weights = sum(t.n_bytes for t in model.gguf.tensors.values())
    params = sum(t.n_elements for t in model.gguf.tensors.values())
    tests = [(p, 0) for p in prompts if p] + [(0, n) for n in gens if n] + list(pg)
    rows = []
    for depth in depths or [0]:
        for n_prompt, n_gen in tests:
            name = test_name(n_prompt, n_gen, depth)
            if progress:
                progress(name)
            row = BenchRow(model.path.name, weights, params, model.backend.name, name, n_prompt, n_gen,
                           bandwidth=bandwidth, n_depth=depth)
            row.samples_ts = bench.run(n_prompt, n_gen, reps, depth)
            if n_gen and not n_prompt:  # mean cached positions over the steps
                row.bytes_per_token = decode_bytes_per_token(model, depth + (n_gen + 1) / 2)
            rows.append(row)
    return rows, bandwidth


# -- output -------------------------------------------------------------------------------------------------


def render(rows: list[BenchRow], fmt: str, device: str, bandwidth: float) -> str:
    if fmt == "json":
        return json.dumps([r.as_dict(device) for r in rows], indent=2)
    if fmt == "csv":
        return csv_text([r.as_dict(device) for r in rows])
    head = ["model", "size", "params", "backend", "test", "t/s", "GB/s", "% BW"]
    lines = [
        f"device: {device}; measured copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)",
        "",
        "| " + " | ".join(head) + " |",
        "| " + " | ".join(["---"] * 3 + ["---"] * 2 + ["---:"] * 3) + " |",
    ]
    for r in rows:
        gbs, frac = r.gb_per_s, r.bw_fraction
        cells = [r.model, human_bytes(r.size), human_count(r.params), r.backend, r.test,
                 f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}",
                 "" if gbs is None else f"{gbs:.1f}", "" if frac is None else f"{frac * 100:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_list(text: str, what: str) -> list[int]:
    from ..errors import UsageError

    try:
        values = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise UsageError(f"{what} takes comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise UsageError(f"{what} values must be >= 0, got {text!r}")
    return values


def parse_pg(text: str) -> tuple[int, int]:
    from ..errors import UsageError

    values = parse_list(text, "--pg")
    if len(values) != 2 or not all(values):
        raise UsageError(f"--pg takes two positive integers P,N, got {text!r}")
    return values[0], values[1]


# -- --profile: one prefill and one decode step by kernel family ----------------------------------------------


@dataclass
class ProfileRow:
    phase: str  # "prefill N" or "decode @pos"
    family: str
    ms: float
    share: float
    launches: int


def attention_kv_bytes(cfg: ModelConfig, pos: int, cache_types: tuple[str, str] = DEFAULT_CACHE) -> list[int]:
    """Bytes of K and V each layer's decode attention reads at position `pos`: the keys 0..pos, or the last
    `window` of them on a sliding-window layer."""
    return kv_read_bytes(cfg, pos + 1, cache_types)


def kv_read_bytes(cfg: ModelConfig, keys: float, cache_types: tuple[str, str] = DEFAULT_CACHE) -> list:
    """Bytes of K and V (of `cache_types`: fp16, or q8_0's 34 bytes per 32 values) each layer reads over
    `keys` cached positions: at most the last `window` of them on a sliding-window layer (rows of the layer's own
    KV heads and head size; a shared-KV layer reads the cache it shares); a delta-net layer's recurrent state
    (float32, whatever the context) instead."""
    n_recurrent = sum(plan.recurrent for plan in cfg.layers)
    state = cfg.recurrent_state_bytes() / n_recurrent if n_recurrent else 0
    return [state if plan.recurrent else min(keys, plan.window or keys) *
            sum(cache_row_bytes(t, cfg.layer_kv_heads(i) * cfg.layer_head_dim(i)) for t in cache_types)
            for i, plan in enumerate(cfg.layers)]


def decode_attention_summary(cfg: ModelConfig, pos: int, rows: list[ProfileRow], bandwidth: float,
                             cache_types: tuple[str, str] = DEFAULT_CACHE) -> dict[str, Any]:
    """The decode step's attention families (the fused kernel, or the fallback's RoPE/K-V store and attention)
    against the K/V bytes they read at `pos`: per layer time, GB/s and the share of the copy bandwidth
    (issue 24's measure of the decode attention)."""
    ms = sum(r.ms for r in rows if r.phase.startswith("decode") and "attention" in r.family.lower())
    nbytes = sum(attention_kv_bytes(cfg, pos, cache_types))
    gbs = nbytes / (ms / 1e3) / 1e9 if ms > 0 else 0.0
    return {"position": pos, "layers": cfg.n_layer, "ms": ms, "us_per_layer": ms * 1e3 / cfg.n_layer,
            "kv_bytes": nbytes, "gb_per_s": gbs, "bandwidth_share": gbs * 1e9 / bandwidth if bandwidth else None}


def run_profile(model: Model, n_prompt: int) -> tuple[list[ProfileRow], dict[str, float], dict[str, Any]]:
    """Break one prefill of n_prompt random tokens (block.run, op by op) and one greedy decode step at
    position n_prompt (the fused step, launched without its graph) down by kernel family, timed with CUDA
    events while the work runs back to back behind a spin kernel. -> rows; per phase the GPU span (sections
    plus gaps) and, for decode, the graph-replayed step time for comparison; and the decode attention's
    summary (decode_attention_summary)."""
    from ..errors import UsageError

    model.seq.clear()  # random ids go into the KV cache (as Bench's)
    be, cfg = model.backend, model.cfg
    if not hasattr(be, "profile"):
        raise UsageError(f"--profile needs the CUDA backend (this run uses {be.name}): pass --backend cuda on a machine with a GPU")
    if n_prompt + 1 > model.ctx:
        raise UsageError(f"--profile with -p {n_prompt} needs a context of {n_prompt + 1}, have {model.ctx} (--ctx)")
    from ..sampling.sampling import SamplingParams

    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=n_prompt)
    greedy = SamplingParams(temperature=0.0)

    def run_prefill() -> int:
        logits = prefill_prompt(be, cfg, ids, 0)
        return be.sample(logits, greedy, rng, [])

    token = run_prefill()  # warm up: compilation, cuBLAS handles, memory pool
    be.snapshots(0, n_prompt)  # (recurrent layers: the state at the prompt's end kept, for decoding from it again)
    be.decode_greedy(token, n_prompt)
    rows: list[ProfileRow] = []
    spans: dict[str, float] = {}
    phases = [(f"prefill {n_prompt}", lambda: be.profile(run_prefill, spin_ms=100.0)),
              (f"decode @{n_prompt}", lambda: be.profile_decode(token, n_prompt))]
    for phase, fn in phases:
        fams, span = fn()
        total = sum(ms for _, ms, _ in fams) or 1.0
        rows += [ProfileRow(phase, f, ms, ms / total, n) for f, ms, n in fams]
        spans[phase] = span
    # The step replayed from its CUDA graph as tg runs it: the mean of up to 20 greedy tokens from position
    # n_prompt on (each next step queued before the id is read), on the GPU timeline.
    k = max(1, min(20, model.ctx - n_prompt - 1))

    def tokens() -> None:
        be.resume(0, n_prompt)  # (recurrent layers decode from the state stored at the prompt's end; KV rows need nothing)
        tok = token
        for pos in range(n_prompt, n_prompt + k):
            tok = be.decode_greedy(tok, pos)

    tokens()
    spans["decode step, graph replay"] = be.elapsed(tokens) / k * 1e3
    return rows, spans, decode_attention_summary(cfg, n_prompt, rows, be.memory_bandwidth(), model.cache_types)


def render_profile(rows: list[ProfileRow], spans: dict[str, float], fmt: str, device: str,
                   attention: dict[str, Any] | None = None) -> str:
    if fmt == "json":
        out = {"device": device, "rows": [r.__dict__ for r in rows],
               "span_ms": {k: round(v, 4) for k, v in spans.items()}}
        if attention is not None:
            out["decode_attention"] = attention
        return json.dumps(out, indent=2)
    lines = [f"device: {device}; GPU time per kernel family (CUDA events, kernels back to back, no graph)", "",
             "| phase | family | ms | share | launches |", "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.phase} | {r.family} | {r.ms:.3f} | {r.share * 100:.1f}% | {r.launches} |")
    lines.append("")
    for k, v in spans.items():
        lines.append(f"{k}: {v:.3f} ms" + (" on the GPU timeline (families + gaps)" if "replay" not in k else ""))
    if attention is not None and attention["ms"] > 0:
        a = attention
        share = f" = {a['bandwidth_share'] * 100:.1f}% of the copy bandwidth" if a["bandwidth_share"] else ""
        lines.append(f"decode attention @{a['position']}: {a['us_per_layer']:.2f} us a layer for "
                     f"{a['kv_bytes'] / a['layers'] / 1e6:.2f} MB of K and V on average, {a['gb_per_s']:.0f} GB/s"
                     f"{share} (kernels back to back)")
    return "\n".join(lines)


# -- --kernels: micro-benchmarks ---------------------------------------------------------------------------------


KERNEL_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (rows N, columns K) of the quantized matvecs
KERNEL_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


def run_kernels(backend: Any, attention_shape: tuple[int, int, int, int] = (16, 32, 512, 64)) -> tuple[list[dict], float]:
    """Micro-benchmarks on the CUDA backend: each one-token matvec (mv1) at KERNEL_SHAPES against the copy
    bandwidth, and causal attention prefill at (batch, heads, tokens, head dim) against
    torch.nn.functional.scaled_dot_product_attention when torch imports. -> (rows, copy bandwidth)."""
    from ..errors import UsageError

    if not hasattr(backend, "profile"):
        raise UsageError(f"--kernels needs the CUDA backend (this run uses {backend.name}): pass --backend cuda on a machine with a GPU")
    from ..backends.cuda.kernel_bench import kernel_benchmarks

    return kernel_benchmarks(backend, KERNEL_SHAPES, KERNEL_TYPES, attention_shape)


def render_kernels(rows: list[dict], bandwidth: float, fmt: str, device: str) -> str:
    if fmt == "json":
        return json.dumps({"device": device, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "rows": rows}, indent=2)
    lines = [f"device: {device}; measured copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)", "",
             "| kernel | shape | us | GB/s | % BW | TFLOP/s | vs |", "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        gbs = r.get("gb_per_s")
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['us']:.1f} | {'' if gbs is None else f'{gbs:.0f}'} | "
                     f"{'' if gbs is None else f'{gbs * 1e9 / bandwidth * 100:.1f}%'} | {r['tflops']:.2f} | {r.get('vs', '')} |")
    return "\n".join(lines)


# -- speculative decoding: the same reply with and without drafts -------------------------------------------


@dataclass
class SpecRow:
    model: str
    backend: str
    test: str  # "plain", or the draft sources
    samples_ts: list[float] = field(default_factory=list)  # decode tokens/s, one per repetition
    tokens: int = 0  # ids generated (the last repetition)
    drafted: int = 0
    accepted: int = 0
    per_pass: float = 0.0  # ids a decode pass gave, on average (the first id is the prompt's)
    same: bool | None = None  # the reply equals the plain one (None: this is the plain one)

    def as_dict(self, device: str) -> dict[str, Any]:
        return {"model": self.model, "backend": self.backend, "device": device, "test": self.test,
                "tokens": self.tokens, "avg_ts": round(statistics.fmean(self.samples_ts), 3),
                "stddev_ts": round(statistics.stdev(self.samples_ts), 3) if len(self.samples_ts) > 1 else 0.0,
                "samples_ts": [round(x, 3) for x in self.samples_ts], "drafted": self.drafted,
                "accepted": self.accepted, "tokens_per_pass": round(self.per_pass, 3),
                "same_as_plain": self.same}


def echo_prompt() -> str:
    """bench's default task for speculative decoding: a short source file to write out again with one change."""
    from pathlib import Path

    from .. import units

    return (f"Here is a Python file:\n\n```python\n{Path(units.__file__).read_text()}```\n\nRewrite the whole file "
            "with the function human_count renamed to format_count. Reply with the code only.")


def run_spec_bench(model: Model, prompt: str, n_gen: int, reps: int, settings: SpecSettings,
                   progress: Callable[[str], None] | None = None) -> list[SpecRow]:
    """A greedy reply of at most n_gen tokens to `prompt` (through the chat template where the model has one),
    plain and with `settings`, each run once to warm up and `reps` times timed."""
    from ..errors import ContextOverflowError
    from ..tokenizer.tokenizer import TooManyTokens

    try:
        ids = model.prompt_ids(prompt, limit=model.ctx - n_gen)
    except TooManyTokens as exc:
        raise ContextOverflowError(f"the prompt and a reply of -n {n_gen} tokens need more than the context of "
                                   f"{model.ctx} (the prompt alone: at least {exc.at_least:,} tokens): raise --ctx, "
                                   "or give a shorter prompt (-f)") from None
    rows, plain = [], None
    for name, spec in (("plain", SpecSettings()), ("+".join(settings.sources), settings)):
        if progress:
            progress(f"running {name}")
        row = SpecRow(model.path.name, model.backend.name, name)
        for i in range(reps + 1):
            c = model.complete(ids, max_tokens=n_gen, temperature=0.0, speculative=spec)
            if i:  # (the first: warm-up)
                t = c.timings
                row.samples_ts.append(t.eval_tokens_per_s)
                row.tokens, row.drafted, row.accepted = len(c.tokens), t.drafted, t.accepted
                row.per_pass = t.eval_tokens / t.passes if t.passes else 0.0
        if plain is None:
            plain = c.tokens
        else:
            row.same = c.tokens == plain
        rows.append(row)
    return rows


def run_verify_cost(model: Model, drafts: list[int], reps: int, depth: int = 0,
                    progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """What a verification pass costs against a decode step, both greedy after a `depth`-token context of random
    ids: a decode step's ms (16 steps as tg runs them, the next queued ahead), and for each k of `drafts` the ms of
    one pass over 1 + k tokens (Backend.verify_greedy: each row's argmax) and its ratio to the step. Mean of `reps`
    after two warm-ups."""
    from ..errors import UsageError

    if not drafts or any(not 1 <= k <= 64 for k in drafts):
        raise UsageError(f"--verify-cost takes draft counts from 1 to 64, got {drafts}")
    if depth + 17 > model.ctx or depth + max(drafts) + 1 > model.ctx:
        raise UsageError(f"--verify-cost after {depth} tokens needs a context of {depth + max(17, max(drafts) + 1)}, "
                         f"have {model.ctx} (--ctx)")
    bench, be = Bench(model), model.backend

    def timed(fn: Callable[[], Any]) -> float:
        for _ in range(2):
            fn()
        return statistics.fmean(bench._timed(fn) for _ in range(reps)) * 1e3

    if depth:
        bench.prefill(depth)
    if progress:
        progress("running the decode step")
    step_ms = timed(lambda: bench.generate(16, start=depth)) / 16
    rows = []
    for k in drafts:
        if progress:
            progress(f"running a verification of 1 + {k}")
        ids = np.asarray(bench._ids(k + 1), dtype=np.int64)
        ms = timed(lambda: be.verify_greedy(ids, depth))
        rows.append({"model": model.path.name, "backend": be.name, "depth": depth, "drafts": k, "tokens": k + 1,
                     "verify_ms": round(ms, 4), "decode_step_ms": round(step_ms, 4), "ratio": round(ms / step_ms, 3)})
    return rows


def render_verify_cost(rows: list[dict[str, Any]], fmt: str, device: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        return csv_text(rows)
    lines = [f"device: {device}; a verification pass of 1 + k tokens against one decode step (greedy)", "",
             "| model | backend | depth | k | tokens | pass ms | step ms | pass / step |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['backend']} | {r['depth']} | {r['drafts']} | {r['tokens']} | "
                     f"{r['verify_ms']:.3f} | {r['decode_step_ms']:.3f} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def render_spec(rows: list[SpecRow], fmt: str, device: str) -> str:
    if fmt == "json":
        return json.dumps([r.as_dict(device) for r in rows], indent=2)
    dicts = [r.as_dict(device) for r in rows]
    if fmt == "csv":
        return csv_text(dicts)
    lines = [f"device: {device}; a greedy reply, with and without speculative decoding", "",
             "| model | backend | test | tokens | t/s | drafted | accepted | tokens/pass | same |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r, d in zip(rows, dicts):
        rate = f" ({r.accepted / r.drafted * 100:.0f}%)" if r.drafted else ""
        same = "" if r.same is None else "yes" if r.same else "NO"
        lines.append(f"| {r.model} | {r.backend} | {r.test} | {r.tokens} | {d['avg_ts']:.2f} ± {d['stddev_ts']:.2f} | "
                     f"{r.drafted} | {r.accepted}{rate} | {d['tokens_per_pass']:.2f} | {same} |")
    return "\n".join(lines)
