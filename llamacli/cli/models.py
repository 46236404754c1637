"""The commands about model files rather than text: inspect, the registry's models/pull/rm, tokenize and
bench."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..textio import json_text, printable, read_text
from .app import (
    BackendOpt,
    CacheTypeKOpt,
    CacheTypeVOpt,
    CtxOpt,
    FlashAttnOpt,
    GpuLayersOpt,
    ModelArg,
    ModelOpt,
    SwaFullOpt,
    ThreadsOpt,
    command,
    dim,
    err,
    fail,
    is_verbose,
    load_model,
    out,
)
from .generate import model_and_text, pick_model

# -- inspect -----------------------------------------------------------------------------------------------


@command()
def inspect(
    model_arg: Annotated[Optional[str], typer.Argument(
        metavar="MODEL", help="A GGUF file, a registry name or hf://owner/repo/file.gguf.", show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="The model, as MODEL.")] = None,
    tensors: Annotated[bool, typer.Option("--tensors", help="Add the tensor table.")] = False,
    metadata: Annotated[bool, typer.Option("--metadata", help="Add every metadata key (long arrays abbreviated).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")] = False,
    ctx: Annotated[Optional[int], typer.Option("--ctx", "-c", "--ctx-size", help="Also size the KV cache at this context length.")] = None,
) -> None:
    """Show what is inside a GGUF file: architecture, sizes, quantization mix, tokenizer, memory needs."""
    from .inspect import inspect_model, render_summary

    model = pick_model(model_arg, model)
    if model is None:
        fail("name the model to inspect: llamacli inspect MODEL (or -m MODEL)")
    if ctx is not None and ctx <= 0:
        fail(f"--ctx must be positive, got {ctx}")
    from ..registry.registry import resolve_model

    info = inspect_model(str(resolve_model(model)), ctx=ctx, with_tensors=tensors, with_metadata=metadata)
    if as_json:
        print(json_text(info))
    else:
        render_summary(out, info)


# -- models, pull, rm --------------------------------------------------------------------------------------


@command("models")
def models_(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array instead.")] = False,
) -> None:
    """List the model registry (models.toml plus yours): name, size, and whether it is downloaded."""
    from rich.table import Table
    from rich.text import Text

    from ..paths import cache_home
    from ..registry.registry import list_models
    from ..registry.sizes import human_size

    rows = list_models()
    if as_json:
        print(json_text(rows))
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "PARAMS", "SIZE", "CACHED", "DESCRIPTION"):
        table.add_column(column, no_wrap=column != "DESCRIPTION")
    for r in rows:
        name = r["name"] + (" (default)" if r["default"] else "")
        notes = " [base model: continues text, no chat template]" if r["base"] else ""
        notes += " [gated: needs HF_TOKEN]" if r["gated"] else ""
        cells = (name, r["parameters"], human_size(r["size"]), "yes" if r["cached"] else "-", r["description"] + notes)
        table.add_row(*(Text(printable(c)) for c in cells))  # Text: a "[" in a description is not markup
    out.print(table, markup=False)
    err.print(f"cache: {cache_home()}", markup=False)


@command()
def pull(
    model: Annotated[str, typer.Argument(
        metavar="MODEL", help="A registry name (see `llamacli models`) or hf://owner/repo/file.gguf.")],
    force: Annotated[bool, typer.Option("--force", help="Download again even if it is cached.")] = False,
) -> None:
    """Download a model into the cache (progress on stderr) and print its path."""
    from ..registry.registry import pull_model

    print(pull_model(model, force=force, progress=True))


@command("rm")
def rm(
    model: Annotated[str, typer.Argument(metavar="MODEL", help="A registry name or hf://owner/repo/file.gguf.")],
) -> None:
    """Delete a downloaded model from the cache."""
    from ..registry.registry import remove_model

    for path in remove_model(model):
        err.print(f"removed {path}", markup=False)


# -- tokenize ----------------------------------------------------------------------------------------------


@command()
def tokenize(
    model_arg: ModelArg = None,
    text_arg: Annotated[Optional[str], typer.Argument(
        metavar="TEXT", help="The text to tokenize (as -p).", show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="A GGUF path (a vocabulary-only one will do) or a registry name.")] = None,
    text: Annotated[Optional[str], typer.Option(
        "--text", "--prompt", "-p", help="The text to tokenize (llama-tokenize's -p).")] = None,
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
    threads: ThreadsOpt = None,
) -> None:
    """Show the token ids of a text (or of a chat prompt with --chat), as the model's tokenizer makes them:
    `llamacli tokenize MODEL "text"`, or with -m and -p/--text/-f. -v prints one 'id piece' line per token
    and, with --chat, which chat template."""
    from ..ggufio.file import open_gguf
    from ..paths import local_model
    from ..tokenizer.tokenizer import Tokenizer

    model, text_arg = model_and_text(model_arg, text_arg, model, text is not None or file is not None)
    if model is None:
        fail("name the model: llamacli tokenize MODEL TEXT (or -m MODEL -p TEXT)")
    if text_arg is not None and text is not None:
        fail("the text is given twice (the TEXT argument and --text/-p): give it once")
    text = text_arg if text_arg is not None else text
    if (text is None) == (file is None):
        fail("give the text once: as the TEXT argument, with --text/-p or with --file/-f")
    verbose = is_verbose()
    if system is not None and not chat:
        fail("--system needs --chat")
    if file is not None:
        text = read_text(file, "input file")  # exactly as written (\r\n kept), so the ids are the file's
    assert text is not None
    path = local_model(model)
    if path is None:  # a name: the registry (a path does not import it: see paths.local_model)
        from ..registry.registry import resolve_model

        path = resolve_model(model)
    md = open_gguf(path).metadata
    tok = Tokenizer.from_metadata(md)
    if chat:
        from ..chat.template import ChatTemplate, chat_messages, encode_prompt

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
    model_arg: ModelArg = None,
    model: ModelOpt = None,
    n_prompt: Annotated[str, typer.Option("--n-prompt", "-p", help="Prompt sizes for prefill tests, comma-separated.")] = "512",
    n_gen: Annotated[str, typer.Option("--n-gen", "-n", help="Token counts for decode tests, comma-separated.")] = "128",
    pg: Annotated[Optional[list[str]], typer.Option("--pg", help="A combined test P,N: prefill P then decode N (repeatable).")] = None,
    n_depth: Annotated[str, typer.Option("--n-depth", "-d", help="Run each test after this many tokens of context, comma-separated (llama-bench's -d).")] = "0",
    reps: Annotated[int, typer.Option("--repetitions", "-r", help="Timed repetitions after one warm-up.")] = 5,
    ctx: CtxOpt = None,
    backend: BackendOpt = "auto",
    threads: ThreadsOpt = None,
    output: Annotated[str, typer.Option("--output", "-o", help="md, json or csv.")] = "md",
    profile: Annotated[bool, typer.Option("--profile", help="Instead: one prefill (the first -p size) and one decode step by kernel family (CUDA).")] = False,
    kernels: Annotated[bool, typer.Option("--kernels", help="Instead: kernel micro-benchmarks (matvecs, attention prefill vs torch SDPA); no model needed (CUDA).")] = False,
    gpu_layers: GpuLayersOpt = None,
    flash_attn: FlashAttnOpt = False,
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    swa_full: SwaFullOpt = False,
) -> None:
    """Measure prefill (ppN) and decode (tgN) speed, with GB/s and the share of the memory bandwidth.
    --profile breaks one prefill and one decode step down by kernel family; --kernels times single kernels."""
    from ..engine.bench import (
        parse_list,
        parse_pg,
        render,
        render_kernels,
        render_profile,
        run_bench,
        run_kernels,
        run_profile,
    )

    model = pick_model(model_arg, model)
    if output not in ("md", "json", "csv"):
        fail(f"--output must be md, json or csv, got {output!r}")
    if reps < 1:
        fail(f"--repetitions must be >= 1, got {reps}")
    if profile and kernels:
        fail("--profile and --kernels are separate runs: pick one")
    if (profile or kernels) and output == "csv":
        fail("--profile and --kernels print md or json")
    if kernels:
        from ..backends import select_backend, start_early

        # start_early: what the CLI's entry began (the driver's thread) is waited for, and let go on NumPy
        be = select_backend(backend, notice=dim, early=start_early(backend))
        krows, bandwidth = run_kernels(be)
        print(render_kernels(krows, bandwidth, output, be.device_name()))
        return
    prompts, gens = parse_list(n_prompt, "-p"), parse_list(n_gen, "-n")
    pairs = [parse_pg(x) for x in pg or []]
    depths = parse_list(n_depth, "-d") or [0]
    need = max([p for p in prompts] + [n for n in gens] + [p + n for p, n in pairs] + [1]) + max(depths)
    m = load_model(model, backend, ctx or max(need + 1, 512), False, gpu_layers, flash_attn,
                   user_ctx=ctx is not None,  # bench's own context is not the user's choice
                   cache_types=(cache_type_k, cache_type_v), swa_full=swa_full)
    if profile:
        prows, spans, attention = run_profile(m, next((p for p in prompts if p), 512))
        print(render_profile(prows, spans, output, m.backend.device_name(), attention))
        return
    rows, bandwidth = run_bench(m, prompts, gens, pairs, reps, progress=lambda t: dim(f"running {t}"), depths=depths)
    print(render(rows, output, m.backend.device_name(), bandwidth))
