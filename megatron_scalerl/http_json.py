"""JSON over HTTP to our servers (vLLM's generators, their RL routes), with a timeout on every call: what the
generators' launcher, the fleet's health checks, weight sync, the trainer and the evaluation watcher share."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class ServerError(RuntimeError):
    """A vLLM server did not start, answer or stop in time; the message names its URL (and route)."""


def request_json(base_url: str, path: str, body: Any = None, *, method: str = "POST", timeout_s: float,
                 api_key: str | None = None, query: dict[str, Any] | None = None) -> Any:
    """Call `base_url + path` with a JSON body; returns the decoded JSON answer (None when empty).

    Raises ServerError naming the URL and route: HTTP errors with the server's message, no connection, or no
    answer within `timeout_s` seconds.
    """
    url = base_url.rstrip("/") + path
    if query:
        url += "?" + urllib.parse.urlencode({k: str(v).lower() if isinstance(v, bool) else v for k, v in query.items()})
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise ServerError(f"{method} {url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"{method} {url}: {reason} (timeout {timeout_s:g} s)") from None
    return json.loads(raw) if raw else None
