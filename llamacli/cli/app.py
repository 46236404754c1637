"""The command line: thin typer commands over the library. Rich lives here, not in the model code.

stdout carries only what the user asked for (text, JSON); notices, progress and timings go to stderr.
Every LlamacliError becomes one line `error: ...` on stderr and its exit code (2 bad input, 1 runtime,
130 Ctrl-C); `--debug` adds the traceback.

Here: the typer app, the options several commands share, model loading, and main() with its error report.
The commands: generate.py (generate, chat, run) and models.py (inspect, models, pull, rm, tokenize,
bench); parser.py reads options as llama.cpp users type them.
"""

from __future__ import annotations

import errno
import os
import sys
import time
import traceback
from typing import Annotated, Any, Callable, NoReturn, Optional

import typer
from typer.core import TyperOption

from ..errors import Interrupted, LlamacliError, OutputError, UsageError
from ..textio import printable, standard_streams
from ..version import __version__
from .parser import HabitCommand, HabitGroup

app = typer.Typer(
    name="llamacli",
    help="Run GGUF language models on NVIDIA GPUs (CuPy + our CUDA kernels), or on the CPU (numba kernels), with a "
         "NumPy reference backend.",
    epilog="Also: list and ls (= models), show (= inspect). llama.cpp's -m, -p, -f, -c, -n, -s, -t, --temp, "
    "--grammar and --ignore-eos work as there; -ngl and -fa are accepted. --debug and -v work before or after "
    "the command.",
    cls=HabitGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class _Console:
    """A rich Console, made when first used: --help, --version and commands that print nothing through it
    (tokenize) do not import rich. Attributes are the Console's; `console()` is the Console itself."""

    def __init__(self, **options: Any):
        self._options = options
        self._console: Any = None

    def console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            class PipeConsole(Console):
                def on_broken_pipe(self) -> None:
                    """rich's own answer to a reader that left (`| head`) is exit 1. Raise instead, so that it
                    ends as every broken pipe does (main: exit 0 quietly), and drop the unwritten text as rich
                    does after a write, so that a later print in the same process (main() called again) does
                    not repeat it."""
                    del self._buffer[:]
                    raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

            self._console = PipeConsole(**self._options)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console(), name)


err = _Console()
out = _Console()


def reset_consoles(environ: Any = None) -> None:
    """(Re)make err and out, each on its first use, for the standard streams in force now and `environ` (a
    mapping; None: os.environ), which rich reads for colours and widths (TERM, NO_COLOR, COLUMNS). Called at
    import, and by the resident server for each command it runs (cli/resident.py). Tables on stdout keep
    their full width when piped (rich would cut them at 80 columns)."""
    extra = {} if environ is None else {"_environ": environ}
    err.__init__(stderr=True, highlight=False, soft_wrap=True, **extra)
    out.__init__(highlight=False, soft_wrap=True, width=None if sys.stdout is None or sys.stdout.isatty() else 240,
                 **extra)


reset_consoles()

# --debug, -v; -t as given, the count it came to and the environment variable it came from (None: not one)
_state: dict = {"debug": False, "verbose": False, "threads": None, "threads_set": None, "threads_from": None}

DEBUG_HELP = "Show tracebacks and log kernel launches."
VERBOSE_HELP = "Say more on stderr: the backend, the chat template, start-up stages, prompt tokens."


def _version(value: bool) -> None:
    if value:
        print(f"llamacli {__version__}")
        raise typer.Exit()


def _set_flag(name: str, on: bool) -> None:
    """--debug or -v/--verbose, before the command's name (the root's options) or after it (every command's)."""
    if not on:
        return
    _state[name] = True
    if name == "debug":
        import logging

        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s: %(message)s")


def is_verbose() -> bool:
    """Whether -v/--verbose was given, before or after the command's name."""
    return _state["verbose"]


def command_state() -> dict[str, Any]:
    """-v, --debug and what -t came to: what a command hands to the resident server with its task
    (cli/keep_alive.py)."""
    return dict(_state)


