"""Speculative decoding (engine/speculative.py, the verification step of backends/step.py) on the NumPy backend:
the output is the plain decode's (greedy, and sampled draw for draw with penalties, logprobs, masks and
constraints), on every kind of layer (sliding-window rings, experts, recurrent Gated DeltaNet layers rolled back
past rejected drafts); the cache a rejection leaves is the plain decode's; the sampled output keeps the model's
distribution (chi-square); drafts come from the ids so far (ngram-simple) or a draft model of the same
vocabulary; the scheduler runs speculative requests beside plain ones."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from llamacli.backends.numpy_backend import NumpyBackend
from llamacli.backends.step import Sampler, SeqStep
from llamacli.engine.generate import Completion, Model
from llamacli.engine.scheduler import Scheduler
from llamacli.engine.speculative import NgramIndex, SpecSettings, parse_spec_type, spec_settings
from llamacli.errors import BackendError, UsageError
from llamacli.ggufio.file import open_gguf
from llamacli.models import block
from llamacli.models.config import ModelConfig
from llamacli.sampling.sampling import SamplingParams, make_rng, softmax, top_k_filter

ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-phi3", "tiny-gemma2", "tiny-gemma3", "tiny-smollm3", "tiny-qwen3moe",
         "tiny-gpt-oss", "tiny-qwen35", "tiny-qwen3next", "tiny-gemma4", "tiny-gemma4-moe"]
ECHO = [5, 9, 2, 40, 7, 7, 1, 5, 9, 2, 40, 7, 11, 60, 61, 62, 5, 9, 2]  # ids that recur: n-gram drafts find them


def ngram(n: int = 1, draft_max: int = 6) -> SpecSettings:
    return SpecSettings(("ngram-simple",), draft_max, 0, n)


@pytest.fixture(scope="module")
def models(random_model):
    """Loaded NumPy models by shape (each kept for the module: loading is most of a tiny model's time)."""
    cache: dict = {}

    def get(shape: str, qtype: str = "F32", seed: int = 0) -> Model:
        key = (shape, qtype, seed)
        if key not in cache:
            cache[key] = Model(random_model(shape, qtype, seed=seed), backend="numpy", ctx=160)
        return cache[key]

    yield get
    for m in cache.values():
        m.close()


def generate(m: Model, spec: SpecSettings | None, n: int = 40, prompt=ECHO, **kw) -> Completion:
    return m.complete(list(prompt), max_tokens=n, speculative=spec or SpecSettings(), **kw)


@pytest.mark.parametrize("shape", ARCHS)
def test_greedy_output_is_the_plain_output(models, shape):
    """n-gram drafts over an echoing prompt (mostly accepted), a draft model of other weights (mostly rejected)
    and one of the same weights at Q8_0 (mostly accepted): every reply is the plain greedy one, and between them
    drafts were both accepted and rejected (so the rollback past a rejection ran)."""
    m = models(shape)
    drafters = [models("tiny-llama", "F32", seed=7), models(shape, "Q8_0")]
    want = generate(m, None, ignore_eos=True, temperature=0.0).tokens
    drafted = accepted = 0
    for spec, drafter in ((ngram(1), None), (ngram(2, 16), None), (SpecSettings(("draft-simple",), 4), drafters[0]),
                          (SpecSettings(("draft-simple",), 5), drafters[1])):
        m.draft = None
        if drafter is not None:
            m.attach_draft(drafter)
        c = generate(m, spec, ignore_eos=True, temperature=0.0)
        assert c.tokens == want, (spec, c.tokens, want)
        drafted, accepted = drafted + c.timings.drafted, accepted + c.timings.accepted
        assert c.timings.eval_tokens == len(c.tokens) - 1 and c.timings.passes < len(c.tokens)
    m.draft = None
    assert 0 < accepted < drafted


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-gemma3", "tiny-qwen35"])
@pytest.mark.parametrize("params", [
    dict(temperature=0.9, top_k=5, seed=3),
    dict(temperature=1.2, top_k=0, top_p=0.9, min_p=0.02, seed=11),
    dict(temperature=0.7, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1, repeat_last_n=16, seed=5),
    dict(temperature=0.0, repeat_penalty=1.5),
], ids=["top-k", "top-p-min-p", "penalties", "greedy-penalties"])
def test_sampled_output_is_the_plain_output_draw_for_draw(models, shape, params):
    """Each row's id is drawn as the plain step's, from the same generator: the same ids for a seed, the same
    log-probabilities, with --ignore-eos's mask too; drafts are verified (some rejected)."""
    m = models(shape)
    m.attach_draft(models(shape, "Q8_0"))  # (drafts where the n-grams have none)
    spec, drafted = SpecSettings(("ngram-simple", "draft-simple"), 4, 0, 1), 0
    for kw in (dict(logprobs=3), dict(ignore_eos=True)):
        want = generate(m, None, n=48, **params, **kw)
        got = generate(m, spec, n=48, **params, **kw)
        drafted += got.timings.drafted
        assert got.tokens == want.tokens
        if want.logprobs is not None:
            assert [e["id"] for e in got.logprobs] == [e["id"] for e in want.logprobs]
            for a, b in zip(got.logprobs, want.logprobs):
                assert abs(a["logprob"] - b["logprob"]) < 1e-4
                assert [t["id"] for t in a["top_logprobs"]] == [t["id"] for t in b["top_logprobs"]]
    m.draft = None
    assert drafted > 0


def test_a_constraint_keeps_its_mask_row_by_row(random_model, llama_cpp_models):
    """A grammar (llguidance) masks each row with the constraint advanced past the ids before it: the replies are
    the plain ones, and still follow the grammar."""
    pytest.importorskip("llguidance")
    from llamacli.sampling.structured import grammar_constraint
    from llamacli.testing import variant

    path = random_model(variant("tiny-llama", vocab_size=32000), "Q8_0", std=0.2,
                        vocab_file=str(llama_cpp_models / "ggml-vocab-llama-spm.gguf"))
    with Model(path, backend="numpy", ctx=160) as m:
        prompt = m.tokenize("ab ab abc b ab abc ab b ab the cat a dog the cat")
        accepted = 0
        for grammar, words in (('root ::= ("ab " | "abc " | "b ")+ "."', {"ab", "abc", "b"}),
                               ('root ::= ("the cat " | "a dog ")+ "."', {"the", "cat", "a", "dog"})):
            constraint = grammar_constraint(m, grammar)
            for params in (dict(temperature=0.0), dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=2)):
                want = m.complete(prompt, max_tokens=40, constraint=constraint, **params)
                got = m.complete(prompt, max_tokens=40, constraint=constraint, speculative=ngram(1, 4), **params)
                assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
                assert set(got.text.rstrip(".").split()) <= words
                accepted += got.timings.accepted
        assert accepted > 0


