"""The API key on every route of our vLLM servers, loaded by vLLM itself (`--middleware`, see `vllm_server`).

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; the dev routes weight sync and the fleet use
(/pause, /update_weights, /init_weight_transfer_engine, /collective_rpc, ...) stay open, and any of them lets a caller
run code in the server's workers. `RequireApiKey` asks for the key (`Authorization: Bearer KEY`, the key from
`VLLM_API_KEY`, which vLLM reads too) on every request of every route, whatever its method (OPTIONS too) and whether
HTTP or WebSocket, except `GET /health`, which launchers and load balancers poll without credentials (vLLM itself
needs nothing else to come up: its readiness is that route). It is a plain ASGI middleware, not Starlette's HTTP
middleware, which never sees WebSocket connections: vLLM gives a class to `app.add_middleware`, so it wraps the
whole application (CORS included). Refused: HTTP 401 with a JSON error; a WebSocket handshake is closed before it is
accepted with code 1008 (policy violation), which the server answers as HTTP 403.

Without `VLLM_API_KEY` the import fails, and with it the server's start: a server given this middleware never runs
open. (A server meant to run open is started without it: `scalerl serve --no-api-key`.)
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any

OPEN_ROUTES = {("GET", "/health")}
KEY_ENV = "VLLM_API_KEY"
REFUSAL = "Unauthorized: this server needs its API key (Authorization: Bearer KEY) on every route but GET /health"


def _key_digest() -> bytes:
    key = os.environ.get(KEY_ENV)
    if not key:
        raise RuntimeError(f"{__name__}: {KEY_ENV} is not set: refusing to start a server whose every route would be "
                           "open (give scalerl serve --api-key-file or $SCALERL_API_KEY)")
    return hashlib.sha256(key.encode()).digest()


_KEY_DIGEST = _key_digest()  # at import, which vLLM does while it builds the app: no key, no server


def authorised(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether ASGI `headers` carry `Authorization: Bearer <the key>` (compared in constant time)."""
    header = next((value for name, value in headers if name.lower() == b"authorization"), b"")
    scheme, _, token = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(hashlib.sha256(token.strip().encode()).digest(),
                                                                 _KEY_DIGEST)


class RequireApiKey:
    """ASGI middleware: HTTP requests and WebSocket handshakes without the key are refused, except GET /health."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or (scope.get("method"), scope["path"]) in OPEN_ROUTES \
                or authorised(scope.get("headers", [])):
            await self.app(scope, receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "Unauthorized"})
        else:
            body = json.dumps({"error": REFUSAL}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"www-authenticate", b"Bearer")]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