def adopt_state(state: dict[str, Any] | None) -> None:
    """The resident server takes a command's command_state() while it runs that command's task, and drops it
    after (None): --debug's log goes to the stderr in force (cli/resident.py)."""
    import logging

    _state.update(debug=False, verbose=False, threads=None, threads_set=None, threads_from=None)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    if state is not None:
        _state.update({k: state.get(k) for k in _state})
        _set_flag("debug", bool(_state["debug"]))


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help=VERBOSE_HELP)] = False,
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
) -> None:
    """llamacli: GGUF inference from readable Python."""
    # (main() may run again in one process: tests)
    _state.update(debug=False, verbose=False, threads=None, threads_set=None, threads_from=None)
    _set_flag("debug", debug)
    _set_flag("verbose", verbose)


class Command(HabitCommand):
    """A command with llama.cpp's option habits that also takes --debug and -v/--verbose after its name (the
    root takes them before it), so that they work wherever a user puts them."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        for names, key, text in ((["--verbose", "-v"], "verbose", VERBOSE_HELP), (["--debug"], "debug", DEBUG_HELP)):
            self.params.append(TyperOption(
                param_decls=names, is_flag=True, default=False, expose_value=False, help=text,
                callback=lambda ctx, param, value, key=key: _set_flag(key, bool(value))))


def command(name: str | None = None, **kw):
    """`app.command`, parsed with llama.cpp's option habits (llamacli/cli/parser.py), with --debug and -v."""
    return app.command(name, cls=Command, **kw)


def dim(message: str) -> None:
    """A notice on stderr, dimmed. The text is not markup: brackets such as [cuda12] print as they are."""
    err.print(message, style="dim", markup=False)


def fail(message: str) -> NoReturn:
    """Raise a usage error from a command (exit 2)."""
    raise UsageError(message)


# -- the options several commands share -----------------------------------------------------------------

ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="A GGUF path, a registry name (llamacli models) or hf://owner/repo/file.gguf. Default: the registry's default model."),
]
BackendOpt = Annotated[str, typer.Option(
    "--backend", help="auto (CUDA when available, else cpu), cuda, cpu (quantized weights, numba kernels) or numpy "
                      "(the reference: float32 weights, slow).")]
ModelArg = Annotated[Optional[str], typer.Argument(metavar="MODEL", help="The model, as -m takes it.", show_default=False)]
PromptArg = Annotated[Optional[str], typer.Argument(metavar="PROMPT", help="The prompt, as -p takes it.", show_default=False)]
CtxOpt = Annotated[Optional[int], typer.Option("--ctx", "-c", "--ctx-size", help="Context size (default: the model's, at most 4096).")]
CacheTypeKOpt = Annotated[str, typer.Option(
    "--cache-type-k", "-ctk", metavar="TYPE",
    help="KV cache type of K, as llama.cpp's: f16 (default) or q8_0 (8-bit: 1.9x the context in the same memory; "
         "on CUDA, K and V of one type).")]
CacheTypeVOpt = Annotated[str, typer.Option(
    "--cache-type-v", "-ctv", metavar="TYPE", help="KV cache type of V: f16 (default) or q8_0, as -ctk.")]
SwaFullOpt = Annotated[bool, typer.Option(
    "--swa-full", help="Sliding-window layers (Gemma, gpt-oss) keep every position, as llama.cpp's --swa-full: more "
                       "memory, and a chat or server can reuse any cached prefix (by default they keep a ring of "
                       "their window, and a prompt that departs from the cache far back is prefilled whole).")]
# llama.cpp's options that have nothing to choose here: accepted, with a notice saying why.
GpuLayersOpt = Annotated[Optional[str], typer.Option(
    "--n-gpu-layers", "-ngl", "--gpu-layers", metavar="N",
    help="As llama.cpp's; ignored: with CUDA every layer runs on the GPU, with --backend cpu or numpy on the CPU.")]
FlashAttnOpt = Annotated[bool, typer.Option(
    "--flash-attn", "-fa", help="As llama.cpp's (on/off/auto may follow); a no-op: CUDA attention is always fused.")]

