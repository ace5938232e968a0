"""The HTTP side: Starlette routes that validate, submit to the engine and stream events back.

The engine thread hands each event to the request's asyncio queue through
`loop.call_soon_threadsafe`; a request whose client goes away (a closed stream, or a
disconnect while a plain request waits) is cancelled, and the engine drops it before its next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..generation.tokenizer import GGUFTokenizer
from . import openai_api as api
from .engine import DoneEvent, Engine, ErrorEvent, TokenEvent
from .text import ReplyText


@dataclass
class ServerState:
    engine: Engine
    tok: GGUFTokenizer
    model_id: str
    max_model_len: int


@dataclass
class Delta:
    """What one engine event adds to a reply: text to show, the token's event, or the end."""

    text: str = ""
    token: TokenEvent | None = None
    finish: str | None = None


def build_app(state: ServerState) -> Starlette:
    routes = [Route("/v1/models", partial(models, state=state), methods=["GET"]),
              Route("/v1/completions", partial(generate, state=state, make_job=api.completion_job), methods=["POST"]),
              Route("/v1/chat/completions", partial(generate, state=state, make_job=api.chat_job), methods=["POST"]),
              Route("/health", partial(health, state=state), methods=["GET"]),
              Route("/metrics", partial(metrics, state=state), methods=["GET"])]
    handlers = {api.ApiError: api_error, HTTPException: http_error, Exception: internal_error}
    return Starlette(routes=routes, exception_handlers=handlers)


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
async def models(_request: Request, state: ServerState) -> Response:
    card = {"id": state.model_id, "object": "model", "created": 0, "owned_by": "moestream",
            "max_model_len": state.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


async def health(_request: Request, state: ServerState) -> Response:
    if state.engine.alive:
        return JSONResponse({"status": "ok"})
    reason = state.engine.failure or "the engine stopped"
    return JSONResponse(api.error_body(reason, "server_error"), status_code=503)


async def metrics(_request: Request, state: ServerState) -> Response:
    m = state.engine.metrics
    return Response(m.exposition(), media_type=m.content_type)


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
    job = make_job(body, state.tok, state.model_id, state.max_model_len)
    if not state.engine.alive:
        raise api.ApiError(503, state.engine.failure or "the engine stopped", kind="server_error")
    if job.stream:
        return StreamingResponse(sse(state, job), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    return await collect(request, state, job)


async def deltas(state: ServerState, job: api.Job) -> AsyncIterator[Delta]:
    """Submit `job` and yield what each engine event adds; the request is cancelled when the
    consumer stops early (client gone) or a stop string ends the reply."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    seq = state.engine.submit(job.req, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    text = ReplyText(state.tok.decode, job.stops, lstrip=job.kind == "chat" and state.tok.space_prefix)
    try:
        while True:
            ev = await events.get()
            if isinstance(ev, TokenEvent):
                piece = text.add(ev.token)
                yield Delta(piece, ev, "stop" if text.stopped else None)
                if text.stopped:
                    return
            elif isinstance(ev, DoneEvent):
                yield Delta(text.finish(), None, "stop" if ev.finish == "cancelled" else ev.finish)
                return
            else:
                assert isinstance(ev, ErrorEvent)
                raise api.ApiError(500, ev.message, kind="server_error")
    finally:
        seq.cancel()  # a no-op for a finished sequence


async def collect(request: Request, state: ServerState, job: api.Job) -> Response:
    """A whole reply as one JSON object; a client that disconnects first cancels it."""
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        reply = asyncio.ensure_future(gather(state, job))
        await asyncio.wait({gone, reply}, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()  # closes the generator in gather: the sequence is cancelled
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        return JSONResponse(reply.result())
    finally:
        gone.cancel()


async def gather(state: ServerState, job: api.Job) -> dict:
    parts, tokens, finish = [], [], None
    gen = deltas(state, job)
    try:
        async for d in gen:
            parts.append(d.text)
            tokens += [d.token] if d.token is not None else []
            finish = d.finish or finish
    finally:
        await gen.aclose()
    lp = api.logprobs_json(job, tokens, partial(token_text, state.tok))
    choice = api.choice(job, "".join(parts), lp, finish, delta=False)
    return api.envelope(job, state.model_id, [choice], chunk=False, usage_=api.usage(job, len(tokens)))


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def sse(state: ServerState, job: api.Job) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token, the finish reason, usage if asked, then [DONE]."""
    n, first = 0, True
    gen = deltas(state, job)
    try:
        async for d in gen:
            n += d.token is not None
            lp = api.logprobs_json(job, [d.token], partial(token_text, state.tok)) if d.token is not None else None
            choice = api.choice(job, d.text, lp, d.finish, delta=True, first=first)
            first = False
            yield event(api.envelope(job, state.model_id, [choice], chunk=True))
    except api.ApiError as e:  # headers are sent: the error goes in the stream, as OpenAI does
        yield event(e.body())
    finally:
        await gen.aclose()
    if job.include_usage:
        yield event(api.envelope(job, state.model_id, [], chunk=True, usage_=api.usage(job, n)))
    yield "data: [DONE]\n\n"


def token_text(tok, token: int) -> str:
    """One token's text as a client reads it (byte-level BPE symbols decoded)."""
    return tok.decode([token], skip_special=False)


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
