"""The SLURM launcher's parts that need no cluster: the allocation's roles and checks, the recipe's sbatch options
and the job's notes on them, preflight's parsers and node check on recorded output, GPU-hours from sacct, the launch's
wait for its generators (the trainer starting meanwhile), the supervisor's handling of generators that keep dying,
and its restarts of a failed trainer or orchestrator within the launch's budget."""

import dataclasses
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_scalerl.errors import UserError
from megatron_scalerl.launch import supervise
from megatron_scalerl.launch.allocation import Allocation, Group, Node, _per_node_count, lost_nodes, nodes_not_yet_gone
from megatron_scalerl.launch.preflight import node_problems, parse_nccl_tests
from megatron_scalerl.launch.slurm import cluster_notes, cluster_options, end_of_roles, job_roles, sbatch_lines
from megatron_scalerl.launch.supervise import (
    ALLOCATION_LOST,
    LAUNCH_ENV,
    Restarts,
    Role,
    _supervise,
    _wait_ready,
    kill_carrying,
    run_roles,
)
from megatron_scalerl.platform import free_port
from megatron_scalerl.ports import LISTEN_PORTS
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.directory import FINISHED_FILE, STOP_FILE, read_finished, read_generators, stop_requested
from megatron_scalerl.run.gpu_hours import ComputeMeter, parse_sacct, record_job

NCCL_TESTS = Path(__file__).parent / "data" / "nccl_tests"
SBATCH_FILES = Path(__file__).resolve().parents[1] / "slurm"
DEMO = load_recipe("demo")  # two trainer nodes x 1, one generator node


def _alloc(trainer_nodes=2, generator_nodes=1, gpus=1, cpus=2) -> Allocation:
    nodes = [Node(f"gpu{i}", f"10.0.0.{i}") for i in range(trainer_nodes + generator_nodes)]
    return Allocation(4321, 0, Group(nodes[:trainer_nodes], gpus, cpus), Group(nodes[trainer_nodes:], gpus, cpus),
                      ("4321", "4322"))


@pytest.mark.parametrize("name, busbw", [("all_reduce_perf_h100x8.txt", 448.212),
                                         ("all_reduce_perf_efa_2nodes_mpirun.txt", 1.15327)])
def test_nccl_tests_average_bus_bandwidth_from_recorded_runs(name, busbw):
    assert parse_nccl_tests((NCCL_TESTS / name).read_text()) == pytest.approx(busbw)


def test_nccl_tests_output_that_never_finished_is_refused():
    text = (NCCL_TESTS / "all_reduce_perf_h100x8.txt").read_text().split("# Out of bounds")[0]
    with pytest.raises(ValueError, match="Avg bus bandwidth"):
        parse_nccl_tests(text)


def test_sacct_gpu_hours_sum_every_allocation_and_requeued_run():
    # sacct -X -n -P --duplicates -o JobID,ElapsedRaw,AllocTRES: two het components (4 and 8 nodes of 8 GPUs), the
    # first run requeued after 600 s
    text = ("4321+0|600|billing=256,cpu=256,gres/gpu=32,mem=2000G,node=4\n"
            "4321+1|600|billing=512,cpu=512,gres/gpu=64,mem=4000G,node=8\n"
            "4321+0|3000|billing=256,cpu=256,gres/gpu=32,mem=2000G,node=4\n"
            "4321+1|3000|billing=512,cpu=512,gres/gpu=64,mem=4000G,node=8\n")
    assert parse_sacct(text) == pytest.approx((600 + 3000) * 96 / 3600)
    assert parse_sacct("4321+0|600|billing=2,cpu=2,mem=1G,node=1\n") is None  # no GPU TRES: not GPU-hours


def test_compute_meter_takes_sacct_when_it_answers(tmp_path, monkeypatch):
    meter = ComputeMeter(tmp_path, gpus=16)
    assert meter.figures()["gpu_hours_source"] == "wall"  # not a SLURM run
    record_job(tmp_path, 4321)
    record_job(tmp_path, 4321)
    assert (tmp_path / "slurm_jobs.txt").read_text() == "4321\n"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sacct = bin_dir / "sacct"  # stands in for SLURM's sacct on a cluster with accounting
    sacct.write_text("#!/bin/sh\necho '4321+0|7200|cpu=8,gres/gpu=8,node=1'\necho '4321+1|7200|cpu=8,gres/gpu=8,node=1'\n")
    sacct.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    figures = ComputeMeter(tmp_path, gpus=16).figures()
    assert figures["gpu_hours_source"] == "sacct" and figures["gpu_hours"] == pytest.approx(32.0, abs=0.01)
    sacct.write_text("#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n")
    assert ComputeMeter(tmp_path, gpus=16).figures()["gpu_hours_source"] == "wall"


