"""Structured output: sampling masked by llguidance (sampling/structured.py) keeps the output valid.

Most cases run the real SmolLM2 vocabulary with seeded random logits in place of the forward pass (a
random model tries far more of the vocabulary than a sensible one, and a step costs a millisecond); a few
run the real model end to end, and the CLI options are driven through the real command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from clirun import run  # noqa: E402
from llamacli.engine.generate import Model  # noqa: E402
from llamacli.models import block  # noqa: E402
from llamacli.sampling.structured import Constraint, grammar_constraint, json_object_constraint, json_schema_constraint  # noqa: E402
from llamacli.testing import variant  # noqa: E402

COMPACT = {"whitespace_flexible": False}  # llguidance option: no free whitespace (random logits love it)

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "score", "ok"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "kind": {"const": "item"}},
            "required": ["id", "kind"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
}


@pytest.fixture(scope="module")
def model(smollm2):
    return Model(smollm2, backend="numpy", ctx=512)


@pytest.fixture
def random_logits(model, monkeypatch):
    """Swap the forward pass for seeded random logits; set(seed) before each run. The KV cache it leaves
    behind holds nothing real, so the model forgets it afterwards."""
    state: dict[str, np.random.Generator] = {}
    vocab = model.cfg.vocab_size

    def logits(*_args) -> np.ndarray:
        return state["rng"].normal(0.0, 3.0, (1, vocab)).astype(np.float32)

    monkeypatch.setattr(block, "prefill", lambda be, cfg, ids, keep: logits())
    monkeypatch.setattr(model.backend, "decode", lambda token, pos: logits())
    yield lambda seed: state.__setitem__("rng", np.random.default_rng(seed))
    model.seq.clear()


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_logits_follow_every_schema(model, random_logits, name):
    schema = {**SCHEMAS[name], "x-guidance": COMPACT}
    constraint = json_schema_constraint(model, schema)
    assert isinstance(constraint, Constraint)
    for seed in range(6):
        random_logits(seed)
        sampling = {"temperature": 0.0} if seed % 2 else {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        c = model.complete([1, 2, 3], max_tokens=160, seed=seed, constraint=constraint, **sampling)
        assert c.finish_reason == "stop", (seed, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])


def test_random_logits_json_object(model, random_logits):
    constraint = json_object_constraint(model)
    for seed in range(4):
        random_logits(seed)
        c = model.complete([1, 2, 3], max_tokens=48, temperature=0.0, constraint=constraint)
        assert c.text.lstrip().startswith("{"), c.text
        if c.finish_reason == "stop":  # random keys may run past 48 tokens; a finished one parses
            assert isinstance(json.loads(c.text), dict)


def test_random_logits_gbnf_and_lark_grammars(model, random_logits):
    gbnf = 'root ::= "id-" [0-9] [0-9] [0-9] ("!" | "?")'
    lark = 'start: "yes" | "no" | "maybe"'
    for text, check in ((gbnf, lambda s: len(s) == 7 and s[:3] == "id-" and s[3:6].isdigit() and s[6] in "!?"),
                        (lark, lambda s: s in ("yes", "no", "maybe"))):
        constraint = grammar_constraint(model, text)
        for seed in range(4):
            random_logits(seed)
            c = model.complete([1, 2, 3], max_tokens=16, temperature=1.0, seed=seed, constraint=constraint)
            assert check(c.text) and c.finish_reason == "stop", (text, c.text)


def test_sentencepiece_vocabulary(random_model, llama_cpp_models):
    """A SentencePiece vocabulary (<0xXX> byte tokens, the \u2581 space marker) goes through the same adapter,
    here under a tiny random model."""
    spec = variant("tiny-llama", vocab_size=32000)
    path = random_model(spec, "Q8_0", vocab_file=str(llama_cpp_models / "ggml-vocab-llama-spm.gguf"), std=0.2)
    with Model(path, backend="numpy", ctx=128) as spm:
        constraint = json_schema_constraint(spm, {**SCHEMAS["numbers"], "x-guidance": COMPACT})
        for seed in range(3):
            c = spm.complete([1, 2, 3], max_tokens=64, temperature=1.0, seed=seed, constraint=constraint)
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMAS["numbers"])


PROMPTS = ["Describe a person as JSON.", "Give me a shopping list in JSON."]
REAL = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "count"],
    "additionalProperties": False,
}


def test_real_model_greedy_and_sampled(model):
    constraint = json_schema_constraint(model, {**REAL, "x-guidance": COMPACT})
    for prompt, params in zip(PROMPTS, ({"temperature": 0.0}, {"temperature": 0.8, "seed": 7})):
        c = model.complete(prompt, max_tokens=24, constraint=constraint, **params)
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), REAL)


def test_allowed_words_are_the_allowed_set(model):
    """allowed_words() is allowed() as bit words (bit i % 32 of word i // 32), no bit past the vocabulary."""
    from llamacli.sampling.structured import unpack_words

    constraint = json_schema_constraint(model, {**REAL, "x-guidance": COMPACT})
    constraint.reset()
    for text in ('{"color":"', 'red","count":'):
        words = constraint.allowed_words().copy()
        assert words.dtype == np.uint32 and words.size == -(-model.cfg.vocab_size // 32)
        assert np.array_equal(unpack_words(words, model.cfg.vocab_size), constraint.allowed())
        assert 0 < int(np.unpackbits(words.view(np.uint8)).sum()) < model.cfg.vocab_size
        for t in model.tokenizer.encode(text, add_bos=False):
            constraint.advance(t)


def test_sample_allowed_masks_then_samples():
    """Backend.sample_allowed is sample() over the logits with the ids outside the words at -inf, for a
    vocabulary not a multiple of 32 (the last word's high bits ignored)."""
    from llamacli.backends.numpy_backend import NumpyBackend
    from llamacli.sampling.sampling import SamplingParams, sample

    be, rng = NumpyBackend(), np.random.default_rng(5)
    x = rng.normal(0, 3, (1, 100)).astype(np.float32)
    bits = rng.random(100) < 0.2
    words = np.packbits(np.concatenate([bits, np.ones(28, bool)]), bitorder="little").view("<u4").astype(np.uint32)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)):
        for seed in range(5):
            got = be.sample_allowed(x, words, params, np.random.default_rng(seed), [])
            want = sample(np.where(bits, x[0], -np.inf), params, np.random.default_rng(seed), [])
            assert got == want and bits[got]


