"""The worker process that tries a schema or grammar before llamacli compiles it (grammar_sandbox.py runs it
as `python -I grammar_worker.py`; it imports nothing from llamacli, so it starts with llguidance alone).

    stdin:  {"kind": "schema" | "grammar", "text", "memory", "cpu", "stack", "walk", "path" (llguidance's folder)}
    stdout: {"ok": true, "grammar": llguidance's grammar text} or {"ok": false, "reason": one line}

It limits itself first (address space, CPU seconds, no core file), then, in a thread with a small stack,
converts the text (JSON schema, GBNF or Lark), validates it, builds an LLMatcher over a byte vocabulary and
computes the masks along a short seeded walk: the steps where llguidance recurses deepest or runs out of its
own limits. A crash, a hang or an allocation past the limit ends the process instead, and the parent reads
that from the exit status.
"""

from __future__ import annotations

import json
import random
import re
import sys
import threading

EOS = 256  # the byte vocabulary: ids 0..255 are the bytes, 256 the end of text
_SPACE = {9, 10, 13, 32}
_SPECIAL = re.compile(rb"<(\|[^<>|\s]{1,200}\|)>")  # <|name|> special tokens a Lark grammar names
_TOKEN_IDS = re.compile(rb"<\[([0-9,\-\s]{1,1000})\]>")  # <[id]>, <[a-b,c]> token ids
MAX_VOCAB = 1 << 18  # token ids a grammar may name here (the model's vocabulary is checked when compiled there)


def main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    _limit(int(request["memory"]), int(request["cpu"]))
    sys.path.insert(0, request["path"])
    result: dict = {}

    def run() -> None:
        try:
            result.update(check(request["kind"], request["text"], int(request["walk"])))
        except MemoryError:
            result.update(ok=False, reason="it needs more memory than the grammar check may use")
        except Exception as exc:  # noqa: BLE001 (llguidance's Python layer raises what it likes)
            result.update(ok=False, reason=f"{type(exc).__name__}: {_one_line(exc)}")

    threading.stack_size(int(request["stack"]))
    thread = threading.Thread(target=run, name="grammar-check")
    thread.start()
    thread.join()
    sys.stdout.write(json.dumps(result))
    sys.stdout.flush()


def _limit(memory: int, cpu: int) -> None:
    """Address space, CPU seconds and core files, for this process (Linux and the other Unixes)."""
    try:
        import resource
    except ImportError:
        return
    for which, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass
    try:  # no core file even where core_pattern pipes to a handler, which ignores RLIMIT_CORE
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def check(kind: str, text: str, walk: int) -> dict:
    import llguidance as llg

    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(text) if kind == "schema" else llg.grammar_from("grammar", text)
    except (ValueError, TypeError, RecursionError) as exc:
        return _fail(_one_line(exc))
    bad, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if bad:
        return _fail(_one_line(messages[0] if messages else "rejected by llguidance"))
    matcher = llg.LLMatcher(_vocabulary(llg, text), grammar, log_level=0)
    if matcher.is_error():
        return _fail(_first_line(matcher.get_error()))
    rng = random.Random(0)
    for step in range(walk + 1):
        mask = matcher.compute_bitmask()
        if matcher.is_error():
            at = "at its start" if step == 0 else f"after {_bytes(step)} of output"
            return _fail(f"llguidance cannot go on {at}: {_first_line(matcher.get_error())}")
        if matcher.is_stopped():
            break
        allowed = [i for i in range(EOS + 1) if mask[i >> 3] >> (i & 7) & 1]
        text_ids = [i for i in allowed if i != EOS and i not in _SPACE] or [i for i in allowed if i != EOS]
        if not text_ids:
            break
        matcher.consume_token(rng.choice(text_ids))
        if matcher.is_error():
            return _fail(f"llguidance cannot go on after {_bytes(step + 1)} of output: "
                         f"{_first_line(matcher.get_error())}")
    return {"ok": True, "grammar": grammar}


def _vocabulary(llg, text: str):
    """The 256 bytes and an end token, plus the special tokens the text names (<|name|>, <[id]>), so that a
    grammar written for a model's special tokens compiles here too."""
    raw = text.encode("utf-8", "surrogatepass")
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<|end|>"]
    tokens += sorted({b"\xff<" + name + b">" for name in _SPECIAL.findall(raw)} - {b"\xff<|end|>"})
    top = max((int(n) for ids in _TOKEN_IDS.findall(raw) for n in re.findall(rb"[0-9]{1,9}", ids)), default=-1)
    tokens += [b"\xff<|filler %d|>" % i for i in range(len(tokens), min(top + 1, MAX_VOCAB))]

    class Bytes:
        eos_token_id, bos_token_id = EOS, None
        special_token_ids = list(range(EOS, len(tokens)))

        def __call__(self, s):
            return list(s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s)

    Bytes.tokens = tokens
    return llg.LLTokenizer(llg.TokenizerWrapper(Bytes()), n_vocab=len(tokens))


def _bytes(n: int) -> str:
    return "1 byte" if n == 1 else f"{n} bytes"


def _fail(reason: str) -> dict:
    return {"ok": False, "reason": reason}


def _one_line(message) -> str:
    return " ".join(str(message).split())[:500]


def _first_line(message) -> str:
    """llguidance's runtime errors carry a parser-state dump after the first line: keep the first."""
    return _one_line(str(message).strip().split("\n", 1)[0])


if __name__ == "__main__":
    main()
