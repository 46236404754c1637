"""Continuous batching: many generations at once, each in a cache slot of its own, their decode steps taken
together in one Backend.step (vLLM's and llama-server's slots; the batching issue's scheduler).

One worker thread owns the model: every backend call happens there (the CUDA state stays with one thread).
Requests come in through `tokens()` and wait in arrival order for a free slot. Each turn of the worker:

1. admit waiting requests to free slots (llama-server's rule: the free slot whose cache holds the longest part
   of the prompt, where that part covers at least half of what the slot holds, so that a resent conversation or
   a shared system prompt is not prefilled again; else the slot used least recently, an empty one first, so
   that another client's conversation is not evicted while a slot stands empty); a slot filled under another
   cache salt than the request's (vLLM's cache_salt) holds no part of its prompt;
2. prefill prompts, up to `prefill_budget` prompt tokens per turn (those the slot's cache or the prefix cache
   gave are not counted), the requests in the order they were admitted: a prompt that fits in what is left of
   the turn's budget runs its prompt step (the rest of its prefill and its first id); a longer one, where the
   backend takes prefill-only steps (Backend.fill_steps; backends/step.py), runs a part of what is left of the
   budget (SeqStep.fill) and goes on at the next turn from where that part ended, until its last part, the
   prompt step, gives its first id. Requests are admitted only while the turn's budget is not spent by the
   prompts already under way, so a long prompt costs the running sequences at most one budget's prefill per
   turn, however long it is (Sarathi's chunked prefill; vLLM's and llama-server's batches mix the two the same
   way). Where the backend runs prompts whole (CUDA today), each admitted prompt's step runs whole in its turn
   (as many prompts as start within the budget, at least one): while it runs, the running sequences wait;
3. run one decode step of every running sequence whose prompt step has run, all in one Backend.step;
4. hand each id to its request (a queue its consumer reads on a thread of its own); a request that finished,
   failed or was cancelled leaves the batch at once and frees its slot.

A request whose consumer has not taken its last AHEAD ids sits out the decode steps (it keeps its slot) until
it does: the ids are pulled, as by a single generation's loop, so a client that stops reading (a full socket)
stops its generation rather than filling a queue. cancel() (any thread) takes a request out at the next turn,
waiting or running.

`Model.run` takes the ids through `scheduler.tokens(...)` instead of its own loop, so the text stream
(detokenizing, stop strings, the reasoning split) is the same code whether one request runs or many; closing
that stream cancels the request, and `Completion.cancel` does from outside. More than `max_waiting` requests
waiting is SchedulerBusy, which `serve` answers with 503 and Retry-After.

A request cancelled while its prompt is under way leaves at the next turn, its slot freed; the slot's record
(SequenceCache) holds the parts that ran, and only those: what the prefix cache stores from it, and what a later
prompt may keep of the slot, are rows the slot does hold. A part that fails fails its request alone.

Failures stay with their request: one whose own step fails (a constraint's mask that raised, NaN logits:
Backend.step's StepErrors) or whose bookkeeping raises (a constraint's advance) gets the error, the others go
on. A step that fails as a whole fails every request in it, each with its own copy of the error. Should the
worker itself fail, every request gets the error and the scheduler closes (no consumer is left waiting).
"""

from __future__ import annotations

import collections
import copy
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..backends.base import StepErrors
from ..backends.step import Sampler, StepOut
from ..errors import LlamacliError
from .speculative import SpecSettings, Speculation
from .tokens import Item, TokenRun

if TYPE_CHECKING:
    from ..sampling.structured import Constraint
    from .generate import Completion, Model

DEFAULT_PREFILL_BUDGET = 2048  # prompt tokens prefilled per turn before the running sequences get their next step
DEFAULT_MAX_WAITING = 64  # requests waiting for a slot before new ones are refused (SchedulerBusy)
AHEAD = 2  # ids a request may have waiting for its consumer before it sits out the decode steps
REUSE_SHARE = 0.5  # a slot's cache serves a prompt whose shared prefix covers this much of what it holds
_DONE = object()


class SchedulerBusy(LlamacliError):
    """Too many requests are waiting for a slot."""

    exit_code = 1