@pytest.mark.parametrize("value, count", [("8", 8), ("gpu:8", 8), ("h100:4", 4), ("64(x4)", 64), ("", None),
                                          (None, None)])
def test_slurm_per_node_counts(value, count):
    assert _per_node_count(value) == count


def test_allocation_smaller_than_the_recipe_is_refused_naming_both():
    with pytest.raises(UserError, match=r"trainer group has 1 node\(s\), the recipe needs cluster.trainer_nodes=2"):
        _alloc(trainer_nodes=1).check(DEMO)
    with pytest.raises(UserError, match=r"holds 1 GPU\(s\) per node, the recipe needs cluster.gpus_per_node=8"):
        _alloc().check(load_recipe("demo", ["cluster.gpus_per_node=8"]))
    _alloc().check(DEMO)


def test_job_roles_place_generators_and_trainer_on_their_groups(tmp_path):
    alloc = _alloc()
    generators, urls, trainer, orchestrator = job_roles(tmp_path, DEMO, alloc, resume=True, cuda=False)
    assert urls == [f"http://10.0.0.2:{alloc.base_port + 2}"]
    assert read_generators(tmp_path) == (urls, "float32")
    [generator] = generators
    assert generator.command[:2] == ["srun", "--het-group=1"] and "--nodelist=gpu2" in generator.command
    # the generator listens on its node's address only (where the trainer and the orchestrator reach it)
    assert "--gpus-per-task=1" in generator.command and generator.command[generator.command.index("--host") + 1] \
        == "10.0.0.2"
    assert trainer.command[:2] == ["srun", "--het-group=0"] and "--nodes=2" in trainer.command
    assert 'PET_NODE_RANK=$SLURM_NODEID exec "$@"' in trainer.command
    assert "--nnodes=2" in trainer.command and "--master-addr=10.0.0.0" in trainer.command
    assert f"--master-port={alloc.base_port}" in trainer.command
    assert orchestrator.command[-1] == "--resume" and "srun" not in orchestrator.command
    assert generator.terminate is not None  # SIGTERM through SLURM, not srun
    (tmp_path / STOP_FILE).touch()  # a stop request left by an earlier launch is gone before the trainer starts
    _, _, trainer, _ = job_roles(tmp_path, DEMO, alloc, resume=True, cuda=False)
    assert not stop_requested(tmp_path)
    assert trainer.terminate() and stop_requested(tmp_path)  # the trainer is asked through the run directory


