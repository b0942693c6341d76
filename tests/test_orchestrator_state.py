"""The orchestrator's saved state and its resume: the state files' rotation, and the rewind to the checkpoint the
trainer resumes from (a stream that went on past the checkpoint's copy of the state is cut back to it, the batches
after it moved aside, the curriculum of that copy restored). The whole loop on real processes:
tests/test_pipeline_run.py."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.batches.train_batch import CorruptBatchError
from megatron_scalerl.checkpoint.store import CheckpointStore, publish
from megatron_scalerl.errors import UserError
from megatron_scalerl.orchestrator.orchestrator import Orchestrator
from megatron_scalerl.orchestrator.state import (
    ABANDONED_DIR,
    ABANDONED_NOTE,
    SavedState,
    load_state,
    rewind_to_checkpoint,
    save_state,
)
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.directory import CURRICULUM_FILE, PREVIOUS_CURRICULUM_FILE
from megatron_scalerl.run.metrics_log import REWOUND_FILE, MetricsLog, logged_wall_hours, read_metrics
from tests.test_batches_stream import make_batch

PROMPTS_PER_BATCH = 2


class WordTokenizer:
    """What the orchestrator asks of a tokenizer before it generates anything: one id per word."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(word) for word in text.split()]


def _state(batch: int, **changes) -> SavedState:
    return SavedState(**{"batch": batch, "next_group": 2 * (batch + 1), "sampler": {"epoch": 0, "position": batch + 1},
                         "resampling": {}, "validated": [0], "pending": [], "wall_hours": 0.1 * (batch + 1),
                         **changes})


def _checkpoint(run_dir: Path, step: int, curriculum: dict | None) -> None:
    """A published checkpoint `iter_<step>` whose rl_state.json holds `curriculum` (None: no copy, as before)."""
    extras = {} if curriculum is None else {"curriculum": curriculum}
    publish(CheckpointStore(run_dir, keep=3).path(step), lambda tmp: (tmp / "model.bin").write_bytes(b"w" * 64),
            {"step_state": {"step": step}, **extras}, {"iteration": step})


def _stream(run_dir: Path, batches: int) -> RolloutStream:
    stream = RolloutStream(run_dir)
    for index in range(batches):
        stream.put(make_batch(seed=index), {"prompts": [f"p{index}"]}, index=index)
    return stream


def _folder(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "rollouts" / ABANDONED_DIR).glob("*"))


def test_the_state_before_a_batch_keeps_the_previous_one_and_a_resume_takes_the_one_of_the_last_batch(tmp_path):
    save_state(tmp_path, _state(0), new_batch=True)
    save_state(tmp_path, _state(1), new_batch=True)
    save_state(tmp_path, _state(1, validated=[0, 1]), new_batch=False)  # after the batch: replaced in place
    assert SavedState.parse(json.loads((tmp_path / PREVIOUS_CURRICULUM_FILE).read_text()), "prev") == _state(0)
    assert load_state(tmp_path, 1) == (_state(1, validated=[0, 1]), tmp_path / CURRICULUM_FILE)
    assert load_state(tmp_path, 0) == (_state(0), tmp_path / PREVIOUS_CURRICULUM_FILE)  # batch 1 never landed
    with pytest.raises(UserError, match="the stream's last batch is 4, but neither curriculum.json nor"):
        load_state(tmp_path, 4)
    (tmp_path / CURRICULUM_FILE).write_text('{"batch": 1, "next_group": 2}')
    with pytest.raises(UserError, match=r"curriculum.json: malformed orchestrator state \(KeyError: 'sampler'\)"):
        load_state(tmp_path, 1)


