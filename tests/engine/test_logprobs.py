"""Logprobs: each generated token's log-probability and the top alternatives, checked against log-softmax of
the model's own logits for the same prefix (computed here with NumPy from a fresh prefill)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clirun import run
from llamacli.engine.generate import Model
from llamacli.errors import UsageError
from llamacli.models import block

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model(smollm2):
    return Model(smollm2, backend="numpy", ctx=256)


def reference_logprobs(model: Model, ids: list[int]) -> np.ndarray:
    """log-softmax of the logits after `ids`, from a prefill of the whole prefix into an empty cache."""
    model.seq.clear()
    logits = np.asarray(model.backend.to_host(block.prefill(model.backend, model.cfg, ids, 0)))[-1]
    model.seq.clear()  # the cache now holds this prefix; let the next run start afresh
    x = logits.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_logprobs_match_log_softmax_of_the_logits(model):
    c = model.complete(PROMPT, raw=True, max_tokens=4, temperature=0.0, logprobs=5)
    assert len(c.logprobs) == len(c.tokens) == 4
    for k in (0, 3):
        entry, ref = c.logprobs[k], reference_logprobs(model, c.prompt_tokens + c.tokens[:k])
        assert entry["id"] == c.tokens[k] and entry["token"] == model.tokenizer.decode([c.tokens[k]])
        assert entry["logprob"] == pytest.approx(ref[entry["id"]], abs=2e-3)
        top = entry["top_logprobs"]
        assert len(top) == 5
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == entry["id"] == int(np.argmax(ref))  # greedy takes the most likely token
        for t in top:
            assert t["logprob"] == pytest.approx(ref[t["id"]], abs=2e-3)
        assert {t["id"] for t in top[:3]} == set(np.argsort(-ref)[:3].tolist())
    values = [e["logprob"] for e in c.logprobs] + [t["logprob"] for e in c.logprobs for t in e["top_logprobs"]]
    assert all(v <= 0 for v in values)


def test_logprobs_do_not_change_the_sampled_tokens(model):
    plain = model.complete(PROMPT, raw=True, max_tokens=5, temperature=0.9, seed=3)
    with_lp = model.complete(PROMPT, raw=True, max_tokens=5, temperature=0.9, seed=3, logprobs=0)
    assert with_lp.tokens == plain.tokens and plain.logprobs is None
    assert all(e["top_logprobs"] == [] for e in with_lp.logprobs)
    assert "logprobs" not in plain.as_dict() and with_lp.as_dict()["logprobs"] == with_lp.logprobs


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0, "3"])
def test_bad_logprobs_value(model, bad):
    with pytest.raises(UsageError, match="logprobs"):
        model.complete(PROMPT, raw=True, max_tokens=1, logprobs=bad)


def test_cli_generate_logprobs_in_json(smollm2):
    r = run("generate", "-m", str(smollm2), "--backend", "numpy", "-p", PROMPT, "--raw", "--greedy", "-n", "3",
            "--logprobs", "2", "--json", "-q")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert [e["id"] for e in out["logprobs"]] == out["tokens"]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in out["logprobs"])


@pytest.mark.parametrize("args, says", [
    (["--logprobs", "21", "--json"], "from 0 to 20"),
    (["--logprobs", "2"], "needs --json"),
])
def test_cli_bad_logprobs_is_one_line_error(smollm2, args, says):
    r = run("generate", "-m", str(smollm2), "-p", "hi", *args)
    assert r.code == 2 and says in r.one_line_error()