def test_a_stop_or_an_end_among_the_accepted_drafts_ends_the_reply_there(models):
    """max_tokens, a stop string and the end-of-generation id may fall among a verification's ids: the reply
    ends where the plain one does."""
    m = models("tiny-gemma3")
    full = generate(m, None, n=40, ignore_eos=True, temperature=0.0)
    for n in (1, 2, 5, 17):
        assert generate(m, ngram(1), n=n, ignore_eos=True, temperature=0.0).tokens == full.tokens[:n]
    text = m.detokenize(full.tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    a = m.complete(list(ECHO), max_tokens=40, ignore_eos=True, stop=stop, temperature=0.0)
    b = m.complete(list(ECHO), max_tokens=40, ignore_eos=True, stop=stop, temperature=0.0, speculative=ngram(1))
    assert (a.text, a.finish_reason) == (b.text, b.finish_reason) and a.finish_reason == "stop"
    for seed in range(6):  # the model's own end, sampled
        plain = generate(m, None, n=40, seed=seed, temperature=1.0)
        assert generate(m, ngram(1), n=40, seed=seed, temperature=1.0).tokens == plain.tokens


# -- the verification step and its rollback -------------------------------------------------------------------


def loaded(path, ctx=96) -> NumpyBackend:
    g = open_gguf(path)
    be = NumpyBackend()
    be.load(g, ModelConfig.from_gguf(g.metadata, set(g.tensors)), ctx)
    return be


def state_of(be: NumpyBackend, upto: int) -> list[np.ndarray]:
    """The cache a sequence's positions 0..upto-1 left: K/V rows (a ring's last window), recurrent states."""
    out = []
    for i, plan in enumerate(be.cfg.layers):
        if plan.recurrent:
            st = be.recurrent_slot.states[i]
            assert st.conv_pos == st.ssm_pos == upto
            out += [st.conv, st.ssm]
        else:
            rows = be.k_cache[i].shape[0]
            lo = max(0, upto - min(rows, plan.window or rows))
            pos = np.arange(lo, upto) % rows
            out += [be.k_cache[i][pos], be.v_cache[i][pos]]
    return out


@pytest.mark.parametrize("shape,n_prompt,ctx", [("tiny-llama", 9, 64), ("tiny-gpt-oss", 9, 64),
                                                ("tiny-gemma3", 700, 1024), ("tiny-qwen35", 9, 64)],
                         ids=["llama", "gpt-oss", "gemma3-rings", "qwen35-recurrent"])
def test_a_rejection_leaves_the_cache_of_plain_decode(random_model, shape, n_prompt, ctx):
    """A verification whose drafts go wrong after the first two: the next step starts past those two, and the
    cache (K/V rows, a sliding-window ring's last window, the recurrent states) and every later step's logits
    are the plain decode's."""
    path = random_model(shape, "F32")
    prompt = np.random.default_rng(3).integers(0, 200, n_prompt).tolist()
    greedy = SamplingParams(temperature=0.0)
    p = len(prompt)

    def start(speculative: bool):
        be = loaded(path, ctx)
        s = Sampler(greedy, make_rng(0), list(prompt), logits=True, speculative=speculative)
        return be, s, be.step([SeqStep(prompt, 0, s)])[0].id

    ref, rs, tok = start(False)
    plain, want = [tok], []
    for i in range(8):  # the plain ids, each step's logits
        out = ref.step([SeqStep([plain[-1]], p + i, rs)])[0]
        plain.append(out.id)
        want.append(out.logits)
    be, s, tok2 = start(True)
    assert tok2 == tok
    drafts = plain[1:3] + [(plain[3] + 1) % be.cfg.vocab_size, plain[4]]  # two right, then wrong
    out = be.step([SeqStep([plain[0], *drafts], p, s)])[0]
    assert out.id == -1 and out.logits.shape == (5, be.cfg.vocab_size)
    for i in range(3):
        np.testing.assert_allclose(out.logits[i], want[i], rtol=1e-4, atol=1e-4)
    # The engine accepts two drafts and takes plain[3]: the next step is that id at p + 3.
    for i in range(3, 8):
        got = be.step([SeqStep([plain[i]], p + i, s)])[0]
        np.testing.assert_allclose(got.logits, want[i], rtol=1e-4, atol=1e-4)
    for a, b in zip(state_of(be, p + 8), state_of(ref, p + 8), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_contract_bounds_a_verification(random_model):
    """Drafts only for a speculative sampler; the next step starts within the positions the last verification
    wrote (past its first); drafts past the context are refused; a plain sampler's greedy verification gives
    the argmax ids."""
    be = loaded(random_model("tiny-llama", "F32"), ctx=16)
    s = Sampler(SamplingParams(temperature=0.0), make_rng(0), [1, 2], speculative=True)
    be.step([SeqStep([1, 2], 0, s)])
    plain = Sampler(SamplingParams(temperature=0.0), make_rng(0), [1, 2])
    out = be.step([SeqStep([3, 4, 5], 2, s)])[0]
    assert out.id == -1 and out.logits is None and len(out.choices) == 3
    with pytest.raises(BackendError, match=r"3\.\.5"):
        be.step([SeqStep([6], 2, s)])  # not past the verification's first position
    s2 = Sampler(SamplingParams(temperature=0.0), make_rng(0), [1, 2], speculative=True)
    be.step([SeqStep([1, 2], 0, s2)])
    be.step([SeqStep([7], 2, s2)])
    with pytest.raises(BackendError, match="next position 3"):
        be.step([SeqStep([8], 4, s2)])  # no verification ran: only the next position
    s3 = Sampler(SamplingParams(temperature=0.0), make_rng(0), [1, 2], speculative=True)
    be.step([SeqStep([1, 2], 0, s3)])
    with pytest.raises(BackendError, match="within the context"):
        be.step([SeqStep(list(range(1, 16)), 2, s3)])  # positions 2..16 of a 16-position context
    be.step([SeqStep([1, 2], 0, plain)])
    with pytest.raises(BackendError, match="one token"):
        be.step([SeqStep([3, 4], 2, plain)])


# -- the distribution -----------------------------------------------------------------------------------------


def test_sampled_speculation_keeps_the_model_distribution(random_model):
    """The first three sampled ids of 1,200 seeds, the second and third out of verification rows (drafts from a
    draft model of the same weights: its greedy ids, accepted or not): their counts against the model's exact
    joint probabilities (top-k 3 at temperature 1.5, worked out with the forward pass), a chi-square test."""
    path = random_model("tiny-llama", "F32", std=0.2)
    m = Model(path, backend="numpy", ctx=64)
    m.attach_draft(Model(path, backend="numpy", ctx=64))
    params = SamplingParams(temperature=1.5, top_k=3, top_p=1.0, min_p=0.0)
    prompt = [5, 9, 2, 40, 7]

    def probs(ids):
        logits = block.run(m.backend, m.cfg, m.backend.token_ids(np.asarray(ids)), m.backend.positions(0, len(ids)))
        return softmax(top_k_filter(m.backend.to_host(logits)[-1], params.top_k), params.temperature)

    joint: dict[tuple[int, ...], float] = {}
    p1 = probs(prompt)
    for a in np.flatnonzero(p1):
        p2 = probs(prompt + [a])
        for b in np.flatnonzero(p2):
            p3 = probs(prompt + [a, b])
            for c in np.flatnonzero(p3):
                joint[(int(a), int(b), int(c))] = p1[a] * p2[b] * p3[c]
    m.seq.clear()
    spec = SpecSettings(("draft-simple",), 2)
    n, counts, drafted, accepted = 1200, {}, 0, 0
    for seed in range(n):
        c = m.complete(prompt, max_tokens=3, params=params, seed=seed, ignore_eos=True, speculative=spec)
        key = tuple(c.tokens)
        assert key in joint, key  # (three ids, each within top-k)
        counts[key] = counts.get(key, 0) + 1
        drafted, accepted = drafted + c.timings.drafted, accepted + c.timings.accepted
    assert 0.2 < accepted / drafted < 0.9  # both outcomes, often
    keys = sorted(joint, key=joint.get)
    cells, exp, obs = [], 0.0, 0  # cells of at least 5 expected (the rarest outcomes pooled)
    for k in keys:
        exp, obs = exp + joint[k] * n, obs + counts.get(k, 0)
        if exp >= 5:
            cells.append((exp, obs))
            exp, obs = 0.0, 0
    if exp:
        cells[-1] = (cells[-1][0] + exp, cells[-1][1] + obs)
    chi2 = sum((o - e) ** 2 / e for e, o in cells)
    dof = len(cells) - 1
    # Wilson-Hilferty: chi2 / dof is about normal with mean 1 - 2/(9 dof) and sd sqrt(2/(9 dof)); 4 sd: p < 1e-4
    z = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    assert z < 4, (chi2, dof, cells)


# -- the draft sources and the settings -------------------------------------------------------------------------


def test_ngram_simple_drafts_what_followed_the_latest_earlier_occurrence():
    idx = NgramIndex(2)
    ids = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    assert idx.draft(ids, 3) == [5, 6, 1]  # the latest [1, 2] before the last: at 4
    assert idx.draft(ids + [9], 3) == []  # [2, 9] never came before
    assert idx.draft(ids + [9, 1, 2], 8) == [9, 1, 2]  # (the index grew with the ids)
    assert NgramIndex(3).draft([7, 7, 7], 4) == []  # nothing before the last 3
    assert NgramIndex(1).draft([7, 7, 7], 4) == [7]  # the occurrence at 1: one id followed it


def test_spec_type_takes_llama_cpp_names_and_refuses_the_others_in_one_line():
    assert parse_spec_type("ngram-simple") == ("ngram-simple",)
    assert parse_spec_type("ngram_simple, draft-simple,ngram") == ("ngram-simple", "draft-simple")
    assert parse_spec_type("none") == ()
    for name, says in (("draft-mtp", "multi-token-prediction"), ("mtp", "multi-token-prediction"),
                       ("ngram-mod", "not implemented"), ("draft-eagle3", "not implemented"),
                       ("bogus", "takes ngram-simple"), ("", "empty"), ("x" * 300, "300 characters")):
        with pytest.raises(UsageError, match=says):
            parse_spec_type(name)
    assert spec_settings(None, 16, 0, 12, draft_model=True).sources == ("draft-simple",)  # -md alone
    assert spec_settings("ngram-simple", 16, 0, 12, draft_model=True).sources == ("ngram-simple", "draft-simple")
    for args, says in (((None, 65, 0, 12), "draft-max"), ((None, 4, 5, 12), "must not exceed"),
                       ((None, 4, -1, 12), "draft-min"), ((None, 4, 0, 0), "spec-ngram-size-n"),
                       (("draft-simple", 4, 0, 12), "needs a draft model"), ((None, True, 0, 12), "draft-max")):
        with pytest.raises(UsageError, match=says):
            spec_settings(*args)
    assert not SpecSettings(("ngram-simple",), 0).on and SpecSettings(("ngram-simple",), 1).on


def test_a_draft_model_must_share_the_vocabulary(random_model):
    from llamacli.testing import variant

    m = Model(random_model("tiny-llama", "F32"), backend="numpy", ctx=64)
    other = Model(random_model(variant("tiny-llama", vocab_size=300), "F32"), backend="numpy", ctx=64)
    with pytest.raises(UsageError, match="vocabulary differs"):
        m.attach_draft(other)
    with pytest.raises(UsageError, match="needs one"):
        m.complete([1, 2], max_tokens=2, speculative=SpecSettings(("draft-simple",)))


def test_a_failing_draft_model_stops_drafting_and_the_reply_goes_on(models, monkeypatch):
    """A draft model whose step fails (NaN logits, say) drafts no more for that reply, which goes on plain; its
    cache forgets what it held."""
    from llamacli.errors import NumericalError

    m, drafter = models("tiny-llama"), models("tiny-llama", "Q8_0")
    want = generate(m, None, temperature=0.0, ignore_eos=True).tokens
    m.attach_draft(drafter)
    calls = {"n": 0}
    step = drafter.backend.step

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise NumericalError("the logits contain NaN")
        return step(batch)

    monkeypatch.setattr(drafter.backend, "step", flaky)
    c = generate(m, SpecSettings(("draft-simple",), 3), temperature=0.0, ignore_eos=True)
    m.draft = None
    assert c.tokens == want and 0 < c.timings.drafted and calls["n"] == 4
    assert len(drafter.seq) == 0


def test_the_scheduler_runs_speculative_requests_beside_plain_ones(random_model):
    """Requests with and without speculation (and different draft bounds) at once, in the scheduler's slots:
    each gets the ids it gets alone."""
    m = Model(random_model("tiny-gemma3", "F32"), backend="numpy", ctx=128, slots=3)
    m.attach_draft(Model(random_model("tiny-gemma3", "Q8_0"), backend="numpy", ctx=128))
    specs = [None, ngram(1, 4), SpecSettings(("draft-simple",), 3), ngram(2, 6).with_limits(draft_max=2)]
    params = [dict(temperature=0.0), dict(temperature=0.9, top_k=8, seed=4)]
    cases = [(i, spec, p) for i, spec in enumerate(specs) for p in params]
    alone = {}
    for i, spec, p in cases:
        alone[i, p["temperature"]] = generate(m, spec, n=30, ignore_eos=True, **p).tokens
    sched = Scheduler(m)
    got: dict = {}

    def one(i, spec, p):
        c = Completion()
        for _ in m.run(list(ECHO), completion=c, max_tokens=30, ignore_eos=True, scheduler=sched,
                       speculative=spec or SpecSettings(), **p):
            pass
        got[i, p["temperature"]] = (c.tokens, c.timings.drafted)

    try:
        threads = [threading.Thread(target=one, args=case) for case in cases]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sched.close()
        m.close()
    assert {k: v[0] for k, v in got.items()} == alone
    assert sum(v[1] for v in got.values()) > 0


def test_replies_stored_in_the_prefix_cache_after_speculation_serve_later_prompts(random_model):
    """With the prefix cache (engine/prefix_cache.py) and the scheduler: a speculative reply's blocks, stored when it
    ends, hold only what the drafts accepted left (the rows past them are never stored): a later prompt that
    continues that reply, in the other slot, gets from the cache the ids a whole prefill gives."""
    m = Model(random_model("tiny-llama", "F32"), backend="numpy", ctx=160, slots=2)
    ref = Model(random_model("tiny-llama", "F32"), backend="numpy", ctx=160)
    m.enable_prefix_cache()
    m.attach_draft(Model(random_model("tiny-llama", "F32", seed=7), backend="numpy", ctx=160))  # (mostly wrong)
    spec = SpecSettings(("draft-simple",), 4)
    sched = Scheduler(m)
    prompt = ECHO * 2

    def run(ids, spec):
        c = Completion()
        for _ in m.run(list(ids), completion=c, max_tokens=40, temperature=0.0, ignore_eos=True, scheduler=sched,
                       speculative=spec):
            pass
        return c

    try:
        first = run(prompt, spec)
        assert first.timings.drafted > first.timings.accepted
        follow = prompt + first.tokens[:33] + [7, 9]
        hold = Completion()  # (the first reply's slot kept busy: the follow-up goes to the other)
        gen = m.run(prompt + first.tokens[:30], completion=hold, max_tokens=120, temperature=0.0, ignore_eos=True,
                    scheduler=sched)
        next(gen)
        again = run(follow, spec)
        gen.close()
    finally:
        sched.close()
    assert again.timings.prefix_cached_tokens >= 32
    want = ref.complete(follow, max_tokens=40, temperature=0.0, ignore_eos=True)
    assert again.tokens == want.tokens
