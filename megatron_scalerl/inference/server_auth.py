"""The API key on every route of our vLLM servers, loaded by vLLM itself (`--middleware`, see `vllm_server`).

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; the dev routes weight sync and the fleet use
(/pause, /resume, /update_weights, /collective_rpc, ...) stay open. This middleware asks for the same key
(`Authorization: Bearer KEY`, the key from `VLLM_API_KEY`, which vLLM reads too) on every route but /health, which
launchers and load balancers poll without credentials. Without `VLLM_API_KEY` it lets everything through.
"""

from __future__ import annotations

import hashlib
import os
import secrets

from starlette.responses import JSONResponse

OPEN_ROUTES = ("/health",)
_KEY = os.environ.get("VLLM_API_KEY") or None
_KEY_DIGEST = hashlib.sha256(_KEY.encode()).digest() if _KEY else b""


def _authorised(header: str | None) -> bool:
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(hashlib.sha256(token.encode()).digest(), _KEY_DIGEST)


async def require_api_key(request, call_next):
    """Starlette HTTP middleware: 401 for a request without the key, unless its route is open."""
    if _KEY is None or request.method == "OPTIONS" or request.url.path in OPEN_ROUTES:
        return await call_next(request)
    if not _authorised(request.headers.get("Authorization")):
        return JSONResponse({"error": "Unauthorized: this server needs its API key on every route"}, status_code=401)
    return await call_next(request)
