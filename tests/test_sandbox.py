"""The sandbox: real runs of well-behaved and adversarial programs, each with the limit it hits, under bwrap and under
the rlimits fallback (asserting what the fallback does not stop), and checks that nothing outlives a run."""

import dataclasses
import os
import resource
import secrets
import signal
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_scalerl.tasks.judge.judge import cpu_clock_s, observed_failure
from megatron_scalerl.tasks.sandbox import (
    BWRAP,
    RLIMITS,
    Limits,
    SandboxError,
    run_cases,
    run_python,
    sandbox_kind,
)

SMALL = Limits(cpu_s=1, wall_s=2, memory_mb=256, processes=16, output_bytes=64 * 1024, file_mb=4)
ROOT = os.geteuid() == 0


@pytest.fixture(params=["bwrap", "rlimits"])
def mode(request, monkeypatch):
    """Each test runs under each sandbox; bwrap where it works here (else skipped, with the reason)."""
    monkeypatch.setenv("SCALERL_SANDBOX", request.param)
    try:
        sandbox_kind()
    except SandboxError as e:
        pytest.skip(str(e))
    return request.param


def _processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds `marker`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():  # empty for a zombie
                pids.append(int(pid))
        except OSError:
            pass
    return pids


def _left_after(marker: str, within_s: float = 3.0) -> list[int]:
    """The processes with `marker` still alive `within_s` seconds on (a PID namespace is torn down asynchronously)."""
    deadline = time.monotonic() + within_s
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _processes_with(marker)


SLEEP = "import time; time.sleep(1000)"  # a child to find by its marker argument (no `sleep` binary under bwrap)


def _sleep_marker() -> str:
    """A unique argument for a sleeping child (SLEEP) to find its process by."""
    return f"1000.{secrets.randbelow(10**9):09d}"


def test_runs_a_program_with_its_input(mode):
    program = ("import importlib.util, json, sys\n"
               "numbers = json.loads(sys.stdin.read())\n"
               "print(sum(numbers), importlib.util.find_spec('numpy'), importlib.util.find_spec('megatron_scalerl'))\n")
    result = run_python(program, "[1, 2, 3]", SMALL)
    assert (result.failure, result.returncode, result.stdout) == (None, 0, "6 None None\n")  # stdlib only


def test_errors_are_told_apart(mode):
    crashed = run_python("raise ValueError('bad input')", "", SMALL)
    assert (crashed.failure, crashed.returncode) == ("runtime_error", 1)
    assert "ValueError: bad input" in crashed.stderr
    assert run_python("import sys; sys.exit(3)", "", SMALL).failure == "runtime_error"
    assert run_python("def f(:\n    pass", "", SMALL).failure == "runtime_error"  # the caller compiles first


def test_a_program_cannot_choose_its_failure_kind(mode):
    """Kinds come from what the judge observed, not from text printed or an exit status chosen."""
    spoofs = ["import sys\nsys.stderr.write('bwrap: cannot mount\\n')\nsys.exit(1)",  # was "sandbox_error"
              "import os\nos._exit(137)",  # was read as SIGKILL: "timeout"
              "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)",  # a signal it sent itself
              "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
              "raise MemoryError('fake')",
              "raise BlockingIOError(11, 'Resource temporarily unavailable')"]
    for program in spoofs:
        assert run_python(program, "", SMALL).failure == "runtime_error", program


def test_endless_loop_hits_the_cpu_limit(mode):
    limits = dataclasses.replace(SMALL, wall_s=10)  # room for a loaded machine: the CPU limit must fire first
    result = run_python("while True:\n    pass", "", limits)
    assert (result.failure, result.returncode) == ("timeout", -signal.SIGXCPU)
    assert result.seconds < limits.wall_s


def test_sleeping_forever_hits_the_wall_limit(mode):
    result = run_python("import time\ntime.sleep(600)", "", SMALL)
    assert result.failure == "timeout"
    assert SMALL.wall_s <= result.seconds < SMALL.wall_s + 1


def test_a_program_cannot_break_the_judge_between_cases(mode):
    """SIGINT to PID 1, a working directory closed to everyone, a tree thousands deep, a directory of mode 000: each
    run still ends with its own kind, and the next run starts in an empty directory."""
    attacks = ["import os, signal, time\nos.kill(1, signal.SIGINT)\ntime.sleep(0.3)\nraise SystemExit(1)",
               "import os\nos.chmod('.', 0)\nraise SystemExit(1)",
               "import os\nfor _ in range(1500):\n    os.mkdir('a')\n    os.chdir('a')\nraise SystemExit(1)",
               "import os\nos.mkdir('closed')\nopen('closed/note', 'w').write('kept?')\nos.chmod('closed', 0)\n"
               "raise SystemExit(1)"]
    look = "import os\nprint(sorted(set(os.listdir('.')) - {'main.py', 'judge.pyc', 'asserts.pyc'}))"
    for attack in attacks:
        program = f"import sys\nif input() == 'attack':\n    exec({attack!r})\nexec({look!r})"
        first, second = run_cases(program, ["attack", "look"], dataclasses.replace(SMALL, wall_s=6))  # on a disk
        assert first.failure == "runtime_error", (attack, first)
        assert (second.failure, second.stdout) == (None, "[]\n"), (attack, second)


