"""A checkpoint's per-rank RNG file (`trainer.checkpointing`): written as tensors only, read back with
`torch.load(weights_only=True)`; a file holding any other object (a pickled callable) is never unpickled, and one of
another layout is not used: its states are not restored, with a warning naming it. The exact resume through it: tests/test_trainer_resume.py."""

import logging

import torch

from megatron_scalerl.trainer.checkpointing import _rng_state, read_rng_state


def test_the_rng_states_written_read_back_with_weights_only_and_continue_the_same_draws(tmp_path):
    file = tmp_path / "rank_00000.pt"
    state = {**_rng_state(), "tracker": {"model-parallel-rng": torch.Generator().manual_seed(7).get_state()}}
    torch.save(state, file)  # as CheckpointWriter writes it
    expected = torch.rand(5)
    torch.manual_seed(123)  # elsewhere
    read = read_rng_state(file)
    assert read.keys() == state.keys() and torch.equal(read["torch"], state["torch"])
    assert torch.equal(read["tracker"]["model-parallel-rng"], state["tracker"]["model-parallel-rng"])
    torch.set_rng_state(read["torch"])
    assert torch.equal(torch.rand(5), expected)


class _Opens:
    """Unpickling it would create `path` (what any pickled callable could do instead)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_file_holding_another_object_is_not_unpickled_and_not_restored(tmp_path, caplog):
    file, marker = tmp_path / "rank_00000.pt", tmp_path / "created_by_unpickling"
    torch.save({"torch": torch.get_rng_state(), "tracker": {}, "hook": _Opens(marker)}, file)
    with caplog.at_level(logging.WARNING):
        assert read_rng_state(file) is None
    assert not marker.exists()
    assert f"{file}: RNG states not restored" in caplog.text and "the resume goes on without them" in caplog.text
    torch.load(file, weights_only=False)  # what the reader did before: it would have run it
    assert marker.exists()


def test_a_file_of_another_layout_is_not_restored(tmp_path, caplog):
    file = tmp_path / "rank_00000.pt"
    torch.save({"torch": torch.get_rng_state().tolist(), "tracker": {}}, file)
    with caplog.at_level(logging.WARNING):
        assert read_rng_state(file) is None
    assert f"{file}: RNG states not restored, the file holds what this version does not write (no tensor 'torch')" \
           in caplog.text
