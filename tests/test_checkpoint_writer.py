"""The trainer's checkpoint writer in the background, as on GPUs: megatron-core's asynchronous save scheduled on its
AsyncCallsQueue (the write runs in a process of its own while the ranks go on), the checkpoint published once
`poll` finds it written on every rank; it loads back to the weights the in-place save (the CPU
path) wrote. The queue's two CUDA calls (a device synchronize, and the device of its done-flag all-reduce) are
pointed at the CPU in this test's workers only: on CPUs the trainer writes in place."""

import pytest
import torch

from megatron_scalerl.platform import run_local_workers
from tests.trainer_utils import FP32, tiny_recipe

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _save_both_ways_and_load(rank, run_dir):
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron_scalerl.checkpoint.store import CheckpointStore
    from megatron_scalerl.trainer.checkpointing import CheckpointWriter, load_trainer
    from megatron_scalerl.trainer.setup import build_model_and_optimizer
    from megatron_scalerl.trainer.step import StepState

    recipe = tiny_recipe("tiny_dense", dp=2, extra=FP32)
    chunks, optimizer = build_model_and_optimizer(recipe)
    store = CheckpointStore(run_dir, keep=3)
    out = {}
    background = CheckpointWriter(store, background=True)
    out["returned"] = background.save(chunks, optimizer, StepState(step=3, updates=3), recipe.model, {"k": 1})
    out["published_while_written"] = store.iterations()
    while (published := background.poll()) is None:
        pass
    background.close()
    out["published"] = published
    out["in_place"] = CheckpointWriter(store, background=False).save(chunks, optimizer, StepState(step=4, updates=4),
                                                                    recipe.model, {"k": 1})
    out["problems"] = [store.problems(store.path(3)), store.problems(store.path(4))]
    loaded = []
    for step in (3, 4):
        fresh, fresh_optimizer = build_model_and_optimizer(recipe)
        state, rl_state = load_trainer(store.path(step), fresh, fresh_optimizer)
        loaded.append((state.step, rl_state["k"], {n: p.detach().clone() for n, p in fresh[0].named_parameters()}))
    out["steps"] = [entry[:2] for entry in loaded]
    out["same_weights"] = all(torch.equal(loaded[0][2][n], loaded[1][2][n]) for n in loaded[0][2])
    out["original_weights"] = all(torch.equal(loaded[0][2][n], p) for n, p in chunks[0].named_parameters())
    return out


def test_a_checkpoint_written_in_the_background_is_published_once_written_and_loads_as_the_in_place_one(tmp_path):
    for rank, out in enumerate(run_local_workers(_save_both_ways_and_load, 2, tmp_path, timeout_s=600)):
        assert out["returned"] is None and out["published_while_written"] == [], rank  # not before it is written
        assert out["published"] == tmp_path / "checkpoints" / "iter_0000003"
        assert out["in_place"] == tmp_path / "checkpoints" / "iter_0000004"
        assert out["problems"] == [[], []]  # manifests and checksums hold
        assert out["steps"] == [(3, 1), (4, 1)] and out["same_weights"] and out["original_weights"], rank
