"""The OpenAI wire format for `llamacli serve`: a request body read into a Job (checked field by field, each
mistake an ApiError in OpenAI's error shape), and a finished or streaming Completion written back as the
JSON objects the `openai` client reads. No HTTP here, and no model work: app.py does both."""

from __future__ import annotations

import inspect
import numbers
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..chat.reasoning import parse_effort
from ..engine.scheduler import SchedulerBusy, SchedulerClosed
from ..engine.tokens import check_cache_salt
from ..errors import BadInputError, ContextOverflowError, LlamacliError
from ..sampling.params import SamplingParams, is_finite_real
from ..textio import brief
from ..tokenizer.tokenizer import TooManyTokens
from . import tool_api

MAX_STOP = 16  # OpenAI takes 4; llama-server takes more
MAX_TOP_LOGPROBS = 20  # as OpenAI


class ApiError(Exception):
    """A request the server refuses, as OpenAI reports it: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def api_error(exc: BaseException) -> ApiError:
    """Any failure during a request as an ApiError: bad input is the client's (400), the rest the server's
    (500, with the library's one-line message: never a traceback)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return ApiError(str(exc), 400, "messages", "context_length_exceeded")
    if isinstance(exc, (SchedulerBusy, SchedulerClosed)):
        return ApiError(str(exc), 503, kind="server_error", code="overloaded")
    if isinstance(exc, BadInputError):
        return ApiError(str(exc), 400, getattr(exc, "param", None))
    if isinstance(exc, LlamacliError):
        return ApiError(str(exc), 500, kind="server_error")
    return ApiError(f"internal error ({type(exc).__name__})", 500, kind="server_error")


@dataclass
class Job:
    """One request, checked: what Model.run needs, and how to answer."""

    chat: bool
    ids: list[int]
    max_tokens: int
    stop: list[str]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the counts
    logprobs: int | None = None  # None: none; N: the chosen token's and N alternatives
    constraint: Any = None
    echo_prompt: str = ""
    tools: Any = None  # a tool_api.ToolJob: the reply is read for tool calls
    ignore_eos: bool = False  # llama-server's: the end-of-generation ids masked out, the reply runs to max_tokens
    speculative: Any = None  # engine.speculative.SpecSettings where the request sets its own draft bounds
    # vLLM's: K/V reused only from requests of the same salt (never logged or echoed: not in the repr either)
    cache_salt: str | None = field(default=None, repr=False)
    id: str = field(default_factory=lambda: "")
    created: int = field(default_factory=lambda: int(time.time()))

    def run_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for Model.run; logprobs and constraint only when asked for, so that a build
        without them still serves everything else."""
        kw: dict[str, Any] = {"max_tokens": self.max_tokens, "stop": self.stop, "params": self.params}
        if self.logprobs is not None:
            kw["logprobs"] = self.logprobs
        if self.constraint is not None:
            kw["constraint"] = self.constraint
        if self.tools is not None:
            kw.update(self.tools.run_kwargs())
        if self.ignore_eos:
            kw["ignore_eos"] = True
        if self.speculative is not None:
            kw["speculative"] = self.speculative
        if self.cache_salt is not None:
            kw["cache_salt"] = self.cache_salt
        return kw


# -- reading a request -------------------------------------------------------------------------------------


def read_job(model, body: Any, chat: bool) -> Job:
    """A /v1/chat/completions or /v1/completions body as a Job, or an ApiError naming the field."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    n = _int(body, "n", 1)
    if n != 1:
        raise ApiError("only n = 1 is supported (one model, one answer per request)", param="n")
    tools = tool_api.read(body) if chat else None
    ids = _ids(model, body, chat, tools)
    job = Job(chat=chat, ids=ids, max_tokens=_max_tokens(model, body), stop=_stop(body), params=_params(body),
              stream=_bool(body, "stream", False), logprobs=_logprobs(body, chat),
              ignore_eos=_bool(body, "ignore_eos", False), speculative=_speculative(model, body),
              cache_salt=_cache_salt(body))
    job.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise ApiError("stream_options must be an object", param="stream_options")
        job.include_usage = _bool(options, "include_usage", False)
    job.constraint = _constraint(model, body.get("response_format"))
    job.tools = tool_api.job(model, tools, ids)
    if job.tools is not None and job.tools.constraint is not None:
        if job.constraint is not None:
            raise ApiError("response_format cannot be combined with tools (unless tool_choice is none)",
                           param="response_format")
        job.constraint = job.tools.constraint
    if job.logprobs is not None or job.constraint is not None or job.cache_salt is not None:
        _check_run_takes(model, job)
    return job


def chat_prompt_ids(model, body: Any) -> list[int]:
    """The token ids of a chat body's prompt (its messages and tools rendered), as read_job makes them, without
    the rest of a job (for counting them)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return _ids(model, body, True, tool_api.read(body))


def _ids(model, body: dict, chat: bool, tools: tool_api.ToolRequest | None) -> list[int]:
    # A prompt that cannot fit is refused before it is tokenized whole: from its length, or partway through
    # (Tokenizer.encode's limit), so that a huge one costs a context's worth of work, not its own size's.
    limit = model.ctx - 1
    try:
        ids = _chat_ids(model, body, limit, tools) if chat else _prompt_ids(model, body, limit)
    except TooManyTokens as exc:
        raise ApiError(f"the prompt has more than {limit:,} tokens (at least {exc.at_least:,}), the context holds "
                       f"{model.ctx}", param="messages" if chat else "prompt", code="context_length_exceeded") from None
    if len(ids) >= model.ctx:
        raise ApiError(f"the prompt has {len(ids)} tokens, the context holds {model.ctx}",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    return ids


def _chat_ids(model, body: dict, limit: int, tools: tool_api.ToolRequest | None = None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    think = None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ApiError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        think = _bool(kwargs, "enable_thinking", None)
        think = _effort(kwargs, "chat_template_kwargs.reasoning_effort", think)
    think = _effort(body, "reasoning_effort", think)  # OpenAI's field, over the template's keyword
    clean, tool_entries = tool_api.template_input(model, clean, tools)
    return model.chat_ids(clean, think=think, limit=limit, tools=tool_entries)


def _effort(body: dict, param: str, think: bool | str | None) -> bool | str | None:
    """A reasoning effort (OpenAI's reasoning_effort, or the template keyword as llama-server takes it), read
    as the CLI reads --reasoning-effort (reasoning.parse_effort): 'low', 'medium' or 'high' reaches a template
    that reads it (gpt-oss) and turns thinking on elsewhere; OpenAI's 'minimal' is 'low'; 'none' is
    enable_thinking false (gpt-oss: low). Absent: `think` as it was."""
    value = body.get(param.rsplit(".", 1)[-1])
    if value is None:
        return think
    try:
        return parse_effort(value)
    except ValueError as exc:
        raise ApiError(f"{param} {exc}", param=param) from None


def _message(m: Any, i: int) -> dict[str, str]:
    """One message as the template takes it: a role and text content (text parts joined; images refused)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(f"{where} must be an object with a role", param=where)
    content = m.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"{where}: only text content parts are supported", param=where)
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError(f"{where}.content must be a string or a list of text parts", param=where)
    out = {"role": m["role"], "content": content}
    if isinstance(m.get("reasoning_content"), str):
        out["reasoning_content"] = m["reasoning_content"]
    out.update(tool_api.message_fields(m, where))  # tool_calls, tool_call_id, name
    return out


def _prompt_ids(model, body: dict, limit: int) -> list[int]:
    """A completion prompt: a string, a list holding one string, or token ids (as OpenAI takes them); more
    than `limit` ids is TooManyTokens."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("prompt is empty", param="prompt")
        return model.tokenize(prompt, limit=limit)
    if isinstance(prompt, list) and len(prompt) > limit:
        raise TooManyTokens(limit, len(prompt))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        vocab = model.cfg.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ApiError(f"prompt token ids must lie in 0..{vocab - 1}", param="prompt")
        return list(prompt)
    raise ApiError("prompt must be a non-empty string or a list of token ids", param="prompt")


def _max_tokens(model, body: dict) -> int:
    value = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if value is None:
        value, name = body.get("max_tokens"), "max_tokens"
    if value is None or value == -1:  # -1: llama-server's "until the context is full"
        return model.ctx
    if not _is_int(value) or value < 0:
        raise ApiError(f"{name} must be an integer >= 0, got {value!r}", param=name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
        raise ApiError(f"stop must be a string or a list of at most {MAX_STOP} strings", param="stop")
    return [s for s in stop if s]


def _params(body: dict) -> SamplingParams:
    """The sampling fields over llamacli's defaults (llama.cpp's); SamplingParams.validate says what is wrong."""
    fields = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty"):
        if body.get(name) is not None:
            fields[name] = _number(body, name)
    for name in ("top_k", "seed", "repeat_last_n"):
        if body.get(name) is not None:
            fields[name] = _int(body, name, None)
    if "top_k" in fields and fields["top_k"] == -1:
        fields["top_k"] = 0  # llama-server's "off"
    try:
        return SamplingParams(**fields).validate()
    except BadInputError as exc:
        raise ApiError(str(exc)) from None


def _speculative(model, body: dict) -> Any:
    """llama-server's "speculative.n_max" and "speculative.n_min" (flat keys): this request's draft bounds over
    the server's speculative settings (--spec-type, -md); None where it sets neither (the server's stand). n_max 0
    turns speculation off for the request."""
    from ..engine.speculative import MAX_DRAFT

    limits = {name: _int(body, f"speculative.{name}", None) for name in ("n_max", "n_min")}
    if all(v is None for v in limits.values()):
        return None
    for name, v in limits.items():
        if v is not None and not 0 <= v <= MAX_DRAFT:
            raise ApiError(f"speculative.{name} must be an integer from 0 to {MAX_DRAFT}, got {v}",
                           param=f"speculative.{name}")
    base = model.speculative
    n_max = base.draft_max if limits["n_max"] is None else limits["n_max"]
    if limits["n_min"] is not None and limits["n_min"] > n_max:
        raise ApiError(f"speculative.n_min ({limits['n_min']}) must not exceed speculative.n_max ({n_max})",
                       param="speculative.n_min")
    return base.with_limits(draft_max=limits["n_max"], draft_min=limits["n_min"])


def _cache_salt(body: dict) -> str | None:
    """vLLM's "cache_salt" (also the Responses and Messages bodies'): a string of 1 to MAX_CACHE_SALT characters, or
    None (absent or null: unsalted). The error never quotes it."""
    try:
        return check_cache_salt(body.get("cache_salt"))
    except BadInputError as exc:
        raise ApiError(str(exc), param="cache_salt") from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: logprobs true, top_logprobs N alternatives. Completions: logprobs N (0 = the chosen token only)."""
    if chat:
        if not _bool(body, "logprobs", False):
            if body.get("top_logprobs") is not None:
                raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        n, name = _int(body, "top_logprobs", 0), "top_logprobs"
    else:
        n, name = body.get("logprobs"), "logprobs"
        if n is None:
            return None
        n = _int(body, "logprobs", 0)
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ApiError(f"{name} must lie in 0..{MAX_TOP_LOGPROBS}, got {n}", param=name)
    return n


