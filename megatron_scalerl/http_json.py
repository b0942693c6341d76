"""JSON over HTTP to our servers (vLLM's generators and their RL routes, an evaluation endpoint), with a timeout on
every call: what the generators' launcher, weight sync, the trainer, the fleet and the evaluation share.

    request_json(url, "/weight_info", method="GET", timeout_s=5)          # sync: control calls, no retry
    async with AsyncJsonClient(api_key=KEY) as client:                    # async: generation and evaluation
        answer = await RetryPolicy(attempts=4, backoff_s=1.0).call(
            url, lambda n: client.request(url, "/v1/completions", body, timeout_s=1800))

One set of conventions for both: the bearer token when there is an API key, booleans in a query as "true"/"false",
an empty answer is None, and one error, `ServerError`, whose message names the method and URL (route included).
`ServerError.transient` says whether the same call may succeed later: no connection, no answer within the timeout,
HTTP 5xx or 429 are transient; any other HTTP error (a bad request, a wrong key) fails every time. Only
`RetryPolicy.call` tries a call again: the sync control calls leave retrying to their callers' own loops.

An https server is always verified, with no way to turn it off: its certificate must chain to `ca_file` when a call
gives one, else to the file `$SCALERL_TLS_CA` names (a run's generators: the launcher sets it to the run's certificate, `RUN/tls/cert.pem`,
for itself and every role: `run/tls.py`), else to the system's trust store (a public endpoint). The certificates in
such a file are trusted as they are (a self-signed one, or a server's own certificate, needs no CA above it), and
the name in the URL must be one the certificate names. A certificate that does not verify fails every time
(ServerError, not transient) with what to trust instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")

# vLLM's HTTP server (uvicorn) closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). A client that keeps
# idle connections longer (aiohttp's default is 15 s) sends its next request on a socket the server has just closed
# and gets ServerDisconnectedError from a healthy server, e.g. the first request after a weight-sync pause.
IDLE_CONNECTION_S = 2.0
TLS_CA_ENV = "SCALERL_TLS_CA"  # the certificate file(s) an https URL's server is verified against (a run's own)


class ServerError(RuntimeError):
    """A server did not start, answer or stop in time, or refused a call; the message names its URL (and route).
    `transient`: the same call may succeed later (see the module docstring)."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def _http_error(method: str, url: str, status: int, detail: str) -> ServerError:
    return ServerError(f"{method} {url}: HTTP {status}: {detail[:2000]}", transient=status >= 500 or status == 429)


def _no_answer(method: str, url: str, reason: object, timeout_s: float) -> ServerError:
    return ServerError(f"{method} {url}: {reason} (timeout {timeout_s:g} s)", transient=True)


def _trusted(ca_file: str | os.PathLike | None) -> str | None:
    return str(ca_file or os.environ.get(TLS_CA_ENV) or "") or None


def _untrusted(method: str, url: str, reason: object, ca_file: str | os.PathLike | None) -> ServerError:
    trusted = _trusted(ca_file)
    return ServerError(f"{method} {url}: the server's TLS certificate is not trusted ({reason}); trusted here: "
                       + (trusted if trusted else f"the system's CAs alone (${TLS_CA_ENV} is not set)")
                       + f"; a run's generators are trusted with ${TLS_CA_ENV}=RUN/tls/cert.pem")


def tls_context(ca_file: str | os.PathLike | None = None) -> ssl.SSLContext:
    """The context an https call verifies its server with (see the module docstring): the certificates in `ca_file`,
    else in `$SCALERL_TLS_CA`, else the system's trust store; certificate and host name always checked. ServerError
    when the file cannot be read."""
    trusted = _trusted(ca_file)
    if trusted is None:
        return _context(None, 0)
    try:
        return _context(trusted, os.stat(trusted).st_mtime_ns)  # a certificate made again is read again
    except (OSError, ssl.SSLError) as exc:
        raise ServerError(f"TLS certificate file {trusted} (ca_file or ${TLS_CA_ENV}) cannot be read: {exc}") from None


@functools.lru_cache(maxsize=8)
def _context(ca_file: str | None, _version: int) -> ssl.SSLContext:
    if ca_file is None:
        return ssl.create_default_context()
    context = ssl.create_default_context(cafile=ca_file)
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the file's certificates are trusted as they are
    return context


