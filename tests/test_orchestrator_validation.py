"""The validation schedule: which versions are validated, the batch held back so that the trainer cannot pass an
interval unvalidated, and a run resumed past batches already on disk, whose every scheduled validation is taken or
recorded as missed, once.

The whole orchestrator runs here (`Orchestrator.run`, its real files, grader and fleet client) against a stand-in
for vLLM's HTTP API (an external program: /weight_info, /inference/v1/generate), while the test plays the trainer's
part of the run-directory contract: it trains batch i the moment it lands (faster than any poll) and then serves
version i + 1, and its checkpoint holds a copy of the orchestrator's state. The loop on real processes, the
Megatron trainer and vLLM included: tests/test_pipeline_run.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.checkpoint.store import CheckpointStore, publish
from megatron_scalerl.models.tokenizer import train_tokenizer
from megatron_scalerl.orchestrator.live_forecast import LiveForecaster
from megatron_scalerl.orchestrator.orchestrator import Orchestrator
from megatron_scalerl.orchestrator.state import load_state, rewind_to_checkpoint
from megatron_scalerl.orchestrator.validation import Validation, ValidationSchedule
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.directory import CURRICULUM_FILE
from megatron_scalerl.run.gpu_hours import ComputeMeter
from megatron_scalerl.run.metrics_log import MetricsLog, read_metrics
from megatron_scalerl.tasks.problems import Problem
from megatron_scalerl.tasks.prompts import THINK_CLOSE, THINK_OPEN, render_prompt

STEPS = 10


# ---- the schedule -------------------------------------------------------------------------------------------------


def test_the_schedule_is_every_intervals_first_served_version_and_the_last_step():
    pipeline = ValidationSchedule(10, 155, "pipeline", 8)
    assert pipeline.versions == [*range(0, 151, 10), 155]
    assert (pipeline.owner(0), pipeline.owner(19), pipeline.owner(20), pipeline.owner(154), pipeline.owner(160)) == \
        (0, 10, 20, 150, 155)
    assert (pipeline.end(10), pipeline.end(150), pipeline.end(155)) == (20, 155, None)
    # PPO-off-policy-4 serves only every 4th step's weights (and the last): each multiple of 10 waits for the next
    assert ValidationSchedule(10, 42, "ppo", 4).versions == [0, 12, 20, 32, 40, 42]
    assert ValidationSchedule(1, 9, "ppo", 4).versions == [0, 4, 8, 9]


def _validation(run_dir: Path, schedule: ValidationSchedule, held_out: int = 1) -> Validation:
    problems = [Problem(f"v#{i}", f"{i} + 1 = ?", str(i + 1)) for i in range(held_out)]
    return Validation(problems, domains=["math"], schedule=schedule, samples=1,
                      metrics=MetricsLog(run_dir, "orchestrator"), compute=ComputeMeter(run_dir, 1),
                      live=LiveForecaster(run_dir, None))


def test_each_interval_is_validated_at_the_first_version_seen_and_one_passed_unseen_is_missed(tmp_path):
    validation = _validation(tmp_path, ValidationSchedule(10, 40, "pipeline", 8))
    assert validation.due(0) == (True, [])
    validation.done.add(0)
    assert validation.due(7) == (False, [])  # step 0's interval: taken
    assert validation.due(13) == (True, [])  # step 10's, late: labelled 13, standing for 10
    validation.done.add(13)
    assert validation.due(19) == (False, [])
    assert validation.due(35) == (True, [20])  # 20's interval passed unseen: missed; 35 stands for 30
    validation.record_missed(20, 35)
    validation.done.add(35)
    assert validation.settled() == {0, 10, 20, 30}
    assert validation.due(40) == (True, [])  # the last step, always
    [row] = [r for r in read_metrics(tmp_path) if "val/missed" in r]
    assert (row["step"], row["val/missed"], row["gpu_hours"] >= 0) == (20, 1.0, True)
    assert row["val/missed_reason"] == "the generators served step 35 before the orchestrator saw any of steps 20..29"


def test_a_batch_that_would_leave_an_unvalidated_interval_is_held_back(tmp_path):
    """Interval 2: training batch b reaches version b + 1; batch 1 would leave step 0's interval, batch 3 step 2's."""
    validation = _validation(tmp_path, ValidationSchedule(2, 6, "pipeline", 2))
    assert not validation.may_write(1) and validation.may_write(0)  # 0 takes the policy to 1: still 0's interval
    validation.done.add(1)  # step 0's interval validated late, at 1
    assert validation.may_write(2) and not validation.may_write(3)
    validation.missed.add(2)
    assert validation.may_write(4) and not validation.may_write(5)
    unvalidated = _validation(tmp_path, ValidationSchedule(2, 6), held_out=0)
    assert unvalidated.may_write(5) and unvalidated.due(4) == (False, [])  # no held-out prompts: no validation


def test_a_resume_knows_the_validations_its_metrics_hold_up_to_the_checkpoint(tmp_path):
    """A validation that landed after the state was last saved (and so after the checkpoint's copy of it) is in
    metrics.jsonl, which the launchers' rewind left holding the rows up to the checkpoint's step only."""
    metrics = MetricsLog(tmp_path, "orchestrator")
    for step in (0, 2, 4, 6):
        metrics.log(step, {"val/pass_rate": 0.5})
    metrics.log(3, {"val/missed": 1.0, "val/missed_reason": "gone"})
    validation = _validation(tmp_path, ValidationSchedule(1, 8))
    validation.restore([0, 1], [5], up_to=4, last_batch=6)
    assert validation.done == {0, 1, 2, 4} and validation.missed == {3}
    validation.record_missed(5, 7)  # a resumed trainer trains batches 4..6, on disk, before the first poll
    assert "the resumed trainer trained batches 4..6, on disk, before the first poll" in read_metrics(tmp_path)[-1][
        "val/missed_reason"]


# ---- a run, stopped and resumed -----------------------------------------------------------------------------------


class Generator:
    """Stands in for one vLLM server: serves the version the trainer last pushed ("default" before the first push);
    every sample is the EOS token alone, tagged with that version (the grader scores it wrong). A request for one of
    the prompts in `stalled` gets no answer until they are cleared (a validation still running when a run is
    killed)."""

    def __init__(self, eos: int):
        self.version: int | None = None
        self.stalled: set[tuple[int, ...]] = set()
        generator = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # /weight_info, /health
                version = generator.version
                self._send({"weight_version": "default" if version is None else str(version)})

            def do_POST(self):  # /inference/v1/generate
                prompt = tuple(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["token_ids"])
                while prompt in generator.stalled:
                    time.sleep(0.05)
                version = str(generator.version)
                with contextlib.suppress(OSError):  # the orchestrator that asked may be gone
                    self._send({"choices": [{"token_ids": [eos], "finish_reason": "stop",
                                             "logprobs": {"content": [{"logprob": -0.5}]},
                                             "weight_versions": [{"start": 0, "end": 1, "version": version}]}]})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Trainer:
    """The test's trainer: trains batch `step` the moment it is on disk (in no time: it outruns every poll of the
    orchestrator), then serves version `step` + 1 (PipelineRL pushes after every step)."""

    def __init__(self, run_dir: Path, generator: Generator, step: int):
        self.run_dir, self.generator, self.step = run_dir, generator, step
        self.stream = RolloutStream(run_dir)
        generator.version = step  # its first push

    def train_on_disk(self) -> None:
        """What a resumed trainer does before the orchestrator has started: train every batch already written."""
        while self.stream.ready(self.step):
            self._train()

    async def run(self, until: int) -> None:
        while self.step < until:
            if self.stream.ready(self.step):
                self._train()
            else:
                await asyncio.sleep(0.01)

    def _train(self) -> None:
        self.stream.read(self.step)
        self.step += 1
        self.generator.version = self.step

    def checkpoint(self) -> None:
        """`iter_<step>` with a copy of the orchestrator's state as it is now, as the real trainer's checkpoint."""
        copy = json.loads((self.run_dir / CURRICULUM_FILE).read_text())
        publish(CheckpointStore(self.run_dir, keep=3).path(self.step),
                lambda tmp: (tmp / "model.bin").write_bytes(b"w" * 64),
                {"step_state": {"step": self.step}, "curriculum": copy}, {"iteration": self.step})


async def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"waited 60 s for {what}"
        await asyncio.sleep(0.01)


async def _first_launch(orchestrator: Orchestrator, trainer: Trainer, generator: Generator) -> None:
    """Steps 0..3 validated; from step 4 on no validation finishes; the trainer checkpoints step 4 once batch 4 is
    written (the state copied: that of batch 4); at step 6 the orchestrator is killed (nothing more is saved)."""
    run = asyncio.create_task(orchestrator.run())
    validation = orchestrator.validation
    await trainer.run(3)
    await _until(lambda: set(range(4)) <= validation.settled() and all(t.done() for t in validation.started.values()),
                 "validations 0..3")
    assert validation.done == set(range(4)) and not validation.missed  # though the trainer outran every poll
    generator.stalled = {tuple(orchestrator.groups.prompt_ids(p)) for p in orchestrator.validation.problems}
    await trainer.run(4)
    await _until(lambda: trainer.stream.ready(4), "batch 4")  # written once validation 4 has started
    trainer.checkpoint()
    await trainer.run(6)
    await _until(lambda: set(range(7)) <= validation.settled(), "validations 4..6 to start")
    assert not run.done(), run
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run


async def _second_launch(orchestrator: Orchestrator, trainer: Trainer) -> None:
    await asyncio.wait_for(asyncio.gather(orchestrator.run(), trainer.run(STEPS)), 120)


def _recipe(tmp_path: Path, *extra: str, steps: int = STEPS):
    """The demo recipe on 60 jsonl prompts, validation at every step, PipelineRL-2, `steps` steps; `extra` overrides
    last."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"problem": f"{i} + {i} = ?", "answer": str(2 * i)}) + "\n"
                               for i in range(60)))
    return load_recipe("demo", [
        f"data.train=[{{kind: jsonl, path: '{prompts}'}}]", "data.validation_holdout=2", "data.validation_interval=1",
        "data.validation_generations=2", "rollout.prompts_per_step=2", "rollout.generations_per_prompt=2",
        "rollout.k=2", f"trainer.max_steps={steps}", "algorithm.zero_variance_filter=false", "forecast.live=false",
        "logging.wandb_mode=disabled", *extra])


