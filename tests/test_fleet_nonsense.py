"""A generator that answers nonsense (HTTP 200 with a body that is not a generation) is the server's fault, as a
dead one is: the fleet marks it down and generates the sample again, whole, on another server, so the run goes on.
The two servers here stand in for vLLM's HTTP API (an external program): one answers every request with two tokens
and no log-probs, the other with a well-formed answer."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_scalerl.http_json import RetryPolicy
from megatron_scalerl.inference.fleet import Fleet, GenerationRequest


def _server(answer: dict) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # /health
            self._send({})

        def do_POST(self):  # /inference/v1/generate
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


GOOD = {"choices": [{"token_ids": [5, 6], "finish_reason": "length",
                     "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]}}]}
NONSENSE = {"choices": [{"token_ids": [5, 6], "logprobs": None}]}


def test_a_server_answering_nonsense_is_marked_down_and_the_sample_made_elsewhere():
    bad, good = _server(NONSENSE), _server(GOOD)
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in (bad, good)]
    requests = [GenerationRequest(f"s{i}", [1, 2, 3], max_tokens=2) for i in range(6)]

    async def main():
        async with Fleet(urls, retry=RetryPolicy(attempts=4, backoff_s=0.01), health_interval_s=60.0) as fleet:
            samples = await asyncio.gather(*(fleet.generate(r) for r in requests))
            return samples, fleet.stats()

    try:
        samples, stats = asyncio.run(main())
    finally:
        bad.shutdown()
        good.shutdown()
    assert all(s.server == urls[1] and s.logprobs == [-1.0, -2.0] for s in samples)
    assert not stats[urls[0]]["up"] and stats[urls[0]]["failures"] >= 1 and stats[urls[1]]["generated"] == 6
