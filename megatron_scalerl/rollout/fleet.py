"""The generator fleet client: token-level samples from N vLLM servers, asyncio, failover-safe.

    async with Fleet(["http://gen0:8000", "http://gen1:8000"], api_key=KEY, on_server_back=resync) as fleet:
        sample = await fleet.generate(GenerationRequest(key="p17/3", prompt_ids=ids, max_tokens=512, seed=3))
        async with fleet.paused():      # pause(keep) on every server: in-flight samples freeze with their KV cache
            push_weights(...)           # the weight update; in-flight samples then continue on the new weights

Each request goes to the healthy server with the fewest outstanding tokens (prompt + max_tokens of what it is
generating), through vLLM's token-in/token-out route `/inference/v1/generate` (`--tokens-only`): a `Generation`
holds the prompt and completion token ids, the generator's log-prob of every completion token (the sampler's
processed log-probs: our servers run `--logprobs-mode processed_logprobs`), the finish reason, and the weight version
of every completion token (vLLM's weight-version spans).

Failures: a request whose server fails (connection refused or reset, HTTP 5xx, no answer in `request_timeout_s`) is
generated again whole on another server after a backoff (`backoff_s`, doubling up to `max_backoff_s`); nothing of the
failed attempt is kept, so a sample is never stitched from two servers, and each request returns exactly one
Generation. A server that fails is marked down; a background task polls its /health, and once it answers again
`on_server_back(url)` (e.g. the orchestrator's weight sync to it) must succeed before it gets work. After
`max_attempts` failed attempts, or with no server up for `max_wait_s`, `generate` raises FleetError naming the
sample and the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


# vLLM's HTTP server (uvicorn) closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). A client that keeps
# idle connections longer (aiohttp's default is 15 s) sends its next request on a socket the server has just closed
# and gets ServerDisconnectedError from a healthy server, e.g. the first request after a weight-sync pause.
IDLE_CONNECTION_S = 2.0


def http_session(api_key: str | None) -> aiohttp.ClientSession:
    """A client session for vLLM's (or any uvicorn) server: unbounded connections, idle ones dropped after
    `IDLE_CONNECTION_S` seconds, the bearer token when there is one."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(headers=headers,
                                 connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S))


class FleetError(RuntimeError):
    """Generation failed on every server it was tried on; the message names the sample and the servers."""


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate. `key`: unique id of the sample (e.g. "<prompt key>/<sample index>"); lengths in
    tokens; `seed`: vLLM's per-request sampling seed (None: unseeded)."""

    key: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def payload(self) -> dict:
        params = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "logprobs": 0, "detokenize": False, "skip_special_tokens": False}
        if self.seed is not None:
            params["seed"] = self.seed
        return {"token_ids": self.prompt_ids, "sampling_params": params}


@dataclass
class Generation:
    """A generated sample. `logprobs[i]` and `versions[i]` belong to `completion_ids[i]` (the weight version that
    sampled it; None where the server had none); `finish_reason`: "stop" (EOS or a stop token) or "length"."""

    key: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[str | None]
    finish_reason: str
    server: str
    attempts: int = 1  # servers tried until this one answered


