"""The HTTP side: Starlette routes that validate, submit to the engine and stream events back.

The engine thread hands each event to the request's asyncio queue through
`loop.call_soon_threadsafe`; a request whose client goes away (a closed stream, or a
disconnect while a plain request waits) is cancelled, and the engine drops it before its next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...generation.tokenizer import GGUFTokenizer
from . import openai_api as api
from . import tools as tl
from ..engine import DoneEvent, Engine, ErrorEvent, GenRequest, TokenEvent
from .middleware import wrap
from ..text import ReplyText


@dataclass
class ServerState:
    engine: Engine
    served: api.Served
    cors_origins: tuple[str, ...] = ()
    api_key: str | None = None
    access_log: bool = True

    @property
    def tok(self) -> GGUFTokenizer:
        return self.served.tok

    @property
    def model_id(self) -> str:
        return self.served.model_id


@dataclass
class Delta:
    """What one engine event adds to a choice: text to show, the token's event, calls, or the end."""

    text: str = ""
    token: TokenEvent | None = None
    finish: str | None = None
    calls: list[tl.ToolCall] = field(default_factory=list)
    experts: dict | None = None  # with the finish: this choice's expert traffic
    cached: int = 0  # with the finish: prompt tokens the prefix cache gave
    index: int = 0


def build_app(state: ServerState) -> Starlette:
    routes = [Route("/v1/models", partial(models, state=state), methods=["GET"]),
              Route("/v1/models/{model_id:path}", partial(model_card, state=state), methods=["GET"]),
              Route("/v1/completions", partial(generate, state=state, make_job=api.completion_job), methods=["POST"]),
              Route("/v1/chat/completions", partial(generate, state=state, make_job=api.chat_job), methods=["POST"]),
              Route("/tokenize", partial(tokenize, state=state), methods=["POST"]),
              Route("/detokenize", partial(detokenize, state=state), methods=["POST"]),
              Route("/health", partial(health, state=state), methods=["GET"]),
              Route("/metrics", partial(metrics, state=state), methods=["GET"])]
    handlers = {api.ApiError: api_error, HTTPException: http_error, Exception: internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    return wrap(app, cors_origins=state.cors_origins, api_key=state.api_key, access_log=state.access_log)


# -- errors in OpenAI's shape --------------------------------------------------------------------
async def api_error(_request: Request, e: Exception) -> Response:
    assert isinstance(e, api.ApiError)
    return JSONResponse(e.body(), status_code=e.status)


async def http_error(_request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(api.error_body(str(e.detail), kind), status_code=e.status_code)


async def internal_error(_request: Request, e: Exception) -> Response:
    return JSONResponse(api.error_body(f"internal error: {e}", "server_error"), status_code=500)


# -- plain endpoints -------------------------------------------------------------------------------
def card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": 0, "owned_by": "moestream",
            "max_model_len": state.served.limit}


async def models(_request: Request, state: ServerState) -> Response:
    return JSONResponse({"object": "list", "data": [card(state)]})


async def model_card(request: Request, state: ServerState) -> Response:
    asked = request.path_params["model_id"]
    if asked != state.model_id:
        raise api.ApiError(404, f"The model {asked!r} does not exist; this server serves {state.model_id!r}",
                           "model", "model_not_found", kind="not_found_error")
    return JSONResponse(card(state))


async def health(_request: Request, state: ServerState) -> Response:
    if not state.engine.alive:
        reason = state.engine.failure or "the engine stopped"
    elif state.engine.draining:
        reason = "the server is shutting down"
    else:
        reason = await asyncio.to_thread(state.engine.unreachable)
    if reason is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse(api.error_body(reason, "server_error"), status_code=503)


async def metrics(_request: Request, state: ServerState) -> Response:
    m = state.engine.metrics
    return Response(m.exposition(), media_type=m.content_type)


async def tokenize(request: Request, state: ServerState) -> Response:
    """vLLM's /tokenize: {prompt} or {messages} (the chat template applied) -> {tokens, count}."""
    body = await read_json(request)
    api.check_model(body, state.model_id)
    if "messages" in body:
        ids = state.tok.encode(api.render_messages(body["messages"], state.tok, body.get("tools")))
    elif isinstance(body.get("prompt"), str):
        ids = state.tok.encode(body["prompt"])
    else:
        raise api.ApiError(400, "tokenize needs prompt (a string) or messages", "prompt")
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.served.limit})


