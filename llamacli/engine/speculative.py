"""Speculative decoding: ids drafted cheaply, then checked by the model k + 1 at a time in one pass (a
verification step, backends/step.py), every draft it agrees with an id for free.

Draft sources (`--spec-type`, llama.cpp's names; several, comma-separated, are tried in the order given, the
first with a draft wins):

- `ngram-simple` (llama.cpp's common_ngram_simple_draft, mirrored): the last n ids (`--spec-ngram-size-n`,
  llama.cpp's default 12) looked up in the ids so far (the prompt and the output); at their most recent earlier
  occurrence, the ids that followed it are the draft. No second model: it pays where the output quotes its
  input (code edits, summaries with quotes, answers repeating their context). The occurrences are kept in a
  dict as the ids grow (NgramIndex), one lookup a step rather than llama.cpp's scan backwards; unlike
  llama.cpp, a match at position 0 counts and a draft shorter than n is used (`--draft-min` bounds it).
- `draft-simple` (llama.cpp's draft model, `-md/--model-draft`): a smaller model of the same vocabulary,
  with its own backend and cache slots, drafts greedily (as llama.cpp's, whose draft sampler keeps the best
  token), continuing the ids its cache holds (what it drafted before and the target rejected is cut back by
  SequenceCache.reusable, as a new prompt's would be).
- llama.cpp's other types (ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache, draft-eagle3, draft-dflash,
  and draft-mtp: Qwen3.5's multi-token-prediction heads) are refused with a line saying so: not implemented
  here.

Acceptance (TokenRun, engine/tokens.py, over a verification's rows): the id at each position is chosen exactly
as a plain decode step would choose it there (`choose`: the sampler's penalties over the ids before it, the
constraint's mask after the ids before it, temperature and the truncations, one draw from the sequence's own
generator), left to right; a draft that equals the id chosen is accepted and the next position is read, the
first that differs ends the step with the id chosen (the correction), and when every draft holds, the last row
gives one more (the bonus). For greedy sampling that is the longest matching prefix, so the output is the plain
decode's. For sampled requests it is the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023) for a
deterministic draft, whose distribution q is one-hot at the drafted id d: accept d with probability
min(1, p(d) / q(d)) = p(d), else draw from normalise(max(0, p - q)) = p without d. Drawing x ~ p and accepting
iff x = d gives the same two cases with the same probabilities, and keeps one draw per position: the ids are the
plain decode's draw for draw, for a seed. Both sources draft deterministically, so no other q arises here.
The rows' logits come to the host for this (StepOut.logits) unless the sampler is plain greedy, whose rows
give their argmax only (StepOut.choices).

Options are checked here without NumPy (the CLI checks them before anything loads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import LlamacliError, UsageError
from ..textio import brief, printable

if TYPE_CHECKING:
    import numpy as np

    from ..backends.step import Sampler

SOURCES = ("ngram-simple", "draft-simple")  # the draft sources this module has
ALIASES = {"ngram": "ngram-simple", "draft": "draft-simple"}  # (llama.cpp's older name for a draft model)
NOT_HERE = {  # llama.cpp's other --spec-type names (and their older spellings): why each is refused
    **{name: "llama.cpp's n-gram statistics and hash pools are not implemented here; ngram-simple is"
       for name in ("ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix")},
    **{name: "multi-token-prediction heads (Qwen3.5's nextn layers) are not implemented here yet; use ngram-simple "
             "or a draft model (-md)" for name in ("draft-mtp", "mtp", "draft-mtp-adaptive")},
    **{name: "its draft heads are not implemented here; use ngram-simple or a draft model (-md)"
       for name in ("draft-eagle3", "eagle3", "draft-dflash", "dflash", "draft-dspark")},
}
DEFAULT_DRAFT_MAX = 16  # llama.cpp's --draft-max
MAX_DRAFT = 64  # --draft-max's bound: a verification is a prefill pass of up to this many + 1 tokens
DEFAULT_NGRAM_N = 12  # llama.cpp's --spec-ngram-size-n
MAX_NGRAM_N = 1024


@dataclass(frozen=True)
class SpecSettings:
    """How a generation drafts: its sources in order (SOURCES; none: no speculation), at most `draft_max` ids a
    step, none below `draft_min` (a shorter draft is not verified: the step is a plain one), `ngram_n` ids
    looked up by ngram-simple."""

    sources: tuple[str, ...] = ()
    draft_max: int = DEFAULT_DRAFT_MAX
    draft_min: int = 0
    ngram_n: int = DEFAULT_NGRAM_N

    @property
    def on(self) -> bool:
        return bool(self.sources) and self.draft_max > 0

    def validate(self) -> SpecSettings:
        """UsageError (one line) for a value that cannot work; self otherwise."""
        if not isinstance(self.sources, tuple) or not all(s in SOURCES for s in self.sources):
            raise UsageError(f"speculative sources must be among {', '.join(SOURCES)}, got {brief(self.sources)}")
        for name, value, low, high in (("draft-max", self.draft_max, 0, MAX_DRAFT),
                                       ("draft-min", self.draft_min, 0, MAX_DRAFT),
                                       ("spec-ngram-size-n", self.ngram_n, 1, MAX_NGRAM_N)):
            if type(value) is not int or not low <= value <= high:
                raise UsageError(f"--{name} must be an integer from {low} to {high}, got {brief(value)}")
        if self.draft_min > self.draft_max:
            raise UsageError(f"--draft-min ({self.draft_min}) must not exceed --draft-max ({self.draft_max})")
        return self

    def with_limits(self, draft_max: int | None = None, draft_min: int | None = None) -> SpecSettings:
        """These settings with a request's own bounds (llama-server's speculative.n_max / n_min), checked."""
        out = replace(self, **{k: v for k, v in (("draft_max", draft_max), ("draft_min", draft_min)) if v is not None})
        if draft_max is not None and draft_min is None:
            out = replace(out, draft_min=min(out.draft_min, out.draft_max))
        return out.validate()


def parse_spec_type(text: str) -> tuple[str, ...]:
    """--spec-type's value (llama.cpp's names, comma-separated; "none" alone: off) -> the sources, or UsageError
    naming what is wrong in one line."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError("--spec-type takes a type (ngram-simple, draft-simple, none), got an empty value")
    if len(text) > 256:
        raise UsageError(f"--spec-type takes a type (ngram-simple, draft-simple, none), got {len(text)} characters")
    out: list[str] = []
    for part in text.split(","):
        name = part.strip().lower().replace("_", "-")
        name = ALIASES.get(name, name)
        if name == "none":
            continue
        if name in NOT_HERE:
            raise UsageError(f"--spec-type {name}: {NOT_HERE[name]}")
        if name not in SOURCES:
            raise UsageError(f"--spec-type takes {', '.join(SOURCES)} or none (comma-separated; llama.cpp's names), "
                             f"got {printable(part.strip())!s}")
        if name not in out:
            out.append(name)
    return tuple(out)


