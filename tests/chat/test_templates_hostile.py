"""Server-side template injection, through the way a template really arrives: a GGUF file's
tokenizer.chat_template, read by open_gguf and rendered by llamacli.chat.template (tests/chat/test_chat.py has the sandbox's
own unit tests; this is the cheat-sheet corpus on top, by class).

Each payload must raise TemplateError or render harmlessly: nothing leaks (no module, builtins, environment
or file content in the output), nothing is written or run (canary files stay absent), and it ends quickly
in little memory (tracemalloc peak, wall time) even when it asks for gigabytes or loops for ever. Then the
same files through `llamacli tokenize --chat` and `generate`: exit 0 or 2 with one line, never a traceback.
"""

from __future__ import annotations

import collections
import os
import time
import tracemalloc
from pathlib import Path

import pytest

import gguf_bytes as gb
import gguf_mutate as gm
from clirun import run
from fuzz_runner import Summary
from llamacli.chat.template import ChatTemplate
from llamacli.errors import TemplateError
from llamacli.ggufio.file import open_gguf
from llamacli.testing import tiny_vocab

SECRET = "llamacli-canary-3f9a"  # planted in the environment: must never reach a rendered prompt
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

# (class, payload). MARKER is replaced by a path that must still not exist afterwards.
PAYLOADS: list[tuple[str, str]] = [
    # object traversal to subclasses / globals
    ("object traversal", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
    ("object traversal", "{{ ''.__class__.__base__.__subclasses__()[59].__init__.__globals__['sys'].modules['os'] }}"),
    ("object traversal", "{{ ().__class__.__bases__[0].__subclasses__() }}"),
    ("object traversal", "{{ {}.__class__.__subclasses__() }}"),
    ("object traversal", "{{ (1).__class__.__mro__ }}"),
    ("object traversal", "{{ 1.0.hex.__self__.__class__ }}"),
    ("object traversal", "{{ messages.__class__.__init__.__globals__ }}"),
    ("object traversal", "{{ messages[0].__class__.__dict__ }}"),
    ("object traversal", "{{ add_generation_prompt.__class__.__mro__ }}"),
    ("object traversal", "{{ bos_token.__class__.__subclasses__() }}"),
    ("object traversal", "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{{ c.__name__ }}{% endfor %}"),
    ("object traversal", "{{ ''.__class__.__mro__[-1].__subclasses__()[0].__init__.__globals__.__builtins__ }}"),
    # Jinja's and our globals
    ("template globals", "{{ cycler.__init__.__globals__.os.environ }}"),
    ("template globals", "{{ joiner.__init__.__globals__['os'].popen('id').read() }}"),
    ("template globals", "{{ namespace.__init__.__globals__.__builtins__['eval']('1+1') }}"),
    ("template globals", "{{ lipsum.__globals__['os'].environ }}"),
    ("template globals", "{{ range.__globals__ }}"),
    ("template globals", "{{ dict.__call__.__globals__ }}"),
    ("template globals", "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}"),
    ("template globals", "{{ strftime_now.__globals__.datetime.__class__ }}"),
    ("template globals", "{{ cycler(1,2).__class__.__init__.__globals__ }}"),
    ("template globals", "{% set ns = namespace() %}{{ ns.__class__.__mro__ }}"),
    ("template globals", "{{ dict(a=1).__class__.__subclasses__() }}"),
    ("template globals", "{{ dict.fromkeys.__self__ }}"),
    # |attr() and friends: names spelled so that a naive filter misses them
    ("attr/filter tricks", "{{ ''|attr('__class__') }}"),
    ("attr/filter tricks", "{{ ''|attr('\\x5f\\x5fclass\\x5f\\x5f') }}"),
    ("attr/filter tricks", "{{ ''|attr('\\u005f\\u005fclass\\u005f\\u005f') }}"),
    ("attr/filter tricks", "{{ ''|attr(['_','_class_','_']|join) }}"),
    ("attr/filter tricks", "{{ ''|attr('%c%cclass%c%c'|format(95,95,95,95)) }}"),
    ("attr/filter tricks", "{{ ''|attr('__cla' ~ 'ss__') }}"),
    ("attr/filter tricks", "{{ ()|attr('__class__')|attr('__base__')|attr('__subclasses__')() }}"),
    ("attr/filter tricks", "{{ ''['__class__'] }}"),
    ("attr/filter tricks", "{{ ''['\\x5f\\x5fclass\\x5f\\x5f'] }}"),
    ("attr/filter tricks", "{{ messages|map(attribute='__class__')|list }}"),
    ("attr/filter tricks", "{{ messages|sort(attribute='__class__') }}"),
    ("attr/filter tricks", "{{ messages|groupby('__class__') }}"),
    ("attr/filter tricks", "{{ messages|map('attr', '__class__')|list }}"),
    ("attr/filter tricks", "{{ messages|selectattr('__class__')|list }}"),
    ("attr/filter tricks", "{{ messages|sum(attribute='__class__') }}"),
    ("attr/filter tricks", "{{ messages|unique(attribute='__class__')|list }}"),
    ("attr/filter tricks", "{{ (messages|first).__class__ }}"),
    ("attr/filter tricks", "{{ ''.__getattribute__('__class__') }}"),
    # str.format reached through |attr, around the sandbox's own check of .format (jinja2 before 3.1.6)
    ("attr/filter tricks", "{{ '{0.__globals__}'|attr('format')(raise_exception) }}"),
    ("attr/filter tricks", "{{ '{0.__globals__[__builtins__][open]}'|attr('format')(strftime_now) }}"),
    ("attr/filter tricks", "{{ '{f.__globals__}'|attr('format_map')({'f': raise_exception}) }}"),
    ("attr/filter tricks", "{{ messages.__getitem__(0) }}"),
    # format-string tricks
    ("format strings", "{{ '{0.__class__.__mro__}'.format('') }}"),
    ("format strings", "{{ '{0[__class__]}'.format({}) }}"),
    ("format strings", "{{ '{.__globals__}'.format(raise_exception) }}"),
    ("format strings", "{{ '{0.__init__.__globals__}'.format(cycler) }}"),
    ("format strings", "{{ '{m.__class__}'.format_map({'m': messages}) }}"),
    ("format strings", "{{ '%s'|format(messages.__class__) }}"),
    ("format strings", "{{ '%(a)s'|format(a=messages.__class__) }}"),
    ("format strings", "{{ '{0.gi_frame.f_globals}'.format(messages|map('upper')) }}"),
    # the loader: import, include, extends
    ("import/include/extends", "{% import os %}"),
    ("import/include/extends", "{% import 'os' as os %}{{ os.system('id') }}"),
    ("import/include/extends", "{% from 'os' import system %}{{ system('id') }}"),
    ("import/include/extends", "{% include '/etc/passwd' %}"),
    ("import/include/extends", "{% include '/etc/passwd' ignore missing %}"),
    ("import/include/extends", "{% include ['/etc/passwd', '/etc/shadow'] %}"),
    ("import/include/extends", "{% extends '/etc/passwd' %}"),
    ("import/include/extends", "{% extends 'base.html' %}{% block x %}{% endblock %}"),
    # framework objects that exist in Flask/Django template contexts, not here
    ("request/config/self", "{{ request.application.__globals__.__builtins__.__import__('os').popen('id').read() }}"),
    ("request/config/self", "{{ config.items() }}"),
    ("request/config/self", "{{ config.__class__.__init__.__globals__['os'] }}"),
    ("request/config/self", "{{ self._TemplateReference__context }}"),
    ("request/config/self", "{{ self.__init__.__globals__.__builtins__ }}"),
    ("request/config/self", "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}"),
    ("request/config/self", "{{ url_for.__globals__['current_app'].config }}"),
    ("request/config/self", "{{ get_flashed_messages.__globals__['__builtins__'] }}"),
    ("request/config/self", "{{ settings.SECRET_KEY }}"),
    ("request/config/self", "{{ self }}{{ config }}{{ request }}{{ g }}"),
    # mutating our data
    ("mutation", "{{ messages.append(1) }}"),
    ("mutation", "{{ messages.pop() }}"),
    ("mutation", "{{ messages.clear() }}"),
    ("mutation", "{% set _ = messages[0].update({'role': 'x'}) %}"),
    ("mutation", "{{ messages[0].__setitem__('role', 'x') }}"),
    ("mutation", "{% set ns = namespace(__class__=1) %}"),
    ("mutation", "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}"),
    # running things / writing files (canaries)
    ("exec / file canary", "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}"),
    ("exec / file canary", "{{ joiner.__init__.__globals__['os'].system('touch MARKER') }}"),
    ("exec / file canary", "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
                           "{{ c(['touch', 'MARKER']) }}{% endif %}{% endfor %}"),
    ("exec / file canary", "{{ namespace.__init__.__globals__.__builtins__.open('MARKER', 'w').write('x') }}"),
    ("exec / file canary", "{{ lipsum.__globals__['os'].popen('touch MARKER') }}"),
    ("exec / file canary", "{{ self.__init__.__globals__.__builtins__.exec(\"open('MARKER','w')\") }}"),
    # loops
    ("huge loops", "{% for i in range(10**9) %}{% endfor %}"),
    ("huge loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
    ("huge loops", "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"),
    ("huge loops", "{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for j in range(100000) %}"
                   "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}"),
    ("huge loops", "{% for x in messages * 100000000 %}{% endfor %}"),
    ("huge loops", "{% for c in 'x' * 10**9 %}{% endfor %}"),
    ("huge loops", "{% for i in range(100000) %}{% for m in messages %}{{ m|tojson }}{% endfor %}{% endfor %}"),
    ("huge loops", "{{ ('ab' * 4000000)|batch(1)|list }}"),
    # recursion
    ("recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
    ("recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
    ("recursion", "{% macro a() %}{{ b() }}{% endmacro %}{% macro b() %}{{ a() }}{% endmacro %}{{ a() }}"),
    ("recursion", "{% for x in [[1]] recursive %}{{ loop([x]) }}{% endfor %}"),
    ("recursion", "{% macro f() %}{% call f() %}{% endcall %}{% endmacro %}{{ f() }}"),
    # gigabytes of text
    ("gigabyte strings", "{{ 'x' * 10**10 }}"),
    ("gigabyte strings", "{{ 'x' * 1000 * 1000 * 1000 }}"),
    ("gigabyte strings", "{{ ('x' * 10**6) * 10**4 }}"),
    ("gigabyte strings", "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"),
    ("gigabyte strings", "{% set ns = namespace(s='xy') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"),
    ("gigabyte strings", "{{ [1] * 10**9 }}"),
    ("gigabyte strings", "{{ ['x' * 100000] * 100000 }}"),
    ("gigabyte strings", "{{ (['x' * 100000] * 1000)|join }}"),
    ("gigabyte strings", "{{ ''.join(['x'] * 10**9) }}"),
    ("gigabyte strings", "{{ 'x'|center(10**10) }}"),
    ("gigabyte strings", "{{ 'x'|indent(10**10) }}"),
    ("gigabyte strings", "{{ 'x'.ljust(10**10) }}"),
    ("gigabyte strings", "{{ 'x'.zfill(10**10) }}"),
    ("gigabyte strings", "{{ '\\t'.expandtabs(10**9) }}"),
    ("gigabyte strings", "{{ ('x' * 10**6).replace('x', 'y' * 1000) }}"),
    ("gigabyte strings", "{{ ('x' * 10**6)|replace('x', 'y' * 1000) }}"),
    ("gigabyte strings", "{{ ('x' * 1000)|replace('', 'y' * 10**6) }}"),
    ("gigabyte strings", "{{ '%999999999999d' % 1 }}"),
    ("gigabyte strings", "{{ '%999999999d'|format(1) }}"),
    ("gigabyte strings", "{{ '{:>99999999999}'.format(1) }}"),
    ("gigabyte strings", "{{ '%.999999999f'|format(1.0) }}"),
    ("gigabyte strings", "{{ (range(100000)|list|string) * 1000 }}"),
    ("gigabyte strings", "{{ messages|tojson * 10**8 }}"),
    ("gigabyte strings", "{{ dict.fromkeys(range(100000), 'x' * 1000) }}"),
    ("gigabyte strings", "{{ (range(100000)|list)|tojson(indent=1000) }}"),
    ("gigabyte strings", "{{ ('x' * 10**6).split('x') * 1000 }}"),
    ("gigabyte strings", "{{ 'x'.ljust(10**6) ~ 'y'.ljust(10**6) }}"),
    ("gigabyte strings", "{{ '%*s' % (10**8, 'x') }}"),  # the width from an argument, not the format
    ("gigabyte strings", "{{ '%0*d' % (10**8, 1) }}"),
    ("gigabyte strings", "{{ '%.*f' % (10**8, 1.0) }}"),
    ("gigabyte strings", "{{ '{:{}}'.format('x', 10**8) }}"),
    ("gigabyte strings", "{{ '{:>{w}}'.format('x', w=10**8) }}"),
    ("gigabyte strings", "{{ '{:.{}f}'.format(1.0, 10**8) }}"),
    ("gigabyte strings", "{{ '%*d'|format(10**8, 1) }}"),
    # numbers
    ("big numbers", "{{ 9 ** (9 ** 9) }}"),
    ("big numbers", "{{ 2 ** 10**8 }}"),
    ("big numbers", "{% set ns = namespace(x=2) %}{% for i in range(40) %}{% set ns.x = ns.x ** 2 %}{% endfor %}"),
    ("big numbers", "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}"),
    ("big numbers", "{{ (10 ** 4000) * (10 ** 4000) }}"),
    ("big numbers", "{{ range(10**18)|length }}"),
    ("big numbers", "{{ '%d' % (10 ** 5000) }}"),
]

# Text that would show a template reached Python internals or the machine.
LEAKS = ["<module", "__builtins__", "<built-in function", "root:x:", "/bin/sh", "Popen", "environ(", SECRET,
         "gi_frame", "uid=", "f_globals"]


def _gguf_with_template(path: Path, template: str) -> Path:
    """A vocabulary-only GGUF whose tokenizer.chat_template is `template` (with the ChatML tokens)."""
    vocab = tiny_vocab()
    kvs = [gb.kv("general.architecture", gb.STR, "llama"),
           gb.kv("tokenizer.ggml.model", gb.STR, vocab["tokenizer.ggml.model"]),
           gb.kv("tokenizer.ggml.pre", gb.STR, vocab["tokenizer.ggml.pre"]),
           gb.kv("tokenizer.ggml.tokens", gb.ARR, (gb.STR, vocab["tokenizer.ggml.tokens"])),
           gb.kv("tokenizer.ggml.token_type", gb.ARR, (gb.I32, vocab["tokenizer.ggml.token_type"])),
           gb.kv("tokenizer.ggml.merges", gb.ARR, (gb.STR, vocab["tokenizer.ggml.merges"])),
           gb.kv("tokenizer.ggml.bos_token_id", gb.U32, 1), gb.kv("tokenizer.ggml.eos_token_id", gb.U32, 2),
           gb.kv("tokenizer.chat_template", gb.STR, template)]
    path.write_bytes(gb.gguf(kvs))
    return path


def _render_bounded(template: Path, peak_mb: int = 48, seconds: float = 4.0) -> tuple[str, str]:
    """('error', message) or ('rendered', text), after checking time and peak memory."""
    md = open_gguf(template).metadata
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = ("rendered", ChatTemplate.from_metadata(md, max_chars=1 << 20, timeout_s=1.0).render(CONVERSATION))
    except TemplateError as exc:
        out = ("error", str(exc))
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    took = time.perf_counter() - t0
    assert took < seconds, f"took {took:.1f} s"
    assert peak < peak_mb << 20, f"peak allocation {peak >> 20} MiB (the limit is 1 MiB of text)"
    return out


@pytest.fixture
def canary(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMACLI_TEMPLATE_SECRET", SECRET)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "pwned"


@pytest.fixture(scope="module")
def tally():
    return collections.defaultdict(collections.Counter)


@pytest.mark.parametrize("kind, payload", PAYLOADS, ids=[f"{i}-{k}" for i, (k, _) in enumerate(PAYLOADS)])
def test_payload_from_gguf(kind, payload, canary, tmp_path, tally):
    marker = str(canary)
    template = _gguf_with_template(tmp_path / "t.gguf", payload.replace("MARKER", marker))
    outcome, text = _render_bounded(template)
    tally[kind][outcome] += 1
    assert not canary.exists(), "the template ran a command or wrote a file"
    if outcome == "rendered":
        for leak in LEAKS:
            assert leak not in text, f"{leak!r} in the rendered prompt: {text[:300]!r}"
    else:
        assert text.startswith("chat template (gguf)"), text  # says which template, on one line
        assert "\n" not in text


def test_every_class_is_covered(tally, request):
    if sum(sum(c.values()) for c in tally.values()) < len(PAYLOADS):
        pytest.skip("only part of the corpus ran (-k?)")
    assert set(tally) == {k for k, _ in PAYLOADS}
    lines = Summary.of(request.config).lines
    lines.append(f"chat-template injection corpus, from GGUF files ({len(PAYLOADS)} payloads): "
                 "class, payloads, TemplateError, rendered harmlessly")
    for kind, c in tally.items():
        lines.append(f"  {kind:<24}{sum(c.values()):>4}{c['error']:>5}{c['rendered']:>5}")


@pytest.fixture(scope="module")
def model_seed(tmp_path_factory) -> gm.Sample:
    path = gm.write_seed_models(tmp_path_factory.mktemp("tmpl-seed"))["llama-bpe-f32"]
    return gm.sample_of(path)


# Through the CLI: every payload but the ones that take the full deadline (5 s each by default).
_SLOW = ("range(100000) %}{% for j", "range(99999)", "batch(1)", "range(100000) %}{% for m")


@pytest.mark.parametrize("command", ["tokenize", "generate"])
def test_payloads_through_the_cli(command, model_seed, canary, tmp_path):
    marker = str(canary)
    outcomes: collections.Counter[int] = collections.Counter()
    for kind, payload in PAYLOADS:
        if any(s in payload for s in _SLOW):
            continue
        payload = payload.replace("MARKER", marker)
        if command == "tokenize":
            path = _gguf_with_template(tmp_path / "t.gguf", payload)
            r = run("tokenize", "-m", str(path), "--text", "hi", "--chat")
        else:
            lay = gm.parse(model_seed)
            lay.set("tokenizer.chat_template", gb.STR, payload)
            sample = lay.build()
            path = tmp_path / "m.gguf"
            path.write_bytes(sample.prefix)
            r = run("generate", "-m", str(path), "--backend", "numpy", "-p", "hi", "-n", "1", "-q", "--greedy")
        outcomes[r.code] += 1
        assert r.code in (0, 2), f"{payload}: exit {r.code}: {r.err}"
        if r.code == 2:  # the template refused, or (generate) a harmless but long prompt overflowed the context
            line = r.one_line_error()
            assert "template" in line or (command == "generate" and "context" in line), (payload, r.err)
        for leak in LEAKS:  # (the error line may name a blocked attribute; it must not show its value)
            assert leak not in r.out, (payload, leak)
        assert SECRET not in r.err and "root:x:" not in r.err
        assert not canary.exists(), payload
    assert set(os.listdir(tmp_path)) <= {"t.gguf", "m.gguf"}  # nothing else written into the cwd
    assert outcomes[2] > 0.8 * sum(outcomes.values())


def test_cli_stops_a_template_that_loops_for_ever(tmp_path):
    """The default deadline (5 s) through the real command: exit 2, one line, in bounded time."""
    path = _gguf_with_template(tmp_path / "t.gguf", "{% for i in range(100000) %}{% for j in range(100000) %}"
                                                    "{% endfor %}{% endfor %}")
    t0 = time.perf_counter()
    r = run("tokenize", "-m", str(path), "--text", "hi", "--chat")
    assert time.perf_counter() - t0 < 15
    assert r.code == 2
    assert "longer than" in r.one_line_error()


# -- resource bombs: one expensive call, checked before it runs ------------------------------------------------
#
# Each payload is a single operation that used to build gigabytes or run for minutes inside one C call, where
# neither the size check on its result nor the deadline could stop it. They run in a child process with an
# address-space limit of 1 GiB over what it had after import (a bomb that allocates first dies with
# MemoryError there, which the sandbox reports as "ran out of memory": that counts as a failure here), each
# must end within BOMB_SECONDS (well under the 5 s deadline: the check, not the deadline, stops it).

BOMB_SECONDS = 2.5
BIG = "{% set big = {'a': 'x' * 1000000} %}"
BOMBS: list[tuple[str, str]] = [
    ("format widths", "{{ '%(a)999999999s' % {'a': 1} }}"),
    ("format widths", "{{ ('%(a)s' * 1000000) % {'a': 'x' * 1000} }}"),
    ("format widths", "{{ ('{0}' * 1000000).format('x' * 1000) }}"),
    ("format widths", "{% set f = '%(a)999999999s' %}{{ f|format(a=1) }}"),
    ("indent/expandtabs/center/ljust", "{{ ('x\\n' * 1000000)|indent(1000) }}"),
    ("indent/expandtabs/center/ljust", "{{ ('x\\n' * 1000)|indent('y' * 1000000) }}"),
    ("indent/expandtabs/center/ljust", "{{ ('\\t' * 1000000).expandtabs(1000) }}"),
    ("indent/expandtabs/center/ljust", "{{ 'x'.encode().center(10**10) }}"),
    ("indent/expandtabs/center/ljust", "{{ 'x'.encode().ljust(10**10) }}"),
    ("join with attribute", BIG + "{{ ([big]|batch(5000, big)|first)|join(attribute='a') }}"),
    ("sum of lists", "{{ ([[1]] * 200000)|sum(start=[])|length }}"),
    ("multiplication", "{{ 'x'.encode() * 10**10 }}"),
    ("replace", "{{ ('x' * 1000000).encode().replace('x'.encode(), ('y' * 1000).encode()) }}"),
    ("replace", "{{ ('x' * 1000000).translate({120: 'y' * 1000}) }}"),
    ("wordwrap/urlize", "{{ ('x ' * 1000000)|wordwrap(1, wrapstring='y' * 1000) }}"),
    ("wordwrap/urlize", "{{ ('a.com ' * 1000000)|urlize|length }}"),
    ("numbers", "{{ 1|round(-100000000) }}"),
    ("numbers", "{% set p = 100000000 %}{{ 1.5|round(p, 'floor') }}"),
    ("numbers", "{% set x = ('f' * 2000000)|int(base=16) %}{% set y = ('f' * 1000000)|int(base=16) %}{{ x // y }}"),
    ("numbers", "{% set x = ('f' * 2000000)|int(base=16) %}{% set y = ('f' * 1000000)|int(base=16) %}"
                "{{ x is divisibleby(y) }}"),
    ("numbers", "{{ (1).to_bytes(10**10, 'big') }}"),
    ("batch fill", "{{ [1]|batch(10**9, 'x')|list|length }}"),
    ("strftime", "{{ strftime_now('%c' * 2000000) }}"),
    ("memory held across a loop", "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                                  "{% set ns.l = [ns.l, 'x' * 4000000 ~ i] %}{% endfor %}"),
    # Calls whose time, not size, grows faster than their input (issue 46): one C call of minutes or hours.
    ("regex backtracking", "{{ (')' * 30000 + 'a)')|urlize }}"),  # 26 s in one match of urlize's regex
    ("regex backtracking", "{{ messages|map('urlize')|list }}"),
    ("strip with a long set", "{{ ('a' * 3000000)|trim('b' * 3000000 + 'a')|length }}"),
    ("strip with a long set", "{{ ('a' * 3000000).lstrip('b' * 3000000 + 'a')|length }}"),
    ("strip with a long set", "{{ ('a' * 3000000).encode().rstrip(('b' * 3000000 + 'a').encode())|length }}"),
]
LINEAR = ("sum of lists", "strip with a long set")  # rendered, in linear time

_BOMB_CHILD = r"""
import json, resource, sys, time
from llamacli.chat.template import ChatTemplate
from llamacli.errors import TemplateError
vm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:'))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
for i, payload in enumerate(json.load(sys.stdin)):
    t0 = time.perf_counter()
    try:
        ChatTemplate(payload).render([{"role": "user", "content": "hi"}])
        outcome = "rendered"
    except TemplateError as exc:
        outcome = str(exc)
    print(json.dumps([i, outcome, time.perf_counter() - t0]), flush=True)
"""


@pytest.fixture(scope="module")
def bomb_outcomes() -> dict[int, tuple[str, float]]:
    """{payload index: (outcome, seconds)} from one child process; a payload that hangs leaves the rest out."""
    import json
    import subprocess
    import sys

    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux (/proc and RLIMIT_AS)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        p = subprocess.run([sys.executable, "-c", _BOMB_CHILD], input=json.dumps([b for _, b in BOMBS]),
                           capture_output=True, text=True, timeout=60, env=env)
        out = p.stdout
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
    return {i: (outcome, took) for i, outcome, took in map(json.loads, out.splitlines())}


@pytest.mark.parametrize("index", range(len(BOMBS)), ids=[f"{i}-{k}" for i, (k, _) in enumerate(BOMBS)])
def test_resource_bombs_are_stopped_before_they_allocate(index, bomb_outcomes):
    kind, payload = BOMBS[index]
    assert index in bomb_outcomes, f"{payload}: did not finish (an earlier payload hung)"
    outcome, took = bomb_outcomes[index]
    assert took < BOMB_SECONDS, f"{payload}: took {took:.1f} s"
    assert "out of memory" not in outcome, f"{payload}: allocated past the address-space limit"
    if kind in LINEAR:
        assert outcome == "rendered"  # in linear time
    else:
        assert outcome.startswith("chat template (custom) stopped"), (payload, outcome)


def test_striptags_is_linear_whichever_markupsafe_is_installed(monkeypatch):
    """MarkupSafe 2.0 stripped tags with a backtracking regex, quadratic on an unclosed '<' repeated (Jinja 3.1
    accepts it): the sandbox's striptags, filter and Markup method alike, does not depend on it."""
    import re

    import markupsafe

    regex = re.compile(r"(<!--.*?-->|<[^>]*>)")

    def striptags(self: markupsafe.Markup) -> str:  # MarkupSafe 2.0's
        return markupsafe.Markup(" ".join(regex.sub("", self).split())).unescape()

    monkeypatch.setattr(markupsafe.Markup, "striptags", striptags)
    for payload in ("{{ ('<' * 200000)|striptags|length }}", "{{ (('<' * 200000)|safe).striptags()|length }}"):
        t0 = time.perf_counter()
        assert ChatTemplate(payload, timeout_s=1.0).render(CONVERSATION) == "200000"
        assert time.perf_counter() - t0 < 1.0, payload
    assert ChatTemplate("{{ 'a <!-- b <i> --> c <em>d</em> &amp;'|striptags }}").render([]) == "a c d &"


def test_template_source_size_is_bounded():
    """A multi-megabyte template used to take tens of seconds and gigabytes to compile."""
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match="characters long; the limit is"):
        ChatTemplate("{{ messages[0].content }}\n" * 100_000)
    assert time.perf_counter() - t0 < 1.0


def test_cli_refuses_a_bomb_and_a_huge_template(tmp_path):
    """Through the real command: exit 2, one `error:` line naming the template, quickly."""
    for i, payload in enumerate(["{{ ([[1]] * 10) | sum(start=[]) }}{{ '%(a)999999999s' % {'a': 1} }}",
                                 "{{ messages[0].content }}\n" * 100_000]):
        path = _gguf_with_template(tmp_path / f"t{i}.gguf", payload)
        t0 = time.perf_counter()
        r = run("tokenize", "-m", str(path), "--text", "hi", "--chat")
        assert time.perf_counter() - t0 < 5
        assert r.code == 2 and "chat template (gguf)" in r.one_line_error(), r.err