def test_every_jobs_ports_lie_below_the_ephemeral_range_and_above_the_local_launches():
    """A port in the ephemeral range may be held by any outgoing connection of the node (the CI failure: job 359's
    port 55900 'in use' on both of its nodes); this machine's range is the oracle, Linux's default where unreadable."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    ephemeral_start = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    jobs = [dataclasses.replace(_alloc(), job_id=job_id) for job_id in range(1, 2000)]
    ports = {port for alloc in jobs for port in (alloc.base_port, alloc.base_port + 1, *alloc.generator_ports(98),
                                                 *alloc.generator_master_ports(49))}
    assert max(ports) < min(ephemeral_start, 32768) and min(ports) >= LISTEN_PORTS.stop
    assert len({alloc.base_port for alloc in jobs[:127]}) == 127  # 127 consecutive jobs run on different ports


def test_a_generator_larger_than_a_node_spans_nodes_with_one_step(tmp_path):
    """generator_tp 16 on nodes of 8 GPUs: one server per two nodes, one srun step over both; each node learns its
    rank and address from its name (the order SLURM gives the step's tasks is its own), node 0's address is the URL
    and where the nodes meet, on a port apart from the HTTP ones."""
    recipe = load_recipe("scalerl", ["parallelism.generator_tp=16", "cluster.generator_nodes=4",
                                     "cluster.trainer_nodes=2"])
    alloc = _alloc(trainer_nodes=2, generator_nodes=4, gpus=8)
    generators, urls, _, _ = job_roles(tmp_path, recipe, alloc, resume=False, cuda=True)
    assert urls == [f"http://10.0.0.2:{alloc.base_port + 2}", f"http://10.0.0.4:{alloc.base_port + 3}"]
    second = generators[1].command
    assert "--nodes=2" in second and "--nodelist=gpu4,gpu5" in second and "--gpus-per-task=8" in second
    serve = second[second.index("serve"):]
    assert serve[serve.index("--nnodes") + 1] == "2" and serve[serve.index("--tp") + 1] == "16"
    assert serve[serve.index("--master-addr") + 1] == "10.0.0.4"
    assert serve[serve.index("--master-port") + 1] == str(alloc.base_port + 98)
    prefix = second[second.index("bash"):second.index("serve") - 3]  # bash -c SCRIPT generator
    for name, rank, address in (("gpu4", "0", "10.0.0.4"), ("gpu5", "1", "10.0.0.5")):
        shown = subprocess.run([*prefix, "sh", "-c", 'echo "$SCALERL_NODE_RANK $VLLM_HOST_IP"'], capture_output=True,
                               text=True, env={**os.environ, "SLURMD_NODENAME": name}, timeout=10)
        assert shown.stdout.split() == [rank, address]
    stray = subprocess.run([*prefix, "true"], capture_output=True, text=True,
                           env={**os.environ, "SLURMD_NODENAME": "gpu9"}, timeout=10)
    assert stray.returncode == 1 and "gpu9 is not a node of this server" in stray.stderr


def test_the_recipes_partition_account_and_time_limit_are_sbatch_options_unless_the_submission_chooses_them(tmp_path):
    cluster = load_recipe("demo", ["cluster.partition=gpu", "cluster.account=rl"]).cluster
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --job-name=x\n# a comment\n#SBATCH -A other\nset -e\n#SBATCH -p late\n")
    # the account is the script's; an #SBATCH line after the first command is not one (sbatch stops reading there)
    assert cluster_options(cluster, script, {}) == ["--partition=gpu", "--time=00:30:00"]
    assert cluster_options(cluster, script, {"SBATCH_TIMELIMIT": "1:00:00", "SBATCH_PARTITION": ""}) == [
        "--partition=gpu"]
    read_once = sbatch_lines(script)  # a sweep's way: the file's options read once, handed to every run
    assert read_once == ["--job-name=x", "-A", "other"]
    assert cluster_options(cluster, read_once, {}) == cluster_options(cluster, script, {})
    for name in ("scalerl_moe", "scalerl_dense"):  # the shipped files choose none of the three
        assert cluster_options(DEMO.cluster, SBATCH_FILES / f"{name}.sbatch", {}) == ["--time=00:30:00"]


def test_a_job_submitted_by_hand_says_where_it_differs_from_the_recipes_cluster_section():
    job = ("JobId=7 HetJobId=7 HetJobOffset=0 JobName=scalerl-moe Partition=cpu Account=(null) TimeLimit=2-00:00:00 "
           "TimeMin=N/A\nJobId=8 HetJobId=7 HetJobOffset=1 Partition=cpu Account=(null) TimeLimit=2-00:00:00\n")
    assert cluster_notes(load_recipe("demo", ["cluster.partition=cpu", "cluster.time_limit='48:00:00'"]).cluster,
                         job) == []
    notes = cluster_notes(load_recipe("scalerl", ["cluster.partition=gpu"]).cluster, job)
    assert notes == [
        "note: this job has Partition=cpu, not the recipe's cluster.partition gpu: the submission's own (sbatch "
        "--partition, SBATCH_PARTITION or an #SBATCH line) or the cluster's default applies (`scalerl sweep --slurm` "
        "submits with the recipe's)",
        "note: this job has TimeLimit=2-00:00:00, not the recipe's cluster.time_limit 7-00:00:00: the submission's own "
        "(sbatch --time, SBATCH_TIMELIMIT or an #SBATCH line) or the cluster's default applies (`scalerl sweep "
        "--slurm` submits with the recipe's)"]
    unlimited = job.replace("TimeLimit=2-00:00:00", "TimeLimit=UNLIMITED")
    assert cluster_notes(load_recipe("demo", ["cluster.time_limit='0'"]).cluster, unlimited) == []


def test_node_check_names_each_problem(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert node_problems(tmp_path / "run", model, [], None, None) == []
    a_file = tmp_path / "file"
    a_file.write_text("")
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        problems = node_problems(a_file / "run", tmp_path / "missing", [port], None, None)
    assert len(problems) == 3
    assert "not writable" in problems[0] and "missing is not visible" in problems[1] and f"port {port}" in problems[2]


def _role(tmp_path, name, code):
    return Role(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


HEALTH_AFTER_2_S = """
import http.server, sys, time
time.sleep(2)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_launch_waits_for_its_generators_while_the_trainer_starts(tmp_path):
    port = free_port()
    generator = Role("generator 0", [sys.executable, "-c", HEALTH_AFTER_2_S, str(port)], tmp_path / "g.log").start()
    trainer = _role(tmp_path, "trainer", "import time; time.sleep(60)").start()
    try:
        _wait_ready([generator], [f"http://127.0.0.1:{port}"], trainer, timeout_s=60)
        assert generator.process.poll() is None and trainer.process.poll() is None
        finished = _role(tmp_path, "finished trainer", "pass").start()  # a resumed run with nothing left to train
        finished.process.wait(timeout=30)
        _wait_ready([generator], [f"http://127.0.0.1:{port}"], finished, timeout_s=60)
        failing = _role(tmp_path, "failing trainer", "import sys; print('bad checkpoint'); sys.exit(2)").start()
        failing.process.wait(timeout=30)
        with pytest.raises(UserError, match="(?s)failing trainer exited with code 2 while the generators started.*bad "
                                            "checkpoint"):
            _wait_ready([generator], [f"http://127.0.0.1:{free_port()}"], failing, timeout_s=60)
        with pytest.raises(UserError, match=r"generator 0 \(http://127.0.0.1:\d+\) not healthy within 1 s"):
            _wait_ready([generator], [f"http://127.0.0.1:{free_port()}"], trainer, timeout_s=1)
    finally:
        generator.stop(timeout_s=5)
        trainer.stop(timeout_s=5)


# an orchestrator that ends the run in RUN (argv[1]) and exits after argv[2] seconds
ENDS_THE_RUN = ("import sys, time; from megatron_scalerl.run.directory import write_finished; "
                "write_finished(sys.argv[1], 'max_steps', 10, 0.5); time.sleep(float(sys.argv[2]))")


@pytest.mark.parametrize("exits_after_s", [None, 0, 60], ids=["in-progress", "ended", "ending"])
def test_a_time_limit_warning_after_the_run_ended_requeues_nothing(tmp_path, capsys, exits_after_s):
    """Real processes as roles and a real USR1 six seconds in, then the job's decision. The orchestrator has not
    ended the run (None: the job is requeued, as test_slurm.py's requeue test runs it), or it has: exited 0 with the
    trainer finishing, or written RUN/finished.json and still exiting. A requeue there would call scontrol, which has
    no cluster to reach in this test and fails it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port = free_port()
    generator = Role("generator 0", [sys.executable, "-c", HEALTH_AFTER_2_S, str(port)], tmp_path / "g.log")
    trainer = _role(tmp_path, "trainer", "import time; time.sleep(60)")
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(60)") if exits_after_s is None else \
        Role("orchestrator", [sys.executable, "-c", ENDS_THE_RUN, str(run_dir), str(exits_after_s)],
             tmp_path / "orchestrator.log")
    warning = threading.Timer(6.0, os.kill, (os.getpid(), signal.SIGUSR1))  # the generator is ready after ~2 s
    warning.start()
    try:
        code = run_roles("job 4321", [generator], [f"http://127.0.0.1:{port}"], trainer, orchestrator, api_key="k",
                         stop_signals=(signal.SIGUSR1,))
    finally:
        warning.cancel()
    assert code == 128 + signal.SIGUSR1
    assert all(role.process.poll() is not None for role in (generator, trainer, orchestrator))
    assert (orchestrator.process.returncode == 0) == (exits_after_s == 0)
    if exits_after_s is not None:
        assert end_of_roles(code, run_dir, _alloc()) == 0
        out = capsys.readouterr().out
        assert f"job 4321: the run has ended ({run_dir / FINISHED_FILE}): nothing to requeue" in out, out
    else:
        assert read_finished(run_dir) is None  # end_of_roles requeues it
    assert end_of_roles(1, run_dir, _alloc()) == 1  # a failed run's code is the job's


def test_supervisor_gives_up_a_generator_that_keeps_dying_and_the_run_goes_on(tmp_path, capsys):
    trainer = _role(tmp_path, "trainer", "import time; time.sleep(8)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(8)").start()
    dead = _role(tmp_path, "generator 0", "import sys; print('node gone'); sys.exit(3)").start()
    alive = _role(tmp_path, "generator 1", "import time; time.sleep(30)").start()
    try:
        assert _supervise(trainer, orchestrator, [dead, alive]) == 0
    finally:
        alive.stop(timeout_s=5)
    err = capsys.readouterr().err
    assert "generator 0 exited 3 times" in err and "given up" in err and dead.restarts == 2


def test_supervisor_fails_the_run_when_no_generator_is_left(tmp_path, capsys):
    trainer = _role(tmp_path, "trainer", "import time; time.sleep(30)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(30)").start()
    dead = _role(tmp_path, "generator 0", "import sys; sys.exit(3)").start()
    try:
        assert _supervise(trainer, orchestrator, [dead]) == 1
    finally:
        trainer.stop(timeout_s=5)
        orchestrator.stop(timeout_s=5)
    assert "no generator left" in capsys.readouterr().err


def test_what_a_stopped_role_left_in_another_session_is_killed(tmp_path):
    """A role's child in a session of its own (as torchrun starts workers, and what a SIGKILLed worker had started)
    outlives the role's process-group kill; the launch id in its environment finds it."""
    launch_id = f"test-{os.getpid()}-{time.monotonic_ns()}"
    code = ("import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
            "start_new_session=True); print(child.pid, flush=True)")
    role = _role(tmp_path, "trainer", code)
    role.env[LAUNCH_ENV] = launch_id
    role.start().process.wait(timeout=60)
    child = int(role.log.read_text().split()[0])
    role.stop(timeout_s=5)
    assert _running(child)  # the group kill did not reach it
    assert [line.split()[0] for line in kill_carrying(f"{LAUNCH_ENV}={launch_id}")] == [str(child)]
    deadline = time.monotonic() + 30
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child) and kill_carrying(f"{LAUNCH_ENV}={launch_id}") == []


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_supervisor_restarts_a_failed_trainer_and_a_resumed_orchestrator_and_the_run_ends(tmp_path, capsys):
    """The trainer fails once (its first start); the launch restarts it and the orchestrator, whose command becomes
    the resumed one, after `prepare` (the rewind) said which step the trainer resumes from; the run then ends."""
    marker = tmp_path / "failed_once"
    trainer = _role(tmp_path, "trainer", f"import pathlib, sys, time\np = pathlib.Path({str(marker)!r})\n"
                                         "if not p.exists(): p.touch(); sys.exit(3)\ntime.sleep(2)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(60)").start()
    calls = []
    restarts = Restarts(2, 0.0, lambda n, cause: calls.append((n, cause)) or 0,
                        [sys.executable, "-c", "import time; time.sleep(1); print('resumed')"])
    try:
        assert _supervise(trainer, orchestrator, [], [], restarts) == 0
    finally:
        orchestrator.stop(timeout_s=5)
    out = capsys.readouterr().out
    assert calls == [(1, "trainer failed (exit 3)")] and restarts.done == 1
    assert "restarting the trainer and the orchestrator from the last checkpoint in 0 s (restart 1 of 2)" in out
    assert orchestrator.command == restarts.resumed_orchestrator and "resumed" in orchestrator.log.read_text()


