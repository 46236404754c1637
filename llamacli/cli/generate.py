"""The commands that run a model on a prompt or a conversation: generate, chat, and run (either of them, as
ollama's). They share the sampling options and load the model the same way (app.load_model). What each does
once the model is loaded is a Task: run here after the load, or, with --keep-alive, handed to the llamacli
server that keeps the model loaded (cli/keep_alive.py), which runs the same Task."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, fields
from typing import Annotated, Any, Optional

import typer

from ..engine.speculative import DEFAULT_DRAFT_MAX, DEFAULT_NGRAM_N
from ..errors import BadInputError, Interrupted, UsageError
from ..textio import json_text, printable, read_text
from .app import (
    BackendOpt,
    CacheTypeKOpt,
    CacheTypeVOpt,
    CtxOpt,
    DeviceOpt,
    DraftMaxOpt,
    DraftMinOpt,
    FlashAttnOpt,
    FrequencyPenaltyOpt,
    GpuLayersOpt,
    GrammarFileOpt,
    GrammarOpt,
    GreedyOpt,
    IgnoreEosOpt,
    JsonSchemaFileOpt,
    JsonSchemaOpt,
    KeepAliveOpt,
    LogprobsOpt,
    MainGpuOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelArg,
    ModelDraftOpt,
    ModelOpt,
    NgramSizeOpt,
    PresencePenaltyOpt,
    PromptArg,
    PromptFileOpt,
    PromptOpt,
    RawOpt,
    ReasoningEffortOpt,
    RepeatLastNOpt,
    RepeatPenaltyOpt,
    SeedOpt,
    SpecTypeOpt,
    SplitModeOpt,
    StopOpt,
    SwaFullOpt,
    TemperatureOpt,
    TensorSplitOpt,
    ThinkOpt,
    ThreadsOpt,
    TopKOpt,
    TopPOpt,
    TruncateOpt,
    command,
    dim,
    err,
    fail,
    is_verbose,
    keep_alive_seconds,
    load_model,
    speculative_settings,
    split_options,
)


def pick_model(positional: str | None, option: str | None) -> str | None:
    """The model named positionally (`generate model.gguf`) or with -m, never both."""
    if positional is not None and option is not None:
        fail(f"the model is given twice ({positional!r} and -m {option!r}): give it once")
    return positional if positional is not None else option


def model_and_text(first: str | None, second: str | None, option: str | None,
                   text_given: bool = False) -> tuple[str | None, str | None]:
    """The arguments MODEL [TEXT] beside -m: with -m, a lone argument is the text (`run -m m.gguf "Hi"`),
    unless an option gave the text (`text_given`: then it names the model a second time)."""
    if option is not None and first is not None and second is None and not text_given:
        return option, first
    return pick_model(first, option), second


def sampling_params(max_tokens: int, ctx: int | None, greedy: bool, temperature: float, top_k: int, top_p: float,
                    min_p: float, repeat_penalty: float, repeat_last_n: int, presence_penalty: float,
                    frequency_penalty: float, seed: int | None):
    """The options generate and chat share, checked: one-line errors for values that cannot work."""
    from ..sampling.params import SamplingParams

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


def _think_flag(think: bool | str | None) -> str | None:
    if think is None:
        return None
    return f"--reasoning-effort {think}" if isinstance(think, str) else "--think" if think else "--no-think"


def prompt_notices(m, think: bool | str | None, *, raw: bool = False, system: str | None = None,
                   chat: bool = False) -> list[str]:
    """How the prompt reaches the model, where that is not what the user may expect, one line each: a base
    model's file has no chat template (its prompt goes in as plain text; a conversation or --system takes a
    built-in format it may not know), and --think/--no-think/--reasoning-effort reach the chat template
    (enable_thinking, reasoning_effort), which may not use them or not be used at all."""
    from ..chat.reasoning import template_takes_effort

    flag = _think_flag(think)
    if raw:
        return [f"{flag} is ignored: --raw sends the prompt without the chat template"] if flag else []
    if not chat and system is None and not m.has_chat_template:
        also = f"; {flag} is ignored" if flag else ""
        return [f"the model's file has no chat template (a base model): the prompt goes in as plain text, for the "
                f"model to continue{also}"]
    lines = []
    if not m.has_chat_template:
        what = "the conversation takes" if chat else "--system puts the prompt in"
        lines.append(f"the model's file has no chat template (a base model): {what} the built-in "
                     f"{m.chat_template.source.removeprefix('builtin:')} format, which it may not follow")
    if flag is None:
        pass
    elif not m.thinks:
        lines.append(f"{flag} is ignored: the model's chat template has no think block")
    elif template_takes_effort(m.chat_template.text):
        if think is False:
            lines.append("this model always reasons: --no-think asks for low reasoning effort")
    elif isinstance(think, str):
        lines.append(f"{flag} turns thinking on: the model's chat template has no effort levels")
    return lines


def template_line(m, *, raw: bool = False, system: str | None = None, chat: bool = False) -> str:
    """--verbose's word on the chat template: which one, or why there is none."""
    if raw:
        return "chat template: none (--raw)"
    if not m.has_chat_template and not chat and system is None:
        return "chat template: none (the file has none: the prompt goes in as plain text)"
    source = m.chat_template.source
    return f"chat template: {source}" + ("" if m.has_chat_template else " (the file has none)")