# Several GPUs (llama.cpp's options and meanings; backends/split_plan.py): checked before anything loads.
SplitModeOpt = Annotated[Optional[str], typer.Option(
    "--split-mode", "-sm", metavar="MODE",
    help="How to split the model over several GPUs, as llama.cpp's: none (one GPU, --main-gpu), layer (each GPU a "
         "range of layers and their KV cache) or tensor (each GPU a share of every layer's heads and columns, summed "
         "by all-reduces). Default: none, or layer where --tensor-split or -dev names several devices. --backend "
         "numpy emulates the devices --tensor-split lists.")]
TensorSplitOpt = Annotated[Optional[str], typer.Option(
    "--tensor-split", "-ts", metavar="A,B,...",
    help="Each GPU's share of the model, as llama.cpp's (3,1: three quarters on the first); a 0 leaves a GPU out. "
         "Default: by free memory.")]
MainGpuOpt = Annotated[Optional[int], typer.Option(
    "--main-gpu", "-mg", metavar="INDEX",
    help="The GPU for the whole model with --split-mode none (an index into -dev's list where given); with "
         "tensor, the one that gathers the logits and samples.")]
DeviceOpt = Annotated[Optional[str], typer.Option(
    "--device", "-dev", metavar="DEV,...",
    help="The GPUs to use, in order, as llama.cpp's: CUDA0,CUDA1 (or 0,1); none: no GPU (the CPU backend).")]


def split_options(split_mode: str | None, tensor_split: str | None, main_gpu: int | None,
                  device: str | None) -> dict[str, Any] | None:
    """-sm, -ts, -mg and -dev checked (one line and exit 2 for a value that cannot work), as the load options
    carry them (JSON: --keep-alive hands them to the process that keeps the model); None for one GPU, the
    default (a model kept loaded without them keeps its key)."""
    from ..backends.split_plan import SplitOptions, parse_split_options

    options = parse_split_options(split_mode, tensor_split, main_gpu, device)
    return None if options == SplitOptions() else options.as_json()


# Sampling options, shared by generate and chat (each command gives its defaults in its signature).
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", "-n", "--n-predict",
                                           help="Most tokens to generate (-1: until the end of the text or a full "
                                                "context).")]
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
JsonSchemaOpt = Annotated[Optional[str], typer.Option(
    "--json-schema", "-j", metavar="JSON|FILE",
    help="Constrain the output to JSON valid against this JSON Schema (the schema itself, as llama.cpp's, or a "
         "file); needs the optional llguidance package (pip install 'llamacli[structured]').")]
JsonSchemaFileOpt = Annotated[Optional[str], typer.Option(
    "--json-schema-file", "-jf", metavar="FILE", help="As --json-schema, the schema read from a file ('-': stdin).")]
GrammarOpt = Annotated[Optional[str], typer.Option(
    "--grammar", metavar="GRAMMAR",
    help="Constrain the output to this grammar, its text as llama.cpp's --grammar takes it: GBNF (root ::= ...) "
         "or Lark (start: ...), as llguidance reads them. A grammar in a file: --grammar-file.")]
GrammarFileOpt = Annotated[Optional[str], typer.Option(
    "--grammar-file", metavar="FILE", help="As --grammar, the grammar read from a file ('-': stdin).")]
IgnoreEosOpt = Annotated[bool, typer.Option(
    "--ignore-eos", help="Go on past the end of the text, as llama.cpp's: end-of-text tokens are never sampled, "
                         "so the output runs to -n (or a full context).")]
StopOpt = Annotated[Optional[list[str]], typer.Option("--stop", help="Stop when this text appears (repeatable).")]
RawOpt = Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")]
PromptOpt = Annotated[Optional[str], typer.Option("--prompt", "-p", help="The prompt text.")]
PromptFileOpt = Annotated[Optional[str], typer.Option(
    "--prompt-file", "-f", "--file", help="Read the prompt from a file ('-' for stdin).")]
TruncateOpt = Annotated[bool, typer.Option("--truncate", help="Keep the tail of a prompt longer than the context.")]

