"""Completions from any OpenAI-compatible endpoint (`POST {endpoint}/v1/completions`, text in, text out), with the
training recipe's length control: the same forced interruption of thinking, the same budgets (tokens).

    async with CompletionClient(endpoint, model, api_key=..., concurrency=32) as client:
        done = await sample_completion(client, prompt_text, key, settings)

Interruption (as in training, `rollout/generation.py`, here on text): the first request may generate the sample's
thinking budget (`InterruptionPolicy.think_budget(key)`); if it stops on that limit with the thinking still open, the
interruption phrase is appended and a second request generates at most the answer budget; thinking already closed:
the answer goes on up to `max_new_tokens`. A sample that ends on a length limit is truncated.

Transport: at most `concurrency` requests in flight; a request that fails on the transport or with HTTP 5xx/429 is
retried `attempts` times with exponential backoff, then `EndpointError` names the endpoint and the last error. HTTP
4xx other than 429 fails at once (a bad request fails every time).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from megatron_scalerl.algo.length_control import InterruptionPolicy
from megatron_scalerl.errors import UserError
from megatron_scalerl.rollout.fleet import http_session
from megatron_scalerl.rollout.prompts import THINK_CLOSE


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
    def __init__(self, endpoint: str, model: str, *, api_key: str | None = None, concurrency: int = 32,
                 attempts: int = 4, backoff_s: float = 1.0, request_timeout_s: float = 1800.0):
        self.url = endpoint.rstrip("/") + ("/completions" if endpoint.rstrip("/").endswith("/v1") else
                                           "/v1/completions")
        self.model, self.api_key, self.attempts, self.backoff_s = model, api_key, attempts, backoff_s
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.slots = asyncio.Semaphore(concurrency)
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> CompletionClient:
        self.session = http_session(self.api_key)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    async def complete(self, prompt: str, *, max_tokens: int, temperature: float, top_p: float,
                       seed: int | None) -> tuple[str, int, str]:
        """(text, completion tokens, finish reason: "stop" or "length") of one completion request."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, **({"seed": seed} if seed is not None else {})}
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self.slots, self.session.post(self.url, json=body, timeout=self.timeout) as reply:
                    text = await reply.text()
                    if reply.status >= 500 or reply.status == 429:
                        last = f"HTTP {reply.status}: {text[:300]}"
                        continue
                    if reply.status >= 400:
                        raise EndpointError(f"{self.url}: HTTP {reply.status}: {text[:500]}")
                    answer = await reply.json(content_type=None)
                    choice = answer["choices"][0]
                    text, reason = str(choice["text"]), choice.get("finish_reason") or "stop"
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
                last = f"{type(exc).__name__}: {exc or 'timeout'}"
                continue
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise EndpointError(f"{self.url}: not an OpenAI completions answer ({type(exc).__name__}: {exc})"
                                    ) from None
            tokens = (answer.get("usage") or {}).get("completion_tokens")
            if tokens is None:  # an endpoint without usage: the limit when it stopped there, else unknown (0)
                tokens = max_tokens if reason == "length" else 0
            return text, int(tokens), reason
        raise EndpointError(f"{self.url}: no answer after {self.attempts} attempts; last error: {last}")


async def sample_completion(client: CompletionClient, prompt: str, key: str, settings: SamplingSettings
                            ) -> Completion:
    """One sample of `prompt` under the recipe's length control (see the module docstring); `key` seeds the
    thinking budget (and the sampler, when `settings.seed` is set)."""
    policy, seed = settings.policy, settings.seed
    budget = policy.think_budget(key) if policy else settings.max_new_tokens
    text, tokens, reason = await client.complete(prompt, max_tokens=budget, temperature=settings.temperature,
                                                 top_p=settings.top_p, seed=seed)
    if policy is None or reason != "length":
        return Completion(text, tokens, reason, interrupted=False, truncated=reason == "length")
    continuation = policy.continuation(generated_tokens=tokens, think_closed=THINK_CLOSE in text)
    if continuation.max_new_tokens <= 0:
        return Completion(text, tokens, reason, interrupted=False, truncated=True)
    appended = settings.interruption_phrase if continuation.interrupted else ""
    more, more_tokens, reason = await client.complete(
        prompt + text + appended, max_tokens=continuation.max_new_tokens, temperature=settings.temperature,
        top_p=settings.top_p, seed=None if seed is None else seed + 1)
    return Completion(text + appended + more, tokens + more_tokens, reason, interrupted=continuation.interrupted,
                      truncated=reason == "length")