def read_constraint(json_schema: str | None, grammar: str | None, *, json_schema_file: str | None = None,
                    grammar_file: str | None = None, quiet: bool = False) -> str | None:
    """The grammar that --json-schema(-file) or --grammar(-file) asks for, read and checked before the model
    loads (None without any). --json-schema takes the schema itself (or, starting with anything but '{', a
    file); --grammar takes the grammar's text, as llama.cpp's. A --grammar value that is no grammar but names
    a file is read as one with a notice (it took a file before it took text): --grammar-file says so plainly."""
    given = {name: value for name, value in (("--json-schema", json_schema), ("--json-schema-file", json_schema_file),
                                              ("--grammar", grammar), ("--grammar-file", grammar_file))
             if value is not None}
    if not given:
        return None
    if len(given) > 1:
        fail(f"give at most one of --json-schema, --json-schema-file, --grammar and --grammar-file (got "
             f"{' and '.join(given)})")
    from ..sampling.structured import require_llguidance, schema_grammar, text_grammar

    if grammar_file is not None:
        return text_grammar(read_text(grammar_file, "grammar file"))
    if json_schema_file is not None:
        return schema_grammar(read_text(json_schema_file, "JSON schema file"))
    if json_schema is not None:
        text = json_schema if json_schema.lstrip().startswith("{") else read_text(json_schema, "JSON schema file")
        return schema_grammar(text)
    assert grammar is not None
    require_llguidance()  # (its absence is no reason to try the value as a file)
    try:
        return text_grammar(grammar)
    except BadInputError as exc:  # (GrammarError: not a grammar, or past the bounds put on one)
        if not _names_file(grammar):
            if "\n" in grammar.strip():
                raise
            raise UsageError(f"{exc} (--grammar takes the grammar's text; a grammar file: --grammar-file FILE)") from None
    compiled = text_grammar(read_text(grammar, "grammar file"))
    if not quiet:
        dim(f"--grammar takes the grammar's text, as llama.cpp's: read the file {printable(grammar)} as the grammar, "
            "as before (--grammar-file FILE says so)")
    return compiled


def _names_file(value: str) -> bool:
    """Whether `value` names something that can be read as a file (a regular file, a pipe, /dev/stdin)."""
    if value == "-":
        return True
    try:
        return os.path.exists(value) and not os.path.isdir(value)
    except (OSError, ValueError):
        return False


def build_constraint(m, grammar: str | None):
    """The Constraint for a loaded model from read_constraint's grammar."""
    if grammar is None:
        return None
    from ..sampling.structured import constraint_for

    return constraint_for(m, grammar)


def read_prompt(prompt: str | None, prompt_file: str | None, positional: str | None = None) -> str:
    """The prompt from the PROMPT argument, -p or -f: exactly one of them."""
    given = [x for x in (positional, prompt, prompt_file) if x is not None]
    if len(given) != 1:
        fail("give the prompt once: as the PROMPT argument, with --prompt (-p) or with --prompt-file (-f)")
    if prompt_file is None:
        return given[0]
    return read_text(prompt_file, "prompt file")


