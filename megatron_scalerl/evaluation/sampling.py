"""Completions from any OpenAI-compatible endpoint (`POST {endpoint}/v1/completions`, text in, text out), with the
training recipe's length control: the same forced interruption of thinking, the same budgets (tokens).

    async with CompletionClient(endpoint, model, api_key=..., concurrency=32) as client:
        done = await sample_completion(client, prompt_text, key, settings)

Interruption: the flow of training (`algo.length_control.generate_in_stages`), here on text: the first request may
generate the sample's thinking budget (`InterruptionPolicy.think_budget(key)`); if it stops on that limit with the
thinking still open, the interruption phrase (its text) is appended and a second request generates at most the
answer budget; thinking already closed: the answer goes on up to `max_new_tokens`. A sample that ends on a length
limit is truncated.

Transport: the shared client (`http_json.AsyncJsonClient`), at most `concurrency` requests in flight; a request that
fails transiently (no connection, no answer in time, HTTP 5xx or 429) is retried under `EVAL_RETRY`, then
`EndpointError` names the endpoint and the last errors. Any other HTTP error fails at once (a bad request fails every
time).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_scalerl.algo.length_control import Continuation, InterruptionPolicy, generate_in_stages
from megatron_scalerl.errors import UserError
from megatron_scalerl.http_json import AsyncJsonClient, RetryPolicy, ServerError
from megatron_scalerl.tasks.prompts import THINK_CLOSE

# a failed request is sent again after 1, 2 and 4 s: four attempts in all
EVAL_RETRY = RetryPolicy(attempts=4, backoff_s=1.0)


class EndpointError(UserError):
    """The endpoint could not answer (after retries), or refused the request."""


@dataclass(frozen=True)
class SamplingSettings:
    """Per-sample generation settings; lengths in tokens."""

    temperature: float
    top_p: float
    max_new_tokens: int
    policy: InterruptionPolicy | None  # None: one request up to max_new_tokens
    interruption_phrase: str = ""
    seed: int | None = None


@dataclass(frozen=True)
class TextSegment:
    """One completion request's output: its text, its completion tokens as the endpoint counted them, and how it
    ended ("stop" or "length")."""

    text: str
    tokens: int
    finish_reason: str


@dataclass
class Completion:
    """One finished sample: `text` (thinking included, the phrase too when interrupted), completion tokens as the
    endpoint counted them, and how it ended."""

    text: str
    tokens: int
    finish_reason: str
    interrupted: bool
    truncated: bool


class CompletionClient:
    """`/v1/completions` of one endpoint for one served `model`; each request waits at most `request_timeout_s`
    seconds for its answer."""

    def __init__(self, endpoint: str, model: str, *, api_key: str | None = None, concurrency: int = 32,
                 retry: RetryPolicy = EVAL_RETRY, request_timeout_s: float = 1800.0):
        self.base = endpoint.rstrip("/")
        self.path = "/completions" if self.base.endswith("/v1") else "/v1/completions"
        self.model, self.retry, self.request_timeout_s = model, retry, request_timeout_s
        self.client = AsyncJsonClient(api_key, concurrency=concurrency)

    async def __aenter__(self) -> CompletionClient:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.__aexit__(*exc)

    async def complete(self, prompt: str, *, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None) -> TextSegment:
        """One completion request (retried under `retry`); EndpointError naming the endpoint when it fails."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, **({"seed": seed} if seed is not None else {})}
        url = self.base + self.path
        try:
            answer = await self.retry.call(url, lambda _: self.client.request(
                self.base, self.path, body, timeout_s=self.request_timeout_s))
        except ServerError as exc:
            raise EndpointError(str(exc)) from None
        try:
            choice = answer["choices"][0]
            text, reason = str(choice["text"]), choice.get("finish_reason") or "stop"
        except (KeyError, IndexError, TypeError) as exc:
            raise EndpointError(f"{url}: not an OpenAI completions answer ({type(exc).__name__}: {exc})") from None
        tokens = (answer.get("usage") or {}).get("completion_tokens")
        if tokens is None:  # an endpoint without usage: the limit when it stopped there, else unknown (0)
            tokens = max_tokens if reason == "length" else 0
        return TextSegment(text, int(tokens), reason)


async def sample_completion(client: CompletionClient, prompt: str, key: str, settings: SamplingSettings
                            ) -> Completion:
    """One sample of `prompt` under the recipe's length control (see the module docstring); `key` seeds the
    thinking budget (and the sampler, when `settings.seed` is set)."""

    def appended(continuation: Continuation) -> str:
        return settings.interruption_phrase if continuation.interrupted else ""

    async def first(max_tokens: int, seed: int | None) -> TextSegment:
        return await client.complete(prompt, max_tokens=max_tokens, temperature=settings.temperature,
                                     top_p=settings.top_p, seed=seed)

    async def second(head: TextSegment, continuation: Continuation, seed: int | None) -> TextSegment:
        return await client.complete(prompt + head.text + appended(continuation),
                                     max_tokens=continuation.max_new_tokens, temperature=settings.temperature,
                                     top_p=settings.top_p, seed=seed)

    stages = await generate_in_stages(settings.policy, key, settings.max_new_tokens, settings.seed, first=first,
                                      second=second, measure=lambda head: (head.tokens, THINK_CLOSE in head.text))
    head, tail = stages.first, stages.second
    if stages.continuation is None or tail is None:
        return Completion(head.text, head.tokens, head.finish_reason, interrupted=False, truncated=stages.truncated)
    return Completion(head.text + appended(stages.continuation) + tail.text, head.tokens + tail.tokens,
                      tail.finish_reason, interrupted=stages.interrupted, truncated=stages.truncated)
