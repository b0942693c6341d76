"""The inference servers: launching vLLM with our extensions (`vllm_server`, `scalerl serve` in `serve_cli`), their
API key (`server_auth`), and the client of a fleet of them (`fleet`: token-in/token-out generation, failover)."""