# -- what a command does with its model ------------------------------------------------------------------

# The keyword arguments of complete() and converse() a Task carries, with the JSON types each may take; those of
# _OPTIONAL only where set (speculative decoding's settings: speculative_json).
_OPTIONAL = frozenset({"speculative"})
_OPTIONS: dict[str, dict[str, tuple[type, ...]]] = {
    "complete": {"text": (str,), "max_tokens": (int,), "stop": (list,), "raw": (bool,), "system": (str, type(None)),
                 "truncate": (bool,), "as_json": (bool,), "verbose": (bool,), "quiet": (bool,),
                 "think": (bool, str, type(None)), "logprobs": (int, type(None)), "ignore_eos": (bool,),
                 "speculative": (dict,)},
    "converse": {"system": (str, type(None)), "max_tokens": (int,), "as_json": (bool,), "quiet": (bool,),
                 "think": (bool, str, type(None)), "stop": (list,), "ignore_eos": (bool,), "speculative": (dict,)},
}


@dataclass
class Task:
    """What a model command does once its model is loaded, in values JSON carries: one reply to a prompt
    (`complete`: generate, and run with a prompt) or a conversation (`converse`: chat, and run without one).
    Here run() follows load_model; with --keep-alive the llamacli server that keeps the model loaded runs
    the same run() on its model (cli/resident.py), with this command's standard streams."""

    kind: str  # "complete" | "converse"
    params: dict[str, Any]  # SamplingParams' fields
    options: dict[str, Any]  # complete()'s / converse()'s keyword arguments, as _OPTIONS lists them
    grammar: str | None = None  # read_constraint's grammar, built against the loaded model (build_constraint)

    def run(self, m) -> None:
        from ..sampling.params import SamplingParams

        params = SamplingParams(**self.params).validate()
        options = {**self.options, "stop": tuple(self.options["stop"])}
        if "speculative" in options:
            options["speculative"] = speculative_from_json(options["speculative"])
        constraint = build_constraint(m, self.grammar)
        if self.kind == "complete":
            text, max_tokens = options.pop("text"), options.pop("max_tokens")
            complete(m, text, params, max_tokens, constraint=constraint, **options)
        else:
            system, max_tokens = options.pop("system"), options.pop("max_tokens")
            converse(m, system, params, max_tokens, constraint=constraint, **options)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> Task:
        """A Task from as_json()'s object, every field checked (ValueError says which is wrong)."""
        from ..sampling.params import SamplingParams

        if not isinstance(value, dict) or set(value) != {"kind", "params", "options", "grammar"}:
            raise ValueError("a task has the fields kind, params, options and grammar")
        kind, params, options, grammar = value["kind"], value["params"], value["options"], value["grammar"]
        if kind not in _OPTIONS:
            raise ValueError(f"no task of the kind {kind!r}")
        names = {f.name for f in fields(SamplingParams)}
        if not isinstance(params, dict) or not set(params) <= names:
            raise ValueError("a task's params are SamplingParams' fields")
        wanted = _OPTIONS[kind]
        if not isinstance(options, dict) or not set(wanted) - _OPTIONAL <= set(options) <= set(wanted):
            raise ValueError(f"a {kind} task's options are {', '.join(sorted(wanted))}")
        for name, kinds in wanted.items():
            if name in options and type(options[name]) not in kinds:
                raise ValueError(f"a task's {name} of the type {type(options[name]).__name__}")
        if not all(isinstance(x, str) for x in options["stop"]) or not isinstance(grammar, (str, type(None))):
            raise ValueError("a task's stop strings and grammar are strings")
        if "speculative" in options:
            try:
                speculative_from_json(options["speculative"])
            except UsageError as exc:
                raise ValueError(f"a task's speculative settings: {exc}") from None
        return cls(kind, params, options, grammar)


def speculative_json(settings) -> dict[str, Any]:
    """engine.speculative.SpecSettings as a Task carries them."""
    return {"sources": list(settings.sources), "draft_max": settings.draft_max, "draft_min": settings.draft_min,
            "ngram_n": settings.ngram_n}


