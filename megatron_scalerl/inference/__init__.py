"""The inference servers: launching vLLM with our extensions (`vllm_server`; the command is `scalerl serve`,
commands/serve.py), their API key (`server_auth`), the client of a fleet of them (`fleet`: token-in/token-out
generation, failover) and, inside each server's workers, our vLLM worker plugin (`worker_extension`, with
`worker_routes`, `expert_permutation`, and weight sync's receiving side from `weight_sync`: `receiver`,
`worker_methods`, `fp32_head`) and the routes middleware (`route_capture`)."""
