"""OpenAI's API in our terms: request bodies validated into a `Job`, and the response shapes.

Every invalid field becomes an `ApiError` (HTTP 400, OpenAI's error shape, `param` naming the
field); nothing here touches the engine.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ...generation import grammar as gr
from ...generation.tokenizer import GGUFTokenizer, TokenizerError
from . import tools as tl
from ..engine import GenRequest, TokenEvent
from .fields import ApiError, boolean, choices_n, error_body, integer, refuse_unknown, sampling_params, stops

__all__ = ["ApiError", "error_body", "Served", "Job", "completion_job", "chat_job"]


@dataclass
class Served:
    """What request validation needs to know of the served model."""

    tok: GGUFTokenizer
    model_id: str
    limit: int  # prompt + completion tokens
    grammars: Callable[[], gr.GrammarBook]  # built on first use (one per server)


@dataclass
class Job:
    """One validated request: what to generate and how to answer."""

    kind: str  # "completion" | "chat"
    req: GenRequest
    stops: list[str]
    stream: bool
    include_usage: bool
    id: str = ""
    n: int = 1
    tool_format: str | None = None  # parse the reply's tool calls in this format
    created: int = field(default_factory=lambda: int(time.time()))


def check_model(body: dict, model_id: str) -> None:
    m = body.get("model")
    if m is not None and m != model_id:
        raise ApiError(404, f"The model {m!r} does not exist; this server serves {model_id!r}", "model",
                       "model_not_found")


def max_tokens(body: dict, prompt_len: int, limit: int, default: int | None) -> int:
    """Completion length, checked against the context: OpenAI's context_length_exceeded 400."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = integer(body, name, None, 1)
    n = asked if asked is not None else (default if default is not None else limit - prompt_len)
    if prompt_len + max(n, 1) > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{prompt_len + n} tokens ({prompt_len} in the prompt, {n} for the completion). "
                            f"Please reduce the prompt or the completion length.", name, "context_length_exceeded")
    return n


def response_grammar(body: dict, served: Served) -> str | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ApiError(400, "response_format must be an object {type: ...}", "response_format")
    return checked(served, lambda: gr.schema_of(rf), "response_format")


def checked(served: Served, make: Callable[[], str], param: str) -> str | None:
    """A grammar made and compiled against the model's vocabulary, or a 400 naming `param`."""
    try:
        g = make()
        if g:
            served.grammars().check(g)
        return g or None
    except (gr.GrammarError, tl.ToolError) as e:
        raise ApiError(400, f"{param}: {e}", param) from None


def _job(kind: str, body: dict, served: Served, prompt: list[int], default_max: int | None,
         logprobs: int | None, grammar: str | None, tool_format: str | None = None) -> Job:
    stream = boolean(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    n = choices_n(body, kind)
    req = GenRequest(prompt, max_tokens(body, len(prompt), served.limit, default_max),
                     sampling_params(body, served.tok.vocab_size), logprobs, grammar=grammar,
                     ignore_eos=boolean(body, "ignore_eos"))
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    return Job(kind, req, stops(body), stream, bool(opts.get("include_usage")), prefix + uuid.uuid4().hex, n,
               tool_format)


def choice_requests(job: Job) -> list[GenRequest]:
    """One engine request per choice: `n` choices sample with seeds seed, seed + 1, ..."""
    s = job.req.sampling
    return [dataclasses.replace(job.req, sampling=dataclasses.replace(s, seed=(s.seed + i) % 2**63))
            for i in range(job.n)]


# -- requests ----------------------------------------------------------------------------------
def completion_job(body: dict, served: Served) -> Job:
    refuse_unknown(body, "completion")
    check_model(body, served.model_id)
    prompt = completion_prompt(body.get("prompt"), served.tok)
    logprobs = integer(body, "logprobs", None, 0, 20)
    return _job("completion", body, served, prompt, 16, logprobs, response_grammar(body, served))  # 16: OpenAI's


def completion_prompt(p: Any, tok: GGUFTokenizer) -> list[int]:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        ids = tok.encode(p)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        check_ids(p, tok.vocab_size, "prompt")
        ids = list(p)
    else:
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise ApiError(400, "prompt is empty", "prompt")
    return ids


def check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"{param} token ids {bad[:5]} are not in the vocabulary of {vocab_size}", param)


def chat_job(body: dict, served: Served) -> Job:
    refuse_unknown(body, "chat")
    check_model(body, served.model_id)
    fmt, mode, tools, forced = tool_setup(body, served)
    text = render_messages(body.get("messages"), served.tok, tools if mode != "none" else None)
    logprobs = None
    if body.get("logprobs"):
        logprobs = integer(body, "top_logprobs", 0, 0, 20)
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    grammar = response_grammar(body, served)
    if forced and grammar:
        raise ApiError(400, "response_format cannot be combined with a forced tool_choice", "response_format")
    return _job("chat", body, served, served.tok.encode(text), None, logprobs, forced or grammar,
                fmt if mode != "none" else None)


