"""The commands that run a model on a prompt or a conversation: generate, chat, and run (either of them, as
ollama's). They share the sampling options and load the model the same way (app.load_model)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from ..errors import Interrupted
from ..textio import json_text, read_text
from .app import (
    BackendOpt,
    CacheTypeKOpt,
    CacheTypeVOpt,
    CtxOpt,
    FlashAttnOpt,
    FrequencyPenaltyOpt,
    GpuLayersOpt,
    GrammarOpt,
    GreedyOpt,
    JsonSchemaOpt,
    LogprobsOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelArg,
    ModelOpt,
    PresencePenaltyOpt,
    ReasoningEffortOpt,
    RepeatLastNOpt,
    RepeatPenaltyOpt,
    SeedOpt,
    SwaFullOpt,
    TemperatureOpt,
    ThinkOpt,
    TopKOpt,
    TopPOpt,
    command,
    dim,
    err,
    fail,
    load_model,
)


def pick_model(positional: str | None, option: str | None) -> str | None:
    """The model named positionally (`generate model.gguf`) or with -m, never both."""
    if positional is not None and option is not None:
        fail(f"the model is given twice ({positional!r} and -m {option!r}): give it once")
    return positional if positional is not None else option


def sampling_params(max_tokens: int, ctx: int | None, greedy: bool, temperature: float, top_k: int, top_p: float,
                    min_p: float, repeat_penalty: float, repeat_last_n: int, presence_penalty: float,
                    frequency_penalty: float, seed: int | None):
    """The options generate and chat share, checked: one-line errors for values that cannot work."""
    from ..sampling.sampling import SamplingParams

    if max_tokens < -1:
        fail(f"--max-tokens must be >= 0, or -1 (until the end of the text or a full context), got {max_tokens}")
    if ctx is not None and ctx <= 0:
        fail(f"--ctx must be positive, got {ctx}")
    return SamplingParams(
        temperature=0.0 if greedy else temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed,
    ).validate()


def think_setting(think: bool | None, effort: str | None) -> bool | str | None:
    """--think/--no-think, or --reasoning-effort LEVEL, as the one value the chat template gets
    (reasoning.template_variables): True, False, an effort level, or None for the template's default."""
    if effort is None:
        return think
    from ..chat.reasoning import parse_effort

    if think is not None:
        fail("give --think/--no-think or --reasoning-effort, not both")
    try:
        return parse_effort(effort)
    except ValueError as exc:
        fail(f"--reasoning-effort {exc}")


def think_notice(m, think: bool | str | None) -> None:
    """--think/--no-think/--reasoning-effort reach the chat template (enable_thinking, reasoning_effort); say
    what a template makes of them when that is not what the flag says, instead of leaving the user to guess."""
    if think is None:
        return
    from ..chat.reasoning import template_takes_effort

    flag = f"--reasoning-effort {think}" if isinstance(think, str) else "--think" if think else "--no-think"
    if not m.thinks:
        dim(f"{flag} is ignored: the model's chat template has no think block")
    elif template_takes_effort(m.chat_template.text):
        if think is False:
            dim("this model always reasons: --no-think asks for low reasoning effort")
    elif isinstance(think, str):
        dim(f"{flag} turns thinking on: the model's chat template has no effort levels")


def read_constraint(json_schema: str | None, grammar: str | None) -> str | None:
    """The grammar that --json-schema or --grammar asks for, read and checked before the model loads (None
    without either). A --json-schema value that starts with '{' is the schema itself, else a file."""
    if json_schema is None and grammar is None:
        return None
    if json_schema is not None and grammar is not None:
        fail("give at most one of --json-schema and --grammar")
    from ..sampling.structured import schema_grammar, text_grammar

    if grammar is not None:
        return text_grammar(read_text(grammar, "grammar file"))
    text = json_schema if json_schema.lstrip().startswith("{") else read_text(json_schema, "JSON schema file")
    return schema_grammar(text)


