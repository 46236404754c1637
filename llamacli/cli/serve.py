"""`llamacli serve`: an OpenAI-compatible HTTP server over one model (serve/server.py makes it, serve/app.py holds
the app, serve/api.py the wire format). Starlette and uvicorn come with the `serve` extra and are imported only
when the command runs, so that the rest of llamacli works without them."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..engine.speculative import DEFAULT_DRAFT_MAX, DEFAULT_NGRAM_N
from ..errors import UsageError
from ..textio import printable, read_text
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
    SpecTypeOpt,
    SplitModeOpt,
    SwaFullOpt,
    TensorSplitOpt,
    ThreadsOpt,
    check_gpu_layers,
    command,
    dim,
    fail,
    is_verbose,
    load_model,
    speculative_settings,
    split_options,
)
from .generate import pick_model, prompt_notices, startup_line, template_line


@command()
def serve(
    model_arg: ModelArg = None,
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free one).")] = 8080,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="LLAMACLI_API_KEY", show_envvar=True,
        help="Require `Authorization: Bearer KEY` on every request (the environment variable keeps it out of "
             "the process list).")] = None,
    api_key_file: Annotated[Optional[str], typer.Option(
        "--api-key-file", help="Read the key from the first line of this file (llama-server's option).")] = None,
    ctx: CtxOpt = None,
    backend: BackendOpt = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No notices or request log on stderr.")] = False,
    threads: ThreadsOpt = None,
    gpu_layers: GpuLayersOpt = None,
    flash_attn: FlashAttnOpt = False,
    cache_type_k: CacheTypeKOpt = "f16",
    cache_type_v: CacheTypeVOpt = "f16",
    swa_full: SwaFullOpt = False,
    split_mode: SplitModeOpt = None,
    tensor_split: TensorSplitOpt = None,
    main_gpu: MainGpuOpt = None,
    device: DeviceOpt = None,
    parallel: Annotated[Optional[int], typer.Option(
        "--parallel", "-np", help="Requests generated at once, each in a cache slot of its own (llama-server's "
        "-np); more wait in arrival order. Default: 4 where the backend runs several and the memory holds "
        "them, else 1.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", "-b", "--max-num-batched-tokens", metavar="N",
        help="Prompt tokens prefilled per scheduler turn (llama-server's -b, vLLM's --max-num-batched-tokens): a "
             "longer prompt runs in parts with the running requests' decode steps in between. Default: 2048.", show_default=False)] = None,
    cache_ram: Annotated[Optional[int], typer.Option(
        "--cache-ram", "-cram", metavar="MiB",
        help="Memory the prefix cache may use, in MiB (llama-server's option; on CUDA it is GPU memory): prompts' "
             "K/V blocks kept for any later request. 0 turns it off. Default: as many positions as the slots "
             "hold, at most 8192 MiB and a quarter of the free memory.")] = None,
    use_prefix_cache: Annotated[bool, typer.Option(
        "--prefix-cache/--no-prefix-cache", "--enable-prefix-caching/--no-enable-prefix-caching",
        help="The prefix cache (on by default; vLLM's names too). Off: a request reuses only what its own slot "
             "holds.")] = True,
    cache_reuse: Annotated[Optional[int], typer.Option(
        "--cache-reuse", metavar="N",
        help="Accepted for llama-server's command lines and explained: llamacli does not shift cached K/V to "
             "reuse chunks at other positions; prompts reuse cached prefixes.", show_default=False)] = None,
    spec_type: SpecTypeOpt = None,
    draft_max: DraftMaxOpt = DEFAULT_DRAFT_MAX,
    draft_min: DraftMinOpt = 0,
    spec_ngram_size_n: NgramSizeOpt = DEFAULT_NGRAM_N,
    model_draft: ModelDraftOpt = None,
) -> None:
    """Serve the model over the OpenAI HTTP API: POST /v1/chat/completions and /v1/completions (streamed
    with "stream": true), Anthropic's /v1/messages, OpenAI's /v1/responses, GET /v1/models, /health and /metrics
    (Prometheus). One model; up to --parallel requests generate at once, the rest wait in arrival order; a
    request reuses the KV cache of the slot that holds most of its prompt. --spec-type / -md: speculative decoding
    for every request (a request may set llama-server's "speculative.n_max" and "speculative.n_min"). Ctrl-C
    stops."""
    model = pick_model(model_arg, model)
    if not 0 <= port <= 65535:
        fail(f"--port must lie in 0..65535, got {port}")
    if ctx is not None and ctx <= 0:
        fail(f"--ctx must be positive, got {ctx}")
    if parallel is not None and not 1 <= parallel <= MAX_PARALLEL:
        fail(f"--parallel must lie in 1..{MAX_PARALLEL}, got {parallel}")
    if batch_size is not None and not 1 <= batch_size <= MAX_BATCH_SIZE:
        fail(f"--batch-size must lie in 1..{MAX_BATCH_SIZE}, got {batch_size}")
    if cache_ram is not None and not 0 <= cache_ram <= MAX_CACHE_RAM:
        fail(f"--cache-ram takes MiB from 0 (no prefix cache) to {MAX_CACHE_RAM}, got {cache_ram}")
    if not use_prefix_cache and cache_ram:
        fail("--no-prefix-cache and --cache-ram: give one (--cache-ram 0 turns the prefix cache off too)")
    if cache_reuse is not None and cache_reuse < 0:
        fail(f"--cache-reuse must be >= 0, got {cache_reuse}")
    if not host.strip():  # '' would bind every interface
        fail("--host is empty: give an address (127.0.0.1: this machine only, 0.0.0.0: every interface)")
    if api_key_file is not None:
        if api_key is not None:
            fail("give the key once: --api-key (or LLAMACLI_API_KEY) or --api-key-file")
        lines = read_text(api_key_file, "API key file", UsageError, limit=1 << 16).splitlines()
        api_key = lines[0] if lines else ""
        if not api_key.strip():
            fail(f"the API key file {printable(api_key_file)} starts with an empty line")
    if api_key is not None and not api_key.strip():
        fail("--api-key is empty")
    check_gpu_layers(gpu_layers)
    split = split_options(split_mode, tensor_split, main_gpu, device)
    speculative = speculative_settings(spec_type, draft_max, draft_min, spec_ngram_size_n, model_draft)
    from ..serve.server import listen, make_server, need_extra

    need_extra()
    sock = listen(host, port)
    try:
        m = load_model(model, backend, ctx, quiet, gpu_layers, flash_attn, cache_types=(cache_type_k, cache_type_v),
                       swa_full=swa_full, split=split, model_draft=model_draft)
        m.speculative = speculative  # every request's, unless it sets its own bounds
        from ..serve.app import stderr_log

        try:
            slots = parallel_slots(m, parallel, None if quiet else dim)
            cached = prefix_cache(m, cache_ram if use_prefix_cache else 0, None if quiet else dim)
            server = make_server(m, m.path.stem, sock, api_key, None if quiet else stderr_log,
                                 prefill_budget=batch_size)
        except BaseException:
            m.close()
            raise
        where = sock.getsockname()
        url_host = printable(f"[{host}]" if ":" in host else host)
        if is_verbose():
            dim(startup_line(m))
            dim(template_line(m, chat=True) + " (/v1/chat/completions; /v1/completions sends prompts as they are)")
        if not quiet:
            for line in prompt_notices(m, None, chat=True):
                dim(line)
            if cache_reuse:
                dim(f"--cache-reuse {cache_reuse}: llamacli does not shift cached K/V to reuse chunks at other "
                    "positions (llama-server's KV shifting); a prompt reuses the cached prefix it starts with")
            if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
                dim(f"listening on {printable(host)} without --api-key: anyone who reaches this port can use the model")
            at_once = "one request at a time" if slots == 1 else f"{slots} requests at once"
            spec = (f"; speculative decoding ({', '.join(speculative.sources)}, up to {speculative.draft_max} drafted "
                    "tokens a pass)" if speculative.on else "")
            dim(f"serving {printable(m.path.name)} ({m.backend.name}, context {m.ctx}) on http://{url_host}:{where[1]}/v1; "
                f"{at_once}{cached}{spec}; Ctrl-C stops")
        try:
            server.run(sockets=[sock])
        finally:
            server.engine.close()
            m.close()
    finally:
        sock.close()


MAX_PARALLEL = 256  # --parallel's bound (each slot holds a context's KV cache)
MAX_BATCH_SIZE = 1 << 20  # --batch-size's bound (prompt tokens a turn: past any context)
MAX_CACHE_RAM = 1 << 30  # --cache-ram's bound in MiB (a pebibyte: beyond any machine's memory, and a sane int)
DEFAULT_PARALLEL = 4


def parallel_slots(m, parallel: int | None, notice) -> int:  # noqa: ANN001 (a Model; notice: dim or None)
    """Give the model the cache slots serve runs at once: `parallel` (--parallel), or DEFAULT_PARALLEL where the
    backend holds several and the memory the caches (fewer where it holds fewer); 1 on a backend that holds one
    sequence, with a notice when more were asked for. -> the slots."""
    from ..errors import BackendError, DeviceMemoryError, HostMemoryError

    want = parallel or DEFAULT_PARALLEL
    while want > 1:
        try:
            m.set_slots(want)
            return want
        except (HostMemoryError, DeviceMemoryError):
            if parallel is not None:
                raise
            want //= 2  # the default: as many as fit
        except BackendError:
            if parallel is not None and notice is not None:
                notice(f"the {m.backend.name} backend generates one request at a time: --parallel {parallel} "
                       "makes the others wait their turn")
            return 1
    return 1


def prefix_cache(m, mib: int | None, notice) -> str:  # noqa: ANN001 (a Model; notice: dim or None)
    """Give the model its prefix cache (engine/prefix_cache.py): `mib` MiB (--cache-ram; 0: none; None: the
    default bound). -> what the start-up line says of it ("" where there is none). Where it cannot run (a model
    with recurrent layers, a bound under one block) a notice says why; where the memory is not there, the
    default bound gives up with a notice, and a bound the user gave is an error."""
    from ..engine.prefix_cache import PrefixCacheOff
    from ..errors import BackendError, HostMemoryError
    from ..units import human_bytes

    if mib == 0:
        return ""
    try:
        cache = m.enable_prefix_cache(None if mib is None else mib << 20)
    except PrefixCacheOff as exc:
        if notice is not None:
            notice(f"no prefix cache: {exc}")
        return ""
    except (BackendError, HostMemoryError) as exc:
        if mib is not None:
            raise
        if notice is not None:
            notice(f"no prefix cache: {exc}")
        return ""
    return f"; prefix cache {human_bytes(cache.capacity * cache.block_bytes)} ({cache.capacity * cache.block:,} positions)"