def test_supervisor_stops_a_failure_that_repeats_once_the_budget_is_spent(tmp_path, capsys):
    # each start logs the cause of its exit as our roles do (the launch names the last one of the failed start)
    trainer = _role(tmp_path, "trainer", "import sys, time; print('poisoned batch'); print(f'{time.time()} trainer "
                                         "ERROR batch 3 is poisoned'); sys.exit(5)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(60)").start()
    calls = []
    restarts = Restarts(2, 0.0, lambda n, cause: calls.append(n) or 0, [sys.executable, "-c", "import time; "
                                                                        "time.sleep(60)"])
    try:
        assert _supervise(trainer, orchestrator, [], [], restarts) == 1
    finally:
        orchestrator.stop(timeout_s=5)
    err = capsys.readouterr().err
    assert calls == [1, 2] and "poisoned batch" in err
    assert ("no restart left (launch.max_restarts 2 spent): the run stops; last cause: trainer failed (exit 5): batch "
            "3 is poisoned") in err


WEIGHT_INFO = """
import http.server, json, pathlib, sys
port, marker, mode = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
restarted = marker.exists()
marker.touch()
served = {"version": "4" if restarted else "7"}  # the first start holds the failed trainer's 7; started again: 4
served["open_update"] = mode == "inside_an_update" and not restarted
class Server(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /weight_info, /is_paused
        self.answer(200, {"weight_version": served["version"], "is_paused": served["open_update"]})
    def do_POST(self):  # /finish_weight_update, /update_weight_version
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/finish_weight_update" and served["open_update"]:
            served["open_update"] = False
            return self.answer(200, {})
        if (mode == "deaf" and not restarted) or served["open_update"] or self.path != "/update_weight_version":
            return self.answer(500, {"error": "busy"})
        served["version"] = body["new_version"]
        if mode in ("trained_on", "inside_an_update"):  # the restarted trainer's pushes come at once
            served["version"] = "5" if mode == "trained_on" else "4"
        self.answer(200, {"success": True})
    def answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
http.server.HTTPServer(("127.0.0.1", port), Server).serve_forever()
"""


