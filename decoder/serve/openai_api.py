"""OpenAI's API in our terms: request bodies validated into a `Job`, and the response shapes.

Every invalid field becomes an `ApiError` (HTTP 400, OpenAI's error shape, `param` naming the
field); nothing here touches the engine.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..generation.sampling import SamplingParams
from ..generation.tokenizer import GGUFTokenizer
from .engine import GenRequest, TokenEvent, random_seed


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Job:
    """One validated request: what to generate and how to answer."""

    kind: str  # "completion" | "chat"
    req: GenRequest
    stops: list[str]
    stream: bool
    include_usage: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


# -- field checks ------------------------------------------------------------------------------
def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{name} must be a number, got {v!r}", name)
    if v < low or v > high or (low_open and v == low):
        raise ApiError(400, f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {v}", name)
    return float(v)


def _int(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, got {v!r}", name)
    if v < low or (high is not None and v > high):
        raise ApiError(400, f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {v}", name)
    return v


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise ApiError(400, "stop must be a string or a list of at most 4 strings", "stop")
    return [s for s in stops if s]


def _unsupported(body: dict) -> None:
    if _int(body, "n", 1, 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", "echo")
    if body.get("suffix"):
        raise ApiError(400, "suffix is not supported", "suffix")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tools are not supported", "tools")


def sampling_params(body: dict) -> SamplingParams:
    top_k = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", None, -2**63)
    return SamplingParams(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                          top_k=max(0, top_k),  # -1 (vLLM's "off") and 0 both mean off
                          top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                          seed=random_seed() if seed is None else seed % 2**63,
                          min_p=_number(body, "min_p", 0.0, 0.0, 1.0))


def check_model(body: dict, model_id: str) -> None:
    m = body.get("model")
    if m is not None and m != model_id:
        raise ApiError(404, f"The model {m!r} does not exist; this server serves {model_id!r}", "model",
                       "model_not_found")


def max_tokens(body: dict, prompt_len: int, limit: int, default: int | None) -> int:
    """Completion length, checked against the context: OpenAI's context_length_exceeded 400."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = _int(body, name, None, 1)
    n = asked if asked is not None else (default if default is not None else limit - prompt_len)
    if prompt_len + max(n, 1) > limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{prompt_len + n} tokens ({prompt_len} in the prompt, {n} for the completion). "
                            f"Please reduce the prompt or the completion length.", name, "context_length_exceeded")
    return n


def _job(kind: str, body: dict, prompt: list[int], limit: int, default_max: int | None, logprobs: int | None) -> Job:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be a boolean, got {stream!r}", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    req = GenRequest(prompt, max_tokens(body, len(prompt), limit, default_max), sampling_params(body), logprobs)
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    return Job(kind, req, _stops(body), stream, bool(opts.get("include_usage")), prefix + uuid.uuid4().hex)


# -- requests ----------------------------------------------------------------------------------
def completion_job(body: dict, tok: GGUFTokenizer, model_id: str, limit: int) -> Job:
    check_model(body, model_id)
    _unsupported(body)
    prompt = completion_prompt(body.get("prompt"), tok)
    logprobs = _int(body, "logprobs", None, 0, 20)
    return _job("completion", body, prompt, limit, 16, logprobs)  # 16: OpenAI's default for completions


def completion_prompt(p: Any, tok: GGUFTokenizer) -> list[int]:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        ids = tok.encode(p)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < tok.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token ids {bad[:5]} are not in the vocabulary of {tok.vocab_size}", "prompt")
        ids = list(p)
    else:
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise ApiError(400, "prompt is empty", "prompt")
    return ids


def chat_job(body: dict, tok: GGUFTokenizer, model_id: str, limit: int) -> Job:
    check_model(body, model_id)
    _unsupported(body)
    text = render_messages(body.get("messages"), tok)
    logprobs = None
    if body.get("logprobs"):
        logprobs = _int(body, "top_logprobs", 0, 0, 20)
    elif body.get("top_logprobs") is not None:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return _job("chat", body, tok.encode(text), limit, None, logprobs)


def render_messages(messages: Any, tok: GGUFTokenizer) -> str:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role", "messages")
        clean.append({"role": m["role"], "content": message_text(m.get("content"), i)})
    from ..generation.tokenizer import TokenizerError

    try:
        return tok.render_chat(clean, add_generation_prompt=True)
    except TokenizerError as e:
        raise ApiError(400, str(e), "messages") from None


def message_text(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


# -- responses ---------------------------------------------------------------------------------
def usage(job: Job, completion_tokens: int) -> dict[str, int]:
    p = len(job.req.prompt)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def logprobs_json(job: Job, events: list[TokenEvent], token_text: Any) -> dict | None:
    """Completions: {tokens, token_logprobs, top_logprobs, text_offset}; chat: {content: [...]}."""
    if job.req.logprobs is None:
        return None
    if job.kind == "chat":
        def entry(t: int, lp: float) -> dict:
            s = token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                            for e in events]}
    return {"tokens": [token_text(e.token) for e in events], "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in events] if job.req.logprobs else None,
            "text_offset": []}


def choice(job: Job, text: str | None, logprobs: dict | None, finish: str | None, delta: bool,
           first: bool = False) -> dict:
    if job.kind == "completion":
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if delta:
        d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            d["content"] = text
        return {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text or ""}, "logprobs": logprobs,
            "finish_reason": finish}


def envelope(job: Job, model_id: str, choices: list[dict], chunk: bool, usage_: dict | None = None) -> dict:
    obj = ("text_completion" if job.kind == "completion"
           else "chat.completion.chunk" if chunk else "chat.completion")
    out = {"id": job.id, "object": obj, "created": job.created, "model": model_id, "choices": choices}
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out
