"""JSON over HTTP to our servers: the sync and async calls classify failures alike (transient or not), name the
server, and `RetryPolicy` is the one place a call is tried again (against a local aiohttp server)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from megatron_scalerl.http_json import AsyncJsonClient, RetryPolicy, ServerError, request_json


async def _serve(statuses: list[int]) -> tuple[web.AppRunner, str, list[dict]]:
    """A server whose `/call` answers the next status of `statuses` (then 200 with the request echoed), `/slow`
    never in time, `/text` something that is not JSON."""
    seen: list[dict] = []

    async def call(request: web.Request) -> web.Response:
        seen.append({"auth": request.headers.get("Authorization"), "query": dict(request.query),
                     "body": await request.json() if request.can_read_body else None})
        status = statuses.pop(0) if statuses else 200
        return web.json_response({"echo": seen[-1]}, status=status)

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.json_response({})

    async def text(_: web.Request) -> web.Response:
        return web.Response(text="<html>")

    app = web.Application()
    app.add_routes([web.post("/call", call), web.get("/call", call), web.get("/slow", slow), web.get("/text", text)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", seen


def test_async_calls_classify_failures_and_name_the_server():
    async def main():
        runner, url, seen = await _serve([503, 429, 400])
        try:
            async with AsyncJsonClient("KEY") as client:
                errors = []
                for _ in range(3):
                    with pytest.raises(ServerError) as caught:
                        await client.request(url, "/call", {"a": 1}, query={"flag": True}, timeout_s=5)
                    errors.append(caught.value)
                answer = await client.request(url, "/call", method="GET", timeout_s=5)
                with pytest.raises(ServerError, match="timeout 0.2 s") as slow:
                    await client.request(url, "/slow", method="GET", timeout_s=0.2)
                with pytest.raises(ServerError, match="not a JSON answer") as text:
                    await client.request(url, "/text", method="GET", timeout_s=5)
            return errors, answer, slow.value, text.value, seen
        finally:
            await runner.cleanup()

    errors, answer, slow, text, seen = asyncio.run(main())
    assert [e.transient for e in errors] == [True, True, False] and slow.transient and not text.transient
    assert all("POST http://127.0.0.1:" in str(e) and "/call: HTTP" in str(e) for e in errors)
    assert seen[0] == {"auth": "Bearer KEY", "query": {"flag": "true"}, "body": {"a": 1}}
    assert answer == {"echo": {"auth": "Bearer KEY", "query": {}, "body": None}}


def test_sync_calls_classify_failures_alike():
    async def main():
        runner, url, _ = await _serve([503, 400])
        try:
            loop = asyncio.get_running_loop()
            outcomes = []
            for _ in range(3):
                try:
                    outcomes.append(await loop.run_in_executor(None, lambda: request_json(url, "/call", timeout_s=5)))
                except ServerError as exc:
                    outcomes.append(exc)
            return outcomes
        finally:
            await runner.cleanup()

    busy, bad, answer = asyncio.run(main())
    assert busy.transient and "HTTP 503" in str(busy) and not bad.transient and "HTTP 400" in str(bad)
    assert answer["echo"]["body"] is None
    with pytest.raises(ServerError, match="GET http://127.0.0.1:9/health") as refused:
        request_json("http://127.0.0.1:9", "/health", method="GET", timeout_s=2)
    assert refused.value.transient


def test_retry_policy_retries_transient_failures_only_with_backoff():
    policy = RetryPolicy(attempts=4, backoff_s=0.05, max_backoff_s=0.1)
    tries: list[float] = []

    async def flaky(n: int) -> str:
        tries.append(time.monotonic())
        if n < 3:
            raise ServerError(f"POST http://gen{n}/x: HTTP 503", transient=True)
        return "ok"

    assert asyncio.run(policy.call("sample s", flaky)) == "ok"
    assert len(tries) == 3 and tries[1] - tries[0] >= 0.05 and tries[2] - tries[1] >= 0.1

    async def refused(n: int) -> str:
        tries.append(n)
        raise ServerError("POST http://gen0/x: HTTP 400", transient=False)

    tries.clear()
    with pytest.raises(ServerError, match="HTTP 400"):
        asyncio.run(policy.call("sample s", refused))
    assert tries == [1]

    async def down(n: int) -> str:
        raise ServerError(f"POST http://gen{n % 2}/x: refused", transient=True)

    with pytest.raises(ServerError) as exhausted:
        asyncio.run(policy.call("sample s", down))
    assert str(exhausted.value) == ("sample s: no answer after 4 attempts: POST http://gen1/x: refused | "
                                    "POST http://gen0/x: refused")  # the last distinct errors, oldest first