def _until_answering(port: int, timeout_s: float = 60.0) -> None:
    """Return once something accepts connections on 127.0.0.1:`port` (AssertionError after `timeout_s` seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing answers on port {port} after {timeout_s:g} s"
            time.sleep(0.05)


@pytest.mark.parametrize("mode, said", [
    ("stuck", "did not get the restarted trainer's weights (policy 4 or later) within 2 s: starting it again"),
    ("deaf", "cannot be readied for the restarted trainer (stuck in a receive of the failed trainer's weights?): "
             "starting it again"),
    ("inside_an_update", None), ("trained_on", None)])
def test_after_a_restart_a_generator_serves_the_restarted_trainers_weights_before_the_orchestrator_starts(
        tmp_path, capsys, monkeypatch, mode, said):
    """After a restart the trainer resumes from step 4; a live generator holds the failed trainer's policy 7. Its
    weights are tagged lost first; then it must serve policy 4 or later. `stuck`: it takes the tag but never gets
    the weights: started again after STUCK_GENERATOR_S, it gets 4. `deaf`: it does not take the tag (a receive
    blocks it): started again at once. `inside_an_update`: the failed trainer died inside a push (the server is
    paused, an update open): the update is closed, then tagged. `trained_on`: the trainer's next pushes reach it
    before the supervisor looks (it serves 5): that is the restarted trainer's too, and the orchestrator starts."""
    monkeypatch.setattr(supervise, "STUCK_GENERATOR_S", 2.0)
    port = free_port()
    generator = Role("generator 0", [sys.executable, "-c", WEIGHT_INFO, str(port), str(tmp_path / "started"), mode],
                     tmp_path / "g.log").start()
    _until_answering(port)  # a loaded machine may start it slower than the trainer fails: the modes are about later
    marker = tmp_path / "failed_once"
    trainer = _role(tmp_path, "trainer", f"import pathlib, sys, time\np = pathlib.Path({str(marker)!r})\n"
                                         "if not p.exists(): p.touch(); sys.exit(3)\ntime.sleep(4)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(60)").start()
    restarts = Restarts(1, 0.0, lambda n, cause: 4, [sys.executable, "-c", "import time; time.sleep(1)"])
    try:
        assert _supervise(trainer, orchestrator, [generator], [f"http://127.0.0.1:{port}"], restarts) == 0
    finally:
        generator.stop(timeout_s=5)
        orchestrator.stop(timeout_s=5)
    out = capsys.readouterr().out
    assert (f"generator 0 (http://127.0.0.1:{port}) {said}" in out) if said else "starting it again" not in out
    assert "restart 1: the trainer resumed from step 4 and the generators serve its weights" in out