def test_a_resume_past_the_checkpoints_copy_sets_the_later_batches_aside_and_restores_its_curriculum(tmp_path):
    """Batches 0..7 were written; the trainer's newest checkpoint (iter_4) holds the state of batch 5 (the orchestrator
    ran ahead of it); the trainer crashed later. Resumed, the orchestrator continues after batch 5, with the prompt
    sampler, the pending prompts and the validations of that copy, and draws batch 6's prompts again."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"problem": f"{i} + {i} = ?", "answer": str(2 * i)}) + "\n" for i in range(40)))
    recipe = load_recipe("demo", ["logging.wandb_mode=disabled", "forecast.live=false", "data.validation_holdout=4",
                                  f"data.train=[{{kind: jsonl, path: '{prompts}'}}]"])
    first = Orchestrator(tmp_path, recipe, WordTokenizer(), ["http://127.0.0.1:9"], grader_workers=1)
    stream, drawn, copy = RolloutStream(tmp_path), {}, None
    try:
        for index in range(8):
            admitted = [first.admission.admit() for _ in range(PROMPTS_PER_BATCH + 1)]
            for group, _ in admitted[:PROMPTS_PER_BATCH]:  # the last one stays pending, in the state
                del first.admission.pending[group]
            drawn[index] = [problem.key for _, problem in admitted]
            first.admission.written += 1
            first.validation.done.add(index)
            first._save_state(new_batch=True)
            if index == 5:
                copy = json.loads((tmp_path / CURRICULUM_FILE).read_text())  # what the trainer copies
                _checkpoint(tmp_path, 4, copy)
            stream.put(make_batch(seed=index), {"prompts": drawn[index][:PROMPTS_PER_BATCH]}, index=index)
    finally:
        first.close()
    _checkpoint(tmp_path, 2, {**copy, "batch": 3})  # an older one: the newest valid checkpoint is the one that counts
    MetricsLog(tmp_path, "orchestrator").log(8, {"wall_hours": 5.0})  # the abandoned timeline's time was spent too

    resumed = Orchestrator(tmp_path, recipe, WordTokenizer(), ["http://127.0.0.1:9"], resume=True, grader_workers=1)
    try:
        [folder] = _folder(tmp_path)
        assert folder.name == "from_batch_00000006" and stream.next_index() == 6
        assert sorted(p.name for p in folder.iterdir()) == [
            ABANDONED_NOTE, "batch_00000006.safetensors", "batch_00000007.safetensors", CURRICULUM_FILE,
            PREVIOUS_CURRICULUM_FILE]
        assert json.loads((folder / CURRICULUM_FILE).read_text())["batch"] == 7  # the abandoned state, kept
        assert "batches 6..7 were written after the orchestrator state of iter_0000004 (batch 5)" in (
            folder / ABANDONED_NOTE).read_text()
        assert json.loads((tmp_path / CURRICULUM_FILE).read_text()) == copy
        assert not (tmp_path / PREVIOUS_CURRICULUM_FILE).exists()
        admission = resumed.admission
        assert admission.written == 6 and admission.next_group == copy["next_group"]
        # the validations of policies after the checkpoint's step 4 are forgotten: they are made again
        assert resumed.sampler.state_dict() == copy["sampler"] and resumed.validation.done == set(range(5))
        assert admission.requeued == [drawn[index][-1] for index in range(6)]  # admitted, in no batch
        assert resumed.compute.wall_hours_before == 5.0
        admission.requeued.clear()
        assert [admission.admit()[1].key for _ in range(3)] == drawn[6]  # the same curriculum from there on
        rewind_to_checkpoint(tmp_path, pytest.fail)  # once rewound, nothing more to do
        stream.put(make_batch(seed=6), index=6)  # the index goes on where the copy ended, never written twice
    finally:
        resumed.close()


def test_a_copy_at_the_streams_end_or_none_at_all_leaves_the_stream_as_it_is(tmp_path):
    said = []
    stream = _stream(tmp_path, 4)
    _checkpoint(tmp_path, 2, None)  # a checkpoint from before the copies: as before, nothing to compare with
    rewind_to_checkpoint(tmp_path, said.append)
    _checkpoint(tmp_path, 3, _state(3).__dict__)  # the copy is of the stream's last batch
    rewind_to_checkpoint(tmp_path, said.append)
    _checkpoint(tmp_path, 4, _state(4).__dict__)  # the state of batch 4 was saved, batch 4 never written
    rewind_to_checkpoint(tmp_path, said.append)
    assert said == [] and stream.next_index() == 4 and not _folder(tmp_path)


def test_without_a_checkpoint_the_run_starts_over_and_a_pruned_copy_point_is_only_said(tmp_path):
    said = []
    stream = _stream(tmp_path, 3)
    save_state(tmp_path, _state(2), new_batch=True)
    rewind_to_checkpoint(tmp_path, said.append)  # the trainer starts again from its initial weights
    assert stream.next_index() == 0 and not (tmp_path / CURRICULUM_FILE).exists()
    assert [p.name for p in _folder(tmp_path)] == ["from_batch_00000000"]
    assert load_state(tmp_path, -1) is None  # the orchestrator starts afresh
    stream = _stream(tmp_path / "pruned", 6)
    stream.path(2).unlink()  # pruned below the oldest kept checkpoint, iter_3
    _checkpoint(tmp_path / "pruned", 3, _state(2).__dict__)
    rewind_to_checkpoint(tmp_path / "pruned", said.append)
    assert stream.next_index() == 6 and said[-1].startswith("warning: the trainer resumes from iter_0000003, whose copy")
    assert "batch 2 was pruned: batches 3..5" in said[-1]


def test_the_launchers_rewind_leaves_each_step_and_validation_once_and_keeps_the_lost_records_aside(tmp_path):
    """The history of a run whose trainer died at step 7 after checkpoint iter_4 (its copy: batch 5), batches 0..7
    written: after the launchers' rewind metrics.jsonl holds trainer steps 1..4, the rows of batches 0..5, the
    validations of policies 0..4 and the evaluation of iter_4; the rest is in metrics.rewound.jsonl, noted; the
    wall-clock hours spent on it still count."""
    _stream(tmp_path, 8)
    _checkpoint(tmp_path, 4, json.loads(_state(5).to_json()))
    trainer, orchestrator, evaluation = (MetricsLog(tmp_path, role) for role in ("trainer", "orchestrator", "eval"))
    for step in range(1, 8):
        trainer.log(step, {"train/loss": 1.0 / step, "wall_hours": 0.1 * step})
    for written in range(1, 9):
        orchestrator.log(written, {"rollout/policy_version": float(written - 1), "wall_hours": 0.1 * written})
    for version in (0, 2, 4, 6):
        orchestrator.log(version, {"val/pass_rate": 0.1 * version, "wall_hours": 0.1 * version})
    orchestrator.log(6, {"forecast/status": "fitted"})
    for step in (4, 6):
        evaluation.log(step, {"eval/aime/mean_at_k": 0.5})
    said = []
    assert rewind_to_checkpoint(tmp_path, said.append, metrics=True) == 4
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if r["role"] == "trainer"] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "rollout/policy_version" in r] == list(range(1, 7))  # batches 0..5
    assert [r["step"] for r in rows if "val/pass_rate" in r] == [0, 2, 4]
    assert [r["step"] for r in rows if r["role"] == "eval"] == [4] and not any("forecast/status" in r for r in rows)
    aside = [json.loads(line) for line in (tmp_path / REWOUND_FILE).read_text().splitlines()]
    assert len(aside) == 3 + 2 + 1 + 1 + 1 and {r["rewound"] for r in aside} == {"resumed from iter_0000004"}
    assert "8 metrics records of work lost since iter_0000004" in said[-1]
    assert logged_wall_hours(tmp_path, "orchestrator") == pytest.approx(0.8)  # batch 7's row, set aside, was paid for
    assert rewind_to_checkpoint(tmp_path, said.append, metrics=True) == 4 and len(said) == 2  # nothing more to move


def _corrupt(path: Path) -> None:
    """Flip one bit of a batch file's last tensor byte: it still parses, only its checksum tells."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def test_an_unreadable_batch_the_trainer_has_yet_to_read_is_set_aside_with_those_after_it_and_written_again(tmp_path):
    """Batches 0..5 written, the trainer's checkpoint iter_2 holds the state of batch 5, batch 3 was corrupted on disk
    (and batch 1, trained already, too): the rewind sets batches 3..5 aside, their rows with them, and the
    orchestrator goes on with the newest state as that of batch 2 (the set-aside batches' prompts count as drawn),
    so the trainer's next resume does not stop at batch 3 again."""
    stream = _stream(tmp_path, 6)
    _checkpoint(tmp_path, 2, json.loads(_state(5).to_json()))
    save_state(tmp_path, _state(4), new_batch=True)
    save_state(tmp_path, _state(5), new_batch=True)
    orchestrator = MetricsLog(tmp_path, "orchestrator")
    for written in range(1, 7):
        orchestrator.log(written, {"rollout/policy_version": float(written - 1)})
    _corrupt(stream.path(1))
    _corrupt(stream.path(3))
    with pytest.raises(CorruptBatchError, match="batch_00000003.safetensors: corrupt TrainBatch"):
        stream.read(3)
    said = []
    assert rewind_to_checkpoint(tmp_path, said.append, metrics=True) == 2
    assert stream.next_index() == 3
    [folder] = _folder(tmp_path)
    assert folder.name == "from_batch_00000003"
    assert sorted(p.name for p in folder.glob("batch_*")) == [stream.path(i).name for i in (3, 4, 5)]
    assert "batch 3 cannot be read" in said[0] and "corrupt TrainBatch" in (folder / ABANDONED_NOTE).read_text()
    assert load_state(tmp_path, 2) == (replace(_state(5), batch=2), tmp_path / CURRICULUM_FILE)
    assert json.loads((folder / CURRICULUM_FILE).read_text())["batch"] == 5
    assert [r["step"] for r in read_metrics(tmp_path) if "rollout/policy_version" in r] == [1, 2, 3]
    stream.put(make_batch(seed=9), index=3)  # written again where it was
    assert rewind_to_checkpoint(tmp_path, said.append) == 2 and len(said) == 2  # nothing more to set aside


def test_a_set_aside_cut_short_is_done_again_from_where_it_stopped(tmp_path):
    """The set-aside of unreadable batch 3 was cut short after the new state (that of batch 2) was saved and batch 5
    moved: the next rewind moves batches 3..4 too and keeps that state."""
    stream = _stream(tmp_path, 6)
    _checkpoint(tmp_path, 2, json.loads(_state(5).to_json()))
    save_state(tmp_path, replace(_state(5), batch=2), new_batch=False)
    _corrupt(stream.path(3))
    (tmp_path / "rollouts" / ABANDONED_DIR / "from_batch_00000003").mkdir(parents=True)
    stream.path(5).rename(tmp_path / "rollouts" / ABANDONED_DIR / "from_batch_00000003" / stream.path(5).name)
    said = []
    assert rewind_to_checkpoint(tmp_path, said.append, metrics=True) == 2
    assert stream.next_index() == 3 and load_state(tmp_path, 2)[0] == replace(_state(5), batch=2)
    assert [p.name for p in _folder(tmp_path)] == ["from_batch_00000003", "from_batch_00000003.1"]
    assert "batches 3..4 set aside" in said[0]