# Speculative decoding (engine/speculative.py), with llama.cpp's names and defaults.
SpecTypeOpt = Annotated[Optional[str], typer.Option(
    "--spec-type", metavar="TYPE[,TYPE]",
    help="Speculative decoding, as llama.cpp's --spec-type: ngram-simple (draft from an earlier occurrence of the "
         "last --spec-ngram-size-n ids in the prompt and the output: for replies that quote their input), "
         "draft-simple (a draft model, -md; implied by -md), both comma-separated (tried in that order), or none "
         "(default). The output is the same as without; a verification pass checks up to --draft-max drafted "
         "tokens at once. llama.cpp's ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache, draft-eagle3, "
         "draft-dflash and draft-mtp (Qwen3.5's multi-token-prediction heads) are not implemented here.")]
DraftMaxOpt = Annotated[int, typer.Option(
    "--draft-max", "--draft", "--draft-n", "--spec-draft-n-max", metavar="N",
    help="Most tokens drafted for one verification pass (llama.cpp's; 0: no speculation; at most 64).")]
DraftMinOpt = Annotated[int, typer.Option(
    "--draft-min", "--draft-n-min", "--spec-draft-n-min", metavar="N",
    help="Fewest drafted tokens worth a verification pass (llama.cpp's): a shorter draft is dropped.")]
NgramSizeOpt = Annotated[int, typer.Option(
    "--spec-ngram-size-n", metavar="N",
    help="ngram-simple: how many of the last ids to look up in the ids so far (llama.cpp's; default 12).")]
ModelDraftOpt = Annotated[Optional[str], typer.Option(
    "--model-draft", "-md", metavar="MODEL",
    help="A draft model for speculative decoding (llama.cpp's -md): a smaller model with the same vocabulary, "
         "as -m takes it, on the same backend with its own cache; it drafts greedily.")]


def speculative_settings(spec_type: str | None, draft_max: int, draft_min: int, ngram_n: int,
                         model_draft: str | None):
    """The speculative-decoding options checked (one line, exit 2): engine.speculative.SpecSettings."""
    from ..engine.speculative import spec_settings

    settings = spec_settings(spec_type, draft_max, draft_min, ngram_n, draft_model=model_draft is not None)
    if model_draft is not None and "draft-simple" not in settings.sources:
        fail(f"-md/--model-draft would go unused with --spec-type {printable(spec_type or '')}: drop one of them")
    return settings


def _threads_option(value: Optional[int]) -> Optional[int]:
    """-t's callback: the count (or the default) applied while the options are read, before the command's body
    first imports numpy, so that where threadpoolctl is missing the environment variables still work."""
    from ..cpu_threads import THREAD_VARIABLES, check_threads, set_threads

    try:
        check_threads(value)
    except ValueError as exc:
        fail(f"--threads {exc}")
    value = None if value == -1 else value  # llama.cpp's -1: the default
    named = next((v for v in THREAD_VARIABLES if os.environ.get(v, "").strip()), None) if value is None else None
    _state.update(threads=value, threads_set=set_threads(value), threads_from=named)
    return value



ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", "-t", metavar="N", callback=_threads_option,
    help="CPU threads of the CPU backends (the cpu backend's kernels, the NumPy backend's BLAS), as llama.cpp's -t. "
         "Default (or -1): half the CPUs, less those other programs keep busy (a busy CPU stalls every thread), at "
         "least 1; OPENBLAS_NUM_THREADS or OMP_NUM_THREADS, where set, instead.")]
# (A command need not pass `threads` on: the callback applied it; load_model says what it came to.)
LogprobsOpt = Annotated[Optional[int], typer.Option(
    "--logprobs", metavar="N",
    help="With --json: each token's log-probability and the N (0-20) most likely alternatives, as "
         "\"logprobs\" (log-softmax of the raw logits, before penalties and sampling filters).")]
KeepAliveOpt = Annotated[Optional[str], typer.Option(
    "--keep-alive", metavar="DURATION", envvar="LLAMACLI_KEEP_ALIVE", show_envvar=True,
    help="Keep the model loaded in a background llamacli process for DURATION after this command, as ollama's "
         "keep_alive (5m, 30s, 1h30m; -1: until `llamacli stop`; 0: unload now, start none): the next command "
         "with the same model and load options answers without loading it. Off by default. `llamacli ps` lists "
         "the loaded models.")]