def speculative_from_json(value: dict[str, Any]):
    """speculative_json's object back as SpecSettings, checked (UsageError)."""
    from ..engine.speculative import SpecSettings

    if set(value) != {"sources", "draft_max", "draft_min", "ngram_n"} or not isinstance(value["sources"], list):
        raise UsageError("speculative settings have the fields sources (a list), draft_max, draft_min and ngram_n")
    return SpecSettings(tuple(value["sources"]), value["draft_max"], value["draft_min"], value["ngram_n"]).validate()


def _speculative_option(settings) -> dict[str, Any]:
    """A Task's speculative option: only where speculative decoding is on."""
    return {"speculative": speculative_json(settings)} if settings is not None and settings.on else {}


def deliver(load: dict[str, Any], task: Task, keep_alive: float | None) -> None:
    """Load the model (load_model's keyword arguments `load`) and run `task` on it; with --keep-alive
    (`keep_alive` seconds), on the llamacli server that keeps the model loaded, started where none runs
    (cli/keep_alive.py), and this process exits with the exit code the task came to there. A draft model (-md)
    is not kept loaded: with one, the models load in this process, with a notice."""
    if keep_alive is not None and load.get("model_draft") is not None:
        if not load.get("quiet"):
            dim("--keep-alive does not keep a draft model (-md) loaded: the models load in this process")
        keep_alive = None
    if keep_alive is not None:
        from .keep_alive import hand_off

        code = hand_off(load, task.as_json(), keep_alive)
        if code is not None:
            raise SystemExit(code)
    task.run(load_model(**load))


def _load_options(model, backend, ctx, quiet, gpu_layers, flash_attn, cache_type_k, cache_type_v,
                  swa_full, split, model_draft=None) -> dict[str, Any]:
    load = {"model": model, "backend": backend, "ctx": ctx, "quiet": quiet, "gpu_layers": gpu_layers,
            "flash_attn": flash_attn, "cache_types": (cache_type_k, cache_type_v), "swa_full": swa_full,
            "split": split}
    return {**load, "model_draft": model_draft} if model_draft is not None else load


def reply_task(params, grammar: str | None, *, text: str, max_tokens: int, stop, raw: bool, system: str | None,
               truncate: bool, as_json: bool, quiet: bool, think, logprobs: int | None, ignore_eos: bool,
               speculative=None) -> Task:
    """The Task of one reply (complete()'s arguments; -v as given)."""
    return Task("complete", asdict(params), {
        "text": text, "max_tokens": max_tokens, "stop": list(stop or ()), "raw": raw, "system": system,
        "truncate": truncate, "as_json": as_json, "verbose": is_verbose(), "quiet": quiet, "think": think,
        "logprobs": logprobs, "ignore_eos": ignore_eos, **_speculative_option(speculative)}, grammar)


def conversation_task(params, grammar: str | None, *, system: str | None, max_tokens: int, stop, as_json: bool,
                      quiet: bool, think, ignore_eos: bool, speculative=None) -> Task:
    """The Task of a conversation (converse()'s arguments)."""
    return Task("converse", asdict(params), {
        "system": system, "max_tokens": max_tokens, "as_json": as_json, "quiet": quiet, "think": think,
        "stop": list(stop or ()), "ignore_eos": ignore_eos, **_speculative_option(speculative)}, grammar)