class SchedulerClosed(LlamacliError):
    """The scheduler stopped (the server is shutting down)."""

    exit_code = 1


def _own(exc: BaseException) -> BaseException:
    """A copy of `exc` for one request (the same object raised on several threads would share a traceback)."""
    try:
        return copy.copy(exc)
    except Exception:  # an exception that cannot be rebuilt from its args
        return LlamacliError(str(exc))


class Request:
    """One generation's ids as the worker hands them out (iterate it on one thread); closing the iterator, or
    cancel() from any thread, takes the request out at the next turn."""

    def __init__(self, ids: list[int], sampler: Sampler, max_tokens: int, completion: Completion,
                 constraint: Constraint | None, logprobs: int | None, wake: Callable[[], None],
                 on_cancel: Callable[[Request], None], speculative: SpecSettings | None = None,
                 salt: str | None = None):
        self.ids, self.sampler, self.max_tokens, self.completion = ids, sampler, max_tokens, completion
        self.constraint, self.logprobs, self.wake, self.on_cancel = constraint, logprobs, wake, on_cancel
        self.speculative = speculative  # (its drafting: the worker's, in its slot)
        self.salt = salt  # its cache salt: it keeps K/V only from slots and blocks filled under the same
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.run: TokenRun | None = None  # (the worker's, once its prompt begins)
        self.slot = -1
        self.estimate = 0  # (the worker's) prompt ids to prefill, as counted at admission (the slot's kept ones off)

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            self.cancelled.set()
            self.on_cancel(self)

    @property
    def ready(self) -> bool:
        """Whether its decode step may run: its consumer keeps up (or it was cancelled: it leaves then)."""
        return self.cancelled.is_set() or self.out.qsize() < AHEAD

    def __iter__(self) -> Iterator[Item]:
        c, taken = self.completion, 0
        try:
            while True:
                item = self.out.get()
                self.wake()  # (a request that sat out may step again)
                if isinstance(item, tuple) and item and item[0] is _DONE:  # (the end, and why it ended)
                    c.finish_reason = c.finish_reason or item[1]
                    return
                if isinstance(item, BaseException):
                    raise item
                if taken:  # the decode steps whose ids the consumer took (the first id is the prompt's)
                    c.timings.eval_tokens += 1
                taken += 1
                yield item
        finally:
            self.cancel()  # (a consumer that stops early: a stop string, a client gone)