def spec_settings(spec_type: str | None, draft_max: int, draft_min: int, ngram_n: int,
                  draft_model: bool = False) -> SpecSettings:
    """The settings the options ask for: --spec-type (None: none, or draft-simple with -md), --draft-max,
    --draft-min, --spec-ngram-size-n; `draft_model`: -md given (draft-simple joins the sources, after those named,
    as llama.cpp's -md does). UsageError for a value that cannot work."""
    sources = parse_spec_type(spec_type) if spec_type is not None else ()
    if draft_model and "draft-simple" not in sources and not (spec_type is not None and not sources):
        sources = (*sources, "draft-simple")
    if "draft-simple" in sources and not draft_model:
        raise UsageError("--spec-type draft-simple needs a draft model: -md/--model-draft FILE")
    return SpecSettings(sources, draft_max, draft_min, ngram_n).validate()


# -- draft sources -------------------------------------------------------------------------------------------


class NgramIndex:
    """ngram-simple over one generation's ids (which only grow): the start of the latest occurrence of every
    n-gram that ends before the last id, kept as the ids come."""

    def __init__(self, n: int):
        self.n = n
        self.starts: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams starting before this are in `starts`

    def draft(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to k ids that followed the most recent earlier occurrence of ids' last n; [] where there is none."""
        n, end = self.n, len(ids)
        if end <= n:
            return []
        for j in range(self.indexed, end - n):  # (an n-gram starting at end - n is the one looked up)
            self.starts[tuple(ids[j : j + n])] = j
        self.indexed = max(self.indexed, end - n)
        j = self.starts.get(tuple(ids[end - n :]))
        return [] if j is None else list(ids[j + n : j + n + k])


class DraftModel:
    """A draft model (engine.generate.Model of the target's vocabulary, loaded with as many cache slots) that
    drafts greedily in the slot of the target's sequence."""

    def __init__(self, model: Any):
        self.model = model

    def draft(self, slot: int, ids: Sequence[int], k: int, salt: str | None = None) -> list[int]:
        """Up to k ids after `ids` (whole: the prompt and the output so far): the ids its cache does not hold
        prefilled (under the request's cache salt `salt`, as the target's: SequenceCache.reusable), then greedy
        decode steps; within its context."""
        from ..backends.step import Sampler, SeqStep
        from ..sampling.sampling import SamplingParams, make_rng

        m = self.model
        seq, be = m.seqs[slot], m.backend
        k = min(k, m.ctx - len(ids))  # its steps write positions len(ids) - 1 .. len(ids) + k - 2
        if k < 1:
            return []
        keep = seq.reusable(ids, salt)
        seq.begin_prompt(keep, len(ids), salt)
        sampler = Sampler(SamplingParams(temperature=0.0), make_rng(0), history=list(ids))
        try:
            out = be.step([SeqStep(list(ids[keep:]), keep, sampler, slot)])[0]
            seq.prompt_done(ids)
            drafts = [out.id]
            while len(drafts) < k:
                pos = len(seq)
                seq.begin_decode(pos)
                out = be.step([SeqStep([drafts[-1]], pos, sampler, slot)])[0]
                seq.token_done(drafts[-1])
                if out.snapshots is not None:
                    seq.held(out.snapshots)
                drafts.append(out.id)
        except BaseException:
            seq.clear()  # what its cache holds is unknown now
            raise
        if out.snapshots is not None:
            seq.held(out.snapshots)
        return drafts


def check_vocabularies(target: Any, draft: Any) -> None:
    """UsageError unless the draft model's vocabulary is the target's: the same tokenizer and the same token texts
    (llama.cpp compares them too), as many embedding rows."""
    def tokens(m: Any) -> tuple[Any, Any]:
        md = m.gguf.metadata
        return md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.tokens")

    (kind, words), (dkind, dwords) = tokens(target), tokens(draft)
    why = None
    if target.cfg.vocab_size != draft.cfg.vocab_size:
        why = f"{draft.cfg.vocab_size:,} tokens against the model's {target.cfg.vocab_size:,}"
    elif kind != dkind:
        why = f"a {printable(str(dkind))} tokenizer against the model's {printable(str(kind))}"
    elif words != dwords:
        at = next((i for i, (a, b) in enumerate(zip(words or [], dwords or [])) if a != b), None)
        why = "other token texts" + (f" (token {at}: {printable(repr(dwords[at]))} against "
                                     f"{printable(repr(words[at]))})" if at is not None else "")
    if why:
        raise UsageError(f"the draft model's vocabulary differs from the model's ({why}): a draft model must share "
                         "the vocabulary")


class Speculation:
    """One generation's drafting (TokenRun's): its settings' sources in order, each asked for up to the step's
    room; the draft model's in cache slot `slot`, under the request's cache salt `salt`. A source that fails (a
    broken draft model) is dropped for the rest of the generation, which goes on."""

    def __init__(self, settings: SpecSettings, draft_model: DraftModel | None = None, slot: int = 0,
                 salt: str | None = None):
        self.settings, self.slot, self.salt = settings, slot, salt
        self.ngram = NgramIndex(settings.ngram_n)
        self.draft_model = draft_model if "draft-simple" in settings.sources else None
        self.failed: LlamacliError | None = None  # why the draft model stopped drafting, if it did

    def propose(self, ids: Sequence[int], room: int) -> list[int]:
        """The drafts after `ids` (the ids so far, the last taken one included) for a step with room for `room`
        (the context's and max_tokens' bounds): at most draft_max, [] below draft_min or where no source has one."""
        s = self.settings
        k = min(s.draft_max, room)
        if k < max(1, s.draft_min):
            return []
        drafts: list[int] = []
        for source in s.sources:
            if source == "ngram-simple":
                drafts = self.ngram.draft(ids, k)
            elif self.draft_model is not None:
                try:
                    drafts = self.draft_model.draft(self.slot, ids, k, self.salt)
                except LlamacliError as exc:  # (NaN logits, say): the target goes on without it
                    self.failed, self.draft_model = exc, None
            if drafts:
                break
        return drafts if len(drafts) >= s.draft_min else []


def choose(row: "np.ndarray", sampler: "Sampler") -> int:
    """The id a plain decode step would take from raw logits `row` [V] (host) with `sampler` as it stands: its
    constraint's mask (computed now), penalties over its history, the settings, one draw from its generator."""
    import numpy as np

    from ..sampling.sampling import sample
    from ..sampling.structured import unpack_words

    x = row
    if sampler.mask is not None:
        x = np.where(unpack_words(sampler.mask(), row.shape[-1]), row, np.float32(-np.inf))
    return sample(x, sampler.params, sampler.rng, sampler.history)