@command()
def generate(
    model_arg: ModelArg = None,
    prompt_arg: PromptArg = None,
    model: ModelOpt = None,
    prompt: PromptOpt = None,
    prompt_file: PromptFileOpt = None,
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
    ignore_eos: IgnoreEosOpt = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message for the chat template.")] = None,
    raw: RawOpt = False,
    stop: StopOpt = None,
    ctx: CtxOpt = None,
    truncate: TruncateOpt = False,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end instead of streaming.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No timings or notices on stderr.")] = False,
    gpu_layers: GpuLayersOpt = None,
    flash_attn: FlashAttnOpt = False,
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    swa_full: SwaFullOpt = False,
    split_mode: SplitModeOpt = None,
    tensor_split: TensorSplitOpt = None,
    main_gpu: MainGpuOpt = None,
    device: DeviceOpt = None,
    think: ThinkOpt = None,
    reasoning_effort: ReasoningEffortOpt = None,
    json_schema: JsonSchemaOpt = None,
    json_schema_file: JsonSchemaFileOpt = None,
    grammar: GrammarOpt = None,
    grammar_file: GrammarFileOpt = None,
    logprobs: LogprobsOpt = None,
    keep_alive: KeepAliveOpt = None,
    spec_type: SpecTypeOpt = None,
    draft_max: DraftMaxOpt = DEFAULT_DRAFT_MAX,
    draft_min: DraftMinOpt = 0,
    spec_ngram_size_n: NgramSizeOpt = DEFAULT_NGRAM_N,
    model_draft: ModelDraftOpt = None,
) -> None:
    """Generate a continuation of a prompt. Text streams to stdout; timings go to stderr.
    The model may come first (`llamacli generate model.gguf -p hi`) or with -m; the prompt with -p, -f or
    after the model. --json-schema / --grammar mask sampling so that the output follows them (it ends once
    complete). --keep-alive 5m keeps the model loaded for the next command (as ollama). --spec-type / -md:
    speculative decoding (the same output, in fewer passes where drafts hold)."""
    model, prompt_arg = model_and_text(model_arg, prompt_arg, model, prompt is not None or prompt_file is not None)
    seconds = keep_alive_seconds(keep_alive)
    split = split_options(split_mode, tensor_split, main_gpu, device)
    text = read_prompt(prompt, prompt_file, prompt_arg)
    think = think_setting(think, reasoning_effort)
    params = sampling_params(max_tokens, ctx, greedy, temperature, top_k, top_p, min_p, repeat_penalty,
                             repeat_last_n, presence_penalty, frequency_penalty, seed)
    check_logprobs(logprobs, as_json)
    speculative = speculative_settings(spec_type, draft_max, draft_min, spec_ngram_size_n, model_draft)
    spec = read_constraint(json_schema, grammar, json_schema_file=json_schema_file, grammar_file=grammar_file,
                           quiet=quiet)
    task = reply_task(params, spec, text=text, max_tokens=max_tokens, stop=stop, raw=raw, system=system,
                      truncate=truncate, as_json=as_json, quiet=quiet, think=think, logprobs=logprobs,
                      ignore_eos=ignore_eos, speculative=speculative)
    deliver(_load_options(model, backend, ctx, quiet, gpu_layers, flash_attn, cache_type_k, cache_type_v, swa_full,
                          split, model_draft), task, seconds)


def check_logprobs(logprobs: int | None, as_json: bool) -> None:
    if logprobs is None:
        return
    if not 0 <= logprobs <= 20:
        fail(f"--logprobs must be from 0 to 20, got {logprobs}")
    if not as_json:
        fail("--logprobs needs --json (the log-probabilities are part of the JSON object)")