def build_constraint(m, grammar: str | None):
    """The Constraint for a loaded model from read_constraint's grammar."""
    if grammar is None:
        return None
    from ..sampling.structured import constraint_for

    return constraint_for(m, grammar)


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    if (prompt is None) == (prompt_file is None):
        fail("give the prompt with exactly one of --prompt or --prompt-file")
    if prompt_file is None:
        return prompt  # type: ignore[return-value]
    return read_text(prompt_file, "prompt file")


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
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    swa_full: SwaFullOpt = False,
    think: ThinkOpt = None,
    reasoning_effort: ReasoningEffortOpt = None,
    json_schema: JsonSchemaOpt = None,
    grammar: GrammarOpt = None,
    logprobs: LogprobsOpt = None,
) -> None:
    """Generate a continuation of a prompt. Text streams to stdout; timings go to stderr.
    The model may come first (`llamacli generate model.gguf -p hi`) or with -m.
    --json-schema / --grammar mask sampling so that the output follows them (it ends once complete)."""
    model = pick_model(model_arg, model)
    text = read_prompt(prompt, prompt_file)
    think = think_setting(think, reasoning_effort)
    params = sampling_params(max_tokens, ctx, greedy, temperature, top_k, top_p, min_p, repeat_penalty,
                             repeat_last_n, presence_penalty, frequency_penalty, seed)
    if logprobs is not None:
        if not 0 <= logprobs <= 20:
            fail(f"--logprobs must be from 0 to 20, got {logprobs}")
        if not as_json:
            fail("--logprobs needs --json (the log-probabilities are part of the JSON object)")
    spec = read_constraint(json_schema, grammar)
    m = load_model(model, backend, ctx, quiet, gpu_layers, flash_attn,
                   cache_types=(cache_type_k, cache_type_v), swa_full=swa_full)
    complete(m, text, params, max_tokens, stop=stop or (), raw=raw, system=system, truncate=truncate,
             as_json=as_json, verbose=verbose, quiet=quiet, think=think, logprobs=logprobs,
             constraint=build_constraint(m, spec))


def complete(m, text: str, params, max_tokens: int, *, stop=(), raw: bool = False, system: str | None = None,
             truncate: bool = False, as_json: bool = False, verbose: bool = False, quiet: bool = False,
             think: bool | str | None = None, logprobs: int | None = None, constraint=None) -> None:
    """One completion of `text` on a loaded model, streamed to stdout (generate, and run with a prompt); a
    thinking model's reasoning streams to stderr."""
    from ..chat.reasoning import ReplyRouter
    from ..engine.generate import Completion

    max_tokens = m.ctx if max_tokens == -1 else max_tokens  # -1 (llama.cpp's): until the end or a full context

    if verbose:
        dim(f"backend {m.backend.name}, context {m.ctx}")
        dim(startup_line(m))
        if not raw:
            dim(f"chat template: {m.chat_template.source}")
    if not quiet:
        think_notice(m, think)
    done = Completion()

    def answer(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    router = ReplyRouter(done, answer, sys.stderr)
    try:
        pieces = m.run(text, completion=done, max_tokens=max_tokens, stop=stop, params=params, raw=raw,
                       system=system, truncate=truncate, think=think, logprobs=logprobs, constraint=constraint)
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


def startup_line(m) -> str:
    """--verbose: the stages of start-up, from the CLI's imports and options through the model's lookup (the
    registry, and a download on first use) to the backend's own (its decode graphs, where it has any)."""
    from ..startup import started_at

    stages = list(m.load_stages)
    if started_at() is not None and m.lookup is not None:
        begun, found = m.lookup
        stages[:0] = [("imports, options", (begun - started_at()) * 1e3), ("model lookup", (found - begun) * 1e3)]
    elif started_at() is not None:
        stages.insert(0, ("imports, options, model lookup", (m.load_started - started_at()) * 1e3))
    return stages_text("start-up", stages) + _since_start(m.load_started + m.load_ms / 1e3, "loaded")


def stages_text(title: str, stages) -> str:
    return f"{title}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in stages)


def _since_start(t: float, what: str) -> str:
    """'; <what> at N ms' since the CLI's entry (llamacli.run), when known."""
    from ..startup import started_at

    return f"; {what} at {(t - started_at()) * 1e3:.0f} ms" if started_at() is not None and t else ""


def _finish(done, as_json: bool, quiet: bool, verbose: bool) -> None:
    if as_json:
        print(json_text(done.as_dict()))
    else:
        if done.text and not done.text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
    if verbose:
        dim(f"prompt: {len(done.prompt_tokens)} tokens; finish reason: {done.finish_reason}")
        if done.timings.stages:
            line = stages_text("to the first token", done.timings.stages)
            dim(line + _since_start(done.timings.first_token_at, "first token"))
    if not quiet:
        for line in done.timings.report():
            dim(line)


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
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    swa_full: SwaFullOpt = False,
    think: ThinkOpt = None,
    reasoning_effort: ReasoningEffortOpt = None,
    json_schema: JsonSchemaOpt = None,
    grammar: GrammarOpt = None,
) -> None:
    """Talk with a model (named first, `llamacli chat model.gguf`, or with -m). Each turn prefills only what
    the KV cache does not hold yet; under each reply a dim line on stderr gives its tokens/s. When the context
    fills, the oldest turns are dropped (the system prompt stays) with a notice. -n limits each reply.

    On a terminal: /help lists the commands (/exit, /reset, /system, /save FILE, /load FILE, /stats). Ctrl-C
    stops a reply and keeps its partial text in the conversation; at the prompt Ctrl-C discards the line
    and a second Ctrl-C in a row exits (130); Ctrl-D and /exit exit (0).

    From a pipe or file: one user message per line; stdout carries only the replies, each followed by one
    newline (`printf 'hi\\nbye\\n' | llamacli chat`).

    --json-schema / --grammar: every reply follows them.
    """
    model = pick_model(model_arg, model)
    think = think_setting(think, reasoning_effort)
    params = sampling_params(max_tokens, ctx, greedy, temperature, top_k, top_p, min_p, repeat_penalty,
                             repeat_last_n, presence_penalty, frequency_penalty, seed)
    spec = read_constraint(json_schema, grammar)
    m = load_model(model, backend, ctx, quiet, gpu_layers, flash_attn,
                   cache_types=(cache_type_k, cache_type_v), swa_full=swa_full)
    converse(m, system, params, max_tokens, as_json=as_json, quiet=quiet, think=think,
             constraint=build_constraint(m, spec))


