"""The generator fleet client: token-level samples from N vLLM servers, asyncio, failover-safe.

    async with Fleet(["http://gen0:8000", "http://gen1:8000"], api_key=KEY, on_server_back=resync) as fleet:
        sample = await fleet.generate(GenerationRequest(key="p17/3", prompt_ids=ids, max_tokens=512, seed=3))
        version = await fleet.weight_version("http://gen0:8000")    # an int; NO_VERSION: start-up weights

Each request goes to the healthy server with the fewest outstanding tokens (prompt + max_tokens of what it is
generating), through vLLM's token-in/token-out route `/inference/v1/generate` (`--tokens-only`): a `Generation`
holds the prompt and completion token ids, the generator's log-prob of every completion token (the sampler's
processed log-probs: our servers run `--logprobs-mode processed_logprobs`), the finish reason, and the policy version
of every completion token (vLLM's weight-version spans, `algo.versions.parse_version`). The trainer's weight sync
pauses the servers themselves (`weight_sync.sender`): in-flight requests freeze there and continue on the new
weights, so one sample's tokens may carry two versions.

Routes (MoE routing replay, docs/routing_replay.md "Capture"): a request with `route_layers` (the model's MoE
layers) also gets, for every position the server ran (prompt and completion tokens but the last, from
`routes_from` on), the global expert ids its router chose at each of those layers: `Generation.routes`, uint8
[positions, len(route_layers), top-k], from vLLM's `routed_experts` (servers started with `capture_routes`).
They come with the answer of the server that generated the tokens, so a sample generated again elsewhere after a
failure carries that server's routes.

Failures: a request whose server fails transiently (`http_json.ServerError.transient`: connection refused or reset,
HTTP 5xx or 429, no answer in `request_timeout_s`, or an answer that does not parse: nonsense is the server's fault)
is generated again whole on another server under the fleet's
`retry` policy (`http_json.RetryPolicy`: backoff doubling up to a cap); nothing of the failed attempt is kept, so a
sample is never stitched from two servers, and each request returns exactly one Generation. A server that fails is
marked down; a background task polls its /health, and once it answers again `on_server_back(url)` (e.g. the
orchestrator's weight sync to it) must succeed before it gets work. Once every attempt failed, on another HTTP error
(it would fail everywhere), or with no server up for `max_wait_s`, `generate` raises FleetError naming the sample
and the servers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron_scalerl.algo.versions import NO_VERSION, parse_version
from megatron_scalerl.http_json import AsyncJsonClient, RetryPolicy, ServerError

log = logging.getLogger(__name__)

# a failed sample is generated again after 0.5 s, then 1, 2, 4, 8, 10, 10 s: eight attempts in all
GENERATION_RETRY = RetryPolicy(attempts=8, backoff_s=0.5, max_backoff_s=10.0)


class FleetError(RuntimeError):
    """Generation failed on every server it was tried on; the message names the sample and the servers."""


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate. `key`: unique id of the sample (e.g. "<prompt key>/<sample index>"); lengths in
    tokens; `seed`: vLLM's per-request sampling seed (None: unseeded); `route_layers`: the decoder layers (0-based,
    model order: the MoE layers) whose routes come back, none by default; `routes_from`: the first position they
    come back for (vLLM's `routed_experts_prompt_start`: the caller has those before it, e.g. a second stage);
    `stop_token_ids`: tokens besides the model's end tokens that end the request, kept as its last token (an
    environment's stops, `tasks.environments`)."""

    key: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    route_layers: tuple[int, ...] = ()
    routes_from: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def payload(self) -> dict:
        params = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "logprobs": 0, "detokenize": False, "skip_special_tokens": False}
        if self.seed is not None:
            params["seed"] = self.seed
        if self.route_layers:
            params["routed_experts_prompt_start"] = self.routes_from
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return {"token_ids": self.prompt_ids, "sampling_params": params}


@dataclass
class Generation:
    """A generated sample. `logprobs[i]` and `versions[i]` belong to `completion_ids[i]` (the policy version that
    sampled it, `algo.versions`; NO_VERSION where the server had none); `finish_reason`: "stop" (EOS or a stop token)
    or "length"; `routes`: None unless the request asked (`route_layers`), else uint8 [len(prompt_ids) +
    len(completion_ids) - 1 - routes_from, len(route_layers), top-k]: row i holds the experts position
    routes_from + i of prompt + completion was routed to (the last token never ran)."""

    key: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    server: str
    attempts: int = 1  # servers tried until this one answered
    routes: torch.Tensor | None = None


def parse_routes(request: GenerationRequest, encoded: str | None, completion_tokens: int, server: str) -> torch.Tensor:
    """`Generation.routes` from vLLM's `routed_experts` (base64 `.npy` of [positions, decoder layers, top-k]), the
    layers `request.route_layers` kept; ValueError naming the server and the sample when they are missing or their
    shape or dtype is off."""
    where = f"{server}: sample {request.key}"
    if encoded is None:
        raise ValueError(f"{where}: no routes in the answer (start the server with capture_routes: "
                         "`scalerl serve --capture-routes`)")
    routes = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    positions = len(request.prompt_ids) + completion_tokens - 1 - request.routes_from
    if routes.ndim != 3 or routes.shape[0] != positions:
        raise ValueError(f"{where}: routes of shape {routes.shape}, expected [{positions}, layers, top-k]")
    if routes.dtype != np.uint8:
        raise ValueError(f"{where}: routes as {routes.dtype}: our batches store expert ids as uint8 (at most 256 "
                         "experts)")
    if max(request.route_layers) >= routes.shape[1]:
        raise ValueError(f"{where}: routes of {routes.shape[1]} layers, route_layers {request.route_layers}")
    return torch.from_numpy(routes[:, list(request.route_layers)].copy())