def complete(m, text: str, params, max_tokens: int, *, stop=(), raw: bool = False, system: str | None = None,
             truncate: bool = False, as_json: bool = False, verbose: bool = False, quiet: bool = False,
             think: bool | str | None = None, logprobs: int | None = None, constraint=None,
             ignore_eos: bool = False, speculative=None) -> None:
    """One completion of `text` on a loaded model, streamed to stdout (generate, and run with a prompt); a
    thinking model's reasoning streams to stderr."""
    from ..chat.reasoning import ReplyRouter
    from ..engine.generate import Completion

    max_tokens = m.ctx if max_tokens == -1 else max_tokens  # -1 (llama.cpp's): until the end or a full context

    if verbose:
        dim(f"backend {m.backend.name}, context {m.ctx}")
        dim(startup_line(m))
        dim(template_line(m, raw=raw, system=system))
    if not quiet:
        for line in prompt_notices(m, think, raw=raw, system=system):
            dim(line)
    done = Completion()

    def answer(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    router = ReplyRouter(done, answer, sys.stderr)
    try:
        pieces = m.run(text, completion=done, max_tokens=max_tokens, stop=stop, params=params, raw=raw,
                       system=system, truncate=truncate, think=think, logprobs=logprobs, constraint=constraint,
                       ignore_eos=ignore_eos, **({"speculative": speculative} if speculative is not None else {}))
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
    ignore_eos: IgnoreEosOpt = False,
    stop: StopOpt = None,
    ctx: CtxOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per reply, one per line, instead of the text.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No per-reply speed lines or notices on stderr.")] = False,
    gpu_layers: GpuLayersOpt = None,
    flash_attn: FlashAttnOpt = False,
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    swa_full: SwaFullOpt = False,
    split_mode: SplitModeOpt = None,
    tensor_split: TensorSplitOpt = None,
    main_gpu: MainGpuOpt = None,
    device: DeviceOpt = None,
    think: ThinkOpt = None,
    reasoning_effort: ReasoningEffortOpt = None,
    json_schema: JsonSchemaOpt = None,
    json_schema_file: JsonSchemaFileOpt = None,
    grammar: GrammarOpt = None,
    grammar_file: GrammarFileOpt = None,
    keep_alive: KeepAliveOpt = None,
    spec_type: SpecTypeOpt = None,
    draft_max: DraftMaxOpt = DEFAULT_DRAFT_MAX,
    draft_min: DraftMinOpt = 0,
    spec_ngram_size_n: NgramSizeOpt = DEFAULT_NGRAM_N,
    model_draft: ModelDraftOpt = None,
) -> None:
    """Talk with a model (named first, `llamacli chat model.gguf`, or with -m). Each turn prefills only what
    the KV cache does not hold yet; under each reply a dim line on stderr gives its tokens/s. When the context
    fills, the oldest turns are dropped (the system prompt stays) with a notice. -n limits each reply.

    Commands (/help lists them), ollama's spellings too: /exit or /bye, /reset or /clear, /system TEXT or
    /set system TEXT, /set parameter NAME VALUE (temperature, top_k, top_p, min_p, num_predict, seed, ...),
    /save FILE, /load FILE, /stats. On a terminal Ctrl-C stops a reply and keeps its partial text in the
    conversation; at the prompt Ctrl-C discards the line and a second Ctrl-C in a row exits (130); Ctrl-D
    and /exit exit (0).

    From a pipe or file: one user message (or command) per line; stdout carries only the replies, each
    followed by one newline (`printf 'hi\\nbye\\n' | llamacli chat`).

    --json-schema / --grammar: every reply follows them. --keep-alive 5m keeps the model loaded for the next
    command (as ollama).
    """
    model = pick_model(model_arg, model)
    seconds = keep_alive_seconds(keep_alive)
    split = split_options(split_mode, tensor_split, main_gpu, device)
    think = think_setting(think, reasoning_effort)
    params = sampling_params(max_tokens, ctx, greedy, temperature, top_k, top_p, min_p, repeat_penalty,
                             repeat_last_n, presence_penalty, frequency_penalty, seed)
    speculative = speculative_settings(spec_type, draft_max, draft_min, spec_ngram_size_n, model_draft)
    spec = read_constraint(json_schema, grammar, json_schema_file=json_schema_file, grammar_file=grammar_file,
                           quiet=quiet)
    task = conversation_task(params, spec, system=system, max_tokens=max_tokens, stop=stop, as_json=as_json,
                             quiet=quiet, think=think, ignore_eos=ignore_eos, speculative=speculative)
    deliver(_load_options(model, backend, ctx, quiet, gpu_layers, flash_attn, cache_type_k, cache_type_v, swa_full,
                          split, model_draft), task, seconds)


def converse(m, system: str | None, params, max_tokens: int, *, as_json: bool = False, quiet: bool = False,
             think: bool | str | None = None, constraint=None, stop=(), ignore_eos: bool = False,
             speculative=None) -> None:
    """The chat loop on a loaded model (chat, and run without a prompt)."""
    from ..engine.chat_session import ChatSession
    from .chat_repl import ChatLoop

    if is_verbose():
        dim(f"backend {m.backend.name}, context {m.ctx}")
        dim(startup_line(m))
        dim(template_line(m, chat=True))
    if not quiet:
        for line in prompt_notices(m, think, chat=True):
            dim(line)
    max_tokens = m.ctx if max_tokens == -1 else max_tokens  # -1 (llama.cpp's): until the end or a full context
    session = ChatSession(m, system=system, params=params, max_tokens=max_tokens, think=think,
                          constraint=constraint, stop=stop, ignore_eos=ignore_eos, speculative=speculative)
    ChatLoop(session, err, interactive=sys.stdin.isatty(), quiet=quiet, as_json=as_json).run()