def _tokenizer(recipe):
    texts = [render_prompt(Problem(f"t#{i}", f"{i} + {i} = ?", "")) + f"{i} {THINK_CLOSE} \\boxed{{{2 * i}}}" for i in range(60)]
    phrase = [recipe.algorithm.length_control.interruption_phrase] * 200  # a few tokens, as the demo's tokenizer
    return train_tokenizer(texts + phrase, vocab_size=recipe.model.vocab_size, markers=(THINK_OPEN, THINK_CLOSE))


def test_a_resumed_run_takes_every_scheduled_validation_or_records_it_missed_once(tmp_path):
    """Validation at every step (`data.validation_interval=1`) under PipelineRL-2. Launch 1: the trainer steps the
    moment each batch lands, yet every step is validated at its own version (the orchestrator holds each batch back
    until the validation of the version before it has started); the orchestrator is killed at step 6 while the
    validation of step 4 is still running, after the trainer's checkpoint of step 4. Launch 2 resumes from step 4:
    the launchers' rewind sets aside what came after the checkpoint's copy of the state, the resumed trainer trains
    batch 4, on disk, before the orchestrator's first poll, so step 4's weights are gone: its validation is
    recorded missed, saying why; every other step is validated once, to the last."""
    run_dir = tmp_path / "run"
    recipe = _recipe(tmp_path)
    tokenizer = _tokenizer(recipe)
    generator = Generator(tokenizer.eos_token_id)
    try:
        first = Orchestrator(run_dir, recipe, tokenizer, [generator.url], grader_workers=1)
        try:
            asyncio.run(_first_launch(first, Trainer(run_dir, generator, 0), generator))
        finally:
            first.close()
        generator.stalled = set()
        assert rewind_to_checkpoint(run_dir, print, metrics=True) == 4  # the launcher's, before any role starts
        assert RolloutStream(run_dir).next_index() == 5  # batches 0..4: those of the checkpoint's copy
        trainer = Trainer(run_dir, generator, 4)
        trainer.train_on_disk()
        resumed = Orchestrator(run_dir, recipe, tokenizer, [generator.url], resume=True, grader_workers=1)
        try:
            asyncio.run(_second_launch(resumed, trainer))
        finally:
            resumed.close()
    finally:
        generator.stalled = set()
        generator.server.shutdown()

    rows = read_metrics(run_dir, role="orchestrator")
    validated = {int(r["val/scheduled_step"]): r["step"] for r in rows if "val/pass_rate" in r}
    missed = {r["step"]: r["val/missed_reason"] for r in rows if "val/missed" in r}
    assert sum("val/pass_rate" in r for r in rows) == len(validated) and sum("val/missed" in r for r in rows) == 1
    assert validated == {step: step for step in range(STEPS + 1) if step != 4}  # each at its own version, once
    assert missed == {4: "the generators served step 5 before the orchestrator saw any of steps 4..4: the resumed "
                         "trainer trained batches 4..4, on disk, before the first poll"}
    state, _ = load_state(run_dir, STEPS - 1)
    assert state.validated == sorted(validated) and state.missed == [4]
