"""Checkpoint publication, manifests, corruption fallback and pruning (model-independent part)."""

import json
import logging
import subprocess

import pytest
import torch.distributed as dist

from megatron_scalerl.checkpoint.store import CheckpointError, CheckpointStore, read_rl_state
from megatron_scalerl.platform import run_local_workers


def _writer(payload: bytes):
    def write(tmp):
        (tmp / "shard").mkdir(exist_ok=True)
        (tmp / "shard" / f"rank{dist.get_rank() if dist.is_initialized() else 0}.bin").write_bytes(payload)
    return write


def test_save_publishes_with_manifest_and_prunes(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for it in (10, 20, 30):
        path = store.save(it, _writer(bytes([it]) * 1000), {"step": it})
        assert path.name == f"iter_{it:07d}" and store.problems(path) == []
    assert store.iterations() == [30, 20]
    assert store.latest_valid() == (30, store.path(30))
    assert read_rl_state(store.path(30)) == {"step": 30}
    assert not list((tmp_path / "checkpoints").glob(".iter_*"))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: (p / "shard" / "rank0.bin").write_bytes(b"x" * 10), "10 bytes, manifest says 1000"),
        (lambda p: (p / "shard" / "rank0.bin").write_bytes(b"y" * 1000), "sha256 mismatch"),
        (lambda p: (p / "shard" / "rank0.bin").unlink(), "missing"),
        (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{"), "manifest.json unreadable"),
    ],
)
def test_corrupt_latest_falls_back_to_previous(tmp_path, caplog, damage, reason):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(10, _writer(b"a" * 1000), {"step": 10})
    store.save(20, _writer(b"b" * 1000), {"step": 20})
    damage(store.path(20))
    with caplog.at_level(logging.WARNING):
        assert store.latest_valid() == (10, store.path(10))
    assert "iter_0000020" in caplog.text and reason in caplog.text


def test_no_valid_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    assert store.latest_valid() is None
    store.save(10, _writer(b"a" * 100), {})
    (store.path(10) / "rl_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no valid checkpoint .*iter_0000010: rl_state.json"):
        store.latest_valid()