def _query(query: dict[str, Any] | None) -> dict[str, Any]:
    return {k: str(v).lower() if isinstance(v, bool) else v for k, v in (query or {}).items()}


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _decode(method: str, url: str, raw: bytes | str) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError as exc:
        raise ServerError(f"{method} {url}: not a JSON answer ({exc}): {str(raw)[:500]}") from None


def request_json(base_url: str, path: str, body: Any = None, *, method: str = "POST", timeout_s: float,
                 api_key: str | None = None, query: dict[str, Any] | None = None,
                 ca_file: str | os.PathLike | None = None) -> Any:
    """Call `base_url + path` with a JSON body, once; returns the decoded JSON answer (None when empty). An https
    server is verified against `ca_file` (else `$SCALERL_TLS_CA`, else the system's CAs: `tls_context`).

    Raises ServerError naming the URL and route: HTTP errors with the server's message, no connection, no answer
    within `timeout_s` seconds, or a certificate that does not verify.
    """
    url = base_url.rstrip("/") + path
    if query:
        url += "?" + urllib.parse.urlencode(_query(query))
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **_headers(api_key)})
    context = tls_context(ca_file) if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise _http_error(method, url, exc.code, exc.read().decode(errors="replace")) from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ssl.SSLCertVerificationError):
            raise _untrusted(method, url, exc.reason, ca_file) from None
        raise _no_answer(method, url, exc.reason, timeout_s) from None
    except (TimeoutError, ConnectionError, OSError) as exc:
        raise _no_answer(method, url, exc, timeout_s) from None
    return _decode(method, url, raw)


class AsyncJsonClient:
    """The async side (aiohttp): one session for many concurrent calls, the bearer token, a timeout per call, at
    most `concurrency` calls in flight (None: no limit), https servers verified as `request_json` verifies them
    (`ca_file`, else `$SCALERL_TLS_CA`, else the system's CAs). Idle connections are dropped after
    `IDLE_CONNECTION_S` seconds. Use it as `async with`."""

    def __init__(self, api_key: str | None = None, *, concurrency: int | None = None,
                 ca_file: str | os.PathLike | None = None):
        self.api_key = api_key
        self.ca_file = ca_file
        self.slots = asyncio.Semaphore(concurrency) if concurrency else None
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncJsonClient:
        self.session = aiohttp.ClientSession(
            headers=_headers(self.api_key),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S,
                                           ssl=tls_context(self.ca_file)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def request(self, base_url: str, path: str, body: Any = None, *, method: str = "POST", timeout_s: float,
                      query: dict[str, Any] | None = None) -> Any:
        """Call `base_url + path` with a JSON body, once; the decoded JSON answer (None when empty), or ServerError
        as `request_json` raises it."""
        assert self.session is not None, "use `async with AsyncJsonClient(...)`"
        url = base_url.rstrip("/") + path
        try:
            async with self.slots or contextlib.nullcontext(), self.session.request(
                    method, url, json=body, params=_query(query),
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as reply:
                text = await reply.text()
                if reply.status >= 400:
                    raise _http_error(method, url, reply.status, text)
        except aiohttp.ClientConnectorCertificateError as exc:
            raise _untrusted(method, url, exc.certificate_error, self.ca_file) from None
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            raise _no_answer(method, url, f"{type(exc).__name__}: {exc or 'no answer'}", timeout_s) from None
        return _decode(method, url, text)


@dataclass(frozen=True)
class RetryPolicy:
    """How a call that failed transiently is tried again: `attempts` tries in all, the second `backoff_s` seconds
    after the first failure, each wait twice the one before, at most `max_backoff_s` seconds."""

    attempts: int
    backoff_s: float
    max_backoff_s: float = 10.0

    async def call(self, what: str, attempt: Callable[[int], Awaitable[T]]) -> T:
        """`await attempt(n)` for n = 1, 2, ... until one returns. A transient ServerError is tried again after the
        backoff; anything else is raised at once. Once every try failed: ServerError "`what`: no answer after N
        attempts: ..." with the last distinct errors (each names its server)."""
        errors: list[str] = []
        delay = self.backoff_s
        for n in range(1, self.attempts + 1):
            if n > 1:
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.max_backoff_s)
            try:
                return await attempt(n)
            except ServerError as exc:
                if not exc.transient:
                    raise
                errors.append(str(exc))
        last = list(dict.fromkeys(reversed(errors)))[:3][::-1]
        raise ServerError(f"{what}: no answer after {self.attempts} attempts: " + " | ".join(last))