class Scheduler:
    """The worker thread over `model` (loaded with Model(..., slots=N)): see the module docstring."""

    def __init__(self, model: Model, prefill_budget: int = DEFAULT_PREFILL_BUDGET,
                 max_waiting: int = DEFAULT_MAX_WAITING):
        if type(prefill_budget) is not int or prefill_budget < 1:
            raise ValueError(f"a prefill budget is a number of prompt tokens >= 1, got {prefill_budget!r}")
        self.model = model
        self.prefill_budget, self.max_waiting = prefill_budget, max_waiting
        self.chunked = bool(getattr(model.backend, "fill_steps", False))  # long prompts in parts (module doc)
        self.free = list(range(len(model.seqs)))  # slots holding no running sequence
        self.used = [-1] * len(model.seqs)  # per slot, the turn it was last taken (-1: never)
        self.turn = 0
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.cv = threading.Condition()
        self.closed = False
        self.steps = 0  # decode steps taken (Backend.step calls with at least one decode)
        self.batched = 0  # sequences in those steps, summed: batched / steps is the mean batch
        self.thread = threading.Thread(target=self._loop, name="llamacli-scheduler", daemon=True)
        self.thread.start()

    # -- the consumer's side ----------------------------------------------------------------------------------
    def tokens(self, ids: list[int], sampler: Sampler, max_tokens: int, completion: Completion,
               constraint: Constraint | None = None, logprobs: int | None = None,
               speculative: SpecSettings | None = None, salt: str | None = None) -> Iterator[Item]:
        """The ids of a generation from prompt `ids` (Model.run's token generator when it runs here), in arrival
        order behind the requests already waiting; `completion.cancel` then cancels it from any thread.
        `speculative`: its decode steps verify drafts (engine/speculative.py; the sampler speculative). `salt`:
        its cache salt (Model.run's cache_salt).
        SchedulerBusy when too many wait, SchedulerClosed after close()."""
        req = Request(list(ids), sampler, max_tokens, completion, constraint, logprobs, self._wake, self._cancelled,
                      speculative if speculative is not None and speculative.on else None, salt)
        with self.cv:
            self._check_room()
            self.waiting.append(req)
            self.cv.notify()
        completion.cancel = req.cancel
        return iter(req)

    def check_room(self) -> None:
        """SchedulerBusy if a request submitted now would be refused for the queue's length; SchedulerClosed
        after close() (serve asks before it answers a stream: the refusal can still be a 503 then)."""
        with self.cv:
            self._check_room()

    def _check_room(self) -> None:
        if self.closed:
            raise SchedulerClosed("the server is shutting down")
        if len(self.waiting) >= self.max_waiting:
            raise SchedulerBusy(f"{len(self.waiting)} requests are waiting for one of {len(self.model.seqs)} "
                                "sequence slots: try again shortly")

    @property
    def load(self) -> dict[str, int]:
        """Requests running (holding a slot: their prompt or decode steps under way), waiting, and slots free."""
        with self.cv:
            return {"running": len(self.model.seqs) - len(self.free), "waiting": len(self.waiting),
                    "free_slots": len(self.free)}

    def close(self) -> None:
        """Stop the worker after its current step; every request not finished gets SchedulerClosed."""
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join()

    # -- the worker ------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        with self.cv:
            self.cv.notify()

    def _cancelled(self, req: Request) -> None:
        """A request cancelled (any thread): one still waiting leaves the queue at once, never prefilled (its
        consumer's wait ends now, even while the worker is busy with a step); a running one at the next turn."""
        with self.cv:
            if req in self.waiting:
                self.waiting.remove(req)
                req.out.put((_DONE, "cancelled"))
            self.cv.notify()

    def _work(self) -> bool:
        """(Under the lock) whether a turn has anything to do: a request to admit or drop, one to step."""
        return bool(self.waiting and self.free) or any(req.ready for req in self.running)

    def _loop(self) -> None:
        try:
            while self._turn():
                pass
        except BaseException as exc:  # the worker itself failed: nobody may wait for it
            self._end_all(exc)
            raise

    def _turn(self) -> bool:
        with self.cv:
            while not self.closed and not self._work():
                self.cv.wait()
            if self.closed:
                self._end_all(SchedulerClosed("the server is shutting down"))
                return False
            self._admit()
        self._prompts()
        self._decode()
        return True

    def _end_all(self, exc: BaseException) -> None:
        """Every request waiting or running gets `exc` (its own copy); no new ones are taken."""
        with self.cv:
            self.closed = True
            reqs = [*self.waiting, *self.running]
            self.waiting.clear()
            self.running.clear()
        for req in reqs:
            req.out.put(_own(exc))

    def _slot_for(self, ids: list[int], salt: str | None) -> tuple[int, int]:
        """(slot, prompt ids it keeps) of the free slot for a prompt of cache salt `salt`: the one keeping most,
        where that covers at least REUSE_SHARE of what it holds; else the least recently used (an empty one
        first). A slot filled under another salt keeps nothing (SequenceCache.reusable)."""
        seqs = self.model.seqs
        keep = {s: seqs[s].reusable(ids, salt) for s in self.free}
        best = max(self.free, key=lambda s: (keep[s], -s))
        if keep[best] and keep[best] >= REUSE_SHARE * len(seqs[best]):
            return best, keep[best]
        slot = min(self.free, key=lambda s: (self.used[s], s))
        return slot, keep[slot]

    def _prefilling(self, req: Request) -> bool:
        """Whether the request's prompt step has yet to run (not begun, or begun in parts)."""
        return req.run is None or req.run.prefilling

    def _left(self, req: Request) -> int:
        """Prompt ids the request has yet to prefill (an estimate before its prompt begins)."""
        return req.estimate if req.run is None else req.run.remaining

    def _admit(self) -> None:
        """(Under the lock) waiting requests into free slots while the turn's prompt budget is not spent, the
        prompts already under way counted first."""
        budget = self.prefill_budget - sum(self._left(req) for req in self.running if self._prefilling(req))
        self.turn += 1
        while self.waiting and self.free and budget > 0:
            req = self.waiting.popleft()
            slot, keep = self._slot_for(req.ids, req.salt)
            self.free.remove(slot)
            self.used[slot] = self.turn
            req.slot, req.estimate = slot, len(req.ids) - keep
            budget -= req.estimate
            self.running.append(req)

    def _release(self, req: Request, item: Any = None) -> None:
        """End a request (its error, or its finish) and free its slot (the prefix cache keeps its blocks)."""
        reason = req.run.finish_reason if req.run is not None else None
        if req.run is not None:
            try:
                req.run.finish()
            except Exception as exc:  # (the request's own: its blocks could not be stored)
                item = item if item is not None else exc
        req.out.put(item if item is not None else (_DONE, reason or "cancelled"))
        with self.cv:
            if req in self.running:
                self.running.remove(req)
                self.free.append(req.slot)

    def _prompts(self) -> None:
        """The turn's prefill (module doc, 2.): prompt steps, or parts of prompts where the backend takes them,
        within the turn's budget; each step runs alone, its failure its request's."""
        model, budget = self.model, self.prefill_budget
        with self.cv:
            pending = [req for req in self.running if self._prefilling(req)]
        for req in pending:
            if req.cancelled.is_set():  # left before its prompt ran (or between its parts): its slot freed
                self._release(req)
                continue
            if self.chunked and budget <= 0:  # the turn's budget is spent: its next part is the next turn's
                continue
            if req.run is None:
                spec = None if req.speculative is None else Speculation(req.speculative, model.draft, req.slot,
                                                                        req.salt)
                req.run = TokenRun(model.seqs[req.slot], req.ids, req.sampler, model.tokenizer, req.max_tokens,
                                   req.completion.timings, req.constraint, req.logprobs, count_eval=False,
                                   cache=model.prefix_cache, spec=spec, salt=req.salt)
            try:
                step = req.run.prompt_step(budget if self.chunked else None)
                out = model.backend.step([step])[0]
                budget -= len(step.tokens)
                if step.fill:
                    req.run.fill_out(out)
                    continue
                item = req.run.prompt_out(out)
            except Exception as exc:  # (the request's own: its step ran alone)
                self._release(req, exc)
                continue
            self._hand(req, item)

    def _hand(self, req: Request, item: Item | None) -> None:
        """Give the request its id, or end it (finished by itself)."""
        if item is None:
            self._release(req)
        else:
            req.out.put(item)

    def _decode(self) -> None:
        batch, reqs = [], []
        with self.cv:
            running = list(self.running)
        for req in running:
            if req.run is None:  # (admitted, its prompt not begun: _prompts' to run or release)
                continue
            if req.cancelled.is_set():
                self._release(req)
                continue
            if req.run.prefilling:  # its prompt's parts still to run (next turn's)
                continue
            if not req.ready:  # its consumer is behind: it sits this step out
                continue
            try:
                step = req.run.next_step()  # (a constraint's advance, a draft model's step may raise: its own)
            except Exception as exc:
                self._release(req, exc)
                continue
            if step is None:
                self._release(req)
                continue
            batch.append(step)
            reqs.append(req)
        if not batch:
            return
        try:
            outs: list[StepOut | None] = list(self.model.backend.step(batch))
        except StepErrors as exc:  # some sequences failed on their own; the others' steps ran
            outs = exc.outs
            for i, err in exc.errors.items():
                self._release(reqs[i], err)
        except Exception as exc:  # the step as a whole
            for req in reqs:
                self._release(req, _own(exc))
            return
        self.steps += 1
        self.batched += len(batch)
        for req, out in zip(reqs, outs):
            if out is None:
                continue
            try:
                items = req.run.step_out(out)
            except Exception as exc:
                self._release(req, exc)
                continue
            for item in items:
                req.out.put(item)
            if req.run.finished:
                self._release(req)
