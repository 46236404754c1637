"""One sequence's token generation as steps (ids in, ids out; mlx-lm's generate_step), driven from outside:
Model._tokens drives one sequence step by step, the scheduler (engine/scheduler.py) many at once, each in its
own cache slot, their decode steps together in one Backend.step.

    run = TokenRun(...)
    item = run.prompt_out(backend.step([run.prompt_step()])[0])   # (id, logprob entry) or None: finished
    items = [] if item is None else [item]
    while items:
        ... hand the items to the text stream ...
        step = None if run.finished else run.next_step()          # None: finished
        if step is None: break
        items = run.step_out(backend.step([step])[0])             # [] only when finished

The scheduler may run a long prompt in parts (a backend that takes prefill-only steps: Backend.fill_steps):
`run.prompt_step(limit)` gives a prefill-only step (SeqStep.fill) of the next `limit` ids while more than that
remain, whose out goes to `run.fill_out(...)`; the call after the last part's gives the prompt's step proper.

With speculation (engine/speculative.py) a decode step may carry drafts after the last id: a verification,
whose ids (the drafts the model agrees with, and one more) come out of step_out together; an end (an
end-of-generation id, max_tokens, a constraint complete) may come among them.

A run ends by itself with `finish_reason` set: "eos" (an end-of-generation id, not handed out), "length"
(max_tokens, or the context full), "stop" (a constraint complete). The text stream may stop it sooner (a stop
string): then nothing more is asked of it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import numpy as np

from ..backends.step import Sampler, SeqStep, StepOut
from ..errors import UsageError
from ..models.seq_cache import SequenceCache
from ..tokenizer.tokenizer import Tokenizer
from .speculative import Speculation, choose

if TYPE_CHECKING:
    from ..sampling.structured import Constraint
    from .prefix_cache import PrefixCache

Item = tuple[int, "dict[str, Any] | None"]  # an id handed out, and its logprob entry (with logprobs)
MAX_CACHE_SALT = 256  # characters a cache salt may have (vLLM takes any non-empty string)


def check_cache_salt(salt: Any) -> str | None:
    """A request's cache salt (vLLM's cache_salt: it reuses K/V only from requests of the same salt), or None;
    UsageError unless it is a string of 1 to MAX_CACHE_SALT characters. The message never quotes the value: a
    salt is a secret of its client's."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        what = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
        got = next((w for t, w in what.items() if isinstance(salt, t)), type(salt).__name__)
    elif not 0 < len(salt) <= MAX_CACHE_SALT:
        got = "an empty string" if not salt else f"{len(salt):,} characters"
    else:
        return salt
    raise UsageError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters, got {got}")


class TokenSource(Protocol):
    """Where Model.run takes a generation's ids from, other than its own loop (engine/scheduler.py Scheduler)."""

    def tokens(self, ids: list[int], sampler: Sampler, max_tokens: int, completion: Any,
               constraint: Constraint | None = None, logprobs: int | None = None,
               speculative: Any = None, salt: str | None = None) -> Iterator[Item]: ...


