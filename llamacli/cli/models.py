"""The commands about model files rather than text: inspect, the registry's models/pull/rm, tokenize and
bench."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..engine.speculative import DEFAULT_DRAFT_MAX, DEFAULT_NGRAM_N
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
    GpuLayersOpt,
    MainGpuOpt,
    ModelArg,
    ModelDraftOpt,
    ModelOpt,
    NgramSizeOpt,
    PromptFileOpt,
    SpecTypeOpt,
    SplitModeOpt,
    SwaFullOpt,
    TensorSplitOpt,
    ThreadsOpt,
    command,
    dim,
    err,
    fail,
    is_verbose,
    load_model,
    out,
    speculative_settings,
    split_options,
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
    gpus: Annotated[Optional[int], typer.Option(
        "--gpus", metavar="N", help="Plan the model over N GPUs: what each holds and needs, with --split-mode layer "
                                    "and tensor (or the one given), at --ctx.")] = None,
    gpu_memory: Annotated[Optional[str], typer.Option(
        "--gpu-memory", metavar="SIZE[,SIZE...]",
        help="With --gpus: each GPU's memory (one size for all: 80G, 141GB, 24576M), to say whether the plan fits.")] = None,
    split_mode: SplitModeOpt = None,
    tensor_split: TensorSplitOpt = None,
    main_gpu: MainGpuOpt = None,
    device: DeviceOpt = None,
) -> None:
    """Show what is inside a GGUF file: architecture, sizes, quantization mix, tokenizer, memory needs; with
    --gpus N (or the split options), how the model splits over N GPUs."""
    from .inspect import inspect_model, render_summary

    model = pick_model(model_arg, model)
    if model is None:
        fail("name the model to inspect: llamacli inspect MODEL (or -m MODEL)")
    if ctx is not None and ctx <= 0:
        fail(f"--ctx must be positive, got {ctx}")
    split = inspect_split(gpus, gpu_memory, split_mode, tensor_split, main_gpu, device)
    from ..registry.registry import resolve_model

    info = inspect_model(str(resolve_model(model)), ctx=ctx, with_tensors=tensors, with_metadata=metadata,
                         split=split)
    if as_json:
        print(json_text(info))
    else:
        render_summary(out, info)


def inspect_split(gpus: int | None, gpu_memory: str | None, split_mode: str | None, tensor_split: str | None,
                  main_gpu: int | None, device: str | None) -> dict | None:
    """inspect's split options checked: the keyword arguments of inspect.split_plans, or None (no plan asked)."""
    from ..backends.split_plan import MAX_DEVICES, parse_split_options
    from ..units import parse_size

    if gpus is None and gpu_memory is None and all(x is None for x in (split_mode, tensor_split, main_gpu, device)):
        return None
    if gpus is not None and not 1 <= gpus <= MAX_DEVICES:
        fail(f"--gpus takes 1 to {MAX_DEVICES}, got {gpus}")
    options = parse_split_options(split_mode, tensor_split, main_gpu, device)
    named = len(options.devices or ()) or len(options.proportions)
    if gpus is not None and options.devices and max(options.devices) >= gpus:
        fail(f"-dev names device {max(options.devices)}, past the {gpus} GPUs of --gpus")
    if gpus is not None and len(options.proportions) > gpus:
        fail(f"--tensor-split gives {len(options.proportions)} proportions for the {gpus} GPUs of --gpus")
    n = gpus or max([named, *(d + 1 for d in options.devices or ())], default=1)
    memory = None
    if gpu_memory is not None:
        words = gpu_memory.split(",")
        if len(words) not in (1, n):
            fail(f"--gpu-memory gives {len(words)} sizes for {n} GPUs: give one for all, or one each")
        try:
            memory = [parse_size(w) for w in words]
        except ValueError as exc:
            fail(f"--gpu-memory: {exc}, got {printable(gpu_memory[:40])}")
    return {"options": options.as_json(), "mode_given": split_mode is not None,
            "gpus": n, "memory": memory}


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
    n_prompt: Annotated[Optional[str], typer.Option("--n-prompt", "-p", help="Prompt sizes for prefill tests, comma-separated (default 512; with --url: about the tokens of each request's prompt; with -npl: as -npp).", show_default=False)] = None,
    n_gen: Annotated[Optional[str], typer.Option("--n-gen", "-n", "--n-predict", help="Token counts for decode tests, comma-separated (default 128; with --url: tokens asked of each request; with -npl: as -ntg).", show_default=False)] = None,
    n_pp: Annotated[Optional[str], typer.Option("-npp", "--n-pp", metavar="N,N,...", help="With -npl: prompt sizes PP, comma-separated (llama-batched-bench's; default 128).", show_default=False)] = None,
    n_tg: Annotated[Optional[str], typer.Option("-ntg", "--n-tg", metavar="N,N,...", help="With -npl: decode steps TG per sequence, comma-separated (llama-batched-bench's; default 128).", show_default=False)] = None,
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
    split_mode: SplitModeOpt = None,
    tensor_split: TensorSplitOpt = None,
    main_gpu: MainGpuOpt = None,
    device: DeviceOpt = None,
    url: Annotated[Optional[str], typer.Option(
        "--url", metavar="URL",
        help="Instead: load a running OpenAI-compatible server (llamacli serve, llama-server, vLLM) at "
             "http://HOST:PORT with concurrent streaming clients: tok/s, req/s, time to first token, inter-token "
             "and end-to-end latency (p50, p99) per --clients level; -p and -n give one prompt size and reply.")] = None,
    clients: Annotated[Optional[str], typer.Option(
        "--clients", "-npl", metavar="N,N,...",
        help="Sequences at once, comma-separated (llama-batched-bench's -npl): without --url, B sequences "
             "decoded together here, llama-batched-bench's table per -npp, -ntg and B; with --url, concurrent "
             "clients, a level each (default 1,4,16).")] = None,
    requests: Annotated[Optional[int], typer.Option(
        "--requests", metavar="M", help="With --url: requests per level (default: 4 x clients, at least 8).")] = None,
    chat: Annotated[bool, typer.Option(
        "--chat", help="With --url: POST /v1/chat/completions (the prompt a user message) instead of /v1/completions.")] = False,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="LLAMACLI_API_KEY", show_envvar=True,
        help="With --url: send `Authorization: Bearer KEY` (the environment variable keeps it out of the process list).")] = None,
    api_key_file: Annotated[Optional[str], typer.Option(
        "--api-key-file", help="With --url: read the key from the first line of this file.")] = None,
    shared_prefix: Annotated[int, typer.Option(
        "--shared-prefix", metavar="N",
        help="With --url: the first N of -p's tokens are the same in every prompt (a system message with --chat), "
             "for a server's prefix cache to reuse; by default every prompt differs from its first word.")] = 0,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos/--no-ignore-eos",
        help="With --url: send \"ignore_eos\": true, so that llama-server and vLLM generate all -n tokens (the "
             "rows count what each server did generate).")] = True,
    timeout: Annotated[float, typer.Option(
        "--timeout", metavar="S", help="With --url: seconds a request may take in all; past them it counts as failed.")] = 600.0,
    seed: Annotated[Optional[int], typer.Option(
        "--seed", help="With --url: the prompts' random words (default: new ones each run, so that no cache "
                       "holds them from an earlier run).")] = None,
    spec_type: SpecTypeOpt = None,
    draft_max: DraftMaxOpt = DEFAULT_DRAFT_MAX,
    draft_min: DraftMinOpt = 0,
    spec_ngram_size_n: NgramSizeOpt = DEFAULT_NGRAM_N,
    model_draft: ModelDraftOpt = None,
    prompt_file: PromptFileOpt = None,
    verify_cost: Annotated[Optional[str], typer.Option(
        "--verify-cost", metavar="K,K,...",
        help="Instead: what a verification pass of 1 + K tokens (speculative decoding: the last id and K drafts) "
             "costs against one decode step, greedy, after -d's first depth of context.")] = None,
) -> None:
    """Measure prefill (ppN) and decode (tgN) speed, with GB/s and the share of the memory bandwidth.
    --profile breaks one prefill and one decode step down by kernel family; --kernels times single kernels;
    -npl decodes several sequences at once (llama-batched-bench's table: `bench -npl 1,4,16,64 -npp 128 -ntg 128`);
    --url loads a running server with concurrent clients instead (`bench --url http://127.0.0.1:8080 -npl 1,4,16`).
    --spec-type / -md compare instead a greedy reply of up to -n tokens to one prompt (-f; by default an echo task)
    with and without speculative decoding: tokens/s, drafts accepted, tokens per pass, the same reply or not."""
    load = {"--requests": requests is not None, "--chat": chat,
            "--api-key-file": api_key_file is not None, "--shared-prefix": shared_prefix != 0,
            "--no-ignore-eos": not ignore_eos, "--timeout": timeout != 600.0, "--seed": seed is not None}
    speculative = None
    if spec_type is not None or model_draft is not None:
        speculative = speculative_settings(spec_type, draft_max, draft_min, spec_ngram_size_n, model_draft)
        if not speculative.on:
            fail("bench compares speculative decoding with plain decoding: give --spec-type ngram-simple or -md, "
                 "and --draft-max > 0")
        others = {"--url": url is not None, "--profile": profile, "--kernels": kernels, "--pg": bool(pg),
                  "-d": n_depth != "0", "-npl": clients is not None, "-npp": n_pp is not None,
                  "--verify-cost": verify_cost is not None}
        given = [name for name, on in others.items() if on]
        if given:
            fail(f"{given[0]} is another run than --spec-type / -md's comparison: pick one")
    elif prompt_file is not None:
        fail("-f gives bench's prompt for the comparison that --spec-type / -md ask for")
    if verify_cost is not None:
        others = {"--url": url is not None, "--profile": profile, "--kernels": kernels, "--pg": bool(pg),
                  "-npl": clients is not None}
        given = [name for name, on in others.items() if on]
        if given:
            fail(f"{given[0]} is another run than --verify-cost: pick one")
    if url is not None:
        model_only = {"--profile": profile, "--kernels": kernels, "--pg": bool(pg), "-d": n_depth != "0",
                      "-r": reps != 5, "--ctx": ctx is not None, "--backend": backend != "auto",
                      "-ngl": gpu_layers is not None, "-fa": flash_attn, "-ctk": cache_type_k != "f16",
                      "-ctv": cache_type_v != "f16", "--swa-full": swa_full, "-npp": n_pp is not None,
                      "-ntg": n_tg is not None, "--split-mode": split_mode is not None,
                      "--tensor-split": tensor_split is not None, "--main-gpu": main_gpu is not None,
                      "-dev": device is not None}
        given = [name for name, on in model_only.items() if on]
        if given:
            fail(f"{given[0]} measures a model here, not a server: leave it out with --url")
        return bench_server(url, pick_model(model_arg, model), n_prompt or "512", n_gen or "128", output, clients,
                            requests, chat, api_key, api_key_file, shared_prefix, ignore_eos, timeout, seed)
    given = [name for name, on in load.items() if on]
    if given:
        fail(f"{given[0]} goes with --url (a running server to load)")
    if clients is not None:
        batched = {"--profile": profile, "--kernels": kernels, "--pg": bool(pg), "-d": n_depth != "0",
                   "-r": reps != 5}
        given = [name for name, on in batched.items() if on]
        if given:
            fail(f"{given[0]} does not go with -npl (llama-batched-bench's table: -npp, -ntg, -npl)")
        for flag, short, a, b in (("-npp", "-p", n_pp, n_prompt), ("-ntg", "-n", n_tg, n_gen)):
            if a is not None and b is not None:
                fail(f"{flag} and {short} give the same sizes with -npl: give one")
        return bench_batched(pick_model(model_arg, model), clients, n_pp or n_prompt or "128", n_tg or n_gen or "128",
                             output, ctx, backend, gpu_layers, flash_attn, (cache_type_k, cache_type_v), swa_full,
                             split_options(split_mode, tensor_split, main_gpu, device))
    if n_pp is not None or n_tg is not None:
        fail(f"{'-npp' if n_pp is not None else '-ntg'} goes with -npl (sequences decoded at once)")
    n_prompt, n_gen = n_prompt or "512", n_gen or "128"
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
    split = split_options(split_mode, tensor_split, main_gpu, device)
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
    if verify_cost is not None:
        from ..engine.bench import render_verify_cost, run_verify_cost

        drafts, depth = parse_list(verify_cost, "--verify-cost"), (parse_list(n_depth, "-d") or [0])[0]
        m = load_model(model, backend, ctx or max(depth + 80, 512), False, gpu_layers, flash_attn,
                       user_ctx=ctx is not None, cache_types=(cache_type_k, cache_type_v), swa_full=swa_full)
        vrows = run_verify_cost(m, drafts, reps, depth, progress=dim)
        print(render_verify_cost(vrows, output, m.backend.device_name()))
        return
    if speculative is not None:
        from ..engine.bench import echo_prompt, render_spec, run_spec_bench

        sizes = parse_list(n_gen, "-n")
        if len(sizes) != 1 or not sizes[0]:
            fail(f"with --spec-type / -md, -n takes one positive number (the reply's most tokens), got {n_gen!r}")
        text = read_text(prompt_file, "prompt file") if prompt_file is not None else echo_prompt()
        m = load_model(model, backend, ctx, False, gpu_layers, flash_attn, cache_types=(cache_type_k, cache_type_v),
                       swa_full=swa_full, model_draft=model_draft)
        srows = run_spec_bench(m, text, sizes[0], reps, speculative, progress=dim)
        print(render_spec(srows, output, m.backend.device_name()))
        return
    prompts, gens = parse_list(n_prompt, "-p"), parse_list(n_gen, "-n")
    pairs = [parse_pg(x) for x in pg or []]
    depths = parse_list(n_depth, "-d") or [0]
    need = max([p for p in prompts] + [n for n in gens] + [p + n for p, n in pairs] + [1]) + max(depths)
    m = load_model(model, backend, ctx or max(need + 1, 512), False, gpu_layers, flash_attn,
                   user_ctx=ctx is not None,  # bench's own context is not the user's choice
                   cache_types=(cache_type_k, cache_type_v), swa_full=swa_full, split=split)
    if profile:
        prows, spans, attention = run_profile(m, next((p for p in prompts if p), 512))
        print(render_profile(prows, spans, output, m.backend.device_name(), attention))
        return
    rows, bandwidth = run_bench(m, prompts, gens, pairs, reps, progress=lambda t: dim(f"running {t}"), depths=depths)
    print(render(rows, output, m.backend.device_name(), bandwidth))