async def detokenize(request: Request, state: ServerState) -> Response:
    body = await read_json(request)
    api.check_model(body, state.model_id)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise api.ApiError(400, "detokenize needs tokens (a list of token ids)", "tokens")
    api.check_ids(ids, state.tok.vocab_size, "tokens")
    return JSONResponse({"prompt": state.tok.decode(ids)})


# -- generation ------------------------------------------------------------------------------------
async def read_json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise api.ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise api.ApiError(400, "request body must be a JSON object")
    return body


async def generate(request: Request, state: ServerState, make_job: Any) -> Response:
    body = await read_json(request)
    job = make_job(body, state.served)
    down = state.engine.source_down()
    if not state.engine.alive or state.engine.draining or down:
        reason = state.engine.failure or ("the engine stopped" if not state.engine.alive
                                          else "shutting down" if state.engine.draining else down)
        raise api.ApiError(503, reason, kind="server_error")
    if job.stream:
        return StreamingResponse(sse(state, job), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    return await collect(request, state, job)


async def deltas(state: ServerState, job: api.Job, req: GenRequest, index: int) -> AsyncIterator[Delta]:
    """Submit one choice's request and yield what each engine event adds; the request is cancelled
    when the consumer stops early (client gone), and stopped when a stop string ends the reply."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    seq = state.engine.submit(req, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    decode = partial(state.tok.decode, skip_special=job.tool_format != "harmony")  # harmony's calls are specials
    text = ReplyText(decode, job.stops, lstrip=job.kind == "chat" and state.tok.space_prefix)
    split = tl.ToolStream(job.tool_format) if job.tool_format else None
    called = False
    try:
        while True:
            ev = await events.get()
            if isinstance(ev, TokenEvent):
                piece, calls = tool_split(split, text.add(ev.token))
                called = called or bool(calls)
                yield Delta(piece, ev, None, calls, index=index)
                if text.stopped:
                    seq.stop()
                    ev = await finished(events)
            if isinstance(ev, DoneEvent):
                piece, calls = tool_split(split, text.finish(), final=True)
                called = called or bool(calls)
                reason = "tool_calls" if called else "stop" if ev.finish == "cancelled" else ev.finish
                yield Delta(piece, None, reason, calls, experts=ev.experts, cached=ev.cached_tokens, index=index)
                return
            if isinstance(ev, ErrorEvent):
                raise api.ApiError(500, ev.message, kind="server_error")
    finally:
        seq.cancel()  # a no-op for a finished sequence


async def finished(events: asyncio.Queue) -> Any:
    """After a stop string: the sequence's last event (its Done, with its expert share)."""
    while True:
        ev = await events.get()
        if not isinstance(ev, TokenEvent):
            return ev


def tool_split(split: tl.ToolStream | None, piece: str, final: bool = False) -> tuple[str, list[tl.ToolCall]]:
    if split is None:
        return piece, []
    shown, calls = split.add(piece)
    if final:
        rest, more = split.finish()
        shown, calls = shown + rest, calls + more
    return shown, calls


async def collect(request: Request, state: ServerState, job: api.Job) -> Response:
    """A whole reply as one JSON object; a client that disconnects first cancels it."""
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        reply = asyncio.ensure_future(gather(state, job))
        await asyncio.wait({gone, reply}, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()  # closes the generators in gather: the sequences are cancelled
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        return JSONResponse(reply.result())
    finally:
        gone.cancel()


async def gather_choice(state: ServerState, job: api.Job, req: GenRequest, index: int) -> tuple[dict, int, Delta]:
    parts, tokens, calls, finish, last = [], [], [], None, Delta()
    gen = deltas(state, job, req, index)
    try:
        async for d in gen:
            parts.append(d.text)
            tokens += [d.token] if d.token is not None else []
            calls += d.calls
            finish, last = d.finish or finish, d if d.finish else last
    finally:
        await gen.aclose()
    lp = api.logprobs_json(job, tokens, partial(token_text, state.tok))
    return api.choice(job, "".join(parts), lp, finish, delta=False, index=index, calls=calls), len(tokens), last


async def gather(state: ServerState, job: api.Job) -> dict:
    done = await asyncio.gather(*(gather_choice(state, job, r, i) for i, r in enumerate(api.choice_requests(job))))
    ends = [d for _, _, d in done]
    used = api.usage(job, sum(n for _, n, _ in done), sum_shares([d.experts or {} for d in ends]),
                     sum(d.cached for d in ends))
    return api.envelope(job, state.model_id, [c for c, _, _ in done], chunk=False, usage_=used)


def sum_shares(shares: list[dict]) -> dict:
    out: dict = {}
    for s in shares:
        for k, v in s.items():
            out[k] = out.get(k, 0) + v
    if "prefetch_hidden_share" in out and shares:
        out["prefetch_hidden_share"] = round(out["prefetch_hidden_share"] / len(shares), 4)
    return out


async def merged(state: ServerState, job: api.Job) -> AsyncIterator[Delta]:
    """The deltas of all `n` choices as they come (one generator per choice, read by tasks)."""
    gens = [deltas(state, job, r, i) for i, r in enumerate(api.choice_requests(job))]
    if len(gens) == 1:
        async for d in gens[0]:
            yield d
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(g: AsyncIterator[Delta]) -> None:
        try:
            async for d in g:
                await q.put(d)
            await q.put(None)
        except BaseException as e:
            await q.put(e)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        for _ in range(len(gens)):
            while (item := await q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            await g.aclose()


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def sse(state: ServerState, job: api.Job) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token, the finish reason, usage if asked, then [DONE];
    an error (the engine failed, the server shuts down) comes as an error event before [DONE]."""
    n, first, offsets, n_calls, shares, cached = 0, set(), [0] * job.n, [0] * job.n, [], 0
    gen = merged(state, job)
    try:
        async for d in gen:
            n += d.token is not None
            lp = None
            if d.token is not None and job.req.logprobs is not None:
                lp = api.logprobs_json(job, [d.token], partial(token_text, state.tok), offsets[d.index])
                offsets[d.index] += len(token_text(state.tok, d.token.token))
            if d.experts is not None:
                shares.append(d.experts)
            cached += d.cached
            if not (d.text or d.calls or d.finish or lp) and (d.index in first or job.kind != "chat"):
                continue  # text not whole yet (a UTF-8 sequence, a stop prefix); a chat's first chunk: the role
            choice = api.choice(job, d.text, lp, d.finish, delta=True, first=d.index not in first, index=d.index,
                                calls=d.calls, call_base=n_calls[d.index])
            first.add(d.index)
            n_calls[d.index] += len(d.calls)
            yield event(api.envelope(job, state.model_id, [choice], chunk=True))
    except api.ApiError as e:  # headers are sent: the error goes in the stream, as OpenAI does
        yield event(e.body())
    finally:
        await gen.aclose()
    if job.include_usage:
        yield event(api.envelope(job, state.model_id, [], chunk=True, usage_=api.usage(job, n, sum_shares(shares), cached)))
    yield "data: [DONE]\n\n"


def token_text(tok, token: int) -> str:
    """One token's text as a client reads it (byte-level BPE symbols decoded)."""
    return tok.decode([token], skip_special=False)


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