SHOW_NODE = """NodeName=gpu0 Arch=x86_64 CoresPerSocket=1 CPUAlloc=2 CPUTot=2 NodeAddr=10.0.0.0 State=ALLOCATED ThreadsPerCore=1
NodeName=gpu1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 NodeAddr=10.0.0.1 State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Reason=Not responding [slurm@2026-11-26T10:00:00]
NodeName=gpu3 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 NodeAddr=10.0.0.3 State=IDLE* ThreadsPerCore=1
NodeName=gpu4 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 NodeAddr=10.0.0.4 State=DOWN* ThreadsPerCore=1 Reason=gone
NodeName=gpu2 Arch=x86_64 CoresPerSocket=1 CPUAlloc=2 CPUTot=2 NodeAddr=10.0.0.2 State=MIXED+DRAIN ThreadsPerCore=1 Reason=disk check [root@2026-11-26T09:00:00]
"""


def test_a_failure_on_an_allocation_that_lost_a_node_ends_the_launch_for_a_requeue(tmp_path, capsys):
    """`scontrol -o show node` names the lost node (a draining one still runs its jobs); a role that fails then is
    not restarted on the same allocation: the launch ends with ALLOCATION_LOST (the job is requeued)."""
    assert lost_nodes(SHOW_NODE) == ["gpu1 (DOWN+NOT_RESPONDING: Not responding [slurm@2026-11-26T10:00:00])",
                                     "gpu3 (IDLE*: no reason given)", "gpu4 (DOWN*: gone)"]
    assert nodes_not_yet_gone(SHOW_NODE) == ["gpu3"]  # not answering, SlurmdTimeout not yet over: the job waits
    trainer = _role(tmp_path, "trainer", "import sys; sys.exit(1)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(60)").start()
    calls = []
    restarts = Restarts(3, 0.0, lambda n, cause: calls.append(n) or 0, [], lambda: "lost node(s): gpu1 (DOWN)")
    try:
        assert _supervise(trainer, orchestrator, [], [], restarts) == ALLOCATION_LOST
    finally:
        orchestrator.stop(timeout_s=5)
    assert calls == [] and "trainer failed (exit 1) and this allocation cannot run it again: lost node(s): gpu1" in (
        capsys.readouterr().err)
    trainer = _role(tmp_path, "trainer", "import time; time.sleep(60)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(60)").start()
    generator = _role(tmp_path, "generator 0", "import sys; sys.exit(9)").start()  # its node died
    try:
        assert _supervise(trainer, orchestrator, [generator], ["http://gpu1:20002"], restarts) == ALLOCATION_LOST
    finally:
        trainer.stop(timeout_s=5)
        orchestrator.stop(timeout_s=5)
    assert "generator 0 exited (code 9) and this allocation cannot run it again" in capsys.readouterr().err
    assert generator.restarts == 0