def _constraint(model, fmt: Any):
    """response_format as a constraint from llamacli.sampling.structured; text (or nothing) is none."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError("response_format must be an object with a type", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise ApiError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                       param="response_format")
    try:
        from ..sampling import structured
    except ImportError:
        raise ApiError("structured output (response_format) is not available in this build",
                       param="response_format") from None
    try:
        if kind == "json_object":
            return structured.json_object_constraint(model)
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ApiError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return structured.json_schema_constraint(model, schema)
    except LlamacliError as exc:
        raise ApiError(str(exc), param="response_format") from None


def _check_run_takes(model, job: Job) -> None:
    """Refuse logprobs / response_format / cache_salt up front when this build's Model.run cannot do them."""
    accepted = inspect.signature(model.run).parameters
    for name, value, param in (("logprobs", job.logprobs, "logprobs"), ("constraint", job.constraint, "response_format"),
                               ("cache_salt", job.cache_salt, "cache_salt")):
        if value is not None and name not in accepted:
            raise ApiError(f"{param} is not available in this build", param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _int(body: dict, name: str, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise ApiError(f"{name} must be an integer, got {brief(v)}", param=name)
    return v


def _number(body: dict, name: str) -> float:
    v = body.get(name)
    if not is_finite_real(v):  # (an integer of hundreds of digits too: no float holds it)
        raise ApiError(f"{name} must be a finite number, got {brief(v)}", param=name)
    return float(v)


def _bool(body: dict, name: str, default: Any) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{name} must be true or false, got {v!r}", param=name)
    return v


# -- writing the answer ------------------------------------------------------------------------------------


def model_entry(name: str, model) -> dict[str, Any]:
    """The model as GET /v1/models lists it: OpenAI's fields, and its context length under the names clients look
    for: `max_model_len` (vLLM's) and `context_length` (OpenRouter's, LM Studio's), the context this server
    runs with (--ctx: what a prompt plus its reply must fit); `meta` as llama-server reports it (`n_ctx_train`:
    the context the model was trained for; `n_vocab`, `n_embd`, `n_params`, `size` in bytes of its tensors),
    with `n_ctx` beside it."""
    tensors = model.gguf.tensors.values()
    meta = {"n_ctx": model.ctx, "n_ctx_train": model.cfg.context_length, "n_vocab": model.cfg.vocab_size,
            "n_embd": model.cfg.n_embd, "n_params": sum(t.n_elements for t in tensors),
            "size": sum(t.n_bytes for t in tensors)}
    return {"id": name, "object": "model", "created": 0, "owned_by": "llamacli", "max_model_len": model.ctx,
            "context_length": model.ctx, "meta": meta}



def finish_reason(c) -> str:
    """OpenAI's two: "length" when -n or the context ran out, "stop" otherwise (end of text, a stop string)."""
    return "length" if c.finish_reason == "length" else "stop"


def usage(c) -> dict[str, Any]:
    """The counts; the prompt's tokens whose K/V were cached already (its slot's, or the prefix cache's) as
    OpenAI reports them, prompt_tokens_details.cached_tokens."""
    prompt, completion = len(c.prompt_tokens), len(c.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(c)}}


def cached_tokens(c) -> int:
    """The prompt tokens of completion `c` that were not prefilled (0 before its prompt's step ran)."""
    return max(0, min(len(c.prompt_tokens), c.timings.cached_tokens))


def chat_logprobs(entries: list[dict]) -> dict[str, Any]:
    """Completion.logprobs entries in the chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def one(e: dict) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode("utf-8", "replace"))}

    return {"content": [{**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs", [])]} for e in entries]}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: parallel lists of tokens, their logprobs, alternatives and text offsets."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])} for e in entries],
        "text_offset": offsets,
    }


def response(job: Job, c, model_name: str) -> dict[str, Any]:
    """The whole answer of a non-streamed request."""
    entries = getattr(c, "logprobs", None) if job.logprobs is not None else None
    if job.chat:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        if c.reasoning:
            message["reasoning_content"] = c.reasoning
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason(c),
                                  "logprobs": chat_logprobs(entries) if entries is not None else None}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": c.text, "finish_reason": finish_reason(c),
                  "logprobs": completion_logprobs(entries) if entries is not None else None}
        kind = "text_completion"
    return {"id": job.id, "object": kind, "created": job.created, "model": model_name, "choices": [choice],
            "usage": usage(c)}


def chunk(job: Job, model_name: str, *, content: str = "", reasoning: str = "", role: bool = False,
          entries: list[dict] | None = None, finish: str | None = None, text_offset: int = 0,
          tool_calls: list[dict] | None = None) -> dict[str, Any]:
    """One streamed chunk (`data: {...}`): the new text, and the finish reason on the last one."""
    if job.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if content:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish,
                                  "logprobs": chat_logprobs(entries) if entries else None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": content, "finish_reason": finish,
                  "logprobs": completion_logprobs(entries, text_offset) if entries else None}
        kind = "text_completion"
    return {"id": job.id, "object": kind, "created": job.created, "model": model_name, "choices": [choice]}


def usage_chunk(job: Job, c, model_name: str) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage is set: no choices, the counts."""
    kind = "chat.completion.chunk" if job.chat else "text_completion"
    return {"id": job.id, "object": kind, "created": job.created, "model": model_name, "choices": [],
            "usage": usage(c)}
