"""The generation engine, shared by every backend: tokenize, prefill, decode loop, stop conditions,
streaming, timings. And the Python API: `llamacli.load(path)` -> Model with .generate/.tokenize/.detokenize.

    prompt -> (chat template) -> ids -> prefill(ids not yet in the KV cache) -> logits -> sample -> id
           -> stop? (end-of-generation id, stop string, -n, full context) -> stream text -> decode(id) -> ...

The sequence's cache remembers which ids it holds (`Model.seq`, models/seq_cache.py): a new prompt that starts
with them prefills only the rest, which is what makes a chat turn cheap. Sliding-window layers keep rings
(models/kv_cache.py) that forget: a prefix is reused only while every ring still holds its last window, else
the prompt is prefilled whole (SequenceCache.reusable). Recurrent layers (Gated DeltaNet) resume only where the
backend stored their state: the end of the last prompt, the last decode step, multiples of 256 positions.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Iterator, Sequence

import numpy as np

from ..backends import select_backend, start_early
from ..backends.base import Backend, Progress
from ..backends.split_plan import SplitOptions
from ..backends.step import Sampler, StepOut
from ..background import Background
from ..chat.reasoning import prompt_opens_think, reply_format, split_reasoning
from ..errors import ContextOverflowError, ShapeMismatchError, UsageError
from ..ggufio.file import open_gguf
from ..ggufio.metadata import array_length
from ..models.config import ModelConfig
from ..models.kv_cache import DEFAULT as DEFAULT_CACHE, check_cache_types, parse_cache_types
from ..models.seq_cache import SequenceCache, layer_caches
from ..models.weights import check_tensors
from ..sampling.sampling import SamplingParams, make_rng
from ..tokenizer.tokenizer import StreamDecoder, Tokenizer, TooManyTokens
from .speculative import DraftModel, SpecSettings, Speculation, check_vocabularies
from .tokens import TokenRun, TokenSource, check_cache_salt

if TYPE_CHECKING:
    from ..sampling.structured import Constraint
    from .prefix_cache import PrefixCache

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
DEFAULT_CTX_CAP = 4096  # default context: the model's, capped here (the KV cache grows with it)


@dataclass
class Timings:
    load_ms: float = 0.0
    prompt_ms: float = 0.0
    prompt_tokens: int = 0  # tokens actually prefilled (a reused cache prefix is not counted)
    cached_tokens: int = 0  # prompt tokens not prefilled: their K/V were in the slot or came from the prefix cache
    prefix_cached_tokens: int = 0  # of those, the ones the prefix cache gave (engine/prefix_cache.py)
    eval_ms: float = 0.0
    eval_tokens: int = 0  # ids the decode steps gave (one a step, or several with speculation)
    passes: int = 0  # decode steps (a verification of drafts is one)
    # Speculative decoding (engine/speculative.py): whether it was on, drafts verified and accepted
    speculative: bool = False
    drafted: int = 0
    accepted: int = 0
    # What --verbose shows besides: (stage, ms) of the prompt's way to its first token, and when that came
    # (time.perf_counter()); neither is in as_dict.
    stages: list[tuple[str, float]] = field(default_factory=list)
    first_token_at: float = 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prompt_ms * 1e3 if self.prompt_ms > 0 else 0.0

    @property
    def eval_tokens_per_s(self) -> float:
        return self.eval_tokens / self.eval_ms * 1e3 if self.eval_ms > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "load_ms": round(self.load_ms, 3),
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_per_s": round(self.prompt_tokens_per_s, 3),
            "eval_ms": round(self.eval_ms, 3),
            "eval_tokens": self.eval_tokens,
            "eval_tokens_per_s": round(self.eval_tokens_per_s, 3),
        }

    def report(self) -> list[str]:
        """Lines like llama.cpp's llama_perf_context_print."""

        def per(ms: float, n: int) -> str:
            if n == 0:
                return ""
            return f" ({ms / n:8.2f} ms per token, {n / ms * 1e3 if ms > 0 else 0:8.2f} tokens per second)"

        lines = [
            f"load time        = {self.load_ms:10.2f} ms",
            f"prompt eval time = {self.prompt_ms:10.2f} ms / {self.prompt_tokens:5d} tokens" + per(self.prompt_ms, self.prompt_tokens),
            f"eval time        = {self.eval_ms:10.2f} ms / {self.eval_tokens:5d} runs  " + per(self.eval_ms, self.eval_tokens),
            f"total time       = {self.load_ms + self.prompt_ms + self.eval_ms:10.2f} ms / {self.prompt_tokens + self.eval_tokens:5d} tokens",
        ]
        return lines + ([self.speculative_line()] if self.speculative else [])

    def speculative_line(self) -> str:
        """Speculative decoding's acceptance (llama.cpp's "draft acceptance rate") and ids per decode pass."""
        rate = f"{self.accepted / self.drafted:.5f}" if self.drafted else "-"
        per_pass = f"{self.eval_tokens / self.passes:.2f}" if self.passes else "-"
        return (f"draft acceptance = {rate} ({self.accepted:5d} accepted / {self.drafted:5d} drafted); "
                f"{per_pass} tokens per decode pass ({self.passes} passes)")