def test_crash_leftovers_are_ignored_and_cleaned(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(10, _writer(b"a"), {})
    partial = tmp_path / "checkpoints" / ".iter_0000020.partial"
    partial.mkdir()
    (partial / "junk").write_bytes(b"junk")
    assert store.latest_valid()[0] == 10
    store.save(20, _writer(b"b"), {})
    assert not partial.exists() and store.latest_valid()[0] == 20


def _two_rank_save(rank, run_dir):
    CheckpointStore(run_dir, keep=2).save(5, _writer(bytes([rank]) * 64), {"step": 5})


@pytest.mark.multiprocess
def test_collective_save_hashes_every_rank_file(tmp_path):
    run_local_workers(_two_rank_save, 2, tmp_path, timeout_s=120)
    store = CheckpointStore(tmp_path, keep=2)
    path = store.path(5)
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert set(files) == {"shard/rank0.bin", "shard/rank1.bin", "rl_state.json"}
    assert store.problems(path) == []


def _two_rank_latest(rank, run_dir):
    return CheckpointStore(run_dir, keep=3).latest_valid()


@pytest.mark.multiprocess
def test_ranks_split_the_validation_and_agree(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(10, _writer(b"a" * 100), {})
    store.save(20, _writer(b"b" * 100), {})
    (store.path(20) / "shard" / "rank0.bin").write_bytes(b"c" * 100)  # hashed by one rank only
    assert run_local_workers(_two_rank_latest, 2, tmp_path, timeout_s=120) == [(10, store.path(10))] * 2


def test_resaving_an_iteration_replaces_it_whole(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(10, _writer(b"a" * 100), {"v": 1})
    store.save(10, _writer(b"b" * 50), {"v": 2})
    assert read_rl_state(store.path(10)) == {"v": 2} and store.problems(store.path(10)) == []
    assert not list((tmp_path / "checkpoints").glob(".iter_*"))


def _corrupt(path):
    (path / "shard" / "rank0.bin").write_bytes(b"x" * 10)


@pytest.mark.parametrize("next_save", [20, 30], ids=["below-the-corrupt-one", "same-iteration"])
def test_after_a_fallback_the_next_save_is_kept_and_the_corrupt_one_set_aside(tmp_path, next_save):
    """keep=1, the newest checkpoint (30) corrupt: resume from 10, then save again; before the fix the prune kept
    the corrupt 30 and deleted the checkpoint just written."""
    store = CheckpointStore(tmp_path, keep=1)
    store.save(10, _writer(b"a" * 1000), {"step": 10})
    store.keep = 3
    store.save(30, _writer(b"c" * 1000), {"step": 30})
    store.keep = 1
    _corrupt(store.path(30))
    assert store.latest_valid(set_aside=True) == (10, store.path(10))
    unusable = tmp_path / "checkpoints" / "unusable" / "iter_0000030"
    assert store.iterations() == [10] and unusable.is_dir()
    reason = (unusable / "UNUSABLE.txt").read_text()
    assert "failed validation (shard/rank0.bin: 10 bytes, manifest says 1000); resumed from iter_0000010" in reason

    store.save(next_save, _writer(b"d" * 1000), {"step": next_save})
    assert store.iterations() == [next_save] and store.latest_valid() == (next_save, store.path(next_save))
    assert unusable.is_dir()  # kept for a human to look at, never loaded


def test_a_read_only_lookup_moves_nothing(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(10, _writer(b"a" * 100), {})
    store.save(20, _writer(b"b" * 100), {})
    _corrupt(store.path(20))
    assert store.latest_valid() == (10, store.path(10))
    assert store.iterations() == [20, 10]


def test_a_save_sets_aside_newer_checkpoints_of_an_abandoned_timeline(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    for it in (10, 20, 30):
        store.save(it, _writer(bytes([it]) * 100), {"step": it})
    store.save(15, _writer(b"e" * 100), {"step": 15})  # e.g. a run restarted by hand from iter 10
    assert store.iterations() == [15, 10]
    aside = tmp_path / "checkpoints" / "unusable"
    assert sorted(p.name for p in aside.iterdir()) == ["iter_0000020", "iter_0000030"]
    assert "newer than iter_0000015" in (aside / "iter_0000030" / "UNUSABLE.txt").read_text()
    store.save(15, _writer(b"f" * 100), {"step": 15})
    store.save(30, _writer(b"g" * 100), {"step": 30})
    store.save(20, _writer(b"h" * 100), {"step": 20})  # the same name set aside twice gets a suffix
    assert store.iterations() == [20, 15, 10]
    assert sorted(p.name for p in aside.iterdir()) == ["iter_0000020", "iter_0000030", "iter_0000030.1"]


def test_keep_every_keeps_evaluation_checkpoints_beyond_the_newest_and_only_the_newest_are_resumable(tmp_path):
    store = CheckpointStore(tmp_path, keep=2, keep_every=20)
    for it in (10, 20, 30, 40, 50, 60):
        store.save(it, _writer(bytes([it]) * 100), {"step": it})
    assert store.iterations() == [60, 50, 40, 20]  # the newest two, and the multiples of 20
    assert store.resumable() == [60, 50]


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs (needs root: mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.parametrize("first, second, message", [
    # the write runs out of room: its partial copy is removed, its space freed
    (100_000, 2_000_000, r"iter_0000020: could not be written \(rank 0: OSError: .*No space left on device.*the earlier "
                         r"checkpoints are untouched"),
    # less room than the newest checkpoint took: refused before anything is written (megatron-core writes some files
    # on rank 0 alone between collectives, where a full disk would leave the other ranks waiting)
    (300_000, 1_000, r"iter_0000020: not written: 0\.\d MiB free in .*, the newest checkpoint \(iter_0000010\) took "
                     r"0\.3 MiB; the earlier checkpoints are untouched"),
])
def test_a_save_that_does_not_fit_fails_whole_and_the_earlier_checkpoint_stays(small_disk, first, second, message):
    """CheckpointError naming the checkpoint and the cause; no partial copy stays, the first checkpoint is untouched
    and still the one a resume takes."""
    store = CheckpointStore(small_disk, keep=3)
    store.save(10, _writer(b"a" * first), {"step": 10})
    with pytest.raises(CheckpointError, match=message):
        store.save(20, _writer(b"b" * second), {"step": 20})
    assert sorted(p.name for p in (small_disk / "checkpoints").iterdir()) == ["iter_0000010"]
    assert store.latest_valid() == (10, store.path(10))
    if first < 200_000:  # room is left: the next save that fits works
        store.save(30, _writer(b"c" * 100_000), {"step": 30})
        assert store.iterations() == [30, 10] and store.latest_valid() == (30, store.path(30))
