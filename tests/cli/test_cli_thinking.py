"""Thinking models through the real commands: --think/--no-think reach the template as enable_thinking, the
reasoning goes to stderr and the answer to stdout, --json returns them apart, chat keeps only answers."""

from __future__ import annotations

import json

import pytest

from clirun import run
from llamacli.testing import tiny_vocab, write_model

# A Qwen3-style generation prompt: with thinking off an empty block closes it, with thinking on (the R1
# distills' way) the prompt leaves <think> open, so all the model writes until </think> is reasoning.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    vocab = tiny_vocab()
    vocab["tokenizer.ggml.tokens"] = vocab["tokenizer.ggml.tokens"] + ["<think>", "</think>"]
    vocab["tokenizer.ggml.token_type"] = vocab["tokenizer.ggml.token_type"] + [4, 4]  # user-defined
    vocab["tokenizer.chat_template"] = TEMPLATE
    return write_model(tmp_path_factory.mktemp("think") / "thinker.gguf", "tiny-qwen3", "F32", vocab=vocab, std=0.08)


def gen(model, *args):
    return run("generate", str(model), "--backend", "numpy", "-p", "Why?", "-n", "12", "--greedy", *args)


def test_think_on_leaves_the_block_open_and_the_output_is_reasoning(thinker):
    r = gen(thinker, "--think", "--json", "--quiet")
    assert r.code == 0, r.err
    obj = json.loads(r.out)
    assert obj["reasoning"] and "<think>" not in obj["reasoning"]
    on = gen(thinker, "--think", "-q")
    assert on.code == 0
    assert on.out.strip() == obj["text"].strip()  # the answer (empty unless </think> came) on stdout
    assert obj["reasoning"].strip() in on.err  # the reasoning on stderr


def test_think_off_closes_the_block_in_the_prompt(thinker):
    r = gen(thinker, "--no-think", "--json", "--quiet")
    assert r.code == 0, r.err
    obj = json.loads(r.out)
    assert obj["reasoning"] == "" and obj["text"]
    assert obj["prompt_tokens"] != json.loads(gen(thinker, "--think", "--json", "-q").out)["prompt_tokens"]
    off = gen(thinker, "--no-think", "-q")
    assert off.out.rstrip("\n") == obj["text"] and off.err == ""


def test_a_scripted_thinking_reply_is_split_on_the_streams(monkeypatch, thinker):
    from llamacli.engine.generate import Model

    def scripted(self, prompt, *, completion, **kw):
        completion.think_open = False
        for piece in ["<think>\n", "Two and", " two.", "\n</think>", "\n\nFour", "."]:
            completion.text += piece
            yield piece
        from llamacli.chat.reasoning import split_reasoning

        completion.reasoning, completion.text = split_reasoning(completion.text)
        completion.finish_reason = "eos"

    monkeypatch.setattr(Model, "run", scripted)
    r = gen(thinker, "-q")
    assert r.code == 0 and r.out == "Four.\n"
    assert r.err == "Two and two.\n"
    j = json.loads(gen(thinker, "-q", "--json").out)
    assert (j["reasoning"], j["text"]) == ("Two and two.", "Four.")


def test_chat_history_keeps_the_answer_only(monkeypatch, thinker):
    from llamacli.engine.chat_session import ChatSession
    from llamacli.engine.generate import Model

    m = Model(thinker, backend="numpy", ctx=256)
    s = ChatSession(m, think=True, max_tokens=8)
    c = s.reply("hi")
    assert s.history[-1] == {"role": "assistant", "content": c.text}
    assert "<think>" not in c.text and c.reasoning
    assert m.chat_ids(s.window(), think=False) != m.chat_ids(s.window(), think=True)


def test_a_think_tag_in_the_prompt_text_opens_no_block(thinker):
    """Only the prompt's last 8 tokens say whether it left a <think> block open (a generation prompt ends with
    one); a <think> a little further back is the user's text, though the reply format looks 16 tokens back."""
    from llamacli.engine.generate import Completion, Model

    with Model(thinker, backend="numpy", ctx=256) as m:
        think_id = m.tokenizer.encode("<think>", special=True, add_bos=False)[0]
        for text in ["Is <think> a tag? Yes, it is", "<think> in a user's text"]:
            ids = m.prompt_ids(text, raw=True)
            assert 8 < len(ids) - ids.index(think_id) <= 16
            c = Completion()
            list(m.run(text, completion=c, max_tokens=0, raw=True))
            assert not c.think_open and c.reasoning_format == "think"
        c = Completion()
        list(m.run("Well <think>", completion=c, max_tokens=0, raw=True))
        assert c.think_open


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A chat model whose template has no think block: enable_thinking means nothing to it."""
    vocab = tiny_vocab()
    vocab["tokenizer.chat_template"] = TEMPLATE[: TEMPLATE.index("{% if enable_thinking")] + "{% endif %}"
    return write_model(tmp_path_factory.mktemp("plain") / "plain.gguf", "tiny-qwen3", "F32", vocab=vocab, std=0.08)


def test_think_flags_on_a_model_without_a_think_block_say_they_do_nothing(plain, thinker):
    for flag in ("--think", "--no-think"):
        r = gen(plain, flag, "-n", "2")
        assert r.code == 0, r.err
        assert f"{flag} is ignored: the model's chat template has no think block" in r.err.splitlines()
        assert "ignored" not in r.out
    assert "is ignored" not in gen(plain, "--think", "-n", "2", "-q").err
    assert "is ignored" not in gen(plain, "-n", "2").err  # no flag, nothing to say
    assert "is ignored" not in gen(thinker, "--no-think", "-n", "2").err
    r = run("chat", str(plain), "--backend", "numpy", "-n", "2", "--greedy", "--no-think", stdin="hi\n")
    assert r.code == 0 and "--no-think is ignored" in r.err
