"""Which request fields the server reads, and the checks that turn a bad value into a 400.

Nothing is silently ignored: a field is honoured, accepted as one of OpenAI's no-ops (it changes
nothing OpenAI itself promises, e.g. `user`), or refused with a 400 whose `param` names it.

| field | endpoints | what happens |
|---|---|---|
| model, prompt / messages, max_tokens, max_completion_tokens, stream, stream_options | as OpenAI | honoured |
| temperature, top_p, top_k, min_p, seed, stop, n, logprobs, top_logprobs | as OpenAI (+ vLLM's top_k, min_p) | honoured |
| presence_penalty, frequency_penalty, repetition_penalty, logit_bias, ignore_eos | both | honoured |
| response_format (text, json_object, json_schema) | both | honoured: constrained decoding |
| tools, tool_choice, parallel_tool_calls | chat | honoured (the template's tool format) |
| best_of | completions | honoured when equal to n; more is refused (no ranking) |
| echo, suffix | completions | refused when set |
| user, metadata, store, service_tier | both | no-ops (OpenAI bookkeeping) |
| anything else (functions, function_call, audio, ...) | | refused |
"""

from __future__ import annotations

from typing import Any

from ...generation.sampling import SamplingParams
from ..engine import random_seed

COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
          "stop", "n", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
          "ignore_eos", "response_format"}
NO_OPS = {"user", "metadata", "store", "service_tier"}
KNOWN = {"completion": COMMON | NO_OPS | {"prompt", "best_of", "echo", "suffix"},
         "chat": COMMON | NO_OPS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                   "parallel_tool_calls"}}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def refuse_unknown(body: dict, kind: str) -> None:
    for name in body:
        if name not in KNOWN[kind]:
            raise ApiError(400, f"unsupported request field {name!r} (the server never ignores a field; "
                                f"see `moestream serve --help` for the fields it honours)", name)


def number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{name} must be a number, got {v!r}", name)
    if v < low or v > high or (low_open and v == low):
        raise ApiError(400, f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {v}", name)
    return float(v)


def integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, got {v!r}", name)
    if v < low or (high is not None and v > high):
        raise ApiError(400, f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {v}", name)
    return v


def boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be a boolean, got {v!r}", name)
    return v


def stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    out = [v] if isinstance(v, str) else v
    if not isinstance(out, list) or not all(isinstance(s, str) for s in out) or len(out) > 4:
        raise ApiError(400, "stop must be a string or a list of at most 4 strings", "stop")
    return [s for s in out if s]


def logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise ApiError(400, "logit_bias must be an object {token id: bias}", "logit_bias")
    out = []
    for k, b in v.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise ApiError(400, f"logit_bias key {k!r} is not a token id", "logit_bias") from None
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"logit_bias token {t} is not in the vocabulary of {vocab_size}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise ApiError(400, f"logit_bias[{k}] must be a number in [-100, 100], got {b!r}", "logit_bias")
        out.append((t, float(b)))
    return tuple(out)


def sampling_params(body: dict, vocab_size: int) -> SamplingParams:
    top_k = integer(body, "top_k", 0, -1)
    seed = integer(body, "seed", None, -2**63)
    return SamplingParams(temperature=number(body, "temperature", 1.0, 0.0, 2.0),
                          top_k=max(0, top_k),  # -1 (vLLM's "off") and 0 both mean off
                          top_p=number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                          seed=random_seed() if seed is None else seed % 2**63,
                          min_p=number(body, "min_p", 0.0, 0.0, 1.0),
                          presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
                          frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                          repetition_penalty=number(body, "repetition_penalty", 1.0, 0.0, 2.0, low_open=True),
                          logit_bias=logit_bias(body, vocab_size))


def choices_n(body: dict, kind: str) -> int:
    n = integer(body, "n", 1, 1, 16)
    if kind == "completion":
        best_of = integer(body, "best_of", None, 1, 16)
        if best_of is not None and best_of != n:
            raise ApiError(400, f"best_of={best_of} with n={n}: only best_of equal to n is supported "
                                f"(candidates are not ranked)", "best_of")
        if body.get("echo"):
            raise ApiError(400, "echo is not supported", "echo")
        if body.get("suffix"):
            raise ApiError(400, "suffix is not supported", "suffix")
    return n