def keep_alive_seconds(value: str | None) -> float | None:
    """--keep-alive (or LLAMACLI_KEEP_ALIVE) in seconds, units.FOREVER for a negative one; None when not given
    (or given empty): the model loads in this process, as without the option."""
    from ..textio import brief
    from ..units import parse_duration

    if value is None or not value.strip():
        return None
    try:
        return parse_duration(value)
    except ValueError:
        fail(f"--keep-alive (or LLAMACLI_KEEP_ALIVE) takes a duration such as 5m, 30s, 1h30m, 0 or -1, got "
             f"{brief(value)}")


ThinkOpt = Annotated[
    Optional[bool],
    typer.Option("--think/--no-think", help="Thinking models (Qwen3, SmolLM3, R1 distills): turn the template's "
                 "think block on or off (enable_thinking). gpt-oss always reasons: --no-think asks for low "
                 "effort. The reasoning goes to stderr, the answer to stdout."),
]
ReasoningEffortOpt = Annotated[
    Optional[str],
    typer.Option("--reasoning-effort", metavar="LEVEL",
                 help="low, medium or high: how much gpt-oss reasons (its template's reasoning_effort; the default "
                      "is medium), as llama.cpp's --reasoning-effort and ollama's --think=LEVEL. none is --no-think, "
                      "OpenAI's minimal is low; on a thinking model without levels any level turns thinking on."),
]


def load_model(model: str | None, backend: str, ctx: int | None, quiet: bool, gpu_layers: str | None = None,
               flash_attn: bool = False, user_ctx: bool = True, cache_types: tuple[str, str] = ("f16", "f16"),
               swa_full: bool = False, split: dict[str, Any] | None = None, model_draft: str | None = None):
    """Resolve, open and upload a model, with a progress bar on stderr. `gpu_layers` and `flash_attn` are
    llama.cpp's -ngl and -fa: checked, then explained in a notice once the backend is known. A context the
    user chose (`user_ctx`) past the trained length is warned about once the model is loaded. `cache_types`:
    -ctk / -ctv (models/kv_cache.py), checked before anything is looked up; `swa_full`: --swa-full; `split`:
    split_options(). -t was applied as it was read (ThreadsOpt); what it came to is said here. `model_draft`
    (-md): a draft model for speculative decoding, loaded after it on the same backend at the same context, and
    attached to it (its vocabulary checked)."""
    from ..models.kv_cache import parse_cache_types

    check_gpu_layers(gpu_layers)
    cache_types = parse_cache_types(*cache_types)
    threads_notice(quiet)
    looked_up = time.perf_counter()
    path = find_model(model)
    draft_path = find_model(model_draft) if model_draft is not None else None
    found = time.perf_counter()
    m = open_model(path, backend, ctx, quiet, cache_types, swa_full, split=split)
    m.lookup = (looked_up, found)
    if draft_path is not None:
        try:
            draft = open_model(draft_path, m.backend.name, m.ctx, True, ("f16", "f16"), swa_full)
            try:
                m.attach_draft(draft)
            except BaseException:
                draft.close()
                raise
        except BaseException:
            m.close()
            raise
    after_load(m, quiet, gpu_layers, flash_attn, user_ctx)
    return m


def find_model(model: str | None):
    """The GGUF file that -m names: a path, else the registry's (its download on first use)."""
    from ..paths import local_model

    path = local_model(model)
    if path is None:  # a name: the registry and the cache, and the download on first use
        from ..registry.registry import resolve_model

        path = resolve_model(model)
    return path