def test_mask_words_are_checked_and_packed():
    """A mask of the wrong type or length is a BackendError on the host path too (not a silent cast);
    pack_words is unpack_words' inverse; a Constraint without allowed_words gets its allowed() packed."""
    from llamacli.backends.numpy_backend import NumpyBackend
    from llamacli.errors import BackendError
    from llamacli.sampling.sampling import SamplingParams
    from llamacli.sampling.structured import mask_words, pack_words, unpack_words

    bits = np.random.default_rng(1).random(70) < 0.5
    words = pack_words(bits)
    assert words.dtype == np.uint32 and words.shape == (3,) and np.array_equal(unpack_words(words, 70), bits)
    x = np.zeros((1, 70), np.float32)
    for bad in (bits, words[:2], words.astype(np.int64), list(words)):
        with pytest.raises(BackendError, match="bit words"):
            NumpyBackend().sample_allowed(x, bad, SamplingParams(temperature=0.0), np.random.default_rng(0), [])

    class Old:  # a Constraint from before allowed_words
        def allowed(self):
            return bits

    assert np.array_equal(mask_words(Old())(), words)


def test_constrained_ids_equal_with_and_without_logprobs(model):
    """The two ways a constrained step is picked (sample_allowed; the host path logprobs take) agree."""
    constraint = json_schema_constraint(model, {**REAL, "x-guidance": COMPACT})
    for params in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 3}):
        a = model.complete(PROMPTS[0], max_tokens=16, constraint=constraint, **params)
        b = model.complete(PROMPTS[0], max_tokens=16, constraint=constraint, logprobs=0, **params)
        assert a.tokens == b.tokens and a.text == b.text, (a.text, b.text)


