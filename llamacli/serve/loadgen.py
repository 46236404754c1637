"""`llamacli bench --url URL`: drive a running OpenAI-compatible server (`llamacli serve`, llama.cpp's
`llama-server -np N`, vLLM: anything that streams /v1/completions or /v1/chat/completions) with N concurrent
clients, and measure what its users feel, as `vllm bench serve` does.

Per concurrency level (--clients 1,4,16), M requests (--requests) go out through N clients; each client sends
its next request as soon as its last one ends (a closed loop), every request streamed. Measured:

    tok/s     generated tokens of the level / its wall time (first request sent to last answer read)
    req/s     requests answered / the wall time
    TTFT      time to first token: request sent -> the first chunk that carries generated text
    ITL       inter-token latency: the gaps between a request's chunks that carry text (one token each on
              llamacli serve, llama-server and vLLM, except where a stop string's prefix or an unfinished
              character holds text back; `chunks` beside `gen_tokens` says so when it happened)
    TPOT      per request, (e2e - TTFT) / (tokens - 1): the decode time per token after the first
    e2e       request sent -> the stream's end
Tokens are the server's counts (`usage`, asked for with stream_options.include_usage); a server that gives
none has its text chunks counted instead (`tokens_from`: usage or chunks). Requests ask for -n tokens with
`ignore_eos` (llama-server's, vLLM's and llamacli serve's field: generation runs to max_tokens); a server
without it may stop earlier, and the counts say what it did generate, never what was asked.

Prompts are random common English words, different in every request (and in every run: --seed repeats
them), so that no server-side prefix cache makes them trivial; --shared-prefix N makes the first N tokens the
same in all (a system message with --chat). Two warm-up requests, not counted, first check that the endpoint
answers and then measure how many tokens the server makes of a given number of words (its tokenizer and chat
template), so that a prompt comes out at about -p tokens; the rows give the tokens the server counted.

Bounds: each request has --timeout seconds in all, and its bytes and memory are bounded (loadclient.py says
how); a level keeps a few numbers per request and one histogram of the inter-token gaps, not every chunk. A
request that fails is counted by its reason; a server that cannot be reached (at the start or mid-run), or a
level where every request fails, ends the run with one LoadError line. No model, backend or server code is
imported: the clients are loadclient.py's, on the standard library.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import Interrupted, LlamacliError, UsageError
from ..textio import brief, csv_text, printable
from .loadclient import (
    Client,
    LogHistogram,
    Outcome,
    Unreachable,
    error_message,
    parse_url,
    read_body,
    reason,
)

WARMUP_TOKENS = 8  # tokens asked of each warm-up request (at most -n)

# Common English words, most of them one token in the usual vocabularies (GPT-2's, Llama's, Qwen's,
# SentencePiece's): prompts are drawn from them, and the warm-up measures what a word costs on this server.
WORDS = tuple("""
the of and to in is it that was for on are with as his they be at one have this from or had by word but
what some we can out other were all there when up use your how said an each she which do their time if will
way about many then them write would like so these her long make thing see him two has look more day could go
come did number sound no most people my over know water than call first who may down side been now find any
new work part take get place made live where after back little only round man year came show every good me
give our under name very through just form sentence great think say help low line turn cause much mean before
move right boy old too same tell does set three want air well also play small end put home read hand port
large spell add even land here must big high such follow act why ask men change went light kind off need
house picture try us again animal point mother world near build self earth father head stand own page should
country found answer school grow study still learn plant cover food sun four between state keep eye never
last let thought city tree cross farm hard start might story saw far sea draw left late run while press close
night real life few north open seem together next white children begin got walk example paper group always
music those both mark often letter until mile river car feet care second book carry took science eat room
friend began idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain
girl young ready above ever red list though feel talk bird soon body dog family leave song door black short
class wind question happen complete ship area half rock order fire south problem piece told knew pass since
top whole king space heard best hour better true during hundred five remember step early hold west ground
interest reach fast sing listen six table travel less morning ten simple several toward war lay against slow
center love person money serve road map rain rule pull cold notice voice unit power town fine certain fly
fall lead cry dark machine note wait plan figure star box field rest able done drive stood front teach week
gave green quick ocean warm free minute strong mind behind clear tail fact street nothing course stay wheel
full force blue object deep moon island foot system busy test record boat common gold plane dry laugh
""".split())


class LoadError(LlamacliError):
    """The run cannot go on: the server cannot be reached, refuses the key, answers something else than the
    API, stops answering, or fails every request of a level (exit 1)."""


def parse_clients(text: str) -> list[int]:
    """--clients / -npl: comma-separated positive integers, each level run in the order given."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--clients takes comma-separated positive integers, got {brief(text)}") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"--clients takes comma-separated positive integers, got {brief(text)}")
    if max(values) > MAX_CLIENTS:
        raise UsageError(f"--clients: at most {MAX_CLIENTS} at once, got {max(values)}")
    return values