def converse(m, system: str | None, params, max_tokens: int, *, as_json: bool = False, quiet: bool = False,
             think: bool | str | None = None, constraint=None) -> None:
    """The chat loop on a loaded model (chat, and run without a prompt)."""
    from ..engine.chat_session import ChatSession
    from .chat_repl import ChatLoop

    if not quiet:
        think_notice(m, think)
    max_tokens = m.ctx if max_tokens == -1 else max_tokens  # -1 (llama.cpp's): until the end or a full context
    session = ChatSession(m, system=system, params=params, max_tokens=max_tokens, think=think,
                          constraint=constraint)
    ChatLoop(session, err, interactive=sys.stdin.isatty(), quiet=quiet, as_json=as_json).run()


# -- run ---------------------------------------------------------------------------------------------------


@command()
def run(
    model: Annotated[str, typer.Argument(
        metavar="MODEL", help="A GGUF path, a registry name or hf://owner/repo/file.gguf.")],
    prompt: Annotated[Optional[str], typer.Argument(
        metavar="PROMPT", help="Answer this once and exit; without it, a chat.", show_default=False)] = None,
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
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    swa_full: SwaFullOpt = False,
    think: ThinkOpt = None,
    reasoning_effort: ReasoningEffortOpt = None,
) -> None:
    """Run a model as ollama does: with a PROMPT, one reply through the chat template (as `generate`);
    without one, a conversation (as `chat`)."""
    think = think_setting(think, reasoning_effort)
    params = sampling_params(max_tokens, ctx, greedy, temperature, top_k, top_p, min_p, repeat_penalty,
                             repeat_last_n, presence_penalty, frequency_penalty, seed)
    m = load_model(model, backend, ctx, quiet, gpu_layers, flash_attn,
                   cache_types=(cache_type_k, cache_type_v), swa_full=swa_full)
    if prompt is None:
        converse(m, system, params, max_tokens, as_json=as_json, quiet=quiet, think=think)
    else:
        complete(m, prompt, params, max_tokens, system=system, as_json=as_json, quiet=quiet, think=think)