def test_unconstrained_greedy_is_unchanged(model):
    """The host path (taken for logprobs) picks the same tokens as the greedy fast path."""
    fast = model.complete("The capital of France is", raw=True, max_tokens=6, temperature=0.0)
    host = model.complete("The capital of France is", raw=True, max_tokens=6, temperature=0.0, logprobs=0)
    assert host.tokens == fast.tokens and host.text == fast.text


# -- the CLI ---------------------------------------------------------------------------------------------------


def test_cli_generate_json_schema(smollm2, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({**REAL, "x-guidance": COMPACT}))
    r = run("generate", "-m", str(smollm2), "--backend", "numpy", "-p", PROMPTS[0], "--greedy", "-n", "24",
            "--json-schema", str(path), "--json", "-q")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), REAL)


def test_cli_chat_grammar(smollm2, tmp_path):
    path = tmp_path / "g.gbnf"
    path.write_text('root ::= "yes" | "no"\n')
    r = run("chat", "-m", str(smollm2), "--backend", "numpy", "--greedy", "-n", "8", "--grammar", str(path), "-q",
            stdin="Is the sky blue?\n")
    assert r.code == 0, r.err
    assert r.out.strip() in ("yes", "no")


@pytest.mark.parametrize("args, says", [
    (["--json-schema", '{"type":'], "not valid JSON"),
    (["--json-schema", '{"type": "frob"}'], "invalid JSON schema"),
    (["--json-schema", "[1, 2]"], "no such JSON schema file"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "no such grammar file"),
    (["--grammar", "/nonexistent/g.gbnf"], "--grammar-file FILE"),
    (["--json-schema", "{}", "--grammar", "x"], "at most one"),
])
def test_cli_bad_constraint_is_one_line_error(smollm2, args, says):
    r = run("generate", "-m", str(smollm2), "-p", "hi", *args)
    assert r.code == 2 and says in r.one_line_error()


def test_cli_bad_grammar_text(smollm2, tmp_path):
    path = tmp_path / "g.gbnf"
    path.write_text("root ::= undefined_rule\n")
    r = run("generate", "-m", str(smollm2), "-p", "hi", "--grammar", str(path))
    assert r.code == 2 and "invalid grammar" in r.one_line_error()


def test_cli_without_llguidance(smollm2, monkeypatch):
    """The extra is optional: without it the library loads and the option explains how to get it."""
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    r = run("generate", "-m", str(smollm2), "-p", "hi", "--json-schema", "{}")
    assert r.code == 2 and "pip install 'llamacli[structured]'" in r.one_line_error()


def test_cli_with_an_llguidance_before_1_8(smollm2, monkeypatch):
    """llguidance 1.6 (what pip takes where glibc is older than 2.31) cannot take the list of end tokens: one
    line that names the version needed, before the model loads."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.6.1" if name == "llguidance" else real(name))
    r = run("generate", "-m", str(smollm2), "-p", "hi", "--json-schema", "{}")
    assert r.code == 2 and "needs llguidance 1.8 or newer, found 1.6.1" in r.one_line_error()


def test_the_structured_extra_asks_for_the_llguidance_the_code_needs():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    from llamacli.sampling.structured import LLGUIDANCE_MIN

    extra = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    need = ".".join(map(str, LLGUIDANCE_MIN))
    assert extra["structured"] == [f"llguidance>={need}"] and f"llguidance>={need}" in extra["dev"]


def test_a_token_the_constraint_forbids_is_a_one_line_error(model):
    from llamacli.sampling.structured import ConstraintError

    constraint = json_object_constraint(model)
    constraint.reset()
    x = model.tokenizer.encode("x", add_bos=False)[0]
    assert not constraint.allowed()[x]
    with pytest.raises(ConstraintError) as info:
        constraint.advance(x)
    assert "\n" not in str(info.value)
    constraint.reset()  # reset starts over: "{" is allowed again
    assert constraint.allowed()[model.tokenizer.encode("{", add_bos=False)[0]]