def test_allocating_gigabytes_hits_the_memory_limit(mode):
    growing = "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 20))"
    assert run_python(growing, "", SMALL).failure == "memory"  # its resident memory reached its limit
    # one allocation refused at once never became resident memory: the judge cannot tell it from any other error
    assert run_python("block = bytearray(4 << 30)", "", SMALL).failure == "runtime_error"


def test_printing_hundreds_of_megabytes_hits_the_output_cap(mode):
    limits = Limits(cpu_s=5, wall_s=10, output_bytes=1 << 20)
    program = "import sys\nfor _ in range(300):\n    sys.stdout.buffer.write(b'x' * (1 << 20))"
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    result = run_python(program, "", limits)
    assert result.failure == "output_limit"
    assert len(result.stdout) == 1 << 20 and result.seconds < 5  # stopped at the cap, not at the end
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 64 << 10  # we held ~1 MiB, not 300


def test_process_limit(mode):
    program = ("import os, time\n"
               "for _ in range(100):\n"
               "    if os.fork() == 0:\n"
               "        time.sleep(0.5)\n"
               "        os._exit(0)\n")
    assert run_python(program, "", SMALL).failure == "processes"


def test_a_failure_two_tasks_below_the_limit_is_a_process_failure():
    """Forks at once each hold a count before the kernel checks the limit, so a refused fork can leave fewer tasks
    than the limit (a fork bomb: the limit less 1 or 2)."""
    limits = {"cpu_s": 1, "memory_mb": 256}

    def kind(peak_tasks):
        return observed_failure(1, 0.0, 10.0, peak_tasks, False, limits, task_limit=17)

    assert [kind(tasks) for tasks in (17, 16, 15, 14, 0)] == ["processes"] * 3 + ["runtime_error"] * 2


def test_the_cpu_seconds_judged_are_those_the_limit_counts():
    """The judge reads a program's CPU seconds on the clock RLIMIT_CPU is enforced on (its PROF clock, before it is
    reaped): a busy loop the kernel stopped at 2 s reads 2 s or more, where rusage once read 1.6 s beside another
    sandbox's fork bomb and the run was graded a runtime error."""
    pid = os.fork()
    if pid == 0:
        resource.setrlimit(resource.RLIMIT_CPU, (1, 2))
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", "while True: pass"])
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    seconds = cpu_clock_s(pid)
    _, status, _ = os.wait4(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGXCPU and seconds is not None and 1.0 <= seconds < 1.5


def test_fork_bomb_is_contained_and_nothing_outlives_it(mode):
    marker = secrets.token_hex(8)
    bomb = "import os\nwhile True:\n    os.fork()\n"
    program = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, {marker!r}])"
    result = run_python(program, "", SMALL)
    assert result.failure in ("processes", "timeout")
    assert result.seconds < SMALL.wall_s + 1
    assert _left_after(marker) == []


def test_a_child_left_running_is_killed(mode):
    marker = _sleep_marker()
    program = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', '{SLEEP}', '{marker}'])\nprint('bye')"
    result = run_python(program, "", SMALL)
    assert (result.failure, result.stdout) == (None, "bye\n")  # the run ends with its process...
    assert result.seconds < SMALL.wall_s
    assert _left_after(marker) == []  # ...and what it left running is killed


def test_a_detached_child_dies_under_bwrap_but_outlives_the_fallback(mode):
    marker = _sleep_marker()
    program = ("import subprocess, sys\n"
               f"subprocess.Popen([sys.executable, '-c', '{SLEEP}', '{marker}'], start_new_session=True,\n"
               "                 stdin=subprocess.DEVNULL,\n"
               "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n")
    try:
        assert run_python(program, "", SMALL).failure is None
        if mode == "bwrap":
            assert _left_after(marker) == []  # its PID namespace died with it
        else:
            assert _processes_with(marker) != []  # a new session escapes the process group: the fallback's gap
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def test_network(mode):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')"
        result = run_python(program, "", SMALL)
        if mode == "bwrap":
            assert result.failure == "runtime_error"  # its loopback is its own: nothing listens there
            with pytest.raises(TimeoutError):
                listener.accept()
        else:
            assert result.failure is None  # the fallback does not isolate the network
            connection, _ = listener.accept()
            with connection:
                assert connection.recv(2) == b"hi"
    if mode == "bwrap":
        outside = "import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=1)"  # TEST-NET-1
        result = run_python(outside, "", SMALL)
        assert result.failure == "runtime_error" and "Network is unreachable" in result.stderr


