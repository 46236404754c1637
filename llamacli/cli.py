"""The command line: thin typer commands over the library. Rich lives here, not in the model code.

stdout carries only what the user asked for (text, JSON); notices, progress and timings go to stderr.
Every LlamacliError becomes one line `error: ...` on stderr and its exit code (2 bad input, 1 runtime,
130 Ctrl-C); `--debug` adds the traceback.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import traceback
from typing import Annotated, Optional

import typer
from rich.console import Console

from . import __version__
from .cli_parser import HabitCommand, HabitGroup
from .errors import Interrupted, LlamacliError, OutputError, UsageError
from .textio import json_text, printable, read_text, standard_streams

app = typer.Typer(
    name="llamacli",
    help="Run GGUF language models on NVIDIA GPUs (CuPy + our CUDA kernels), with a NumPy reference backend.",
    epilog="Also: list and ls (= models), show (= inspect). llama.cpp's -c, -n, -s, -f and --temp work as there; "
    "-ngl and -fa are accepted.",
    cls=HabitGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """rich's own answer to a reader that left (`| head`) is exit 1. Raise instead, so that it ends as every
        broken pipe does (main: exit 0 quietly), and drop the unwritten text as rich does after a write, so
        that a later print in the same process (main() called again) does not repeat it."""
        del self._buffer[:]
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


err = _Console(stderr=True, highlight=False, soft_wrap=True)
# Tables on stdout keep their full width when piped (rich would cut them at 80 columns).
out = _Console(highlight=False, soft_wrap=True, width=None if sys.stdout is None or sys.stdout.isatty() else 240)

_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        print(f"llamacli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and log kernel launches.")] = False,
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
) -> None:
    """llamacli: GGUF inference from readable Python."""
    _state["debug"] = debug
    if debug:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s: %(message)s")


def command(name: str | None = None, **kw):
    """`app.command`, parsed with llama.cpp's option habits (llamacli/cli_parser.py)."""
    return app.command(name, cls=HabitCommand, **kw)


def dim(message: str) -> None:
    """A notice on stderr, dimmed. The text is not markup: brackets such as [cuda12] print as they are."""
    err.print(message, style="dim", markup=False)


def fail(message: str) -> None:
    """Raise a usage error from a command (exit 2)."""
    raise UsageError(message)


# -- inspect -----------------------------------------------------------------------------------------------


@command()
def inspect(
    model: Annotated[str, typer.Argument(help="A GGUF file, a registry name or hf://owner/repo/file.gguf.")],
    tensors: Annotated[bool, typer.Option("--tensors", help="Add the tensor table.")] = False,
    metadata: Annotated[bool, typer.Option("--metadata", help="Add every metadata key (long arrays abbreviated).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    ctx: Annotated[Optional[int], typer.Option("--ctx", "-c", "--ctx-size", help="Also size the KV cache at this context length.")] = None,
) -> None:
    """Show what is inside a GGUF file: architecture, sizes, quantization mix, tokenizer, memory needs."""
    from .inspect import inspect_model, render_summary

    if ctx is not None and ctx <= 0:
        fail(f"--ctx must be positive, got {ctx}")
    from .registry import resolve_model

    info = inspect_model(str(resolve_model(model)), ctx=ctx, with_tensors=tensors, with_metadata=metadata)
    if as_json:
        print(json_text(info))
    else:
        render_summary(out, info)


# -- generate ----------------------------------------------------------------------------------------------

ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="A GGUF path, a registry name (llamacli models) or hf://owner/repo/file.gguf. Default: the registry's default model."),
]
BackendOpt = Annotated[str, typer.Option("--backend", help="auto (CUDA when available), cuda or numpy.")]
ModelArg = Annotated[Optional[str], typer.Argument(metavar="MODEL", help="The model, as -m takes it.", show_default=False)]
CtxOpt = Annotated[Optional[int], typer.Option("--ctx", "-c", "--ctx-size", help="Context size (default: the model's, at most 4096).")]
# llama.cpp's options that have nothing to choose here: accepted, with a notice saying why.
GpuLayersOpt = Annotated[Optional[str], typer.Option(
    "--n-gpu-layers", "-ngl", "--gpu-layers", metavar="N",
    help="As llama.cpp's; ignored: with CUDA every layer runs on the GPU, with --backend numpy on the CPU.")]
