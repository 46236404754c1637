"""Continuous batching: many generations at once, each in a cache slot of its own, their decode steps taken
together in one Backend.step (vLLM's and llama-server's slots; the batching issue's scheduler).

One worker thread owns the model: every backend call happens there (the CUDA state stays with one thread).
Requests come in through `tokens()` and wait in arrival order for a free slot. Each turn of the worker:

1. admit waiting requests to free slots, each to the free slot whose cache shares the longest prefix with its
   prompt: a slot's cache is a prefix cache, so a resent conversation or a shared system prompt is not
   prefilled again (SequenceCache.reusable says how much a prompt keeps);
2. run the prompt steps of the requests admitted (a prefill and the first id each), up to `prefill_budget`
   prompt tokens per turn (at least one prompt), so that running sequences keep getting their ids while
   long prompts come in;
3. run one decode step of every running sequence, all in one Backend.step;
4. hand each id to its request (a queue the consumer reads on its own thread); a request that finished or was
   cancelled leaves the batch at once and frees its slot.

A request whose consumer has not taken its last AHEAD ids sits out the decode steps (it keeps its slot) until
it does: the ids are pulled, as by a single generation's loop, so a client that stops reading (a full socket)
stops its generation rather than filling a queue.

A request joins the running batch at the next turn and leaves it at the step it finishes. `Model.run` takes
the ids through `scheduler.tokens(...)` instead of its own loop, so the text stream (detokenizing, stop
strings, the reasoning split) is the same code whether one request runs or many: closing that stream (a stop
string, a client gone) cancels the request. More than `max_waiting` requests waiting is SchedulerBusy, which
`serve` answers with 503 and Retry-After.

A step that raises fails every request in it (their sequences start again with their next request): a batch
shares its launches, so one sequence's error cannot be told from the batch's.
"""

from __future__ import annotations

import collections
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..backends.step import Sampler, StepOut
from ..errors import LlamacliError
from .tokens import Item, TokenRun

if TYPE_CHECKING:
    from ..sampling.structured import Constraint
    from .generate import Completion, Model

DEFAULT_PREFILL_BUDGET = 2048  # prompt tokens per turn before the running sequences get their next step
DEFAULT_MAX_WAITING = 256  # requests waiting for a slot before new ones are refused (SchedulerBusy)
AHEAD = 2  # ids a request may have waiting for its consumer before it sits out the decode steps
_DONE = object()


class SchedulerBusy(LlamacliError):
    """Too many requests are waiting for a slot."""

    exit_code = 1


class SchedulerClosed(LlamacliError):
    """The scheduler stopped (the server is shutting down)."""

    exit_code = 1


class Request:
    """One generation's ids as the worker hands them out (iterate it on any thread); closing the iterator, or
    cancel(), takes the request out of the batch at the next turn."""

    def __init__(self, ids: list[int], sampler: Sampler, max_tokens: int, completion: Completion,
                 constraint: Constraint | None, logprobs: int | None, wake: Callable[[], None]):
        self.ids, self.sampler, self.max_tokens, self.completion = ids, sampler, max_tokens, completion
        self.constraint, self.logprobs, self.wake = constraint, logprobs, wake
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.run: TokenRun | None = None  # (the worker's, once admitted)
        self.slot = -1

    def cancel(self) -> None:
        self.cancelled.set()
        self.wake()

    @property
    def ready(self) -> bool:
        """Whether its decode step may run: its consumer keeps up (or it was cancelled: it leaves then)."""
        return self.cancelled.is_set() or self.out.qsize() < AHEAD

    def __iter__(self) -> Iterator[Item]:
        try:
            while True:
                item = self.out.get()
                self.wake()  # (a request that sat out may step again)
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()  # (a consumer that stops early: a stop string, a client gone)