def bench_batched(model: str | None, npl: str, npp: str, ntg: str, output: str, ctx: int | None, backend: str,
                  gpu_layers: str | None, flash_attn: bool, cache_types: tuple[str, str], swa_full: bool,
                  split: dict | None = None) -> None:
    """`bench -npl`: the sizes checked, the model loaded with a slot per sequence (engine/batched_bench.py), the
    table on stdout and the progress on stderr. `split`: app.split_options()."""
    from ..engine.batched_bench import check_sizes, context_for, render_batched, run_batched
    from ..engine.bench import parse_list

    if output not in ("md", "json", "csv"):
        fail(f"--output must be md, json or csv, got {output!r}")
    if ctx is not None and ctx <= 0:
        fail(f"--ctx must be positive, got {ctx}")
    pps, tgs, npls = parse_list(npp, "-npp"), parse_list(ntg, "-ntg"), parse_list(npl, "-npl")
    check_sizes(pps, tgs, npls)
    m = load_model(model, backend, ctx or context_for(pps, tgs), False, gpu_layers, flash_attn,
                   user_ctx=ctx is not None, cache_types=cache_types, swa_full=swa_full, split=split)
    try:
        rows = run_batched(m, pps, tgs, npls, progress=dim)
        tensors = m.gguf.tensors.values()
        info = {"model": m.path.name, "size": sum(t.n_bytes for t in tensors),
                "params": sum(t.n_elements for t in tensors), "backend": m.backend.name,
                "device": m.backend.device_name(), "n_ctx": m.ctx}
        print(render_batched(rows, output, info))
    finally:
        m.close()