FlashAttnOpt = Annotated[bool, typer.Option(
    "--flash-attn", "-fa", help="As llama.cpp's (on/off/auto may follow); a no-op: attention is always fused.")]

# Sampling options, shared by generate and chat (each command gives its defaults in its signature).
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", "--n-predict", help="Most tokens to generate.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "--temp", help="0 = greedy.")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling, in (0, 1] (1 = off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Drop tokens below min-p x the best one's probability.")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", help="Penalize repeated tokens (1 = off).")]
RepeatLastNOpt = Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalties look back over (-1 = all).")]
PresencePenaltyOpt = Annotated[float, typer.Option("--presence-penalty")]
FrequencyPenaltyOpt = Annotated[float, typer.Option("--frequency-penalty")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", "-s", help="Seed for reproducible sampling.")]
GreedyOpt = Annotated[bool, typer.Option("--greedy", help="Always take the most likely token (temperature 0).")]


def load_model(model: str | None, backend: str, ctx: int | None, quiet: bool, gpu_layers: str | None = None,
               flash_attn: bool = False, user_ctx: bool = True):
    """Resolve, open and upload a model, with a progress bar on stderr. `gpu_layers` and `flash_attn` are
    llama.cpp's -ngl and -fa: checked, then explained in a notice once the backend is known. A context the
    user chose (`user_ctx`) past the trained length is warned about once the model is loaded."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .generate import Model, context_warning
    from .registry import resolve_model

    check_gpu_layers(gpu_layers)
    path = resolve_model(model)
    notice = None if quiet else dim
    with Progress(
        TextColumn("loading {task.description}", markup=False), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=err, transient=True, disable=quiet or not err.is_terminal,
    ) as bar:
        task = bar.add_task(printable(path.name), total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total)

        m = Model(path, backend=backend, ctx=ctx, progress=progress, notice=notice)
    if not quiet:
        for line in llama_cpp_notices(m.backend.name, gpu_layers, flash_attn):
            dim(line)
        warning = context_warning(m.cfg, m.ctx) if user_ctx else None
        if warning:
            err.print(warning, style="yellow", markup=False)
    return m


def check_gpu_layers(value: str | None) -> None:
    """-ngl takes what llama.cpp's does: a layer count, `auto` or `all`."""
    if value is None or value.lower() in ("auto", "all"):
        return
    try:
        int(value)
    except ValueError:
        fail(f"--n-gpu-layers takes a number of layers, 'auto' or 'all', got {value!r}")


def llama_cpp_notices(backend: str, gpu_layers: str | None, flash_attn: bool) -> list[str]:
    """Why llama.cpp's -ngl and -fa change nothing here, said once so that their users are not left guessing."""
    lines = []
    if gpu_layers is not None:
        where = ("the CUDA backend runs every layer on the GPU (--backend numpy runs on the CPU)" if backend == "cuda"
                 else f"the {backend} backend runs on the CPU")
        lines.append(f"-ngl {gpu_layers} is ignored: {where}")
    if flash_attn:
        lines.append("-fa is a no-op: the CUDA backend's attention is always fused (flash-attention style)")
    return lines


def pick_model(positional: str | None, option: str | None) -> str | None:
    """The model named positionally (`generate model.gguf`) or with -m, never both."""
    if positional is not None and option is not None:
        fail(f"the model is given twice ({positional!r} and -m {option!r}): give it once")
    return positional if positional is not None else option


def sampling_params(max_tokens: int, ctx: int | None, greedy: bool, temperature: float, top_k: int, top_p: float,
                    min_p: float, repeat_penalty: float, repeat_last_n: int, presence_penalty: float,
                    frequency_penalty: float, seed: int | None):
    """The options generate and chat share, checked: one-line errors for values that cannot work."""
    from .sampling import SamplingParams

    if max_tokens < 0:
        fail(f"--max-tokens must be >= 0, got {max_tokens}")
    if ctx is not None and ctx <= 0:
        fail(f"--ctx must be positive, got {ctx}")
    return SamplingParams(
        temperature=0.0 if greedy else temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed,
    ).validate()


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if (prompt is None) == (prompt_file is None):
        fail("give the prompt with exactly one of --prompt or --prompt-file")
    if prompt_file is None:
        return prompt  # type: ignore[return-value]
    return read_text(prompt_file, "prompt file")


ThinkOpt = Annotated[
    Optional[bool],
    typer.Option("--think/--no-think", help="Thinking models (Qwen3, SmolLM3, R1 distills): turn the template's "
                 "think block on or off (enable_thinking). The reasoning goes to stderr, the answer to stdout."),
]


@command()
def generate(
    model_arg: ModelArg = None,
    model: ModelOpt = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt text.")] = None,
    prompt_file: Annotated[Optional[str], typer.Option("--prompt-file", "-f", "--file", help="Read the prompt from a file ('-' for stdin).")] = None,
    max_tokens: MaxTokensOpt = 256,
    temperature: TemperatureOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    repeat_last_n: RepeatLastNOpt = 64,
    presence_penalty: PresencePenaltyOpt = 0.0,
    frequency_penalty: FrequencyPenaltyOpt = 0.0,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message for the chat template.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this text appears (repeatable).")] = None,
    ctx: CtxOpt = None,
    truncate: Annotated[bool, typer.Option("--truncate", help="Keep the tail of a prompt longer than the context.")] = False,
    backend: BackendOpt = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end instead of streaming.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the template used and the prompt tokens.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No timings or notices on stderr.")] = False,
    gpu_layers: GpuLayersOpt = None,
    flash_attn: FlashAttnOpt = False,
    think: ThinkOpt = None,
) -> None:
    """Generate a continuation of a prompt. Text streams to stdout; timings go to stderr.
    The model may come first (`llamacli generate model.gguf -p hi`) or with -m."""
    model = pick_model(model_arg, model)
    text = read_prompt(prompt, prompt_file)
    params = sampling_params(max_tokens, ctx, greedy, temperature, top_k, top_p, min_p, repeat_penalty,
                             repeat_last_n, presence_penalty, frequency_penalty, seed)
    m = load_model(model, backend, ctx, quiet, gpu_layers, flash_attn)
    complete(m, text, params, max_tokens, stop=stop or (), raw=raw, system=system, truncate=truncate,
             as_json=as_json, verbose=verbose, quiet=quiet, think=think)


def complete(m, text: str, params, max_tokens: int, *, stop=(), raw: bool = False, system: str | None = None,
             truncate: bool = False, as_json: bool = False, verbose: bool = False, quiet: bool = False,
             think: bool | None = None) -> None:
    """One completion of `text` on a loaded model, streamed to stdout (generate, and run with a prompt); a
    thinking model's reasoning streams to stderr."""
    from .generate import Completion
    from .reasoning import ReplyRouter

    if verbose:
        dim(f"backend {m.backend.name}, context {m.ctx}")
        if not raw:
            dim(f"chat template: {m.chat_template.source}")
    done = Completion()

    def answer(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    router = ReplyRouter(done, answer, sys.stderr)
    try:
        pieces = m.run(text, completion=done, max_tokens=max_tokens, stop=stop, params=params, raw=raw,
                       system=system, truncate=truncate, think=think)
        for piece in pieces:
            if not as_json:
                router.write(piece)
        if not as_json:
            router.end()
    except KeyboardInterrupt:
        done.finish_reason = done.finish_reason or "interrupted"  # Ctrl-C may land here, outside the engine
        _finish(done, as_json, quiet, verbose)
        raise Interrupted("interrupted") from None
    _finish(done, as_json, quiet, verbose)


def _finish(done, as_json: bool, quiet: bool, verbose: bool) -> None:
    if as_json:
        print(json_text(done.as_dict()))
    else:
        if done.text and not done.text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
    if verbose:
        dim(f"prompt: {len(done.prompt_tokens)} tokens; finish reason: {done.finish_reason}")
    if not quiet:
        for line in done.timings.report():
            dim(line)


# -- models, pull, rm --------------------------------------------------------------------------------------


@command("models")
def models_(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array instead.")] = False,
) -> None:
    """List the model registry (models.toml plus yours): name, size, and whether it is downloaded."""
    from rich.table import Table
    from rich.text import Text

    from .registry import cache_home, human_size, list_models

    rows = list_models()
    if as_json:
        print(json_text(rows))
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "PARAMS", "SIZE", "CACHED", "DESCRIPTION"):
        table.add_column(column, no_wrap=column != "DESCRIPTION")
    for r in rows:
        name = r["name"] + (" (default)" if r["default"] else "")
        gated = " [gated: needs HF_TOKEN]" if r["gated"] else ""
        cells = (name, r["parameters"], human_size(r["size"]), "yes" if r["cached"] else "-", r["description"] + gated)
        table.add_row(*(Text(printable(c)) for c in cells))  # Text: a "[" in a description is not markup
    out.print(table, markup=False)
    err.print(f"cache: {cache_home()}", markup=False)


@command()
def pull(
    model: Annotated[str, typer.Argument(help="A registry name (see `llamacli models`) or hf://owner/repo/file.gguf.")],
    force: Annotated[bool, typer.Option("--force", help="Download again even if it is cached.")] = False,
) -> None:
    """Download a model into the cache (progress on stderr) and print its path."""
    from .registry import pull_model

    print(pull_model(model, force=force, progress=True))


@command("rm")
def rm(
    model: Annotated[str, typer.Argument(help="A registry name or hf://owner/repo/file.gguf.")],
) -> None:
    """Delete a downloaded model from the cache."""
    from .registry import remove_model

    for path in remove_model(model):
        err.print(f"removed {path}", markup=False)


# -- tokenize ----------------------------------------------------------------------------------------------


@command()
def tokenize(
    model: Annotated[
        str, typer.Option("--model", "-m", help="A GGUF path (a vocabulary-only one will do) or a registry name.")
    ],
    text: Annotated[Optional[str], typer.Option("--text", "-t", help="The text to tokenize.")] = None,
    file: Annotated[Optional[str], typer.Option("--file", "-f", help="Read the text from a file ('-': stdin).")] = None,
    special: Annotated[
        bool,
        typer.Option("--special", help="Turn special-token strings (<|im_start|>, <s>) into ids (--chat always does)."),
    ] = False,
    no_bos: Annotated[bool, typer.Option("--no-bos", help="Do not add BOS, whatever the file says.")] = False,
    chat: Annotated[
        bool, typer.Option("--chat", help="Tokenize the chat prompt for one user message with this text.")
    ] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="With --chat: a system message.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"ids": [...], "pieces": [...]}.')] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="One 'id piece' line per token; say which chat template.")
    ] = False,
) -> None:
    """Show the token ids of a text (or of a chat prompt with --chat), as the model's tokenizer makes them."""
    from .chat import ChatTemplate, chat_messages, encode_prompt
    from .gguf_file import open_gguf
    from .registry import resolve_model
    from .tokenizer import Tokenizer

    if (text is None) == (file is None):
        fail("give the text with exactly one of --text or --file")
    if system is not None and not chat:
        fail("--system needs --chat")
    if file is not None:
        text = read_text(file, "input file")  # exactly as written (\r\n kept), so the ids are the file's
    assert text is not None
    md = open_gguf(resolve_model(model)).metadata
    tok = Tokenizer.from_metadata(md)
    if chat:
        template = ChatTemplate.from_metadata(md)
        if verbose:
            why = "" if template.source == "gguf" else " (the file has no tokenizer.chat_template)"
            err.print(f"chat template: {template.source}{why}", markup=False)
        prompt = template.render(chat_messages(text, system), add_generation_prompt=True)
        if verbose:
            err.print(f"prompt: {json_text(prompt)}", markup=False)
        ids = encode_prompt(tok, prompt, add_bos=False if no_bos else None)
    else:
        ids = tok.encode(text, add_bos=False if no_bos else None, special=special)
    pieces = [tok.piece(i) for i in ids]
    if as_json:
        print(json_text({"ids": ids, "pieces": pieces}))
    elif verbose:
        for i, p in zip(ids, pieces):
            print(f"{i:>8} {json_text(p)}")
    else:
        print(" ".join(map(str, ids)))


# -- bench -------------------------------------------------------------------------------------------------


@command()
def bench(
    model: ModelOpt = None,
    n_prompt: Annotated[str, typer.Option("--n-prompt", "-p", help="Prompt sizes for prefill tests, comma-separated.")] = "512",
    n_gen: Annotated[str, typer.Option("--n-gen", "-n", help="Token counts for decode tests, comma-separated.")] = "128",
    pg: Annotated[Optional[list[str]], typer.Option("--pg", help="A combined test P,N: prefill P then decode N (repeatable).")] = None,
    reps: Annotated[int, typer.Option("--repetitions", "-r", help="Timed repetitions after one warm-up.")] = 5,
    ctx: CtxOpt = None,
    backend: BackendOpt = "auto",
    output: Annotated[str, typer.Option("--output", "-o", help="md, json or csv.")] = "md",
    profile: Annotated[bool, typer.Option("--profile", help="Instead: one prefill (the first -p size) and one decode step by kernel family (CUDA).")] = False,
    kernels: Annotated[bool, typer.Option("--kernels", help="Instead: kernel micro-benchmarks (matvecs, attention prefill vs torch SDPA); no model needed (CUDA).")] = False,
    gpu_layers: GpuLayersOpt = None,
    flash_attn: FlashAttnOpt = False,
) -> None:
    """Measure prefill (ppN) and decode (tgN) speed, with GB/s and the share of the memory bandwidth.
    --profile breaks one prefill and one decode step down by kernel family; --kernels times single kernels."""
    from .bench import parse_list, parse_pg, render, render_kernels, render_profile, run_bench, run_kernels, run_profile

    if output not in ("md", "json", "csv"):
        fail(f"--output must be md, json or csv, got {output!r}")
    if reps < 1:
        fail(f"--repetitions must be >= 1, got {reps}")
    if profile and kernels:
        fail("--profile and --kernels are separate runs: pick one")
    if (profile or kernels) and output == "csv":
        fail("--profile and --kernels print md or json")
    if kernels:
        from .backends import select_backend

        be = select_backend(backend, notice=dim)
        krows, bandwidth = run_kernels(be)
        print(render_kernels(krows, bandwidth, output, be.device_name()))
        return
    prompts, gens = parse_list(n_prompt, "-p"), parse_list(n_gen, "-n")
    pairs = [parse_pg(x) for x in pg or []]
    need = max([p for p in prompts] + [n for n in gens] + [p + n for p, n in pairs] + [1])
    m = load_model(model, backend, ctx or max(need + 1, 512), False, gpu_layers, flash_attn,
                   user_ctx=ctx is not None)  # bench's own context is not the user's choice
    if profile:
        prows, spans = run_profile(m, next((p for p in prompts if p), 512))
        print(render_profile(prows, spans, output, m.backend.device_name()))
        return
    rows, bandwidth = run_bench(m, prompts, gens, pairs, reps, progress=lambda t: dim(f"running {t}"))
    print(render(rows, output, m.backend.device_name(), bandwidth))


# -- chat --------------------------------------------------------------------------------------------------


@command()
def chat(
    model_arg: ModelArg = None,
    model: ModelOpt = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt (/system changes it).")] = None,
    max_tokens: MaxTokensOpt = 512,
    temperature: TemperatureOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    repeat_last_n: RepeatLastNOpt = 64,
    presence_penalty: PresencePenaltyOpt = 0.0,
    frequency_penalty: FrequencyPenaltyOpt = 0.0,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    ctx: CtxOpt = None,
    backend: BackendOpt = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per reply, one per line, instead of the text.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No per-reply speed lines or notices on stderr.")] = False,
    gpu_layers: GpuLayersOpt = None,
    flash_attn: FlashAttnOpt = False,
    think: ThinkOpt = None,
) -> None:
    """Talk with a model (named first, `llamacli chat model.gguf`, or with -m). Each turn prefills only what
    the KV cache does not hold yet; under each reply a dim line on stderr gives its tokens/s. When the context
    fills, the oldest turns are dropped (the system prompt stays) with a notice. -n limits each reply.

    On a terminal: /help lists the commands (/exit, /reset, /system, /save FILE, /load FILE, /stats). Ctrl-C
    stops a reply and keeps its partial text in the conversation; at the prompt Ctrl-C discards the line
    and a second Ctrl-C in a row exits (130); Ctrl-D and /exit exit (0).

    From a pipe or file: one user message per line; stdout carries only the replies, each followed by one
    newline (`printf 'hi\\nbye\\n' | llamacli chat`).
    """
    model = pick_model(model_arg, model)
    params = sampling_params(max_tokens, ctx, greedy, temperature, top_k, top_p, min_p, repeat_penalty,
                             repeat_last_n, presence_penalty, frequency_penalty, seed)
    m = load_model(model, backend, ctx, quiet, gpu_layers, flash_attn)
    converse(m, system, params, max_tokens, as_json=as_json, quiet=quiet, think=think)


def converse(m, system: str | None, params, max_tokens: int, *, as_json: bool = False, quiet: bool = False,
             think: bool | None = None) -> None:
    """The chat loop on a loaded model (chat, and run without a prompt)."""
    from .chat_repl import ChatLoop
    from .chat_session import ChatSession

    session = ChatSession(m, system=system, params=params, max_tokens=max_tokens, think=think)
    ChatLoop(session, err, interactive=sys.stdin.isatty(), quiet=quiet, as_json=as_json).run()


# -- run ---------------------------------------------------------------------------------------------------


@command()
def run(
    model: Annotated[str, typer.Argument(help="A GGUF path, a registry name or hf://owner/repo/file.gguf.")],
    prompt: Annotated[Optional[str], typer.Argument(help="Answer this once and exit; without it, a chat.")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    max_tokens: MaxTokensOpt = 512,
    temperature: TemperatureOpt = 0.8,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    min_p: MinPOpt = 0.05,
    repeat_penalty: RepeatPenaltyOpt = 1.0,
    repeat_last_n: RepeatLastNOpt = 64,
    presence_penalty: PresencePenaltyOpt = 0.0,
    frequency_penalty: FrequencyPenaltyOpt = 0.0,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    ctx: CtxOpt = None,
    backend: BackendOpt = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per reply instead of the text.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No timings or notices on stderr.")] = False,
    gpu_layers: GpuLayersOpt = None,
    flash_attn: FlashAttnOpt = False,
    think: ThinkOpt = None,
) -> None:
    """Run a model as ollama does: with a PROMPT, one reply through the chat template (as `generate`);
    without one, a conversation (as `chat`)."""
    params = sampling_params(max_tokens, ctx, greedy, temperature, top_k, top_p, min_p, repeat_penalty,
                             repeat_last_n, presence_penalty, frequency_penalty, seed)
    m = load_model(model, backend, ctx, quiet, gpu_layers, flash_attn)
    if prompt is None:
        converse(m, system, params, max_tokens, as_json=as_json, quiet=quiet, think=think)
    else:
        complete(m, prompt, params, max_tokens, system=system, as_json=as_json, quiet=quiet, think=think)


# -- entry point -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: run the app, turning every failure into one line and an exit code."""
    standard_streams()
    stdout = sys.stdout
    try:
        code = app(args=argv, standalone_mode=False)
        if code == 130:  # typer turns a KeyboardInterrupt outside our own handlers into a returned 130
            raise KeyboardInterrupt
        if isinstance(code, int) and code:
            sys.exit(code)
        _flush_stdout()
    except SystemExit:
        if sys.stdout is not stdout:  # click's answer to a broken pipe: it wraps stdout and exits 1
            _reader_gone()
        raise
    except BrokenPipeError:
        _reader_gone()
    except LlamacliError as exc:
        _report(exc, exc.exit_code)
    except (KeyboardInterrupt, Interrupted) as exc:
        _report(exc, 130, "interrupted")
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        _report(None, 130, "interrupted")
    except _CLICK_ERRORS as exc:
        # Bad options and arguments: click's own message, one line, exit 2.
        _report(exc, 2, exc.format_message())
    except OSError as exc:  # a write that failed (a full disk, a device error): the system's words
        _report(exc, 1, f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
    except MemoryError as exc:
        if _is_gpu_out_of_memory(exc):  # CuPy's (a MemoryError): the load-time estimate left too little room
            _report(exc, 1, f"out of GPU memory ({exc}); try a smaller --ctx, a shorter prompt or a smaller model")
        _report(exc, 1, "out of host memory")
    except Exception as exc:  # a bug of ours: still one line, unless --debug
        _report(exc, 1, f"internal error: {type(exc).__name__}: {exc}")
    sys.exit(0)


def _flush_stdout() -> None:
    """Flush what the command printed while we can still report a failure as one line (at the interpreter's
    exit it would be a traceback)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:  # a full disk, a device error
        _detach_stdout()
        raise OutputError(f"cannot write to standard output: {exc.strerror or exc}") from None


def _reader_gone() -> None:
    """`llamacli ... | head`: the reader left, which is not an error: exit 0 and print nothing."""
    _detach_stdout()
    sys.exit(0)


def _detach_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so that the interpreter's own flush at exit, which writes what
    is still buffered, succeeds instead of printing "Exception ignored ... BrokenPipeError"."""
    try:
        fd = sys.stdout.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (AttributeError, OSError, ValueError):  # a stream with no descriptor (in memory, closed): nothing to do
        pass


def _is_gpu_out_of_memory(exc: BaseException) -> bool:
    """CuPy's allocation failure (cupy.cuda.memory.OutOfMemoryError), recognised without importing CuPy."""
    return any(c.__name__ == "OutOfMemoryError" and c.__module__.split(".")[0] in ("cupy", "cupy_backends")
               for c in type(exc).__mro__)


def _click_errors() -> tuple[type[BaseException], ...]:
    """Usage errors from the option parser: click's, or the copy of click that newer typer vendors."""
    found: list[type[BaseException]] = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(__import__(module, fromlist=["ClickException"]).ClickException)
        except ImportError:
            pass
    return tuple(found)


_CLICK_ERRORS = _click_errors()


def _report(exc: BaseException | None, code: int, message: str | None = None) -> None:
    """Print the one `error:` line for `exc` (or `message`) and exit with `code`; --debug adds the traceback."""
    if _state["debug"] and exc is not None:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
    text = message or str(exc) or type(exc).__name__
    if isinstance(exc, Interrupted) and str(exc):
        text = str(exc)
    _say_error(text)
    sys.exit(code)


def _say_error(text: str) -> None:
    """`error: <text>` on one line of stderr. A message may quote a file's metadata, a template's words or a
    path, so it is escaped (printable): an escape sequence in a GGUF must not reach the terminal raw."""
    try:
        sys.stderr.write("error: " + printable(" ".join(text.split())) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr is gone as well: the exit code still tells
        pass


if __name__ == "__main__":
    main()
