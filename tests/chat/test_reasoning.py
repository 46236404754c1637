"""Reasoning split: whole texts, every way of cutting them into stream pieces, and hostile shapes."""

from __future__ import annotations

import random

import pytest

from llamacli.chat.reasoning import (
    ChannelSplitter,
    ReasoningSplitter,
    ReplyRouter,
    parse_effort,
    prompt_opens_think,
    reply_format,
    split_reasoning,
    template_thinks,
)

CASES = [
    # (output, opened by the prompt, reasoning, answer)
    ("<think>\nLet me add.\n2+2=4\n</think>\n\nThe answer is 4.", False, "Let me add.\n2+2=4", "The answer is 4."),
    ("The answer is 4.", False, "", "The answer is 4."),
    ("  <think>x</think>y", False, "x", "y"),
    ("Okay, so 2+2.\n</think>\n\n4", True, "Okay, so 2+2.", "4"),
    ("still thinking when the tokens ran out", True, "still thinking when the tokens ran out", ""),
    ("<think>never closed", False, "never closed", ""),
    ("<thin", False, "", "<thin"),  # a partial tag at the end is text
    ("a <think> in the middle </think> stays", False, "", "a <think> in the middle </think> stays"),
    ("<think></think>", False, "", ""),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),
    ("", False, "", ""),
    ("</thinking> is not the tag </think>ok", True, "</thinking> is not the tag", "ok"),
]


@pytest.mark.parametrize("text,opened,reasoning,answer", CASES)
def test_whole_texts(text, opened, reasoning, answer):
    assert split_reasoning(text, opened) == (reasoning, answer)


@pytest.mark.parametrize("text,opened,reasoning,answer", CASES)
def test_any_cut_into_pieces_gives_the_same(text, opened, reasoning, answer):
    rng = random.Random(hash(text) % 1000)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        s = ReasoningSplitter(opened)
        think, ans = "", ""
        for p in pieces:
            t, a = s.feed(p)
            think, ans = think + t, ans + a
        t, a = s.finish()
        think, ans = think + t, ans + a
        assert (think.strip(), ans) == (reasoning, answer)
        assert s.texts == (reasoning, answer)


CHANNEL_CASES = [  # Gemma 4's replies (its template; llama.cpp's common/parsers/gemma4.cpp): (output, reasoning, answer)
    ("<|channel>thought\nLet me add.\n2+2=4<channel|>The answer is 4.", "Let me add.\n2+2=4", "The answer is 4."),
    ("<|channel>thought\nHm.<channel|>\n\nFour.", "Hm.", "Four."),  # the blank lines after a block dropped
    ("Four.", "", "Four."),
    ("Four.<|channel>thought\n<channel|>", "", "Four."),  # an empty block after the answer
    ("Four.<channel|>", "", "Four."),  # a stray close
    ("<|channel>thought\nstill thinking when the tokens ran out", "still thinking when the tokens ran out", ""),
    ("<|channel>thou", "", ""),  # cut inside the block's name: nothing yet
    ("Four <|chan", "", "Four <|chan"),  # a partial marker at the end is text
    ("<|channel>thought\nA<channel|>B<|channel>thought\nC<channel|>D", "A\n\nC", "BD"),  # blocks a blank line apart
    ("<|channel>other\nx<channel|>y", "other\nx", "y"),  # a channel of another name: all reasoning
    ("", "", ""),
]


@pytest.mark.parametrize("text,reasoning,answer", CHANNEL_CASES)
def test_gemma4_channel_replies_whole_and_cut_anywhere(text, reasoning, answer):
    """Whole, and cut at every place into two pieces and into single characters: the same split."""
    want = split_reasoning(text, reply="channel")
    assert want == (reasoning, answer)
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        s = ChannelSplitter()
        think, ans = "", ""
        for p in pieces:
            t, a = s.feed(p)
            think, ans = think + t, ans + a
        t, a = s.finish()
        assert s.texts == want and (think + t).strip() == want[0] and ans + a == answer


def test_gemma4_prompts_say_their_reply_format():
    """Gemma 4's template leaves a model turn open (thinking on), or with an empty thought block after it (off), or
    the turn going on after tool responses; other prompts keep their formats."""
    assert reply_format("<|turn>user\nHi<turn|>\n<|turn>model\n") == "channel"
    assert reply_format("<|turn>model\n<|channel>thought\n<channel|>") == "channel"
    assert reply_format("<tool_response|>") == "channel"
    assert reply_format("<|im_start|>assistant\n") == "think" and reply_format("<|start|>assistant") == "harmony"