def test_a_failure_that_would_end_the_launch_waits_for_slurm_to_report_a_lost_node(tmp_path, capsys):
    """A step on a node whose slurmd died fails at once, before SLURM reports the node (the lost-node test on a
    loaded machine: the only generator given up within seconds, the node NOT_RESPONDING a minute later). Before the
    launch ends for good (no generator left; no restart left), it asks again until `settle_s` have passed."""

    def reported_from_call(n):  # SLURM reports the node from the n-th question on
        call = itertools.count(1)
        return lambda: "lost node(s): gpu2 (DOWN*)" if next(call) >= n else None

    # three quick exits, each asked about (calls 1-3), then the last generator's: asked at once (4), then waited on
    restarts = Restarts(0, 0.0, lambda n, cause: 0, [], reported_from_call(6), settle_s=30.0)
    trainer = _role(tmp_path, "trainer", "import time; time.sleep(60)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(60)").start()
    generator = _role(tmp_path, "generator 0", "import sys; sys.exit(233)").start()  # srun: launch failed
    try:
        assert _supervise(trainer, orchestrator, [generator], ["http://gpu2:20002"], restarts) == ALLOCATION_LOST
    finally:
        trainer.stop(timeout_s=5)
        orchestrator.stop(timeout_s=5)
    err = capsys.readouterr().err
    assert "no generator left: waiting up to 30 s for SLURM to report whether a node of this allocation is lost" in err
    assert "no generator left and this allocation cannot run it again: lost node(s): gpu2" in err, err
    restarts.allocation_lost = reported_from_call(3)  # the trainer fails, no restart left (max_restarts 0)
    trainer = _role(tmp_path, "trainer", "import sys; sys.exit(1)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(60)").start()
    try:
        assert _supervise(trainer, orchestrator, [], [], restarts) == ALLOCATION_LOST
    finally:
        orchestrator.stop(timeout_s=5)
    assert "trainer failed (exit 1): waiting up to 30 s" in capsys.readouterr().err
    restarts.allocation_lost, restarts.settle_s = reported_from_call(10), 1.0  # nothing reported within it: it ends
    trainer = _role(tmp_path, "trainer", "import sys; sys.exit(1)").start()
    orchestrator = _role(tmp_path, "orchestrator", "import time; time.sleep(60)").start()
    try:
        assert _supervise(trainer, orchestrator, [], [], restarts) == 1
    finally:
        orchestrator.stop(timeout_s=5)