def parse_generation(request: GenerationRequest, answer: dict, server: str) -> Generation:
    """A Generation from `/inference/v1/generate`'s JSON answer (one choice, log-probs of the sampled tokens)."""
    choice = answer["choices"][0]
    tokens = list(choice["token_ids"] or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(tokens):
        raise ValueError(f"{server}: {len(tokens)} tokens but {len(content)} log-probs for sample {request.key}")
    versions: list[str | None] = [None] * len(tokens)
    for span in choice.get("weight_versions") or []:
        versions[span["start"]:span["end"]] = [span["version"]] * (span["end"] - span["start"])
    return Generation(request.key, list(request.prompt_ids), tokens, [float(e["logprob"]) for e in content],
                      versions, choice.get("finish_reason") or "stop", server)


@dataclass
class _Server:
    url: str
    up: bool = True
    outstanding_tokens: int = 0  # prompt + max_tokens of the requests it is generating
    generated: int = 0  # requests it answered
    failures: int = 0


class _RetryElsewhere(Exception):
    """This attempt failed because of its server; try another."""


@dataclass
class Fleet:
    """Client of N vLLM servers (see the module docstring). Times in seconds."""

    urls: list[str]
    api_key: str | None = None
    request_timeout_s: float = 3600.0  # one sample, including time paused
    control_timeout_s: float = 60.0  # pause / resume / health calls
    max_attempts: int = 8
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_wait_s: float = 600.0  # with every server down, how long a request waits for one to come back
    health_interval_s: float = 2.0
    on_server_back: Callable[[str], Awaitable[None]] | None = None
    servers: dict[str, _Server] = field(init=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("a fleet needs at least one server URL")
        self.servers = {url.rstrip("/"): _Server(url.rstrip("/")) for url in self.urls}
        self._session: aiohttp.ClientSession | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._changed = asyncio.Condition()
        self._watcher: asyncio.Task | None = None

    async def __aenter__(self) -> Fleet:
        self._session = http_session(self.api_key)
        self._watcher = asyncio.create_task(self._watch_down_servers())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._session is not None:
            await self._session.close()

    # -- HTTP --------------------------------------------------------------------------------------------------------

    async def _post(self, url: str, path: str, body: Any = None, *, timeout_s: float, method: str = "POST",
                    **query: Any) -> Any:
        """One call to one server; `_RetryElsewhere` on transport errors and HTTP 5xx, FleetError on other HTTP
        errors (a bad request fails everywhere)."""
        assert self._session is not None, "use `async with Fleet(...)`"
        params = {k: str(v).lower() if isinstance(v, bool) else v for k, v in query.items()}
        try:
            async with self._session.request(method, url + path, json=body, params=params,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                text = await reply.text()
                if reply.status >= 500:
                    raise _RetryElsewhere(f"{url}{path}: HTTP {reply.status}: {text[:500]}")
                if reply.status >= 400:
                    raise FleetError(f"{url}{path}: HTTP {reply.status}: {text[:500]}")
                return await reply.json(content_type=None) if text else None
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            raise _RetryElsewhere(f"{url}{path}: {type(exc).__name__}: {exc or 'timeout'}") from None

    # -- generation --------------------------------------------------------------------------------------------------

    async def _pick(self, cost: int, deadline: float) -> _Server:
        """The up server with the fewest outstanding tokens (charged `cost` tokens now); waits while none is up."""
        async with self._changed:
            while True:
                up = [s for s in self.servers.values() if s.up]
                if up:
                    server = min(up, key=lambda s: s.outstanding_tokens)
                    server.outstanding_tokens += cost
                    return server
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FleetError(f"no server of {sorted(self.servers)} came back within {self.max_wait_s:g} s")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)

    async def _mark_down(self, server: _Server, reason: str) -> None:
        async with self._changed:
            if server.up:
                log.warning("generator %s is down: %s", server.url, reason)
            server.up = False
            server.failures += 1

    async def generate(self, request: GenerationRequest, *, server: str | None = None) -> Generation:
        """One sample, whole, from one server (`server`: prefer this one while it is up, e.g. the server that holds
        the prompt's KV prefix; else the least loaded). Waits while the fleet is paused."""
        cost = len(request.prompt_ids) + request.max_tokens
        errors: list[str] = []
        delay = self.backoff_s
        deadline = time.monotonic() + self.max_wait_s
        for attempt in range(1, self.max_attempts + 1):
            await self._running.wait()
            preferred = self.servers.get(server.rstrip("/")) if server else None
            if preferred is not None and preferred.up:
                chosen = preferred
                chosen.outstanding_tokens += cost
            else:
                chosen = await self._pick(cost, deadline)
            try:
                answer = await self._post(chosen.url, "/inference/v1/generate", request.payload(),
                                          timeout_s=self.request_timeout_s)
                generation = parse_generation(request, answer, chosen.url)
                generation.attempts = attempt
                chosen.generated += 1
                return generation
            except _RetryElsewhere as exc:
                errors.append(str(exc))
                await self._mark_down(chosen, str(exc))
            finally:
                chosen.outstanding_tokens -= cost
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.max_backoff_s)
        raise FleetError(f"sample {request.key}: failed on {self.max_attempts} attempts: " + " | ".join(errors[-3:]))

    # -- pause / resume, health --------------------------------------------------------------------------------------

    async def _on_every_up_server(self, path: str, **query: Any) -> None:
        servers = [s for s in self.servers.values() if s.up]
        results = await asyncio.gather(*(self._post(s.url, path, timeout_s=self.control_timeout_s, **query)
                                          for s in servers), return_exceptions=True)
        for server, result in zip(servers, results, strict=True):
            if isinstance(result, _RetryElsewhere):
                await self._mark_down(server, str(result))
            elif isinstance(result, BaseException):
                raise result

    async def pause(self) -> None:
        """Freeze generation on every up server, keeping in-flight requests and their KV cache (`/pause?mode=keep`);
        new requests wait here until `resume`."""
        self._running.clear()
        await self._on_every_up_server("/pause", mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self._on_every_up_server("/resume")
        self._running.set()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """`pause()`, the body (a weight update), then `resume()` even when the body fails."""
        await self.pause()
        try:
            yield
        finally:
            await self.resume()

    async def _watch_down_servers(self) -> None:
        """Every `health_interval_s`: a down server that answers /health again gets `on_server_back` (the current
        weights), then, if the fleet is not paused, work again."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            for server in [s for s in self.servers.values() if not s.up]:
                try:
                    await self._post(server.url, "/health", method="GET", timeout_s=self.control_timeout_s)
                    if self.on_server_back is not None:
                        await self.on_server_back(server.url)
                    if not self._running.is_set():  # paused meanwhile: it joins frozen, like the others
                        await self._post(server.url, "/pause", timeout_s=self.control_timeout_s, mode="keep",
                                         clear_cache=False)
                except Exception as exc:  # noqa: BLE001 - still down (or its resync failed): try again later
                    log.info("generator %s not back yet: %s", server.url, exc)
                    continue
                async with self._changed:
                    server.up = True
                    self._changed.notify_all()
                log.warning("generator %s is back", server.url)

    async def weight_version(self, url: str) -> int | None:
        """The policy version server `url` serves: its /weight_info as an int (the trainer tags each update with its
        step); None while it serves its start-up weights (vLLM's "default") or when it does not answer."""
        try:
            answer = await self._post(url.rstrip("/"), "/weight_info", method="GET", timeout_s=self.control_timeout_s)
        except _RetryElsewhere:
            return None
        version = str((answer or {}).get("weight_version"))
        return int(version) if version.isdigit() else None

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per server: up, outstanding tokens, requests answered, failures."""
        return {s.url: {"up": s.up, "outstanding_tokens": s.outstanding_tokens, "generated": s.generated,
                        "failures": s.failures} for s in self.servers.values()}