class TokenRun:
    """The ids of one generation from prompt ids `ids` in cache slot `seq`: the prompt's step (a prefill of what
    the slot does not hold yet, and the first id), then a decode step per id. The slot's record (SequenceCache)
    is kept as steps run, and `timings` (engine.generate.Timings) filled: the prompt's, and the decode steps'
    count. With a prefix cache (engine/prefix_cache.py) the prompt's step starts behind the rows it copies into
    the slot, and the slot's blocks are stored after the prompt's step and by finish() (call it when the run
    ends, however). With `spec` (engine/speculative.py; the sampler's `speculative` set) a decode step verifies
    the drafts it proposes, where it has any. `salt`: the request's cache salt (vLLM's cache_salt; None:
    unsalted): it keeps K/V only from the slot's and the prefix cache's rows filled under the same salt."""

    def __init__(self, seq: SequenceCache, ids: list[int], sampler: Sampler, tokenizer: Tokenizer,
                 max_tokens: int, timings: Any, constraint: Constraint | None = None, logprobs: int | None = None,
                 count_eval: bool = True, cache: PrefixCache | None = None, spec: Speculation | None = None,
                 salt: str | None = None):
        self.seq, self.ids, self.sampler, self.tokenizer = seq, ids, sampler, tokenizer
        self.salt = salt
        self.max_tokens, self.timings, self.constraint, self.logprobs = max_tokens, timings, constraint, logprobs
        self.count_eval = count_eval  # (False: the consumer counts the decode steps whose ids it took)
        self.cache = cache
        self.restored = 0  # prompt ids the prefix cache gave (beyond what the slot held)
        self.spec = spec
        self.drafts: list[int] = []  # what the step under way verifies after self.last
        self.finish_reason: str | None = None
        self.handed = 0  # ids handed out
        self.last = -1  # the last id handed out: the next decode step's input
        self.new = 0  # prompt ids the prompt's step prefills
        self.started = 0.0  # time.perf_counter() at the prompt's step
        self.at = -1  # where the prompt's next part starts (-1: not begun; len(ids) once its step ran whole)
        self._part = 0  # the ids of the prefill-only step under way

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """Whether the prompt was begun in parts and its step has not run whole yet."""
        return 0 <= self.at < len(self.ids)

    @property
    def remaining(self) -> int:
        """Prompt ids still to prefill (before the prompt is begun: all but those the slot keeps, an estimate
        that the prefix cache may lower)."""
        return len(self.ids) - (self.at if self.at >= 0 else self.seq.reusable(self.ids, self.salt))

    def prompt_step(self, limit: int | None = None) -> SeqStep:
        """The prompt's step: the ids the slot does not hold yet (at least the last, whose logits are needed). With
        `limit`, where more than `limit` of them remain, a prefill-only step (SeqStep.fill) of the next `limit`
        instead (a backend that takes them: Backend.fill_steps); after its fill_out, call again for the next."""
        seq = self.seq
        if self.at < 0:  # the prompt begins: what the slot keeps, and what the prefix cache adds to it
            keep = seq.reusable(self.ids, self.salt)
            self.started = time.perf_counter()
            if self.cache is not None:  # rows of more of the prompt copied into the slot, where the cache has them
                held = keep
                keep = self.cache.restore(seq, self.ids, keep, self.salt)
                self.restored = keep - held
            seq.begin_prompt(keep, len(self.ids), self.salt)
            self.at, self.new = keep, len(self.ids) - keep
        rest = self.ids[self.at :]
        if limit is not None and len(rest) > limit:
            if limit < 1:
                raise ValueError(f"a prompt's part takes at least one id (limit {limit})")
            self._part = limit
            return SeqStep(rest[:limit], self.at, self.sampler, seq.slot, fill=True)
        return SeqStep(rest, self.at, self.sampler, seq.slot)

    def fill_out(self, out: StepOut) -> None:
        """A prefill-only step of the prompt ran whole: the slot holds the prompt up to its end (what the prefix
        cache stores for the slot, should the run end before its prompt's step)."""
        self.at += self._part
        self.seq.prompt_done(self.ids[: self.at])
        if out.snapshots is not None:  # recurrent layers: the state at the part's end, where the next resumes
            self.seq.held(out.snapshots)

    def prompt_out(self, out: StepOut, on_first: Callable[[StepOut], None] | None = None) -> Item | None:
        """The prompt's step ran whole: the slot holds the prompt; the first id, or None (finished)."""
        self.at = len(self.ids)
        self.seq.prompt_done(self.ids)
        if out.snapshots is not None:  # recurrent layers: where a later prompt may resume
            self.seq.held(out.snapshots)
        t = self.timings
        # The step also made the decode ready (out.setup_ms): timed apart, as neither prompt nor generation
        t.first_token_at = time.perf_counter() - out.setup_ms / 1e3
        t.prompt_ms = (t.first_token_at - self.started) * 1e3
        t.prompt_tokens = self.new
        t.cached_tokens, t.prefix_cached_tokens = len(self.ids) - self.new, self.restored
        if self.cache is not None:  # the prompt's blocks, for the prompts to come
            self.cache.store(self.seq)
        if on_first is not None:
            on_first(out)
        if self.max_tokens == 0:
            self.finish_reason = "length"
            return None
        return self._hand(out)

    def next_step(self) -> SeqStep | None:
        """After the last id was handed out: the decode step of that id at the next position (and the drafts
        after it, with speculation), or None (a constraint complete, max_tokens reached, or the context full)."""
        if self.constraint is not None:
            self.constraint.advance(self.last)
            if self.constraint.is_done:
                self.finish_reason = "stop"
                return None
        if self.handed >= self.max_tokens or self.seq.full:
            self.finish_reason = "length"
            return None
        pos = len(self.seq)
        if self.spec is not None:  # room: positions up to the context's end, ids up to max_tokens
            room = min(self.seq.ctx - 1 - pos, self.max_tokens - self.handed - 1)
            self.drafts = self.spec.propose(self.sampler.history, room)
            if self.drafts:
                self.seq.begin_verify(pos, 1 + len(self.drafts))
                return SeqStep([self.last, *self.drafts], pos, self.sampler, self.seq.slot)
        self.seq.begin_decode(pos)
        return SeqStep([self.last], pos, self.sampler, self.seq.slot)

    def step_out(self, out: StepOut) -> list[Item]:
        """A decode step ran whole: its input's K/V are in the slot; its id, or with drafts the ids their
        verification accepts (engine/speculative.py); [] when the run finished without one."""
        self.timings.passes += 1
        if self.drafts:
            items = self._verified(out)
        else:
            self.seq.token_done(self.last)
            if self.count_eval:
                self.timings.eval_tokens += 1
            item = self._hand(out)
            items = [] if item is None else [item]
        if out.snapshots is not None:
            self.seq.held(out.snapshots)
        return items

    def _verified(self, out: StepOut) -> list[Item]:
        """A verification's ids: row by row, the id chosen as a plain step would choose it there (the penalties
        over the ids before it, the constraint advanced past them); a draft equal to it is accepted and the next
        row read, the first that differs ends the step (its row's id is the correction), and after the last
        draft its row gives one more."""
        drafts, self.drafts = self.drafts, []
        t, seq, items = self.timings, self.seq, []
        t.drafted += len(drafts)
        seq.token_done(self.last)  # the pass's first input: its K/V at the step's position
        for i in range(len(drafts) + 1):
            if i:  # drafts[i - 1] was taken (it is self.last): its K/V came with the pass; now the next row
                if self.handed >= self.max_tokens:
                    break  # (next_step ends the run)
                if self.constraint is not None:
                    self.constraint.advance(self.last)
                    if self.constraint.is_done:
                        self.finish_reason = "stop"
                        break
                seq.token_done(self.last)
            token = out.choices[i] if out.choices is not None else choose(out.logits[i], self.sampler)
            if self.count_eval:
                t.eval_tokens += 1
            item = self._hand(StepOut(token, out.logits[i] if self.sampler.logits else None))
            if item is None:  # an end of generation
                break
            items.append(item)
            if i == len(drafts) or token != drafts[i]:
                break
            t.accepted += 1
        return items

    def finish(self) -> None:
        """The run ended (finished, stopped, cancelled or failed): the prefix cache stores the blocks of what the
        slot holds (the reply's too)."""
        if self.cache is not None:
            self.cache.store(self.seq)

    def _hand(self, out: StepOut) -> Item | None:
        token = out.id
        if token in self.tokenizer.eog_ids:
            self.finish_reason = "eos"
            return None
        self.sampler.history.append(token)
        self.handed += 1
        self.last = token
        entry = None if out.logits is None else logprob_entry(self.tokenizer, out.logits, token, self.logprobs or 0)
        return token, entry


def logprob_entry(tokenizer: Tokenizer, logits: np.ndarray, chosen: int, n: int) -> dict[str, Any]:
    """The chosen id's log-probability under softmax(logits) and the n most likely ids, best first."""
    x = logits.astype(np.float64)
    top = x.max()
    lp = x - (top + np.log(np.exp(x - top).sum()))
    best = np.argpartition(-lp, n)[:n] if 0 < n < lp.size else np.arange(lp.size if n else 0)
    best = best[np.lexsort((best, -lp[best]))]

    def item(i: int) -> dict[str, Any]:
        return {"token": token_text(tokenizer, i), "id": i, "logprob": float(lp[i])}

    return {**item(int(chosen)), "top_logprobs": [item(int(i)) for i in best]}


def token_text(tokenizer: Tokenizer, tid: int) -> str:
    """A token's text as generated output prints it (a lone UTF-8 fragment becomes U+FFFD)."""
    return tokenizer.decode([tid], strip_dummy_prefix=False)
