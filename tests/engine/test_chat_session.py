"""ChatSession: prefix reuse between turns, greedy equivalence with one-shot completion, trimming when the
context fills, Ctrl-C, /save and /load files. SmolLM2 on the NumPy backend, plus a fake model for the
bookkeeping that needs exact token counts."""

from __future__ import annotations

import json

import pytest

from llamacli.engine.chat_session import ChatSession, ConversationFileError, check_messages
from llamacli.engine.generate import Completion, Model, Timings
from llamacli.errors import ContextOverflowError
from llamacli.models.seq_cache import LayerCache, SequenceCache, common_prefix
from llamacli.sampling.sampling import SamplingParams
from llamacli.tokenizer.tokenizer import TooManyTokens

GREEDY = SamplingParams(temperature=0.0)
N = 16


@pytest.fixture(scope="module")
def model(smollm2):
    m = Model(smollm2, backend="numpy")
    yield m
    m.close()


@pytest.fixture(scope="module")
def two_turns(model):
    """A greedy two-turn chat, with what the cache held after turn 1."""
    s = ChatSession(model, params=GREEDY, max_tokens=N)
    first = s.reply("Hi")
    after_first = list(model.seq.ids)
    second = s.reply("What is the capital of France?")
    return s, first, after_first, second


def test_second_turn_prefills_only_the_new_tokens(model, two_turns):
    s, first, after_first, second = two_turns
    assert first.finish_reason == "eos"  # so every reply token went through the model and sits in the cache
    assert after_first == first.prompt_tokens + first.tokens
    # The template re-renders the reply exactly as generated: turn 2's prompt extends the cache.
    ids2 = second.prompt_tokens
    assert ids2[: len(after_first)] == after_first
    assert model.detokenize(ids2[len(after_first) :]).startswith("<|im_end|>\n<|im_start|>user\nWhat is")
    t1, t2 = s.turns
    assert (t1.reused, t1.prefilled) == (0, len(first.prompt_tokens))
    assert t2.held == t2.reused == len(after_first)
    assert second.timings.prompt_tokens == t2.prefilled == len(ids2) - len(after_first)
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    assert s.messages[1]["content"] == first.text and s.messages[3]["content"] == second.text


def test_greedy_reply_equals_completion_of_the_rendered_prompt(model, two_turns):
    s, first, _, second = two_turns
    ids = model.chat_ids(s.messages[:3])  # user, assistant, user: what `generate` would get as one prompt
    assert ids == second.prompt_tokens
    model.seq.clear()  # no reuse: a full prefill, as a fresh `generate` does
    one_shot = model.complete(ids, max_tokens=N, temperature=0.0)
    assert one_shot.text == second.text and one_shot.tokens == second.tokens
    assert one_shot.timings.prompt_tokens == len(ids)
    assert "Paris" in second.text


def test_reset_keeps_the_system_prompt_and_its_cache(model):
    s = ChatSession(model, system="You answer in one short sentence.", params=GREEDY, max_tokens=8)
    a = s.reply("Hi")
    s.reset()
    assert s.messages == [{"role": "system", "content": "You answer in one short sentence."}]
    b = s.reply("Hi")
    assert b.text == a.text
    assert s.turns[-1].reused >= len(model.chat_ids(s.messages[:1], add_generation_prompt=False)) - 1
    s.set_system("You are a pirate.")
    s.max_tokens = 1
    s.reply("Hi")
    system_ids = model.tokenize("<|im_start|>system\nYou are a pirate.", special=True)
    assert s.turns[-1].reused == common_prefix(b.prompt_tokens + b.tokens, system_ids, 10**9)


def test_ctrl_c_keeps_the_partial_reply(model):
    s = ChatSession(model, params=GREEDY, max_tokens=200)
    c = Completion()
    pieces = s.send("Tell me a long story about a dragon.", c)
    got = "".join(next(pieces) for _ in range(3))
    with pytest.raises(KeyboardInterrupt):
        pieces.throw(KeyboardInterrupt)  # delivered inside Model.run, where a real Ctrl-C lands
    assert c.finish_reason == "interrupted" and c.text == got
    assert s.messages[-1] == {"role": "assistant", "content": got}
    assert s.turns[-1].finish_reason == "interrupted"
    s.max_tokens = 4
    # The conversation goes on, reusing the cache up to the interruption.
    nxt = s.reply("Thanks.")
    assert nxt.finish_reason in ("eos", "length") and s.turns[-1].reused > len(c.prompt_tokens)
    # Closing the stream early (a Ctrl-C outside the engine) ends the turn the same way.
    pieces = s.send("And another one?")
    next(pieces)
    pieces.close()
    assert s.messages[-1]["role"] == "assistant" and s.turns[-1].finish_reason == "interrupted"