MAX_CLIENTS = 4096  # threads of one process; beyond that, more machines


# -- statistics -----------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values`, interpolated between the two nearest ranks (numpy's
    default), or None when there are none."""
    if not values:
        return None
    s = sorted(values)
    at = (len(s) - 1) * q / 100
    lo = math.floor(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


# -- prompts --------------------------------------------------------------------------------------------------


class Prompts:
    """Random word prompts of about -p tokens. `words` is the count per prompt (set from the warm-up's
    measure), `shared_text` the words all prompts begin with (--shared-prefix)."""

    def __init__(self, n_prompt: int, shared_tokens: int, seed: int | None):
        self.rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
        self.n_prompt, self.shared_tokens = n_prompt, shared_tokens
        self.words, self.shared_words, self.shared_text = n_prompt, 0, ""
        self.lock = threading.Lock()

    def _text(self, n: int) -> str:
        with self.lock:
            return " ".join(self.rng.choices(WORDS, k=n))

    def fit(self, words: int) -> None:
        """`words` a prompt from now on, of which the shared part's share is drawn once here."""
        self.words = max(1, words)
        self.shared_words = min(self.words - 1, round(self.words * self.shared_tokens / self.n_prompt))
        self.shared_text = self._text(self.shared_words) if self.shared_words > 0 else ""

    def next(self) -> tuple[str, str]:
        """(shared part, own part) of the next prompt; the own part is never empty."""
        return self.shared_text, self._text(max(1, self.words - max(self.shared_words, 0)))


# -- a level ----------------------------------------------------------------------------------------------


@dataclass
class LevelRow:
    """One concurrency level's measurements."""

    clients: int
    requests: int
    outcomes: list[Outcome]
    duration: float  # s, from the first request sent to the last answer read
    itl: LogHistogram = field(default_factory=LogHistogram)

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is None]

    @property
    def errors(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for o in self.outcomes:
            if o.error is not None:
                found[o.error] = found.get(o.error, 0) + 1
        return dict(sorted(found.items()))

    @property
    def gen_tokens(self) -> int:
        return sum(o.tokens for o in self.ok)

    @property
    def prompt_tokens(self) -> int | None:
        counts = [o.prompt_tokens for o in self.ok]
        return sum(c for c in counts if c is not None) if counts and None not in counts else None

    @property
    def tokens_from(self) -> str:
        return "usage" if self.ok and all(o.gen_tokens is not None for o in self.ok) else "chunks"

    def as_dict(self) -> dict[str, Any]:
        ok = self.ok

        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1e3, 3)

        def stat(name: str, values: list[float]) -> dict[str, float | None]:
            mean = sum(values) / len(values) if values else None
            return {f"{name}_ms_mean": ms(mean), f"{name}_ms_p50": ms(percentile(values, 50)),
                    f"{name}_ms_p99": ms(percentile(values, 99))}

        d: dict[str, Any] = {
            "clients": self.clients, "requests": self.requests, "ok": len(ok),
            "failed": len(self.outcomes) - len(ok), "errors": self.errors,
            "prompt_tokens": self.prompt_tokens, "gen_tokens": self.gen_tokens, "chunks": sum(o.chunks for o in ok),
            "tokens_from": self.tokens_from, "duration_s": round(self.duration, 4),
            "gen_tps": round(self.gen_tokens / self.duration, 3) if self.duration > 0 else None,
            "req_per_s": round(len(ok) / self.duration, 4) if self.duration > 0 else None,
        }
        d.update(stat("ttft", [o.ttft for o in ok if o.ttft is not None]))
        d.update({"itl_ms_mean": ms(self.itl.mean), "itl_ms_p50": ms(self.itl.percentile(50)),
                  "itl_ms_p99": ms(self.itl.percentile(99))})
        d.update(stat("tpot", [t for o in ok if (t := o.tpot) is not None]))
        d.update(stat("e2e", [o.e2e for o in ok]))
        return d