def open_model(path, backend: str, ctx: int | None, quiet: bool, cache_types: tuple[str, str], swa_full: bool,
               said: list[str] | None = None, split: dict[str, Any] | None = None):
    """Model(path, ...) with a progress bar on a terminal's stderr and the load's notices (the backend's
    choice) there, unless `quiet`; they are also added to `said` (the resident server repeats them to each
    command it serves: cli/resident.py). `split`: split_options() (None: one device)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ..backends.split_plan import SplitOptions
    from ..engine.generate import Model

    options = SplitOptions() if split is None else SplitOptions.from_json(split)

    def notice(line: str) -> None:
        if said is not None:
            said.append(line)
        if not quiet:
            dim(line)

    if quiet or not err.is_terminal:
        # No bar at all: a disabled rich Progress still prints an empty line on stderr when it stops, on a
        # stream that is not a terminal (rich before 14.3).
        return Model(path, backend=backend, ctx=ctx, notice=notice, cache_types=cache_types, swa_full=swa_full,
                     split=options)
    with Progress(
        TextColumn("loading {task.description}", markup=False), BarColumn(),
        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=err.console(), transient=True,
    ) as bar:
        task = bar.add_task(printable(path.name), total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total)

        return Model(path, backend=backend, ctx=ctx, progress=progress, notice=notice, cache_types=cache_types,
                     swa_full=swa_full, split=options)


def after_load(m, quiet: bool, gpu_layers: str | None, flash_attn: bool, user_ctx: bool) -> None:
    """What is said once a model is loaded (unless `quiet`): why -ngl and -fa change nothing, and a context
    past the trained length (only where the user chose it: `user_ctx`)."""
    from ..engine.generate import context_warning

    if quiet:
        return
    for line in llama_cpp_notices(m.backend.name, gpu_layers, flash_attn):
        dim(line)
    plan = getattr(m.backend, "plan", None)  # a split (backends/split_plan.py): what each device holds
    if plan is not None and is_verbose():
        dim(f"{plan.mode} split over {plan.n} devices" + (" (emulated)" if m.backend.name == "numpy" else ""))
        for line in plan.lines():
            dim(line)
    warning = context_warning(m.cfg, m.ctx) if user_ctx else None
    if warning:
        err.print(warning, style="yellow", markup=False)


def threads_notice(quiet: bool) -> None:
    """What -t came to, once the model is loading: ignored (said unless --quiet), or the count (--verbose)."""
    given, applied = _state.get("threads"), _state.get("threads_set")
    if applied is None and given is not None and not quiet:
        dim(f"--threads {given} is ignored: numpy was loaded before it and threadpoolctl is missing "
            "(pip install threadpoolctl)")
    elif applied is not None and is_verbose():
        source = "" if given is not None else f" (from {_state['threads_from']})" if _state.get("threads_from") else \
            " (the default; -t N to choose)"
        dim(f"CPU threads: {applied}{source}")


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
        where = ("the CUDA backend runs every layer on the GPU (--backend cpu runs on the CPU)" if backend == "cuda"
                 else f"the {backend} backend runs on the CPU")
        lines.append(f"-ngl {gpu_layers} is ignored: {where}")
    if flash_attn:
        why = ("the CUDA backend's attention is always fused (flash-attention style)" if backend == "cuda"
               else f"the {backend} backend has no fused attention to turn on (the CUDA backend's always is)")
        lines.append(f"-fa is a no-op: {why}")
    return lines


# -- entry point -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Console-script entry: run the app, turning every failure into one line and an exit code."""
    standard_streams()

    def run_app() -> None:
        code = app(args=argv, standalone_mode=False)
        if code == 130:  # typer turns a KeyboardInterrupt outside our own handlers into a returned 130
            raise KeyboardInterrupt
        if isinstance(code, int) and code:
            sys.exit(code)

    guarded(run_app)


def guarded(run: Callable[[], None]) -> NoReturn:
    """run(), then exit: 0, its own sys.exit's status, or one `error:` line and the failure's exit code (main;
    and the resident server for each command it runs, cli/resident.py)."""
    stdout = sys.stdout
    try:
        run()
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
    """Usage errors from the option parser: those of the copy of click that newer typer vendors, and click's
    own where typer uses it (older typer) or anything else loaded it; click is not imported only to be
    listed here (typer, imported above, has loaded whichever it parses with)."""
    found: list[type[BaseException]] = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        if module == "click.exceptions" and found and "click" not in sys.modules:
            continue
        try:
            found.append(__import__(module, fromlist=["ClickException"]).ClickException)
        except ImportError:
            pass
    return tuple(found)


_CLICK_ERRORS = _click_errors()


def _report(exc: BaseException | None, code: int, message: str | None = None) -> NoReturn:
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