@dataclass
class Completion:
    text: str = ""  # the answer: a thinking model's <think> block goes to `reasoning` once generation ends
    reasoning: str = ""
    think_open: bool = False  # the prompt left a <think> block open: the output starts inside it
    reasoning_format: str = "think"  # "think" (<think> blocks), "harmony" (gpt-oss channels) or "channel" (Gemma 4's
    #                                   <|channel>thought ... <channel|> block): chat/reasoning.py
    tokens: list[int] = field(default_factory=list)  # generated ids (an end-of-generation id is not included)
    prompt_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "interrupted"
    stop_sequence: str | None = None  # the stop string that ended the reply (finish_reason "stop"), if one did
    timings: Timings = field(default_factory=Timings)
    logprobs: list[dict[str, Any]] | None = None  # with run(logprobs=N): one entry per id in `tokens`
    # With run(scheduler=...): cancels the request from any thread (a client gone while it waits for a slot).
    cancel: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "reasoning": self.reasoning,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "timings": self.timings.as_dict(),
            **({"logprobs": self.logprobs} if self.logprobs is not None else {}),
            **({"speculative": {"drafted": self.timings.drafted, "accepted": self.timings.accepted}}
               if self.timings.speculative else {}),
        }


class Model:
    """A loaded model: GGUF file, config, tokenizer, chat template and a backend holding weights + KV cache."""

    def __init__(
        self,
        path: str | Path,
        backend: str = "auto",
        ctx: int | None = None,
        progress: Progress | None = None,
        notice: Callable[[str], None] | None = None,
        cache_types: tuple[str, str] = DEFAULT_CACHE,
        swa_full: bool = False,
        slots: int = 1,
        split: SplitOptions | None = None,
    ):
        t0 = self.load_started = time.perf_counter()
        laps = _Laps()
        self.path = Path(path)
        self.gguf = open_gguf(self.path)
        md = self.gguf.metadata
        self.cfg = ModelConfig.from_gguf(md, set(self.gguf.tensors))
        if swa_full:  # every position on sliding-window layers too (no rings: models/kv_cache.py)
            self.cfg = replace(self.cfg, swa_full=True)
        laps.lap("open + metadata")
        early = start_early(backend)  # the GPU's start on a thread of its own (CuPy's import, its check)
        try:
            n_tokens = array_length(md, "tokenizer.ggml.tokens")  # (the tokenizer's thread decodes them)
            if n_tokens is not None and n_tokens != self.cfg.vocab_size:  # llama.cpp refuses these too
                raise ShapeMismatchError(f"the vocabulary has {n_tokens} tokens but the model "
                                         f"has {self.cfg.vocab_size} embedding rows")
            if ctx is not None and (type(ctx) is not int or ctx <= 0):
                raise UsageError(f"context size must be a positive integer, got {ctx!r}")
            if type(slots) is not int or slots < 1:
                raise UsageError(f"the number of parallel sequences must be a positive integer, got {slots!r}")
            self.ctx = ctx or min(self.cfg.context_length, DEFAULT_CTX_CAP)
            self.cache_types = parse_cache_types(*cache_types)
            for head_dim in sorted(self.cfg.head_dims):  # (gemma4: its sliding and global layers' own)
                check_cache_types(head_dim, self.cache_types)
        except BaseException:
            if early is not None:  # the thread leaves the driver before the process may exit
                with contextlib.suppress(BaseException):
                    early()
            raise
        self.backend = select_backend(backend, notice, early, self.cfg, split)  # (split: --split-mode and its kin)
        laps.lap(f"backend start ({self.backend.name})")
        # The tokenizer is built on a thread of its own (Llama 3's 128k tokens and 280k merges take a while)
        # while the weights upload, whose copies leave the GIL free. Not sooner: beside CuPy's import (the
        # backend's start) the two only take turns at the GIL. A broken vocabulary is reported after the load.
        tokenizer = Background(Tokenizer.from_metadata, md, name="llamacli-tokenizer")
        try:
            check_tensors(self.gguf, self.cfg, self.backend.runnable_types)
            self.backend.load(self.gguf, self.cfg, self.ctx, progress, cache_types=self.cache_types)
            laps.lap("weights, KV cache", self.backend.load_stages)
            # The decode steps' graphs (CUDA) are captured here, so that no generation's timed loop pays for them.
            self.backend.prepare_decode()
            if _has_own(self.backend, "prepare_decode"):  # the NumPy backend has no graphs: no stage to list
                laps.lap("decode graphs")
            self.tokenizer = tokenizer.result()  # what the build raised (a broken vocabulary) is raised here
        except BaseException:
            tokenizer.wait()
            with contextlib.suppress(Exception):  # the device memory goes now, not with the traceback
                self.close()
            raise
        laps.lap("tokenizer (waited for)")
        self.load_stages = laps.stages  # (stage, ms): --verbose prints them
        # When the CLI looked the model up (registry, cache, any download) before this load: (start, end) in
        # time.perf_counter() seconds, for --verbose's start-up line; None outside the CLI.
        self.lookup: tuple[float, float] | None = None
        # Speculative decoding (engine/speculative.py): what run() drafts with unless told otherwise, and the
        # draft model (attach_draft), if any
        self.speculative = SpecSettings()
        self.draft: DraftModel | None = None
        # Each cache slot's record: which ids it holds (slot 0 is the one generate/chat use; the scheduler all).
        self.seqs = [SequenceCache(layer_caches(self.cfg, self.ctx), self.ctx)]
        self.seq = self.seqs[0]
        self.prefix_cache: PrefixCache | None = None  # (enable_prefix_cache)
        if slots != 1:
            try:
                self.set_slots(slots)
            except BaseException:
                with contextlib.suppress(Exception):
                    self.close()
                raise
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self._chat = None

    def set_slots(self, n: int) -> None:
        """Hold the caches of `n` sequences (engine/scheduler.py runs them together): slot 0 keeps what it holds;
        the draft model's too. BackendError where the backend holds one, HostMemoryError / DeviceMemoryError where
        they do not fit."""
        had = len(self.seqs)
        self.backend.set_slots(n)
        if self.draft is not None:
            try:
                self.draft.model.set_slots(n)
            except BaseException:
                self.backend.set_slots(had)
                raise
        layers = layer_caches(self.cfg, self.ctx)
        self.seqs = self.seqs[:n] + [SequenceCache(layers, self.ctx, slot) for slot in range(len(self.seqs), n)]

    def enable_prefix_cache(self, budget: int | None = None) -> PrefixCache:
        """Keep prompts' K/V rows across requests, for any slot (engine/prefix_cache.py), in at most `budget` bytes
        (None: prefix_cache.default_budget, as many positions as the slots hold within the free memory; 0 turns
        it off). PrefixCacheOff where it cannot run (a model with recurrent layers, a bound under one block),
        BackendError or HostMemoryError where the memory is not there."""
        from .prefix_cache import PrefixCache, PrefixCacheOff, default_budget

        self.disable_prefix_cache()
        if budget == 0:
            raise PrefixCacheOff("the prefix cache is off (a bound of 0)")
        if budget is None:
            budget = default_budget(self.backend, self.ctx * len(self.seqs))
        self.prefix_cache = PrefixCache(self.backend, layer_caches(self.cfg, self.ctx), self.ctx, budget)
        return self.prefix_cache

    def disable_prefix_cache(self) -> None:
        """Drop the prefix cache and its memory."""
        if self.prefix_cache is not None:
            self.prefix_cache = None
            self.backend.alloc_kv_pool(0)

    def attach_draft(self, draft: "Model") -> None:
        """Draft with `draft` (a loaded Model of the same vocabulary: UsageError otherwise), which takes as many
        cache slots; it closes with this model."""
        check_vocabularies(self, draft)
        if draft.ctx < self.ctx:
            raise UsageError(f"the draft model's context ({draft.ctx}) is shorter than the model's ({self.ctx})")
        if len(draft.seqs) != len(self.seqs):
            draft.set_slots(len(self.seqs))
        self.draft = DraftModel(draft)

    # -- text <-> ids -------------------------------------------------------------------------------------
    def tokenize(self, text: str, *, special: bool = False, add_bos: bool | None = None,
                 limit: int | None = None) -> list[int]:
        """Token ids of `text`; with `limit`, more than that many is TooManyTokens, found without tokenizing a
        long text whole (Tokenizer.encode)."""
        return self.tokenizer.encode(text, special=special, add_bos=add_bos, limit=limit)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def chat_template(self):
        if self._chat is None:
            from ..chat.template import ChatTemplate

            self._chat = ChatTemplate.from_metadata(self.gguf.metadata, self.cfg.architecture)
        return self._chat

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    think: bool | str | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """The rendered conversation; `think` True/False reaches the template as enable_thinking (as
        transformers passes it), a reasoning effort ('low', 'medium', 'high') as reasoning_effort to a template
        that reads it (reasoning.template_variables); None leaves the template's defaults. `tools` (OpenAI's
        tool entries) reach it as transformers' apply_chat_template passes them."""
        from ..chat.reasoning import template_variables

        extra = template_variables(self.chat_template.text, think)
        if tools:
            extra["tools"] = tools
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                 think: bool | str | None = None, limit: int | None = None,
                 tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a rendered conversation: special tokens parsed, BOS added unless the template wrote it;
        `limit` as in tokenize; `tools` as render_chat takes them."""
        from ..chat.template import encode_prompt

        return encode_prompt(self.tokenizer, self.render_chat(messages, add_generation_prompt, think, tools),
                             limit=limit)

    @property
    def has_chat_template(self) -> bool:
        """Whether the file has a chat template of its own. Without one (a base model) a prompt goes in as plain
        text; a conversation, or a prompt with a system message, takes the built-in format chat_template names."""
        text = self.gguf.metadata.get("tokenizer.chat_template")
        return isinstance(text, str) and bool(text.strip())

    @property
    def thinks(self) -> bool:
        """Whether the chat template knows think blocks (Qwen3, SmolLM3, the R1 distills) or reasoning efforts
        (gpt-oss)."""
        from ..chat.reasoning import template_thinks

        return template_thinks(self.chat_template.text)

    def prompt_ids(self, prompt: str, *, raw: bool = False, system: str | None = None,
                   think: bool | str | None = None, limit: int | None = None) -> list[int]:
        """The ids for a prompt: through the chat template (when the file has one, or `system` is given),
        or as plain text with `raw` or without a template in the file; `limit` as in tokenize."""
        if raw:
            if system is not None:
                raise UsageError("--system needs the chat template; it cannot be combined with --raw")
            return self.tokenize(prompt, limit=limit)
        if not self.has_chat_template and system is None:
            return self.tokenize(prompt, limit=limit)  # a base model: plain completion
        from ..chat.template import chat_messages

        return self.chat_ids(chat_messages(prompt, system), think=think, limit=limit)

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **kw: Any) -> Iterator[str]:
        """Stream the continuation of `prompt` (text, or token ids) as text pieces. Keyword arguments: those of
        `run` (max_tokens, stop, params or the sampling fields: temperature, top_k, ...)."""
        completion = Completion()
        yield from self.run(prompt, completion=completion, **kw)

    def complete(self, prompt: str | Sequence[int], **kw: Any) -> Completion:
        completion = Completion()
        for _ in self.run(prompt, completion=completion, **kw):
            pass
        return completion

    def run(
        self,
        prompt: str | Sequence[int],
        *,
        completion: Completion,
        max_tokens: int = 256,
        stop: str | Sequence[str] = (),
        params: SamplingParams | None = None,
        raw: bool = False,
        system: str | None = None,
        truncate: bool = False,
        think: bool | str | None = None,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        ignore_eos: bool = False,
        keep_special: Collection[int] = (),
        scheduler: TokenSource | None = None,
        speculative: SpecSettings | None = None,
        cache_salt: str | None = None,
        **sampling: Any,
    ) -> Iterator[str]:
        """The engine. Yields text as it completes (a thinking model's <think> block included: feed it to a
        reasoning.make_splitter(completion) to tell them apart while streaming); fills
        `completion` (answer and reasoning, ids, finish reason, timings).

        `logprobs=N` (0..20) fills `completion.logprobs`, one entry per generated id: {"token", "id",
        "logprob", "top_logprobs": the N most likely [{"token", "id", "logprob"}], best first}. The values are
        the log-softmax of the model's raw logits (temperature 1, before penalties, top-k/p, min-p and any
        constraint), the distribution OpenAI and llama-server report, not the truncated one sampled from.
        `constraint` (sampling/structured.py) masks every step to the ids it allows; once it says the output is
        complete, generation ends with finish_reason "stop". `keep_special`: control tokens whose text the
        output keeps (a tool-call format's markers, such as Mistral's [TOOL_CALLS]; llama.cpp's preserved
        tokens); other control tokens print nothing. Logprobs move each step's logits to the host; a
        constraint alone sends its mask the other way (each step still waits for the id, as the mask of the
        next depends on it). `ignore_eos` (llama.cpp's --ignore-eos) masks the end-of-generation ids out of every
        step, so the reply runs to max_tokens or a full context; that takes the masked step as a constraint
        does (a constraint that allows nothing but an end still ends). With `scheduler` (engine/scheduler.py,
        over this model) the ids come from one of its cache slots, the steps batched with its other requests';
        the text stream is the same, and closing it cancels the request. The caller then may be any thread.
        `speculative` (engine/speculative.py; None: the model's own `speculative`) drafts ids for the decode steps
        to verify several at a time: the same ids as without (a seed's too), fewer passes where drafts hold;
        completion.timings counts the drafts and those accepted. `cache_salt` (vLLM's: a string of 1 to
        tokens.MAX_CACHE_SALT characters, None: unsalted) keeps K/V only from requests of the same salt, in the slots
        and the prefix cache alike: requests of different salts share nothing cached."""
        laps = _Laps()  # --verbose's stages of this prompt
        params = (replace(params, **sampling) if params else SamplingParams(**sampling)).validate()
        spec = (self.speculative if speculative is None else speculative).validate()
        salt = check_cache_salt(cache_salt)
        if "draft-simple" in spec.sources and self.draft is None:
            raise UsageError("speculative decoding from a draft model needs one: -md/--model-draft FILE")
        if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= MAX_LOGPROBS):
            raise UsageError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {logprobs!r}")
        if type(max_tokens) is not int or max_tokens < 0:
            raise UsageError(f"max tokens must be an integer >= 0, got {max_tokens!r}")
        stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]  # one string is one stop string
        if isinstance(prompt, str):
            # Without --truncate, a prompt that cannot fit is refused as soon as that is clear: from its length, or
            # partway through tokenizing it (a 60 MB file costs a context's worth of tokenizing, not 60 MB's).
            try:
                ids = self.prompt_ids(prompt, raw=raw, system=system, think=think,
                                      limit=None if truncate else self.ctx - 1)
            except TooManyTokens as exc:
                raise ContextOverflowError(
                    f"the prompt has more than {exc.limit:,} tokens (at least {exc.at_least:,}), the context holds "
                    f"{self.ctx}: shorten it, raise --ctx, or pass --truncate to keep its tail"
                ) from None
        else:
            ids = list(prompt)
        if not ids:
            raise UsageError("the prompt is empty (no tokens to start from)")
        if len(ids) >= self.ctx:
            if not truncate:
                raise ContextOverflowError(
                    f"the prompt has {len(ids)} tokens, the context holds {self.ctx}: "
                    "shorten it, raise --ctx, or pass --truncate to keep its tail"
                )
            ids = ids[len(ids) - self.ctx + 1 :]
        for tid in ids:
            if not 0 <= tid < self.cfg.vocab_size:
                raise UsageError(f"token id {tid} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        c = completion
        c.prompt_tokens, c.timings = list(ids), Timings(load_ms=self.load_ms, speculative=spec.on)
        # A generation prompt that opens a think block ends with it: 8 tokens, so that a <think> in the user's
        # text a little before is not taken for one; "<|start|>assistant" may take 16 in a small vocabulary.
        c.think_open = prompt_opens_think(self.tokenizer.decode(ids[-8:]))
        c.reasoning_format = reply_format(self.tokenizer.decode(ids[-16:]))
        # (history: the penalty window, the prompt and then each id taken)
        sampler = Sampler(params, make_rng(params.seed), history=list(ids), logits=logprobs is not None,
                          speculative=spec.on)
        c.logprobs = [] if logprobs is not None else None
        if constraint is not None:
            from ..sampling.structured import mask_words

            constraint.reset()
            sampler.mask = mask_words(constraint)
        if ignore_eos and self.tokenizer.eog_ids:
            sampler.mask = _without(self.tokenizer.eog_ids, self.cfg.vocab_size, sampler.mask)
        if scheduler is None:
            tokens = self._tokens(ids, sampler, max_tokens, constraint, logprobs, c, laps, spec, salt)
        else:  # in a cache slot of the scheduler's, its steps batched with the other requests'
            tokens = scheduler.tokens(ids, sampler, max_tokens, c, constraint, logprobs,
                                      **({"speculative": spec} if spec.on else {}),
                                      **({"salt": salt} if salt is not None else {}))
        # The text: ids detokenized as they come, held back while they may begin a stop string. Generated text
        # continues the prompt: keep the space SentencePiece pieces start with, and print no control tokens
        # (llama-cli without --special).
        decoder = StreamDecoder(self.tokenizer, special=False, strip_dummy_prefix=False, keep=keep_special)
        pending = ""  # text held back because it might begin a stop string
        cut = False  # a stop string ended the output: what follows it is dropped
        t0 = None
        try:
            for token, entry in tokens:
                if t0 is None:  # the decode loop's clock starts with the first id
                    t0 = time.perf_counter()
                c.tokens.append(token)
                if c.logprobs is not None:
                    c.logprobs.append(entry)
                pending += decoder.feed(token)
                before, matched = split_stop(pending, stop)
                cut = matched is not None
                if cut:
                    c.finish_reason, c.stop_sequence, pending = "stop", matched, ""
                else:
                    before, pending = hold_back(pending, stop)
                if before:
                    c.text += before
                    yield before
                if cut:
                    break
            if not cut:
                tail = pending + decoder.flush()
                if tail:
                    c.text += tail
                    yield tail
        except KeyboardInterrupt:
            c.finish_reason = "interrupted"
            raise
        finally:  # also when the consumer stops early: a partial reply is split too
            tokens.close()
            if t0 is not None:
                c.timings.eval_ms = (time.perf_counter() - t0) * 1e3
            c.reasoning, c.text = split_reasoning(c.text, c.think_open, c.reasoning_format)

    def _tokens(self, ids: list[int], sampler: Sampler, max_tokens: int, constraint: Constraint | None,
                logprobs: int | None, c: Completion, laps: "_Laps",
                spec: SpecSettings, salt: str | None = None) -> Iterator[tuple[int, dict[str, Any] | None]]:
        """The token generator (ids in, ids out; mlx-lm's generate_step): the prompt's step (a prefill of what
        the cache does not hold yet, and the first id), then a decode step per id (or per verification of
        drafts, with `spec` on), each through Backend.step. Yields (id, its logprob entry or None) for every
        id the reply keeps, and sets c.finish_reason when it ends by itself: "eos" (an end-of-generation id,
        not yielded), "length" (max_tokens, or the context full), "stop" (the constraint complete). The consumer
        stops it otherwise (a stop string in the text): nothing more is computed then."""
        be = self.backend
        run = TokenRun(self.seq, ids, sampler, self.tokenizer, max_tokens, c.timings, constraint, logprobs,
                       cache=self.prefix_cache,
                       spec=Speculation(spec, self.draft, self.seq.slot, salt) if spec.on else None, salt=salt)
        step = run.prompt_step()
        laps.lap("prompt to ids")

        def first(out: StepOut) -> None:  # --verbose's stages: the prefill, and the decode set-up apart
            stage = (f"prefill ({run.new} tokens), first token", (c.timings.first_token_at - laps.at) * 1e3)
            own = _has_own(be, "prepare_decode") or _has_own(be, "start_sampling")  # (none on NumPy)
            laps.lap("", [stage, ("decode set-up", out.setup_ms)] if own else [stage])
            c.timings.stages = laps.stages

        item = run.prompt_out(be.step([step])[0], first)
        items = [] if item is None else [item]
        try:
            while items:
                yield from items
                # Decode: one token at the next position (a captured graph on CUDA), and perhaps the following
                # one queued ahead; or that token and its drafts, verified in one pass.
                step = None if run.finished else run.next_step()
                if step is None:
                    return
                items = run.step_out(be.step([step])[0])
        finally:
            c.finish_reason = c.finish_reason or run.finish_reason
            run.finish()

    def close(self) -> None:
        if self.draft is not None:
            self.draft.model.close()
        self.backend.close()
        self.gguf.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _without(ids: Iterable[int], vocab: int, words: Callable[[], np.ndarray] | None) -> Callable[[], np.ndarray]:
    """A step mask (uint32 bit words, structured.pack_words) that drops `ids` from every step, and from the ids
    `words` (a constraint's mask) allows; where that leaves nothing, the constraint's own mask."""
    from ..sampling.structured import pack_words

    keep = np.ones(vocab, dtype=bool)
    keep[[i for i in ids if 0 <= i < vocab]] = False
    fixed = pack_words(keep)
    if words is None:
        return lambda: fixed

    def masked() -> np.ndarray:
        allowed = words()
        both = allowed & fixed
        return both if both.any() else allowed

    return masked


def _has_own(backend: Backend, method: str) -> bool:
    """Whether `backend` overrides Backend.`method` (whose own is a no-op): --verbose lists only real stages."""
    return getattr(type(backend), method) is not getattr(Backend, method)


class _Laps:
    """Consecutive stages in milliseconds: lap(name) closes the stage that began at the previous lap."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, float]] = []
        self.at = time.perf_counter()  # when the current stage began

    def lap(self, name: str, parts: Sequence[tuple[str, float]] = ()) -> None:
        """`parts`: the stage's own breakdown (stage, ms), listed instead of it where there is one."""
        now = time.perf_counter()
        self.stages.extend(parts or [(name, (now - self.at) * 1e3)])
        self.at = now


def load(path: str | Path, backend: str = "auto", ctx: int | None = None, **kw: Any) -> Model:
    """Load a GGUF model: `llamacli.load("model.gguf").generate("Hello")` streams text."""
    return Model(path, backend=backend, ctx=ctx, **kw)


def context_warning(cfg: ModelConfig, ctx: int) -> str | None:
    """Why a context past the trained length may give worse text, naming the RoPE scaling that applies (the
    file's own, unchanged: positions past its context_length were never seen in training)."""
    trained = cfg.context_length
    if ctx <= trained:
        return None
    scaling = {
        "none": "no RoPE scaling applies",
        "linear": f"the file's linear RoPE scaling (factor {cfg.rope_scaling_factor:g}) applies unchanged",
        "llama3": f"the file's llama3 RoPE scaling (from {cfg.rope_original_context} tokens) applies unchanged",
        "proportional": "no RoPE scaling applies",
        "longrope": f"the long RoPE factors apply (as past {cfg.rope_original_context} tokens)",
        "yarn": f"the file's YaRN RoPE scaling (factor {cfg.rope_scaling_factor:g}, from "
                f"{cfg.rope_original_context} tokens) applies unchanged",
    }.get(cfg.rope_scaling, f"{cfg.rope_scaling} RoPE scaling applies")
    return (f"warning: a context of {ctx} tokens is longer than the {trained} the model was trained for, and "
            f"{scaling}: text past {trained} tokens may degrade")


def split_stop(text: str, stop: Sequence[str]) -> tuple[str, str | None]:
    """The text stream's stop strings (Model.run), the text so far cut where one begins: (the text before the
    earliest occurrence of any string of `stop`, that string), or (text, None) where none occurs; of two that
    begin at one place, the first listed. `stop` holds no empty string (Model.run drops those)."""
    found = min(((i, k) for k, i in enumerate(text.find(s) for s in stop) if i >= 0), default=None)
    return (text[: found[0]], stop[found[1]]) if found else (text, None)


def hold_back(text: str, stop: Sequence[str]) -> tuple[str, str]:
    """The text stream's hold-back (Model.run): `text` (in which no stop string occurs) split into (safe to
    print, held back), the held part the longest tail of `text` that is a proper prefix of a string of `stop`,
    since the next token may complete it."""
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return text[: len(text) - held], text[len(text) - held :]