# -- the run ----------------------------------------------------------------------------------------------


@dataclass
class LoadSettings:
    url: str
    clients: list[int]
    n_predict: int = 128
    n_prompt: int = 512
    requests: int | None = None  # per level; None: 4 x clients, at least 8
    chat: bool = False
    api_key: str | None = None
    model: str | None = None  # None: the first of GET /v1/models
    shared_prefix: int = 0  # tokens of -p that every prompt shares
    ignore_eos: bool = True
    timeout: float = 600.0  # s per request
    seed: int | None = None  # the prompts' words; None: new ones each run

    def requests_for(self, clients: int) -> int:
        return self.requests if self.requests is not None else max(8, 4 * clients)


MAX_TOKENS = 1 << 20  # -p and -n: a million tokens, past any server's context
MAX_TIMEOUT = 1e6  # s (a socket's timeout must fit a C timeval)


def check(s: LoadSettings) -> None:
    """Each setting, or a UsageError naming the option."""
    for flag, n in (("-p", s.n_prompt), ("-n", s.n_predict)):
        if not 1 <= n <= MAX_TOKENS:
            raise UsageError(f"with --url, {flag} takes one number in 1..{MAX_TOKENS} (each request's), got {n}")
    if not 0 <= s.shared_prefix < s.n_prompt:
        raise UsageError(f"--shared-prefix must lie in 0..{s.n_prompt - 1} (less than -p), got {s.shared_prefix}")
    if not 0 < s.timeout <= MAX_TIMEOUT:  # (NaN too)
        raise UsageError(f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {s.timeout}")
    if s.requests is not None and s.requests < 1:
        raise UsageError(f"--requests must be >= 1, got {s.requests}")
    if not s.clients or any(not 1 <= c <= MAX_CLIENTS for c in s.clients):
        raise UsageError(f"--clients takes numbers in 1..{MAX_CLIENTS}, got {s.clients}")
    if s.api_key is not None:
        try:
            s.api_key.encode("latin-1")  # (what an HTTP header holds)
            ok = bool(s.api_key.strip()) and s.api_key.isprintable()
        except UnicodeEncodeError:
            ok = False
        if not ok:
            raise UsageError("--api-key must be printable text of Latin-1 characters (an HTTP header), and not empty")
    parse_url(s.url)


@dataclass
class RunInfo:
    """What the rows have in common: where, which model, which endpoint, and what each request asked."""

    url: str
    model: str
    endpoint: str
    n_prompt: int
    n_predict: int
    prompt_words: int  # words a prompt was given for -p tokens (the warm-up's measure)
    shared_prefix: int

    def as_dict(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.model, "endpoint": self.endpoint, "n_prompt": self.n_prompt,
                "n_predict": self.n_predict, "shared_prefix": self.shared_prefix, "prompt_words": self.prompt_words}


class LoadTest:
    """A run against one server: the model's name, the warm-up, then each level (run_level)."""

    def __init__(self, s: LoadSettings, progress: Callable[[str], None] | None = None):
        check(s)
        self.s, self.target = s, parse_url(s.url)
        self.progress = progress or (lambda line: None)
        self.headers = {"Accept": "text/event-stream"}
        if s.api_key is not None:
            self.headers["Authorization"] = f"Bearer {s.api_key}"
        self.path = "/v1/chat/completions" if s.chat else "/v1/completions"
        self.prompts = Prompts(s.n_prompt, s.shared_prefix, s.seed)
        self.model = s.model

    # the start: the model's name, the warm-up and the prompts' size

    def start(self) -> RunInfo:
        if self.model is None:
            self.model = self.first_model()
        words = self.calibrate()
        self.prompts.fit(words)
        self.progress(f"warmed up {self.target.url}{self.path} (model {printable(self.model)}): prompts of {words} "
                      f"words for -p {self.s.n_prompt}")
        return RunInfo(self.target.url, self.model, self.path, self.s.n_prompt, self.s.n_predict, words,
                       self.s.shared_prefix)

    def first_model(self) -> str:
        """The first model GET /v1/models lists, checking on the way that the server is there and takes the key."""
        client = Client(self.target, {k: v for k, v in self.headers.items() if k != "Accept"}, self.s.timeout)
        where = f"{self.target.url}/v1/models"
        got: list[Any] = []

        def ask() -> None:
            try:
                resp, _ = client.send("GET", "/v1/models", None)
                got.append((resp.status, read_body(resp)))
            except Unreachable as exc:
                got.append(LoadError(str(exc)))
            except TimeoutError:
                got.append(LoadError(f"{where} did not answer within --timeout {self.s.timeout:g} s"))
            except (OSError, http.client.HTTPException) as exc:
                late = client.timed_out
                got.append(LoadError(f"{where} did not answer within --timeout {self.s.timeout:g} s" if late else
                                     f"{where}: the connection broke: {reason(exc)}"))
            except Exception as exc:  # noqa: BLE001 (a bug of ours: still one line)
                got.append(LoadError(f"internal error: {type(exc).__name__}: {exc}"))
            finally:
                client.done()
                client.close()

        _watch([client], [ask])
        if isinstance(got[0], LoadError):
            raise got[0]
        status, body = got[0]
        if status != 200:
            raise LoadError(self._refusal(status, error_message(body), where))
        try:
            name = json.loads(body)["data"][0]["id"]
        except (ValueError, RecursionError, KeyError, IndexError, TypeError):
            raise LoadError(f"{where} lists no model (is this an OpenAI-compatible server?); name one with "
                            "--model") from None
        if not isinstance(name, str) or not name or len(name) > 1024:
            raise LoadError(f"{where} gives no usable model name; name one with --model")
        return name

    def _refusal(self, status: int, message: str, where: str) -> str:
        if status in (401, 403):
            hint = "wrong --api-key" if self.s.api_key is not None else "this server needs --api-key"
            return f"{where}: {status} ({hint}): {message}"
        if status == 404:
            return f"{where}: 404 (is --url the server's address, and does it serve this endpoint?): {message}"
        return f"{where}: {status}: {message}"

    def body(self, shared: str, own: str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.s.ignore_eos:
            body["ignore_eos"] = True
        if self.s.chat:
            system = [{"role": "system", "content": shared}] if shared else []
            body["messages"] = system + [{"role": "user", "content": own}]
        else:
            body["prompt"] = f"{shared} {own}" if shared else own
        return body

    def warmup(self) -> Outcome:
        """One request of the prompts' present size, not counted; its failure ends the run (it says what is
        wrong)."""
        client = Client(self.target, self.headers, self.s.timeout)
        body = self.body(*self.prompts.next(), min(WARMUP_TOKENS, self.s.n_predict))
        got: list[Outcome | LoadError] = []

        def ask() -> None:
            try:
                got.append(client.request(self.path, body, self.s.chat))
            except Unreachable as exc:
                got.append(LoadError(str(exc)))
            except Exception as exc:  # noqa: BLE001 (a bug of ours: still one line)
                got.append(LoadError(f"internal error: {type(exc).__name__}: {exc}"))
            finally:
                client.close()

        _watch([client], [ask])
        out = got[0]
        if isinstance(out, LoadError):
            raise out
        if out.error is not None:
            where = f"{self.target.url}{self.path}"
            if out.error.isdigit():
                raise LoadError("the warm-up request failed: " + self._refusal(int(out.error), out.message, where))
            raise LoadError(f"the warm-up request failed: {where}: {out.message}")
        return out

    def calibrate(self) -> int:
        """Words a prompt needs for about -p tokens: two warm-up requests (of -p/2 and -p/4 words, so that
        they fit a context that -p fits, with a shared prefix's share alike) give the server's tokens a word
        and the tokens it adds (BOS, the chat template). Without usage in the answers: -p words."""
        n = self.s.n_prompt
        w1, w2 = (n + 1) // 2, (n + 3) // 4
        self.prompts.fit(w1)
        first = self.warmup()
        if first.prompt_tokens is None or first.gen_tokens is None:
            self.progress("the server reports no usage: prompts are -p words, and tokens are counted as chunks")
            return n
        if w2 == w1:
            return max(1, round(n * w1 / max(first.prompt_tokens, 1)))
        self.prompts.fit(w2)
        second = self.warmup()
        if second.prompt_tokens is None or second.prompt_tokens >= first.prompt_tokens:
            return max(1, round(n * w1 / max(first.prompt_tokens, 1)))
        per_word = (first.prompt_tokens - second.prompt_tokens) / (w1 - w2)
        extra = first.prompt_tokens - per_word * w1
        return max(1, round((n - extra) / per_word))

    # a level

    def run_level(self, clients: int) -> LevelRow:
        """`clients` clients send the level's requests, each its next as soon as its last one ended."""
        total = self.s.requests_for(clients)
        self.progress(f"running {_clients(clients)}, {total} requests")
        lock = threading.Lock()
        issued = 0
        outcomes: list[Outcome] = []
        fatal: list[str] = []
        workers = [Client(self.target, self.headers, self.s.timeout) for _ in range(min(clients, total))]

        def work(client: Client) -> None:
            nonlocal issued
            try:
                while not fatal:
                    with lock:
                        if issued == total:
                            return
                        issued += 1
                    body = self.body(*self.prompts.next(), self.s.n_predict)  # made here: M prompts are not held
                    try:
                        out = client.request(self.path, body, self.s.chat)
                    except Unreachable as exc:
                        fatal.append(str(exc))
                        return
                    except Exception as exc:  # noqa: BLE001 (a bug of ours: still one line, and the run stops)
                        fatal.append(f"internal error: {type(exc).__name__}: {exc}")
                        return
                    with lock:
                        outcomes.append(out)
            finally:
                client.close()

        t0 = time.perf_counter()
        _watch(workers, [lambda c=c: work(c) for c in workers], stop=lambda: bool(fatal))
        duration = time.perf_counter() - t0
        if fatal:
            raise LoadError(f"the server stopped answering at {_clients(clients)}, after {len(outcomes)} of {total} "
                            f"requests: {fatal[0]}")
        row = LevelRow(clients, total, outcomes, duration)
        for c in workers:
            row.itl.merge(c.itl)
        if not row.ok:
            summary = ", ".join(f"{n} x {'HTTP ' * k.isdigit()}{k}" for k, n in row.errors.items())
            raise LoadError(f"every request failed at {_clients(clients)} ({summary}); the first: {outcomes[0].message}")
        return row


def _clients(n: int) -> str:
    return f"{n} client" + "s" * (n != 1)


def _watch(clients: list[Client], jobs: list[Callable[[], None]], stop: Callable[[], bool] = lambda: False) -> None:
    """Run the jobs on threads of their own and wait for them, meanwhile cutting off any client's request that
    passes its deadline, and every client's once `stop()` says so. Ctrl-C aborts them all (Interrupted)."""
    threads = [threading.Thread(target=job, daemon=True, name=f"llamacli-load-{i}") for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.05)
                now, stopping = time.monotonic(), stop()
                for c in clients:
                    if stopping:
                        c.abort()
                    else:
                        c.check(now)
    except KeyboardInterrupt:
        for c in clients:
            c.abort()
        raise Interrupted("interrupted") from None


def run_load(s: LoadSettings, progress: Callable[[str], None] | None = None) -> tuple[RunInfo, list[LevelRow]]:
    """The warm-up, then every level of `s.clients` in turn -> (what the rows share, the rows)."""
    test = LoadTest(s, progress)
    info = test.start()
    rows = [test.run_level(c) for c in s.clients]
    return info, rows


# -- output -------------------------------------------------------------------------------------------------


def render(info: RunInfo, rows: list[LevelRow], fmt: str) -> str:
    """The rows as `llamacli bench` prints its own: a Markdown table (md), a JSON array of flat rows, or CSV."""
    dicts = [{**info.as_dict(), **r.as_dict()} for r in rows]
    for d in dicts:
        d["model"] = printable(d["model"])
    if fmt == "json":
        return json.dumps(dicts, indent=2)
    if fmt == "csv":
        return csv_text([{**d, "errors": ";".join(f"{k}:{n}" for k, n in d["errors"].items())} for d in dicts])
    prompt = f"-p {info.n_prompt}" + (f" (shared {info.shared_prefix})" if info.shared_prefix else "")
    head = ["clients", "requests", "errors", "prompt tok", "gen tok", "tok/s", "req/s", "TTFT p50", "TTFT p99",
            "ITL p50", "ITL p99", "TPOT p50", "e2e p50", "e2e p99"]
    lines = [f"server: {printable(info.url)}{info.endpoint}; model: {printable(info.model)}; {prompt}, "
             f"-n {info.n_predict}; latencies in ms", "",
             "| " + " | ".join(head) + " |", "| " + " | ".join(["---:"] * len(head)) + " |"]

    def num(x: float | None, digits: int = 1) -> str:
        return "" if x is None else f"{x:,.{digits}f}"

    for r, d in zip(rows, dicts):
        errors = ", ".join(f"{k}: {n}" for k, n in r.errors.items())
        cells = [str(r.clients), str(r.requests), f"{d['failed']}" + (f" ({errors})" if errors else ""),
                 "" if d["prompt_tokens"] is None else f"{d['prompt_tokens']:,}",
                 f"{d['gen_tokens']:,}" + ("" if d["tokens_from"] == "usage" else " (chunks)"),
                 num(d["gen_tps"]), num(d["req_per_s"], 2), num(d["ttft_ms_p50"]), num(d["ttft_ms_p99"]),
                 num(d["itl_ms_p50"], 2), num(d["itl_ms_p99"], 2), num(d["tpot_ms_p50"], 2), num(d["e2e_ms_p50"]),
                 num(d["e2e_ms_p99"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(rows: list[LevelRow]) -> list[str]:
    """What the reader of the table should know (for stderr): chunks that held several tokens."""
    found = []
    for r in rows:
        d = r.as_dict()
        if d["tokens_from"] == "usage" and d["chunks"] < d["gen_tokens"]:
            found.append(f"{_clients(r.clients)}: {d['gen_tokens']:,} tokens came in {d['chunks']:,} chunks: the ITL "
                         "is per chunk there (TPOT is per token)")
    return found