class Scheduler:
    """The worker thread over `model` (loaded with Model(..., slots=N)): see the module docstring."""

    def __init__(self, model: Model, prefill_budget: int = DEFAULT_PREFILL_BUDGET,
                 max_waiting: int = DEFAULT_MAX_WAITING):
        self.model = model
        self.prefill_budget, self.max_waiting = prefill_budget, max_waiting
        self.free = list(range(len(model.seqs)))  # slots holding no running sequence
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
               constraint: Constraint | None = None, logprobs: int | None = None) -> Iterator[Item]:
        """The ids of a generation from prompt `ids` (Model.run's token generator when it runs here), in arrival
        order behind the requests already waiting. SchedulerBusy when too many wait, SchedulerClosed after
        close()."""
        req = Request(list(ids), sampler, max_tokens, completion, constraint, logprobs, self._wake)
        with self.cv:
            self._check_room()
            self.waiting.append(req)
            self.cv.notify()
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

    def _work(self) -> bool:
        """(Under the lock) whether a turn has anything to do: a request to admit, or one to step or drop."""
        return bool(self.waiting and self.free) or any(req.ready for req in self.running)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.closed and not self._work():
                    self.cv.wait()
                if self.closed:
                    for req in [*self.waiting, *self.running]:
                        req.out.put(SchedulerClosed("the server is shutting down"))
                    self.waiting.clear()
                    self.running.clear()
                    return
                admitted = self._admit()
            self._drop_cancelled()
            self._prompts(admitted)
            self._decode()

    def _admit(self) -> list[Request]:
        """Waiting requests into free slots (under the lock), each to the slot that keeps most of its prompt,
        up to the turn's prompt budget (the first always)."""
        admitted, budget = [], self.prefill_budget
        while self.waiting and self.free and (not admitted or budget > 0):
            req = self.waiting.popleft()
            if req.cancelled.is_set():
                req.out.put(_DONE)
                continue
            seqs = self.model.seqs
            slot = max(self.free, key=lambda s: (seqs[s].reusable(req.ids), -s))
            self.free.remove(slot)
            req.slot = slot
            budget -= len(req.ids) - seqs[slot].reusable(req.ids)
            admitted.append(req)
        return admitted

    def _release(self, req: Request, item: Any = _DONE) -> None:
        req.completion.finish_reason = req.completion.finish_reason or (req.run.finish_reason if req.run else None)
        req.out.put(item)
        with self.cv:
            if req in self.running:
                self.running.remove(req)
            self.free.append(req.slot)

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.running if r.cancelled.is_set()]:
            self._release(req)

    def _prompts(self, admitted: list[Request]) -> None:
        model = self.model
        for req in admitted:
            c = req.completion
            run = req.run = TokenRun(model.seqs[req.slot], req.ids, req.sampler, model.tokenizer, req.max_tokens,
                                     c.timings, req.constraint, req.logprobs)
            try:
                item = run.prompt_out(model.backend.step([run.prompt_step()])[0])
            except Exception as exc:  # (the request's own: it runs alone)
                self._release(req, exc)
                continue
            with self.cv:
                self.running.append(req)
            self._hand(req, item)

    def _hand(self, req: Request, item: Item | None) -> None:
        """Give the request its id, or end it (finished by itself)."""
        if item is None:
            self._release(req)
        else:
            req.out.put(item)

    def _decode(self) -> None:
        batch, reqs = [], []
        for req in list(self.running):
            if req.cancelled.is_set():
                self._release(req)
                continue
            if not req.ready:  # its consumer is behind: it sits this step out
                continue
            step = req.run.next_step()
            if step is None:
                self._release(req)
                continue
            batch.append(step)
            reqs.append(req)
        if not batch:
            return
        try:
            outs: list[StepOut] = self.model.backend.step(batch)
        except Exception as exc:
            for req in reqs:
                self._release(req, exc)
            return
        self.steps += 1
        self.batched += len(batch)
        for req, out in zip(reqs, outs):
            self._hand(req, req.run.step_out(out))
