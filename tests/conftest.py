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
                     help=f"write each file's test seconds and CPU seconds of this run into {DURATIONS.name} (make "
                          "test-durations); files that did not run keep theirs")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _recorded() -> dict:
    """tests/durations.json as the last `make test-durations` wrote it ({} before the first)."""
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def _known_seconds() -> dict[str, float]:
    return _recorded().get("files", {})


def pytest_collection_modifyitems(config, items):
    """The files longest first, by the seconds tests/durations.json gives them (a stable sort, so a file's tests keep
    their order): with `-n 2 --dist loadfile --no-loadscope-reorder` (make test) each worker takes the next longest
    file when it is nearly done with its own, so the long files start first and the short ones fill in at the end
    and both workers finish together. A file the durations do not know goes last and is named at the end."""
    seconds = _known_seconds()
    config._unknown_files = sorted({_file_of(item.nodeid) for item in items} - set(seconds))
    items.sort(key=lambda item: -seconds.get(_file_of(item.nodeid), 0.0))


def _cpu_seconds() -> float:
    """CPU seconds of this test process so far: its own, its children's that were waited for (with theirs: servers,
    launches and every process below them), and the forkserver's with its reaped children (the trainer's local gloo
    workers and the graders fork from it, and it lives to the end of the session)."""
    import resource

    spent = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                for f in ("ru_utime", "ru_stime"))
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    try:  # utime stime cutime cstime: fields 14-17 of /proc/PID/stat, after the parenthesised name
        ticks = Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[11:15] if server else []
    except OSError:
        ticks = []
    return spent + sum(int(t) for t in ticks) / os.sysconf("SC_CLK_TCK")


class _CpuMeter:
    """In each test process: the CPU seconds of every setup, call and teardown (`_cpu_seconds` across it), carried
    to the controller in the phase's report (`user_properties`)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._measure(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._measure(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._measure(item)

    @staticmethod
    def _measure(item):
        before = _cpu_seconds()
        yield
        item.user_properties = [p for p in item.user_properties if p[0] != "cpu_s"]
        item.user_properties.append(("cpu_s", _cpu_seconds() - before))


class _DurationRecorder:
    """Sums each file's setup + call + teardown seconds, wall and CPU (`_CpuMeter`), as the reports arrive (in the
    controller under xdist)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[_file_of(report.nodeid)] += report.duration
        self.cpu_seconds[_file_of(report.nodeid)] += dict(report.user_properties).get("cpu_s", 0.0)


def pytest_configure(config):
    if config.getoption("--record-durations"):
        config.pluginmanager.register(_CpuMeter(), "scalerl-cpu-meter")
        if not hasattr(config, "workerinput"):
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
        known = _recorded()

        def merged(field: str, seconds: dict[str, float]) -> dict[str, float]:  # files that did not run keep theirs
            both = {**known.get(field, {}), **{f: round(s, 1) for f, s in seconds.items()}}
            return dict(sorted(both.items(), key=lambda kv: -kv[1]))

        DURATIONS.write_text(json.dumps({"measured_on": measured, "files": merged("files", recorder.seconds),
                                         "cpu_seconds": merged("cpu_seconds", recorder.cpu_seconds)}, indent=1) + "\n")
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