def parse_generation(request: GenerationRequest, answer: dict, server: str, attempts: int = 1) -> Generation:
    """A Generation from `/inference/v1/generate`'s JSON answer (one choice, log-probs of the sampled tokens, the
    routes when the request asked for them)."""
    choice = answer["choices"][0]
    tokens = list(choice["token_ids"] or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(tokens):
        raise ValueError(f"{server}: {len(tokens)} tokens but {len(content)} log-probs for sample {request.key}")
    versions = [NO_VERSION] * len(tokens)
    for span in choice.get("weight_versions") or []:
        versions[span["start"]:span["end"]] = [parse_version(span["version"])] * (span["end"] - span["start"])
    routes = (parse_routes(request, choice.get("routed_experts"), len(tokens), server) if request.route_layers
              else None)
    return Generation(request.key, list(request.prompt_ids), tokens, [float(e["logprob"]) for e in content],
                      versions, choice.get("finish_reason") or "stop", server, attempts, routes)


@dataclass
class _Server:
    url: str
    up: bool = True
    outstanding_tokens: int = 0  # prompt + max_tokens of the requests it is generating
    generated: int = 0  # requests it answered
    failures: int = 0


@dataclass
class Fleet:
    """Client of N vLLM servers (see the module docstring). Times in seconds."""

    urls: list[str]
    api_key: str | None = None
    request_timeout_s: float = 3600.0  # one sample, including time paused
    control_timeout_s: float = 60.0  # /health and /weight_info calls
    retry: RetryPolicy = GENERATION_RETRY
    max_wait_s: float = 600.0  # with every server down, how long a request waits for one to come back
    health_interval_s: float = 2.0
    on_server_back: Callable[[str], Awaitable[None]] | None = None
    servers: dict[str, _Server] = field(init=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("a fleet needs at least one server URL")
        self.servers = {url.rstrip("/"): _Server(url.rstrip("/")) for url in self.urls}
        self._client = AsyncJsonClient(self.api_key)
        self._changed = asyncio.Condition()
        self._watcher: asyncio.Task | None = None

    async def __aenter__(self) -> Fleet:
        await self._client.__aenter__()
        self._watcher = asyncio.create_task(self._watch_down_servers())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self._client.__aexit__(*exc)

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
        the prompt's KV prefix; else the least loaded)."""
        cost = len(request.prompt_ids) + request.max_tokens
        deadline = time.monotonic() + self.max_wait_s

        async def attempt(n: int) -> Generation:
            preferred = self.servers.get(server.rstrip("/")) if server else None
            if preferred is not None and preferred.up:
                chosen = preferred
                chosen.outstanding_tokens += cost
            else:
                chosen = await self._pick(cost, deadline)
            try:
                answer = await self._client.request(chosen.url, "/inference/v1/generate", request.payload(),
                                                    timeout_s=self.request_timeout_s)
            except ServerError as exc:
                if exc.transient:  # its server's fault: mark it down, the next attempt goes elsewhere
                    await self._mark_down(chosen, str(exc))
                raise
            finally:
                chosen.outstanding_tokens -= cost
            try:
                generation = parse_generation(request, answer, chosen.url, attempts=n)
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:  # nonsense: its server's fault
                reason = f"{chosen.url}: a malformed answer for sample {request.key} ({type(exc).__name__}: {exc})"
                await self._mark_down(chosen, reason)
                raise ServerError(reason, transient=True) from None
            chosen.generated += 1
            return generation

        try:
            return await self.retry.call(f"sample {request.key}", attempt)
        except ServerError as exc:
            raise FleetError(str(exc)) from None

    # -- health, versions --------------------------------------------------------------------------------------------

    async def _watch_down_servers(self) -> None:
        """Every `health_interval_s`: a down server that answers /health again gets `on_server_back` (the current
        weights), then work again."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            for server in [s for s in self.servers.values() if not s.up]:
                try:
                    await self._client.request(server.url, "/health", method="GET", timeout_s=self.control_timeout_s)
                    if self.on_server_back is not None:
                        await self.on_server_back(server.url)
                except Exception as exc:  # noqa: BLE001 - still down (or its resync failed): try again later
                    log.info("generator %s not back yet: %s", server.url, exc)
                    continue
                async with self._changed:
                    server.up = True
                    self._changed.notify_all()
                log.warning("generator %s is back", server.url)

    async def weight_version(self, url: str) -> int:
        """The policy version server `url` serves (its /weight_info, `algo.versions.parse_version`); NO_VERSION
        while it serves its start-up weights or when it does not answer. FleetError when it refuses the call."""
        try:
            answer = await self._client.request(url, "/weight_info", method="GET", timeout_s=self.control_timeout_s)
        except ServerError as exc:
            if exc.transient:
                return NO_VERSION
            raise FleetError(str(exc)) from None
        return parse_version((answer or {}).get("weight_version"))

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per server: up, outstanding tokens, requests answered, failures."""
        return {s.url: {"up": s.up, "outstanding_tokens": s.outstanding_tokens, "generated": s.generated,
                        "failures": s.failures} for s in self.servers.values()}