def bench_server(url: str, model: str | None, n_prompt: str, n_gen: str, output: str, clients: str | None,
                 requests: int | None, chat: bool, api_key: str | None, api_key_file: str | None, shared_prefix: int,
                 ignore_eos: bool, timeout: float, seed: int | None) -> None:
    """`bench --url`: the options checked, the server loaded level by level (serve/loadgen.py), the rows on
    stdout and the progress on stderr."""
    from ..engine.bench import parse_list
    from ..errors import UsageError
    from ..serve.loadgen import LoadSettings, check, notes, parse_clients, parse_url, render, run_load

    if output not in ("md", "json", "csv"):
        fail(f"--output must be md, json or csv, got {output!r}")
    parse_url(url)
    levels = parse_clients(clients if clients is not None else "1,4,16")
    sizes = {}
    for flag, text in (("-p", n_prompt), ("-n", n_gen)):
        values = parse_list(text, flag)
        if len(values) != 1:
            fail(f"with --url, {flag} takes one number (each request's), got {text!r}")
        sizes[flag] = values[0]
    if api_key_file is not None:
        if api_key is not None:
            fail("give the key once: --api-key (or LLAMACLI_API_KEY) or --api-key-file")
        lines = read_text(api_key_file, "API key file", UsageError, limit=1 << 16).splitlines()
        api_key = lines[0].strip() if lines else ""
        if not api_key:
            fail(f"the API key file {printable(api_key_file)} starts with an empty line")
    settings = LoadSettings(url=url, clients=levels, n_predict=sizes["-n"], n_prompt=sizes["-p"], requests=requests,
                            chat=chat, api_key=api_key, model=model, shared_prefix=shared_prefix,
                            ignore_eos=ignore_eos, timeout=timeout, seed=seed)
    check(settings)  # (-p, -n, --shared-prefix, --timeout, --requests, --api-key)
    info, rows = run_load(settings, progress=dim)
    for line in notes(rows):
        dim(line)
    print(render(info, rows, output))
