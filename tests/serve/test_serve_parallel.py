"""`serve --parallel`: many clients at once through the official openai client, with four cache slots (on the NumPy
backend; LLAMACLI_TEST_BACKEND=cuda: the CUDA backend's batched step). Every answer equals the one the same request
gets alone (greedy and seeded sampling, streamed and whole, stop strings, logprobs; on CUDA the greedy ones, since a
lone request takes the fused step, whose logits round otherwise than the batched step's, and a seeded draw near a
boundary may go the other way); a client that leaves mid-stream frees its slot; past the waiting bound a request
gets 503 with Retry-After and the server goes on; `--parallel` on the command line."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from serve_runner import BACKEND, start, stop  # noqa: E402

from llamacli.engine.generate import Model  # noqa: E402
from llamacli.serve.connections import Limits  # noqa: E402

SLOTS = 4
WAITING = 8  # the server's bound on requests waiting for a slot


@pytest.fixture(scope="module")
def path(random_model, smollm2):
    return random_model("tiny-llama", "Q8_0", vocab_file=smollm2, std=0.2)


def requests_():
    prompts = ["Once upon a time", "The quick brown fox", "Numbers: 1 2 3 4 5", "Hello", "Why is the sky blue?",
               "A B C D", "In the beginning", "Tell me a story about a cat"]
    settings = [dict(temperature=0.0), dict(temperature=0.9, seed=5), dict(temperature=0.0, logprobs=2),
                dict(temperature=1.1, top_p=0.9, seed=11), dict(temperature=0.0, stop=["e"]),
                dict(temperature=0.7, seed=3, max_tokens=3), dict(temperature=0.0, frequency_penalty=0.5),
                dict(temperature=0.8, seed=1)]
    return [(p, {"max_tokens": 10, **s}) for p, s in zip(prompts, settings)]


def ask(client, prompt: str, kw: dict, stream: bool) -> tuple[str, str, list | None]:
    """(text, finish reason, logprob ids) of a completion, streamed or whole."""
    if not stream:
        r = client.completions.create(model="m", prompt=prompt, **kw)
        ch = r.choices[0]
        return ch.text, ch.finish_reason, ch.logprobs.tokens if ch.logprobs else None
    text, finish, tokens = "", None, []
    for chunk in client.completions.create(model="m", prompt=prompt, stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
            if ch.logprobs:
                tokens += ch.logprobs.tokens
    return text, finish, tokens or None


@pytest.fixture(scope="module")
def alone(path):
    """Each request's answer alone: one request at a time (to a server of as many slots: on CUDA a lone request
    takes the fused decode step)."""
    model = Model(path, backend=BACKEND, ctx=256, slots=SLOTS)
    url, server, thread = start(model, "m")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        yield [ask(client, p, kw, stream=False) for p, kw in requests_()]
    finally:
        stop(server, thread)
        model.close()


@pytest.fixture(scope="module")
def parallel(path):
    model = Model(path, backend=BACKEND, ctx=256, slots=SLOTS)
    url, server, thread = start(model, "m", limits=Limits(max_waiting=WAITING))
    try:
        yield url, model, server
    finally:
        stop(server, thread)
        model.close()


def test_concurrent_clients_get_what_they_get_alone(alone, parallel):
    url, model, server = parallel
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    jobs = requests_()
    got: dict[tuple[int, bool], tuple] = {}

    def one(i: int, stream: bool) -> None:
        got[i, stream] = ask(client, *jobs[i], stream=stream)

    for stream in (False, True):  # 8 requests at once, 4 slots: four run, the rest wait (within the bound)
        threads = [threading.Thread(target=one, args=(i, stream)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert len(got) == 2 * len(jobs)
    for i, want in enumerate(alone):
        if BACKEND != "numpy" and jobs[i][1]["temperature"] > 0:  # (see the module's docstring)
            assert all(len(got[i, st][0]) > 0 and got[i, st][1] == want[1] for st in (False, True)), jobs[i]
            continue
        assert got[i, False] == want, jobs[i]
        assert got[i, True] == want, jobs[i]
    engine = server.engine
    assert engine.scheduler.batched > engine.scheduler.steps  # steps did carry several requests
    health = json.load(urllib.request.urlopen(url + "/health"))
    assert health["slots"] == SLOTS and health["running"] == 0 and health["queue_length"] == 0


def test_a_client_that_leaves_frees_its_slot(parallel):
    url, model, server = parallel
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for _ in range(2 * SLOTS):  # each leaves after its first piece; the slots must come back every time
        stream = client.completions.create(model="m", prompt="Once upon a time", max_tokens=200, stream=True,
                                           temperature=0.0)
        next(iter(stream))
        stream.close()
    text, finish, _ = ask(client, "Hello", {"max_tokens": 3, "temperature": 0.0}, stream=False)
    assert finish in ("length", "stop")
    sched = server.engine.scheduler
    for _ in range(200):
        if sched.load["free_slots"] == SLOTS:
            break
        threading.Event().wait(0.05)
    assert sched.load == {"running": 0, "waiting": 0, "free_slots": SLOTS}


def test_past_the_waiting_bound_503_with_retry_after(parallel):
    """With every step held, requests pile up: once WAITING of them wait, the next is refused at once (503,
    Retry-After, the reason), and when the steps go on every request taken is answered."""
    url, model, server = parallel
    gate = threading.Event()
    step = model.backend.step

    def held(batch):
        gate.wait(30)
        return step(batch)

    model.backend.step = held
    answers: list[int] = []

    def post() -> int:
        body = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0.0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=60).status
        except urllib.error.HTTPError as exc:
            if exc.code == 503:
                assert exc.headers["Retry-After"] == "1"
                assert "waiting" in json.load(exc)["error"]["message"]
            return exc.code

    threads: list[threading.Thread] = []
    sched = server.engine.scheduler
    try:
        while sched.load["waiting"] < WAITING:  # each taken: it waits, or runs held in a step
            assert len(threads) < SLOTS + WAITING + 1
            threads.append(threading.Thread(target=lambda: answers.append(post())))
            threads[-1].start()
            for _ in range(200):
                if sched.load["waiting"] + sched.load["running"] >= len(threads):
                    break
                threading.Event().wait(0.02)
        assert post() == 503
    finally:
        gate.set()
        del model.backend.step
        for t in threads:
            t.join(60)
    assert answers == [200] * len(threads)
    assert post() == 200


def test_parallel_on_the_command_line(path):
    """`serve -np N` is checked before the model loads (one error line, exit 2)."""
    from clirun import run

    r = run("serve", str(path), "--backend", "numpy", "-np", "0")
    assert r.code == 2 and r.one_line_error().startswith("error: --parallel must lie in 1..256") and r.out == ""


def test_ignore_eos_reaches_the_engine(parallel, monkeypatch):
    """llama-server's `ignore_eos` (the load tool sends it): the reply runs to max_tokens; not a boolean: 400."""
    import functools

    url, model, server = parallel
    seen: list[dict] = []
    run = model.run

    @functools.wraps(run)  # (the server reads run's signature)
    def spy(prompt, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append(kw)
        return run(prompt, **kw)

    monkeypatch.setattr(model, "run", spy)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.completions.create(model="m", prompt="Hello", max_tokens=12, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert seen[-1].get("ignore_eos") is True
    with pytest.raises(openai.BadRequestError, match="ignore_eos must be true or false"):
        client.completions.create(model="m", prompt="Hello", max_tokens=2, extra_body={"ignore_eos": "yes"})


def test_batch_size_on_the_command_line_and_in_the_engine(path):
    """`serve -b N` (llama-server's -b, vLLM's --max-num-batched-tokens) is checked before the model loads; the
    engine hands it to its scheduler as the prompt tokens a turn."""
    from clirun import run
    from llamacli.serve.app import Engine

    for bad in ("0", "-3", str((1 << 20) + 1)):
        r = run("serve", str(path), "--backend", "numpy", "-b", bad)
        assert r.code == 2 and r.one_line_error().startswith("error: --batch-size must lie in 1..") and r.out == ""
    m = Model(path, backend="numpy", ctx=64)
    try:
        for budget, want in ((None, 2048), (3, 3)):
            engine = Engine(m, "t", prefill_budget=budget)
            try:
                assert engine.scheduler.prefill_budget == want
            finally:
                engine.close()
    finally:
        m.close()