def _scontrol_answering(node_states: list[str], calls: list[tuple[str, ...]], *, slurmd_timeout_s: int = 1,
                        signal_at_poll: tuple[int, int] | None = None, requeue_error: str = "", restarts: int = 0):
    """`scontrol` as SLURM answers a job that lost gpu1: SlurmdTimeout `slurmd_timeout_s`; gpu1's state, poll by poll,
    from `node_states` (its last one from then on); `signal_at_poll` (signal, poll): that signal raised at that
    `show node` poll; `requeue` failing with `requeue_error` if given; the job's `Restarts=` count `restarts`. Each
    call is recorded in `calls`."""
    def scontrol(*args: str) -> str:
        calls.append(args)
        if args[:2] == ("show", "config"):
            return f"SlurmctldTimeout        = 120 sec\nSlurmdTimeout           = {slurmd_timeout_s} sec\n"
        if args[:3] == ("-o", "show", "node"):
            polls = sum(call[:3] == ("-o", "show", "node") for call in calls)
            if signal_at_poll and polls == signal_at_poll[1]:
                signal.raise_signal(signal_at_poll[0])
            state = node_states[min(polls, len(node_states)) - 1]
            return (f"NodeName=gpu0 NodeAddr=10.0.0.0 State=ALLOCATED\nNodeName=gpu1 NodeAddr=10.0.0.1 State={state}\n"
                    "NodeName=gpu2 NodeAddr=10.0.0.2 State=ALLOCATED\n")
        if args[:3] == ("-o", "show", "job"):
            return f"JobId=4321 HetJobOffset=0 JobState=PENDING Restarts={restarts}\n"
        if args[0] == "requeue" and requeue_error:
            raise UserError(f"scontrol requeue failed (exit 1): {requeue_error}")
        return ""
    return scontrol


def _slurm_answering(monkeypatch, scontrol):
    """launch.slurm with its scontrol calls (and launch.allocation's) answered by `scontrol`, polling every 10 ms and
    waiting no margin past SlurmdTimeout."""
    from megatron_scalerl.launch import allocation, slurm

    monkeypatch.setattr(slurm, "scontrol", scontrol)
    monkeypatch.setattr(allocation, "scontrol", scontrol)
    monkeypatch.setattr(slurm, "NODE_LOSS_POLL_S", 0.01)
    monkeypatch.setattr(slurm, "NODE_LOSS_MARGIN_S", 0.0)
    return slurm


@pytest.mark.parametrize("states, settings, message, code, polls", [
    # DOWN in two polls in a row (SLURM's own requeue has had its chance), then requeued here
    (["ALLOCATED*", "DOWN*", "ALLOCATED*", "DOWN*", "DOWN*"], {}, "the lost node(s) are DOWN, or answer again", 0, 5),
    (["ALLOCATED*", "ALLOCATED", "ALLOCATED"], {}, "the lost node(s) are DOWN, or answer again", 0, 3),  # it is back
    (["ALLOCATED*"], {}, "SLURM did not declare the lost node(s) DOWN within 1 s", 0, None),
    (["ALLOCATED*"], {"signal_at_poll": (signal.SIGUSR1, 2)}, "its time is up first", 0, 2),
    (["ALLOCATED*", "DOWN*"], {"signal_at_poll": (signal.SIGTERM, 2)}, "stopped by SIGTERM (SLURM's requeue",
     128 + signal.SIGTERM, 2),
    (["ALLOCATED*"], {"slurmd_timeout_s": 0}, "SlurmdTimeout 0: SLURM does not declare a node DOWN", 0, 0),
    (["DOWN*"], {"requeue_error": "Job is pending execution", "restarts": 1}, "SLURM has requeued it already", 0, 2),
])
def test_a_job_that_lost_a_node_waits_for_slurm_to_declare_it_down_before_a_requeue(
        monkeypatch, capsys, states, settings, message, code, polls):
    """After a lost node the job requeues only once SLURM has declared the node DOWN (or it answers again), else at
    the time-limit warning, after SlurmdTimeout + the margin, or at once with SlurmdTimeout 0; SLURM's own requeue
    (SIGTERM) ends the wait, and a requeue SLURM made already is recognised."""
    calls: list[tuple[str, ...]] = []
    slurm = _slurm_answering(monkeypatch, _scontrol_answering(states, calls, **settings))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    assert slurm.requeue_after_node_loss(_alloc()) == code
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # the handlers given back
    out = capsys.readouterr().out
    assert message in out
    assert ("waiting up to 1 s for SLURM to declare the lost node(s) DOWN (SlurmdTimeout 1 s)" in out) == (
        settings.get("slurmd_timeout_s", 1) == 1)
    assert (("requeue", "4321") in calls) == (code == 0)
    if polls is not None:
        assert sum(call[:3] == ("-o", "show", "node") for call in calls) == polls


def test_a_requeue_that_fails_for_another_reason_is_not_taken_for_slurms(monkeypatch):
    slurm = _slurm_answering(monkeypatch, _scontrol_answering(["DOWN*"], [], requeue_error="Access/permission denied"))
    with pytest.raises(UserError, match="Access/permission denied"):
        slurm.requeue_after_node_loss(_alloc())