# -- run ---------------------------------------------------------------------------------------------------


@command()
def run(
    model_arg: ModelArg = None,
    prompt_arg: Annotated[Optional[str], typer.Argument(
        metavar="PROMPT", help="Answer this once and exit (as -p); without a prompt, a chat.",
        show_default=False)] = None,
    model: ModelOpt = None,
    prompt: PromptOpt = None,
    prompt_file: PromptFileOpt = None,
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
    ignore_eos: IgnoreEosOpt = False,
    raw: Annotated[bool, typer.Option("--raw", help="With a prompt: send it as is, without the chat template.")] = False,
    stop: StopOpt = None,
    ctx: CtxOpt = None,
    truncate: Annotated[bool, typer.Option(
        "--truncate", help="With a prompt: keep the tail of one longer than the context.")] = False,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per reply instead of the text.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No timings or notices on stderr.")] = False,
    gpu_layers: GpuLayersOpt = None,
    flash_attn: FlashAttnOpt = False,
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    swa_full: SwaFullOpt = False,
    split_mode: SplitModeOpt = None,
    tensor_split: TensorSplitOpt = None,
    main_gpu: MainGpuOpt = None,
    device: DeviceOpt = None,
    think: ThinkOpt = None,
    reasoning_effort: ReasoningEffortOpt = None,
    json_schema: JsonSchemaOpt = None,
    json_schema_file: JsonSchemaFileOpt = None,
    grammar: GrammarOpt = None,
    grammar_file: GrammarFileOpt = None,
    logprobs: LogprobsOpt = None,
    keep_alive: KeepAliveOpt = None,
    spec_type: SpecTypeOpt = None,
    draft_max: DraftMaxOpt = DEFAULT_DRAFT_MAX,
    draft_min: DraftMinOpt = 0,
    spec_ngram_size_n: NgramSizeOpt = DEFAULT_NGRAM_N,
    model_draft: ModelDraftOpt = None,
) -> None:
    """Run a model as ollama does: with a prompt (after the model, or -p / -f), one reply through the chat
    template (as `generate`); without one, a conversation (as `chat`). The model comes first or with -m.
    --keep-alive 5m keeps the model loaded for the next command (as ollama's; off by default)."""
    model, prompt_arg = model_and_text(model_arg, prompt_arg, model, prompt is not None or prompt_file is not None)
    seconds = keep_alive_seconds(keep_alive)
    split = split_options(split_mode, tensor_split, main_gpu, device)
    one = prompt_arg is not None or prompt is not None or prompt_file is not None
    text = read_prompt(prompt, prompt_file, prompt_arg) if one else None
    if not one:
        for given, name in ((raw, "--raw"), (truncate, "--truncate"), (logprobs is not None, "--logprobs")):
            if given:
                fail(f"{name} works with a prompt (one reply), not in a chat")
    think = think_setting(think, reasoning_effort)
    params = sampling_params(max_tokens, ctx, greedy, temperature, top_k, top_p, min_p, repeat_penalty,
                             repeat_last_n, presence_penalty, frequency_penalty, seed)
    check_logprobs(logprobs, as_json)
    speculative = speculative_settings(spec_type, draft_max, draft_min, spec_ngram_size_n, model_draft)
    spec = read_constraint(json_schema, grammar, json_schema_file=json_schema_file, grammar_file=grammar_file,
                           quiet=quiet)
    if text is None:
        task = conversation_task(params, spec, system=system, max_tokens=max_tokens, stop=stop, as_json=as_json,
                                 quiet=quiet, think=think, ignore_eos=ignore_eos, speculative=speculative)
    else:
        task = reply_task(params, spec, text=text, max_tokens=max_tokens, stop=stop, raw=raw, system=system,
                          truncate=truncate, as_json=as_json, quiet=quiet, think=think, logprobs=logprobs,
                          ignore_eos=ignore_eos, speculative=speculative)
    deliver(_load_options(model, backend, ctx, quiet, gpu_layers, flash_attn, cache_type_k, cache_type_v, swa_full,
                          split, model_draft), task, seconds)
