"""A generator larger than one machine, real processes: `scalerl serve --tp 2 --nnodes 2` run twice on this machine
as two nodes would run it (node 0 serving HTTP, node 1 headless with $SCALERL_NODE_RANK=1, the workers meeting at
node 0's master port). It must serve checkpoint A as transformers computes it, take checkpoint B from a TP=2 trainer
over weight sync (so the worker on "node 1" received its shard too: a stale shard changes the tokens) and stop
cleanly on SIGTERM, each node logging to a file of its own."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.platform import free_port, run_local_workers
from megatron_scalerl.weight_sync.sender import SenderConfig
from tests.trainer_utils import FP32, tiny_hf_checkpoint, tiny_recipe
from tests.weight_sync_utils import assert_matches, hf_greedy, push_and_read, server_greedy

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiprocess]


def _serve(model, log, port: int, master_port: int, node_rank: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "megatron_scalerl.commands", "serve", "--model", str(model), "--port", str(port),
               "--no-api-key", "--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
               str(master_port), "--dtype", "float32", "--max-model-len", "256", "--log", str(log),
               "--health-interval", "2", "--", "--block-size", "32", "--tokens-only"]
    env = {**os.environ, "SCALERL_NODE_RANK": str(node_rank), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    out = open(log.with_suffix(f".out{node_rank}"), "w")
    return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_health(url: str, procs, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert all(p.poll() is None for p in procs), "a node's scalerl serve exited while starting"
        try:
            request_json(url, "/health", method="GET", timeout_s=5)
            return
        except ServerError:
            assert time.monotonic() < deadline, f"{url} not healthy within {timeout_s} s"
            time.sleep(1)


@pytest.fixture(scope="module")
def spanning(tmp_path_factory):
    root = tmp_path_factory.mktemp("across_nodes")
    a, b = (tiny_hf_checkpoint(root / name, "tiny_dense", seed=seed) for seed, name in ((11, "a"), (12, "b")))
    port, master_port, log = free_port(), free_port(), root / "vllm.log"
    procs = [_serve(a, log, port, master_port, rank) for rank in (0, 1)]
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, procs)
        before = server_greedy(url)
        tp2 = tiny_recipe("tiny_dense", tp=2, hf=b, extra=FP32)
        config = SenderConfig(bucket_mib=0.25, serving_dtype=torch.float32, timeout_s=30.0, checksum_every=1)
        pushed = run_local_workers(push_and_read, 2, [(tp2, 1, None)], [url], config, timeout_s=400)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        codes = [proc.wait(timeout=90) for proc in procs]
    return {"dirs": (a, b), "before": before, "pushed": pushed, "codes": codes, "root": root}


def test_a_server_over_two_nodes_serves_its_checkpoint(spanning):
    a, _ = spanning["dirs"]
    assert_matches(spanning["before"], hf_greedy(a), "checkpoint A served by TP2 over two nodes")
    head, node1 = (spanning["root"] / name for name in ("vllm.log", "vllm.node1.log"))
    assert "world_size=2" in head.read_text() and "headless multiproc executor" in node1.read_text()


def test_weight_sync_reaches_the_workers_on_every_node(spanning):
    _, b = spanning["dirs"]
    result = spanning["pushed"][0][0]
    assert result["error"] is None and spanning["pushed"][1][0]["error"] is None
    assert result["stats"].checksums_verified == 2 * 69  # both workers, the one on "node 1" too, every slice
    assert result["versions"] == ["1"]
    assert_matches(result["outputs"][0], hf_greedy(b), "after the TP2 push of B")


def test_every_node_stops_cleanly_on_sigterm(spanning):
    assert spanning["codes"] == [0, 0], (spanning["root"] / "vllm.out1").read_text()[-2000:]


@pytest.mark.parametrize("tp, env_rank, message", [
    ("3", "0", "a server of 3 workers cannot span 2 nodes evenly (tensor_parallel_size, serve's --tp"),
    ("2", "2", "node_rank (--node-rank) 2 of a server spanning 2 node(s): must be 0..1")])
def test_a_span_that_does_not_divide_is_refused_in_one_line(tmp_path, tp, env_rank, message):
    (tmp_path / "config.json").write_text("{}")
    done = subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "serve", "--model", str(tmp_path),
                           "--no-api-key", "--tp", tp, "--nnodes", "2"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SCALERL_NODE_RANK": env_rank})
    assert done.returncode == 2 and message in done.stderr, done.stderr
