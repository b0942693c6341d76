"""Test-wide environment: offline wandb and HF hub, one thread per process (2-core CI machines), one forkserver per
test process preloaded for both of its users, the schedule of files by their measured durations, and the `bwrap`
fixture of the code verifier's attack tests."""

import json
import multiprocessing
import multiprocessing.forkserver
import os
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")

DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help=f"write each file's test seconds of this run into {DURATIONS.name} (make test-durations); "
                          "files that did not run keep theirs")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _known_seconds() -> dict[str, float]:
    return json.loads(DURATIONS.read_text())["files"] if DURATIONS.exists() else {}


def pytest_collection_modifyitems(config, items):
    """The files longest first, by the seconds tests/durations.json gives them (a stable sort, so a file's tests keep
    their order): with `-n 2 --dist loadfile --no-loadscope-reorder` (make test) each worker takes the next longest
    file when it is nearly done with its own, so the long files start first and the short ones fill in at the end
    and both workers finish together. A file the durations do not know goes last and is named at the end."""
    seconds = _known_seconds()
    config._unknown_files = sorted({_file_of(item.nodeid) for item in items} - set(seconds))
    items.sort(key=lambda item: -seconds.get(_file_of(item.nodeid), 0.0))


class _DurationRecorder:
    """Sums each file's setup + call + teardown seconds as the reports arrive (in the controller under xdist)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[_file_of(report.nodeid)] += report.duration


def pytest_configure(config):
    if config.getoption("--record-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_DurationRecorder(), "scalerl-durations")


def _machine(config) -> dict:
    """Where this run's timings were taken: cores, CPU model, torch's capability, whether bf16 is native."""
    import torch

    from megatron_scalerl.platform.precision import CPUINFO, cpu_bf16_support

    names = [line.split(":", 1)[1].strip() for line in CPUINFO.read_text().splitlines()
             if line.startswith("model name")] if CPUINFO.is_file() else []
    return {"cores": len(os.sched_getaffinity(0)), "cpu": names[0] if names else "unknown",
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "bf16": cpu_bf16_support()[1],
            "workers": config.getoption("numprocesses", None)}


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    measured = _machine(config)
    terminalreporter.write_line(f"measured on: {measured}")  # every timing says where (CI keeps a log's tail)
    recorder = config.pluginmanager.get_plugin("scalerl-durations")
    if recorder is not None:
        files = {**_known_seconds(), **{f: round(s, 1) for f, s in recorder.seconds.items()}}
        DURATIONS.write_text(json.dumps({"measured_on": measured, "files": dict(sorted(
            files.items(), key=lambda kv: -kv[1]))}, indent=1) + "\n")
        terminalreporter.write_line(f"{DURATIONS}: {len(recorder.seconds)} files' seconds recorded")
    unknown = getattr(config, "_unknown_files", [])
    if unknown:
        named = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        terminalreporter.write_line(f"{len(unknown)} file(s) not in tests/{DURATIONS.name}, so scheduled last: "
                                    f"{named} (refresh it: make test-durations)")


@pytest.fixture(scope="session", autouse=True)
def shared_forkserver():
    """The trainer's local gloo workers (`platform.local_workers`) and the reward graders (`tasks.rewards`) both fork
    their workers from the process's one forkserver, which imports what its first user asks for. A test process runs
    both, in any order: start it with both preloads, so neither imports megatron-core or math-verify per worker."""
    from megatron_scalerl.platform.local_workers import WORKER_IMPORTS
    from megatron_scalerl.tasks.rewards import WORKER_PRELOAD

    multiprocessing.set_forkserver_preload([WORKER_IMPORTS, *WORKER_PRELOAD])
    multiprocessing.forkserver.ensure_running()


@pytest.fixture(scope="module")
def bwrap():
    """Skips, saying why, where the bubblewrap sandbox does not work (the attack tests grade under it)."""
    from megatron_scalerl.tasks.sandbox import SandboxError, sandbox_kind

    try:
        sandbox_kind("bwrap")
    except SandboxError as e:
        pytest.skip(str(e))