def tool_setup(body: dict, served: Served) -> tuple[str | None, str, list | None, str | None]:
    """(format, mode, the OpenAI tools list for the template, forced-call grammar)."""
    raw = body.get("tools")
    if raw is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None, "none", None, None
    try:
        tools = tl.function_tools(raw)
    except tl.ToolError as e:
        raise ApiError(400, str(e), "tools") from None
    fmt = tl.detect_format(served.tok.chat_template)
    if fmt is None:
        raise ApiError(400, "tools: this model's chat template has no tool-call format (start the server with "
                            "--chat-template FILE giving one that has)", "tools")
    try:
        mode, picked = tl.chosen_tools(tools, body.get("tool_choice"))
    except tl.ToolError as e:
        raise ApiError(400, str(e), "tool_choice") from None
    parallel = boolean(body, "parallel_tool_calls", True)
    forced = (checked(served, lambda: tl.forced_grammar(fmt, picked, parallel), "tool_choice")
              if mode == "forced" else None)
    return fmt, mode, raw, forced


ROLES = ("system", "developer", "user", "assistant", "tool")


def render_messages(messages: Any, tok: GGUFTokenizer, tools: list | None = None) -> str:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    clean = [template_message(m, i) for i, m in enumerate(messages)]
    try:
        return tok.render_chat(clean, add_generation_prompt=True, tools=tools)
    except TokenizerError as e:
        raise ApiError(400, str(e), "messages") from None


def template_message(m: Any, i: int) -> dict:
    """One message as chat templates read it (HF's convention: tool-call arguments as objects)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, dict) else None
        raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    role = "system" if m["role"] == "developer" else m["role"]
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls is not None:
        out = {"role": role, "content": "" if m.get("content") is None else message_text(m["content"], i),
               "tool_calls": [history_call(c, i) for c in calls] if isinstance(calls, list) else bad_calls(i)}
    else:
        out = {"role": role, "content": message_text(m.get("content"), i)}
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id", ""))
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def bad_calls(i: int) -> list:
    raise ApiError(400, f"messages[{i}].tool_calls must be a list", "messages")


def history_call(c: Any, i: int) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise ApiError(400, f"messages[{i}].tool_calls entries must be {{id, type, function: {{name, arguments}}}}",
                       "messages")
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass  # a template prints it as it came
    return {"id": c.get("id", ""), "type": "function", "function": {"name": f["name"], "arguments": args}}


def message_text(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


# -- responses ---------------------------------------------------------------------------------
def usage(job: Job, completion_tokens: int, experts: dict | None = None, cached: int = 0) -> dict[str, Any]:
    """OpenAI's counts (cached_tokens: prompt tokens the prefix cache gave), and the `moestream`
    extension: this request's share of the expert traffic."""
    p = len(job.req.prompt) * job.n
    out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": completion_tokens,
                           "total_tokens": p + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
    if experts is not None:
        out["moestream"] = experts
    return out


def logprobs_json(job: Job, events: list[TokenEvent], token_text: Any, offset: int = 0) -> dict | None:
    """Completions: {tokens, token_logprobs, top_logprobs, text_offset}; chat: {content: [...]}.
    `text_offset`: each token's character offset in the completion text (from `offset`, the text
    of the choice's earlier chunks when streaming), as vLLM counts it without echo."""
    if job.req.logprobs is None:
        return None
    if job.kind == "chat":
        def entry(t: int, lp: float) -> dict:
            s = token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                            for e in events]}
    texts = [token_text(e.token) for e in events]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in events] if job.req.logprobs else None,
            "text_offset": offsets}


def choice(job: Job, text: str | None, logprobs: dict | None, finish: str | None, delta: bool,
           first: bool = False, index: int = 0, calls: list[tl.ToolCall] | None = None,
           call_base: int = 0) -> dict:
    """One choice of a reply (`delta`: a streamed chunk's; `call_base`: calls sent in earlier chunks)."""
    if job.kind == "completion":
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if delta:
        d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            d["content"] = text
        if calls:
            d["tool_calls"] = [c.json(call_base + i) for i, c in enumerate(calls)]
        return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
    msg: dict[str, Any] = {"role": "assistant", "content": text or ("" if not calls else None)}
    if calls:
        msg["tool_calls"] = [c.json() for c in calls]
    return {"index": index, "message": msg, "logprobs": logprobs, "finish_reason": finish}


def envelope(job: Job, model_id: str, choices: list[dict], chunk: bool, usage_: dict | None = None) -> dict:
    obj = ("text_completion" if job.kind == "completion"
           else "chat.completion.chunk" if chunk else "chat.completion")
    out = {"id": job.id, "object": obj, "created": job.created, "model": model_id, "choices": choices}
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out