def test_writes_outside_its_directory(mode):
    marker = secrets.token_hex(8)
    in_repo, in_etc = Path(__file__).parent / f"escape-{marker}.txt", Path(f"/etc/escape-{marker}.txt")
    try:
        for target in (in_repo, in_etc):
            result = run_python(f"open({str(target)!r}, 'w').write('escaped')", "", SMALL)
            if mode == "rlimits" and not ROOT and target == in_repo:
                assert result.failure is None and target.exists()  # the fallback runs as us: our files are open
            else:
                # under bwrap the host's files are not there (the root is read-only and nearly empty); the fallback
                # as root runs the program as nobody, who may not write there. Either way its own error, no kind.
                assert result.failure == "runtime_error" and "Error" in result.stderr
                assert not target.exists()
    finally:
        in_repo.unlink(missing_ok=True)


def test_its_own_directory_is_writable_within_the_file_limit(mode):
    program = "open('scratch.txt', 'w').write('kept')\nprint(open('scratch.txt').read())"
    assert run_python(program, "", SMALL).stdout == "kept\n"
    assert run_python("open('big', 'wb').write(b'x' * (8 << 20))", "", SMALL).failure == "filesystem"


def test_nothing_is_left_on_the_host_disk(mode):
    marker = secrets.token_hex(8)
    program = ("import os\n"
               f"open('{marker}.txt', 'w').write('x')\n"
               "os.makedirs('locked/deeper')\n"
               "os.chmod('locked', 0)\n"
               "print(os.getcwd())\n")
    result = run_python(program, "", SMALL)
    assert result.failure is None
    workdir = result.stdout.strip()
    if mode == "bwrap":
        assert workdir == "/tmp"  # a tmpfs of its own
        tmp = Path(tempfile.gettempdir())
        assert [*tmp.glob(f"{marker}.txt"), *tmp.glob(f"*/{marker}.txt")] == []
    else:
        assert Path(workdir).parent == Path(tempfile.gettempdir())
        assert not Path(workdir).exists()  # removed, with the directory it locked


@pytest.mark.skipif(not ROOT, reason="as root only: the fallback's programs then run as uid 65534")
def test_fallback_as_root_needs_a_temp_directory_others_can_enter(monkeypatch, tmp_path):
    monkeypatch.setenv("SCALERL_SANDBOX", "rlimits")
    tmp_path.chmod(0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SandboxError, match="TMPDIR"):
        run_python("print(1)", "", SMALL)


def test_parallel_runs_do_not_share_a_process_limit(mode):
    normal = "import subprocess\nprint(subprocess.run(['echo', 'ok'], capture_output=True, text=True).stdout.strip())"
    hog = "import os, time\nfor _ in range(100):\n    if os.fork() == 0:\n        time.sleep(1)\n        os._exit(0)\n"
    # Under the fallback concurrent runs share the user's headroom (module docstring): no hog there.
    programs = [normal] * 7 + [hog if mode == "bwrap" else normal]
    with ThreadPoolExecutor(len(programs)) as pool:
        results = list(pool.map(lambda program: run_python(program, "", SMALL), programs))
    assert [r.stdout for r in results[:7]] == ["ok\n"] * 7
    assert results[7].failure == ("processes" if mode == "bwrap" else None)


def test_choosing_the_sandbox(monkeypatch, tmp_path):
    monkeypatch.setenv("SCALERL_SANDBOX", "docker")
    with pytest.raises(SandboxError, match="expected one of bwrap, rlimits"):
        sandbox_kind()
    monkeypatch.setenv("SCALERL_SANDBOX", "rlimits")
    assert sandbox_kind() == RLIMITS
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    monkeypatch.setenv("SCALERL_SANDBOX", "bwrap")
    with pytest.raises(SandboxError, match="bubblewrap"):
        sandbox_kind()
    monkeypatch.delenv("SCALERL_SANDBOX")  # bwrap is the default, and the weaker one is never taken silently
    with pytest.raises(SandboxError, match="data.code_sandbox: rlimits"):
        run_python("print('fallback')", "", SMALL)
    assert run_python.__name__ and sandbox_kind("rlimits") == RLIMITS


def test_sandbox_kind_here():
    """Where bwrap is installed it should work (it does on our CI image); say which sandbox ran otherwise."""
    assert sandbox_kind() == BWRAP


def test_limits_are_checked():
    with pytest.raises(ValueError, match="cpu_s must be positive"):
        Limits(cpu_s=0)
    with pytest.raises(ValueError, match="whole seconds"):
        Limits(cpu_s=1.5)