def test_ctrl_c_during_the_prefill_records_no_turn(model, monkeypatch):
    """A Ctrl-C before the prefill finished: no turn in /stats (it used to count the whole prompt as reused),
    the question goes, and the next turn answers as a fresh session would."""
    from llamacli.models import block

    s = ChatSession(model, params=GREEDY, max_tokens=6)
    real = block.prefill

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(block, "prefill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s.reply("Hello there")
    assert s.turns == [] and s.messages == [] and s.stats()["reused"] == 0
    monkeypatch.setattr(block, "prefill", real)
    again = s.reply("Hello there")
    assert again.text == ChatSession(model, params=GREEDY, max_tokens=6).reply("Hello there").text


def test_one_stop_string_is_not_split_into_characters(model):
    s = ChatSession(model, params=GREEDY, max_tokens=12, stop="The End")
    assert s.stop == ("The End",)
    many = ChatSession(model, params=GREEDY, max_tokens=12, stop=["The End"]).reply("Say hello")
    assert s.reply("Say hello").text == many.text and many.finish_reason != "stop"
    c = model.complete("The capital of France is", raw=True, max_tokens=8, temperature=0, stop="Paris and")
    assert c.text == model.complete("The capital of France is", raw=True, max_tokens=8, temperature=0,
                                    stop=["Paris and"]).text


def test_context_trimming_on_the_real_model(smollm2):
    with Model(smollm2, backend="numpy", ctx=96) as m:
        notes: list[str] = []
        s = ChatSession(m, system="Be brief.", params=GREEDY, max_tokens=10, notice=notes.append)
        questions = ["What is the capital of France?", "And of Italy?", "And of Spain?", "And of Poland?"]
        for q in questions:
            c = s.reply(q)
            assert len(c.prompt_tokens) <= m.ctx - s.reserve
        assert s.dropped > 0 and notes and "dropped" in notes[0]
        assert s.window()[0] == {"role": "system", "content": "Be brief."}
        assert s.window()[1]["role"] == "user"
        assert len(s.messages) == 1 + 2 * len(questions)  # dropped turns stay in the saved conversation
        trimmed = next(i for i, t in enumerate(s.turns) if t.reused < t.held)
        if trimmed + 1 < len(s.turns):  # the turn after a trim extends the new prefix again
            after = s.turns[trimmed + 1]
            assert after.reused == after.held


# -- bookkeeping on a fake model: one token per word --------------------------------------------------------


class FakeModel:
    """The part of Model a ChatSession uses. A message renders as [role, words..., end]; replies are
    scripted; the cache behaves as Model.run's (longest common prefix, reply ids appended)."""

    def __init__(self, ctx: int, reply: str = "fine thanks"):
        self.ctx, self.seq, self.reply, self.vocab = ctx, SequenceCache([LayerCache()], ctx), reply, {}

    def _id(self, word: str) -> int:
        return self.vocab.setdefault(word, len(self.vocab))

    def chat_ids(self, messages, add_generation_prompt=True, think=None, limit=None):
        ids = []
        for m in messages:
            ids += [self._id("<" + m["role"] + ">"), *map(self._id, m["content"].split()), self._id("<end>")]
        ids = ids + [self._id("<assistant>")] if add_generation_prompt else ids
        if limit is not None and len(ids) > limit:
            raise TooManyTokens(limit, len(ids))
        return ids

    def run(self, ids, *, completion, max_tokens, stop, params, constraint=None):
        keep = self.seq.reusable(ids)
        c = completion
        c.prompt_tokens, c.timings = list(ids), Timings(prompt_tokens=len(ids) - keep)
        c.tokens = [self._id(w) for w in self.reply.split()][:max_tokens]
        self.seq.prompt_done(list(ids) + c.tokens)
        c.text, c.finish_reason = self.reply, "eos"
        yield self.reply


def test_trimming_drops_whole_exchanges_and_moves_forward():
    m = FakeModel(ctx=40)
    notes: list[str] = []
    s = ChatSession(m, system="be brief", max_tokens=4, notice=notes.append)  # reserve 4, budget 36
    budget = m.ctx - s.reserve
    firsts = []
    for i in range(12):
        c = s.reply(f"question number {i}")
        assert len(c.prompt_tokens) <= budget
        firsts.append(s.first)
        assert s.window()[0]["role"] == "system" and s.window()[1]["role"] == "user"
    assert firsts == sorted(firsts) and firsts[-1] > 0
    assert len(notes) < 12 // 2  # a trim frees half the budget: most turns after it reuse the cache
    trims = [i for i in range(1, 12) if firsts[i] != firsts[i - 1]]
    for i in trims:
        t = s.turns[i]
        assert len(t.completion.prompt_tokens) <= budget // 2 and t.reused < t.held
    for i in range(1, 12):
        if i not in trims:
            assert s.turns[i].reused == s.turns[i].held  # a plain turn: only new tokens prefilled
    assert len(s.messages) == 1 + 24


def test_a_message_too_long_for_the_context_changes_nothing():
    m = FakeModel(ctx=40)
    s = ChatSession(m, max_tokens=4)
    s.reply("hello there")
    s.reply("how are you")
    before = (list(s.history), s.first)
    with pytest.raises(ContextOverflowError, match="raise --ctx"):
        s.reply(" ".join(["word"] * 40))
    assert (s.history, s.first) == before


def test_a_pasted_message_of_megabytes_is_refused_before_it_is_tokenized(random_model, smollm2):
    """6 MiB pasted into a chat (tokenizing it whole took some 6 s): refused at once, the conversation as it
    was; messages that fit go on."""
    import time

    with Model(random_model("tiny-llama", vocab_file=smollm2), backend="numpy", ctx=256) as m:
        s = ChatSession(m, max_tokens=4)
        s.reply("hello")
        before = (list(s.history), s.first)
        t0 = time.monotonic()
        with pytest.raises(ContextOverflowError, match="needs more than"):
            s.reply("The quick brown fox jumps over the lazy dog. " * ((6 << 20) // 45))
        assert time.monotonic() - t0 < 3
        assert (s.history, s.first) == before
        assert s.reply("and again").tokens


def test_a_failed_turn_undoes_the_trim_it_needed():
    """An error in the engine (here NaN logits) after the window was trimmed for the new message: the
    message goes and so does the trim; the dropped exchanges are back in the window."""
    from llamacli.errors import NumericalError

    class Broken(FakeModel):
        fail = False

        def run(self, ids, **kw):
            if self.fail:
                raise NumericalError("the logits contain NaN")
            yield from super().run(ids, **kw)

    m = Broken(ctx=40)
    s = ChatSession(m, max_tokens=4)
    for i in range(3):
        s.reply(f"question number {i}")
    before = (list(s.history), s.first)
    m.fail = True
    with pytest.raises(NumericalError):
        s.reply("a much longer question that will not fit beside the others")
    assert (s.history, s.first) == before


def test_interrupt_before_any_text_drops_the_question():
    class Stubborn(FakeModel):
        def run(self, ids, **kw):
            raise KeyboardInterrupt
            yield  # a generator, like Model.run

    s = ChatSession(Stubborn(ctx=64))
    with pytest.raises(KeyboardInterrupt):
        s.reply("hello")
    assert s.messages == [] and s.turns == []


# -- files ---------------------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    s = ChatSession(FakeModel(ctx=64), system="be brief")
    s.reply("hello there")
    s.reply("ünïcode ✓")
    f = tmp_path / "c.json"
    assert s.save(f) == 5
    data = json.loads(f.read_text(encoding="utf-8"))
    assert data == s.messages and data[0] == {"role": "system", "content": "be brief"}
    t = ChatSession(FakeModel(ctx=64), system="another")
    assert t.load(f) == 5
    assert t.messages == s.messages and t.system == "be brief"
    f.write_text('[{"role": "user", "content": "hi", "name": "x"}]', encoding="utf-8")
    t.load(f)
    assert t.system is None and t.messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "text,words",
    [
        ("{not json", "not valid JSON (line 1"),
        ('{"role": "user", "content": "hi"}', "expected a JSON list"),
        ('["hi"]', "message 1 is a string, not an object"),
        ('[{"role": "robot", "content": "hi"}]', "message 1 has role 'robot'"),
        ('[{"content": "hi"}]', "message 1 has role None"),
        ('[{"role": "user", "content": null}]', "message 1 has no text content"),
        ('[{"role": "user", "content": [{"type": "text"}]}]', "content\" must be a string"),
        ('[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]', "only the first"),
    ],
)
def test_load_rejects_bad_files(tmp_path, text, words):
    s = ChatSession(FakeModel(ctx=64), system="keep me")
    s.reply("hello")
    before = s.messages
    f = tmp_path / "bad.json"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(ConversationFileError) as info:
        s.load(f)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert s.messages == before


def test_load_and_save_file_errors(tmp_path):
    s = ChatSession(FakeModel(ctx=64))
    with pytest.raises(ConversationFileError, match="no such conversation file"):
        s.load(tmp_path / "missing.json")
    with pytest.raises(ConversationFileError, match="cannot write"):
        s.save(tmp_path / "no-such-dir" / "c.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe[")
    with pytest.raises(ConversationFileError, match="cannot read"):
        s.load(tmp_path / "bin.json")
    assert check_messages([]) == []


def test_closing_the_stream_after_the_reply_ended_keeps_its_finish_reason():
    s = ChatSession(FakeModel(ctx=64))
    c = Completion()
    pieces = s.send("hello there", c)
    assert next(pieces) == "fine thanks"  # the whole reply; the engine already said why it ended
    pieces.close()
    assert c.finish_reason == "eos" and s.turns[-1].finish_reason == "eos"
    assert s.messages[-1] == {"role": "assistant", "content": "fine thanks"}


# -- hostile files and long conversations --------------------------------------------------------------------

_FULL_DISK_CHILD = r"""
import resource, signal, sys
from llamacli.engine.chat_session import ChatSession, ConversationFileError
sys.path.insert(0, sys.argv[2])
from test_chat_session import FakeModel
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG instead of a kill
s = ChatSession(FakeModel(ctx=64))
s.load_messages([{"role": "user", "content": "x" * 5000}])
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))  # the disk fills after 2000 bytes
try:
    s.save(sys.argv[1])
    print("saved")
except ConversationFileError as exc:
    print("error:", exc)
"""


def test_a_save_that_fills_the_disk_keeps_the_old_file(tmp_path):
    """/save over an existing conversation on a disk that fills mid-write (RLIMIT_FSIZE in a child: a real
    short write): a clean error, the old file intact, no temporary file left behind."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    f = tmp_path / "c.json"
    old = ChatSession(FakeModel(ctx=64), system="be brief")
    old.reply("hello there")
    old.save(f)
    before = f.read_bytes()
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(tests.parents[1])}
    p = subprocess.run([sys.executable, "-c", _FULL_DISK_CHILD, str(f), str(tests)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.stdout.startswith("error: cannot write"), p.stdout + p.stderr
    assert f.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.json"]


def test_save_replaces_atomically_and_keeps_permissions(tmp_path, monkeypatch):
    """The new text is complete on disk before it takes the name; a failure at any step leaves the old file."""
    import os

    import llamacli.engine.chat_session as cs

    f = tmp_path / "c.json"
    s = ChatSession(FakeModel(ctx=64))
    s.reply("hello there")
    s.save(f)
    os.chmod(f, 0o640)
    before = f.read_bytes()
    s.reply("and more")

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cs.os, "fsync", no_space)
    with pytest.raises(ConversationFileError, match="No space left"):
        s.save(f)
    assert f.read_bytes() == before and os.listdir(tmp_path) == ["c.json"]
    monkeypatch.undo()
    s.save(f)
    assert json.loads(f.read_text(encoding="utf-8")) == s.messages
    assert os.stat(f).st_mode & 0o777 == 0o640 and os.listdir(tmp_path) == ["c.json"]



def test_save_writes_only_a_regular_file_or_a_new_path(tmp_path):
    """A symbolic link (to a file or anywhere), a directory, a FIFO: refused with one line, left as they were;
    the file a link points to keeps its text. A regular file or a new path is written."""
    import os

    s = ChatSession(FakeModel(ctx=64))
    s.reply("hello there")
    f = tmp_path / "c.json"
    f.write_text("[]", encoding="utf-8")
    link, dangling, fifo, folder = (tmp_path / n for n in ("link.json", "dangling.json", "fifo", "folder"))
    link.symlink_to(f)
    dangling.symlink_to(tmp_path / "elsewhere.json")
    os.mkfifo(fifo)
    folder.mkdir()
    for path, kind in ((link, "a symbolic link"), (dangling, "a symbolic link"), (fifo, "a FIFO"),
                       (folder, "a directory")):
        with pytest.raises(ConversationFileError, match=f"it is {kind}, not a regular file") as info:
            s.save(path)
        assert "\n" not in str(info.value)
    assert link.is_symlink() and dangling.is_symlink() and not (tmp_path / "elsewhere.json").exists()
    assert f.read_text(encoding="utf-8") == "[]" and os.path.exists(fifo) and not os.path.isfile(fifo)
    assert folder.is_dir() and s.save(f) == 2 and json.loads(f.read_text(encoding="utf-8")) == s.messages
    assert s.save(tmp_path / "new.json") == 2


def test_save_never_touches_the_process_umask(tmp_path, monkeypatch):
    """The umask is process-wide and reading it means setting it, a race with every thread that creates a
    file meanwhile: a new file gets 0o666 less the umask from the kernel, at creation, instead."""
    import os

    import llamacli.engine.chat_session as cs

    def no_umask(mask):
        raise AssertionError("os.umask called")

    s = ChatSession(FakeModel(ctx=64))
    s.reply("hello there")
    old = os.umask(0o027)
    try:
        monkeypatch.setattr(cs.os, "umask", no_umask)
        s.save(tmp_path / "new.json")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert os.stat(tmp_path / "new.json").st_mode & 0o777 == 0o640
    assert json.loads((tmp_path / "new.json").read_text(encoding="utf-8")) == s.messages


def test_nul_bytes_in_file_names_are_clean_errors(tmp_path):
    s = ChatSession(FakeModel(ctx=64))
    s.reply("hello")
    for action in (s.save, s.load):
        with pytest.raises(ConversationFileError, match="NUL byte"):
            action(str(tmp_path / "a\0b.json"))
    assert s.messages[0] == {"role": "user", "content": "hello"}


def test_a_number_of_thousands_of_digits_is_a_clean_error(tmp_path):
    f = tmp_path / "c.json"
    f.write_text('[{"role": "user", "content": "hi", "n": ' + "9" * 5000 + "}]", encoding="utf-8")
    s = ChatSession(FakeModel(ctx=64))
    with pytest.raises(ConversationFileError, match="number too long"):
        s.load(f)
    assert s.messages == []


def _window_from(s: ChatSession, first: int) -> list[dict[str, str]]:
    """The messages a prompt renders when the window starts at history[first]: the system prompt (the head of
    s.messages before the history) and the turns from there."""
    head = s.messages[: len(s.messages) - len(s.history)]
    return head + [dict(m) for m in s.history[first:]]


def _old_trim_start(s: ChatSession) -> int:
    """Where the window started under the first trimming rule: drop one exchange at a time, re-rendering after
    each, until the prompt fills at most half the budget (the reference the binary search must agree with)."""
    budget = s.model.ctx - s.reserve
    first = s.first
    if len(s.model.chat_ids(s.window())) <= budget:
        return first
    last_user = max(i for i, m in enumerate(s.history) if m["role"] == "user")
    while len(s.model.chat_ids(_window_from(s, first))) > budget // 2:
        nxt = next((i for i in range(first + 1, last_user + 1) if s.history[i]["role"] == "user"), None)
        if nxt is None:
            break
        first = nxt
    return first


def _long_conversation(exchanges: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(exchanges):
        words = " ".join(["word"] * (i % 7))  # exchanges of different lengths
        messages += [{"role": "user", "content": f"question {i} {words}"},
                     {"role": "assistant", "content": f"answer {i}"}]
    return messages


@pytest.mark.parametrize("exchanges", [1, 2, 3, 17, 60])
def test_trimming_keeps_the_turns_the_one_by_one_rule_keeps(exchanges):
    for ctx in (12, 24, 40, 64, 200):  # 12: the new message does not fit even alone
        s = ChatSession(FakeModel(ctx=ctx), max_tokens=4)
        s.load_messages(_long_conversation(exchanges))
        s.history.append({"role": "user", "content": "the new question"})
        want = _old_trim_start(s)
        try:
            s.fit()
        except ContextOverflowError:
            assert s.first == 0
            # The one-by-one rule, left with its shortest window, overflows as well.
            assert len(s.model.chat_ids(_window_from(s, want))) > s.model.ctx - s.reserve, (exchanges, ctx)
            continue
        assert s.first == want, (exchanges, ctx)


def test_loading_a_long_conversation_into_a_small_context_is_fast():
    """2,000 exchanges /load'ed into a small context: the next turn trims in a few renders (it used to
    re-render the conversation once per dropped exchange: minutes on a real model)."""
    import time

    s = ChatSession(FakeModel(ctx=64), max_tokens=8)
    s.load_messages(_long_conversation(2000))
    renders = 0
    chat_ids = s.model.chat_ids

    def counted(*args, **kwargs):
        nonlocal renders
        renders += 1
        return chat_ids(*args, **kwargs)

    s.model.chat_ids = counted
    t0 = time.perf_counter()
    c = s.reply("the new question")
    assert time.perf_counter() - t0 < 2.0
    assert renders <= 16
    budget = s.model.ctx - s.reserve
    assert len(c.prompt_tokens) <= budget // 2
    assert s.window()[-2] == {"role": "user", "content": "the new question"}
    assert s.window()[1]["content"].startswith("question 199")  # the most recent exchanges that fit
    earlier = _window_from(s, s.first - 2)[:-1]  # one more exchange would not fit in half
    assert len(s.model.chat_ids(earlier)) > budget // 2