def test_answer_streams_before_the_end():
    s = ReasoningSplitter()
    assert s.feed("<think>hm") == ("hm", "")
    assert s.feed("</think>\n\nPar") == ("", "Par")
    assert s.feed("is") == ("", "is")


def test_prompt_opens_think():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")
    assert prompt_opens_think("<think>old</think> ... <think>\n")


def test_template_thinks():
    assert template_thinks("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}")
    assert not template_thinks("{{ messages }}") and not template_thinks(None)


def test_long_reasoning_is_linear():
    s = ReasoningSplitter()
    s.feed("<think>")
    for _ in range(20000):
        s.feed("word ")
    s.feed("</think>done")
    assert s.texts[1] == "done" and len(s.texts[0]) == 5 * 20000 - 1


class _Side:
    def __init__(self, tty=False):
        self.text, self.tty = "", tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return self.tty


class _C:
    think_open = False


@pytest.mark.parametrize("tty", [False, True])
def test_router_sends_reasoning_aside_and_the_answer_on(tty):
    side, answer = _Side(tty), []
    r = ReplyRouter(_C(), answer.append, side)
    for piece in ["<th", "ink>\n", "Step one.", "\n</think>", "\n\nThe ", "answer."]:
        r.write(piece)
    r.end()
    assert "".join(answer) == "The answer."
    shown = side.text.replace("\x1b[2m", "").replace("\x1b[0m", "")
    assert shown == "Step one.\n"
    assert (side.text.startswith("\x1b[2m") and side.text.count("\x1b[0m") == 1) == tty


def test_router_without_reasoning_leaves_stderr_alone():
    side, answer = _Side(True), []
    r = ReplyRouter(_C(), answer.append, side)
    r.write("Hello")
    r.write(" there")
    r.end()
    assert "".join(answer) == "Hello there" and side.text == ""


EFFORT_TEMPLATE = (  # shows what reached it
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "[effort={{ reasoning_effort | default('-') }} think={{ enable_thinking | default('-') }}]"
)


def test_reasoning_efforts_read_alike_everywhere(tmp_path):
    """--reasoning-effort (cli/generate.py think_setting) and the API's reasoning_effort and
    chat_template_kwargs.reasoning_effort (serve/api.py read_job) all read an effort with parse_effort: any case,
    OpenAI's "minimal" as gpt-oss's least ("low"), "none" as thinking off; the API's reaches the template as the
    CLI's does, and a bad one is a 400 naming its field."""
    from llamacli.cli.generate import think_setting
    from llamacli.engine.generate import Model
    from llamacli.errors import UsageError
    from llamacli.serve.api import ApiError, read_job
    from llamacli.testing import tiny_vocab, write_model

    vocab = tiny_vocab()
    vocab["tokenizer.chat_template"] = EFFORT_TEMPLATE
    messages = [{"role": "user", "content": "Hi"}]
    with Model(write_model(tmp_path / "m.gguf", vocab=vocab), backend="numpy", ctx=256) as model:
        assert "[effort=low think=True]" in model.render_chat(messages, think="low")
        for given, want in [("low", "low"), ("HIGH", "high"), (" Medium ", "medium"), ("minimal", "low"),
                            ("none", False), ("NONE", False)]:
            assert parse_effort(given) == want
            assert think_setting(None, given) == want
            ids = model.chat_ids(messages, think=want)
            for body in ({"reasoning_effort": given}, {"chat_template_kwargs": {"reasoning_effort": given}}):
                assert read_job(model, {"messages": messages, **body}, chat=True).ids == ids, body
        for bad in ["max", "", "lowest", 3, None, ["low"]]:
            with pytest.raises(ValueError, match="none, minimal, low, medium, high"):
                parse_effort(bad)
            with pytest.raises(ApiError) as e:
                read_job(model, {"messages": messages, "reasoning_effort": "?" if bad is None else bad}, chat=True)
            assert e.value.status == 400 and e.value.param == "reasoning_effort"
    with pytest.raises(UsageError, match="--reasoning-effort must be one of"):
        think_setting(None, "max")
