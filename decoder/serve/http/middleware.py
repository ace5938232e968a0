"""What wraps every route: the access log, CORS and the API key (plain ASGI, outermost first).

| layer | what it does |
|---|---|
| access log | one line per request on stderr: client, method, path, status, bytes, seconds |
| CORS (`--cors-origin`) | answers preflight `OPTIONS` and adds `access-control-allow-origin` for listed origins (`*`: any) |
| API key (`--api-key`) | `/v1/*`, `/tokenize`, `/detokenize` need `Authorization: Bearer KEY` (401 otherwise, OpenAI's shape); `/health` and `/metrics` stay open for probes |
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
ASGI = Callable[[Scope, Callable, Callable], Awaitable[None]]

log = logging.getLogger("moestream.serve.access")
OPEN_PATHS = ("/health", "/metrics")


def wrap(app: ASGI, *, cors_origins: tuple[str, ...] = (), api_key: str | None = None,
         access_log: bool = True) -> ASGI:
    if api_key:
        app = ApiKey(app, api_key)
    if cors_origins:
        app = Cors(app, cors_origins)
    return AccessLog(app) if access_log else app


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def _send_json(send: Callable, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class ApiKey:
    def __init__(self, app: ASGI, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = _header(scope, b"authorization") or ""
        given = auth[7:] if auth.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.key.encode()):
            err = {"error": {"message": "missing or wrong API key (send Authorization: Bearer KEY)",
                             "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
            return await _send_json(send, 401, err, [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class Cors:
    def __init__(self, app: ASGI, origins: tuple[str, ...]):
        self.app, self.origins = app, origins

    def _allowed(self, origin: str | None) -> str | None:
        if origin is None:
            return None
        return "*" if "*" in self.origins else origin if origin in self.origins else None

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        allow = self._allowed(_header(scope, b"origin"))
        if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method"):
            if allow is None:
                return await _send_json(send, 403, {"error": {"message": "origin not allowed",
                                                               "type": "invalid_request_error",
                                                               "param": None, "code": None}})
            asked = _header(scope, b"access-control-request-headers") or "authorization, content-type"
            headers = [(b"access-control-allow-origin", allow.encode()),
                       (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                       (b"access-control-allow-headers", asked.encode()), (b"access-control-max-age", b"600"),
                       (b"vary", b"origin")]
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            return await send({"type": "http.response.body", "body": b""})

        async def send_cors(msg: dict) -> None:
            if msg["type"] == "http.response.start" and allow is not None:
                msg = {**msg, "headers": [*msg.get("headers", []), (b"access-control-allow-origin", allow.encode()),
                                          (b"vary", b"origin")]}
            await send(msg)

        return await self.app(scope, receive, send_cors)


class AccessLog:
    """`client "METHOD path" status bytes seconds`, written when the response ends."""

    def __init__(self, app: ASGI):
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, size = time.perf_counter(), [0], [0]

        async def counting(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            elif msg["type"] == "http.response.body":
                size[0] += len(msg.get("body", b""))
            await send(msg)

        try:
            await self.app(scope, receive, counting)
        finally:
            client = scope.get("client") or ("-", 0)
            log.info('%s:%s "%s %s" %s %d %.3f', client[0], client[1], scope["method"], scope["path"],
                     status[0] or "-", size[0], time.perf_counter() - t0)
