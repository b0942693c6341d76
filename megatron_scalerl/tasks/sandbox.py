"""Run an untrusted Python program in a sandbox, with limits on CPU, wall time, memory, processes, files and output.

The program never judges itself. A trusted judge (tasks/judge/judge.py) runs inside the sandbox, reads its job (the
inputs, or the asserts with their expected values) from a file descriptor it then closes, makes itself non-dumpable
(no process of the same user can read its memory, fds or environment through /proc, nor ptrace it) and starts the
program as a fresh interpreter (`python -I -S`: standard library only) with nothing but its own input. It reports to
its stdout, of which the program holds no descriptor, one JSON record per result; what the program printed is data in
those records, never a record itself. Two kinds of job:

- `run_cases(source, inputs)`: a run of the program per input (stdin); each run's stdout and how it ended. The
  caller compares the output: the expected outputs never enter the sandbox. `run_python(source, stdin)`: one run.
- `run_asserts(source, setup, asserts)`: the program runs once as module "solution" in a process that only answers
  calls; the judge executes the setup and the asserts in its own interpreter, on the plain-data values the program
  returns (tasks/judge/asserts.py). An object that is not plain data is never a value: an assert that needs it fails.

How a run ended is what the judge observed (judge.py's `observed_failure`): "timeout" (its wall time passed or it used
its CPU seconds), "output_limit", "memory" (its peak resident memory reached 3/4 of the limit), "processes" (its tasks
came within two of the limit), "filesystem" (it filled its scratch space or wrote a file of the largest size),
"runtime_error" (any other failure); "sandbox_error" when the sandbox did not start or the judge reported nothing. Never
from text the program printed or an exit status it chose: a program can only make its own failure look like
"runtime_error". (A syntax error is the caller's to find: tasks/code_verifier.py compiles the program first.)

Two sandboxes, chosen by name (`sandbox_kind(choice)`; recipes: `data.code_sandbox`; SCALERL_SANDBOX sets the choice
of a process): `bwrap`, the default, and `rlimits`, used only when named, never as a silent fallback:

- bwrap (bubblewrap): the judge is PID 1 of its own user, PID, network, IPC, UTS and cgroup namespaces (PID 1 cannot
  be killed from inside; every process of the run dies with it). The sandbox's root is empty but for what the
  interpreter needs, read-only: its executable, its standard library, the directories of the shared libraries it and
  its extension modules load, the loader's cache; a minimal /dev, its own /proc, and a writable /tmp of `file_mb` MiB
  in memory (the working directory; the program is /tmp/main.py). No host file outside those is visible: no data,
  no run directory, no home, no /etc. Its network is a loopback device of its own.
- rlimits (weaker: no network or filesystem isolation): the same judge and limits, a new session, a private working
  directory on the host's disk, a clean environment; as root the judge and the program run as uid/gid 65534
  ("nobody"). The program can connect anywhere the host can and read what its user can read (as our own user, when
  we are not root, our files and processes too; the grader's workers hold no secrets in their environment and are
  non-dumpable, tasks/rewards.py), and a child that calls setsid() can outlive the run.

Limits (`Limits`) are rlimits of each of the program's processes (CPU seconds, address space, file size, open files,
no core files, tasks: processes and threads, counted per sandbox under bwrap and per user, machine-wide, in the
fallback) plus the wall time and the output cap, which the judge enforces.
"""

from __future__ import annotations

import ast
import binascii
import dataclasses
import functools
import json
import marshal
import os
import py_compile
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_scalerl.errors import UserError
from megatron_scalerl.tasks.sandbox_root import ENV, interpreter_binds

FAILURE_KINDS = ("timeout", "memory", "output_limit", "processes", "filesystem", "runtime_error", "syntax_error",
                 "sandbox_error")
SANDBOXES = ("bwrap", "rlimits")
BWRAP = "bwrap"
RLIMITS = "rlimits (weaker: no network or filesystem isolation)"
NOBODY = 65534  # uid and gid the program runs as when we are root
STDERR_KEEP = 8000  # bytes of stderr kept in a RunResult: its end, where the traceback is
STARTUP_GRACE_S = 2.0  # wall seconds the sandbox and the judge get to start, beyond the program's own wall time
JUDGE_DIR = Path(__file__).resolve().parent / "judge"  # its files: copied to /sandbox under bwrap (read-only)
_JUDGE_FILES = ("judge.pyc", "asserts.pyc")  # compiled here once: each sandbox would compile the sources (~9 ms)
_BWRAP_ENV = {**ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}  # the environment of the judge and the program under bwrap


class SandboxError(UserError):
    """The sandbox cannot be used as asked: the chosen one does not work here, or no Python can run in it."""


@dataclass(frozen=True)
class Limits:
    """Limits on one run. `cpu_s`: CPU seconds of each process; `wall_s`: wall seconds of a run (a case, or all the
    asserts); `memory_mb`: address space of each process, MiB; `processes`: tasks (processes and threads) at once;
    `output_bytes`: stdout and stderr together, bytes; `file_mb`: the largest file it may write, MiB (under bwrap
    also the size of /tmp); `files`: open file descriptors of each process."""

    cpu_s: int = 2
    wall_s: float = 4.0
    memory_mb: int = 512
    processes: int = 32
    output_bytes: int = 1 << 20
    file_mb: int = 16
    files: int = 64

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "output_bytes", "file_mb", "files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")
        if int(self.cpu_s) != self.cpu_s:
            raise ValueError(f"Limits.cpu_s must be whole seconds (an rlimit), got {self.cpu_s!r}")


@dataclass(frozen=True)
class RunResult:
    """How one run ended. `stdout`: all of it, up to the output cap; `stderr`: its last STDERR_KEEP bytes, decoded;
    `returncode`: the exit status, -N when killed by signal N (-1 when the run never happened); `seconds`: wall
    seconds; `failure`: None when it exited 0, else one of FAILURE_KINDS (see the module docstring)."""

    stdout: str
    stderr: str
    returncode: int
    seconds: float
    failure: str | None


def chosen_sandbox() -> str:
    """The sandbox this process is set to use: SCALERL_SANDBOX ("bwrap" or "rlimits"), "bwrap" when unset."""
    choice = os.environ.get("SCALERL_SANDBOX", "") or "bwrap"
    if choice not in SANDBOXES:
        raise SandboxError(f"SCALERL_SANDBOX={choice!r}: expected one of {', '.join(SANDBOXES)}")
    return choice


def sandbox_kind(choice: str | None = None) -> str:
    """The sandbox that runs programs for `choice` (default: `chosen_sandbox()`): BWRAP, or RLIMITS when named.
    SandboxError when bwrap is chosen and does not work here, naming why and the opt-in to the weaker one."""
    choice = choice or chosen_sandbox()
    if choice not in SANDBOXES:
        raise SandboxError(f"code sandbox {choice!r}: expected one of {', '.join(SANDBOXES)}")
    if choice == "rlimits":
        return RLIMITS
    problem = _bwrap_problem(shutil.which("bwrap"))
    if problem:
        raise SandboxError(f"the code sandbox is bwrap, but {problem}. The weaker rlimits sandbox (no network or "
                           "filesystem isolation) runs only when asked for by name: data.code_sandbox: rlimits in "
                           "the recipe, --sandbox rlimits, or SCALERL_SANDBOX=rlimits")
    return BWRAP


def require_sandbox(choice: str, who: str) -> str | None:
    """The start-up check of a run or evaluation that grades code (`who` names it in messages): SandboxError when
    `choice` is bwrap and bwrap does not work here; for rlimits, the warning to print at start and with every step."""
    kind = sandbox_kind(choice)
    if kind == BWRAP:
        return None
    return (f"WARNING: {who} grades code in the {kind} sandbox, chosen by data.code_sandbox: programs under test can "
            "read what its user can read and reach the network")


def run_cases(source: str, inputs: list[str], limits: Limits = Limits(), deadline_s: float | None = None
              ) -> Iterator[RunResult]:
    """Run the program `source` once per input (on its stdin), each in a sandbox of its own (see "Fresh state"
    below) within `limits`, all within `deadline_s` wall seconds (default: as many wall limits as inputs); a run not
    started by then is a "timeout". The results come one at a time, as each run ends: a caller that compares each
    and lets it go holds one run's output at most (`CASE_RECORD_BYTES`)."""
    deadline = time.monotonic() + (len(inputs) * limits.wall_s if deadline_s is None else deadline_s)
    for stdin in inputs:
        left = deadline - time.monotonic()
        if left <= 0:
            yield RunResult("", "", -1, 0.0, "timeout")
            continue
        run_limits = dataclasses.replace(limits, wall_s=min(limits.wall_s, left))
        records, stderr, timed_out = _judge(source, {"mode": "case", "stdin": stdin}, run_limits, run_limits.wall_s,
                                            cap=case_record_bytes(limits))
        record = next((r for r in records if "case" in r), None)
        if record is None:
            yield RunResult("", stderr, -1, 0.0, "timeout" if timed_out else "sandbox_error")
            continue
        yield RunResult(_raw(record["stdout"]).decode(errors="replace"), _raw(record["stderr"]).decode(errors="replace"),
                        int(record["status"]), float(record["seconds"]), record["failure"])


def case_record_bytes(limits: Limits) -> int:
    """The most bytes the judge's record of one run can take: what the run may print (stdout and stderr together,
    `output_bytes`, the raw bytes the judge captured before anything is decoded) in base64 (4/3), plus the record's
    other fields. The bound on what grading an answer's stdin/stdout tests holds at once."""
    return (limits.output_bytes + 2) // 3 * 4 + 4096


def _raw(text: str) -> bytes:
    """The bytes a judge's record carries as base64 text."""
    return binascii.a2b_base64(text)


def run_python(source: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """Run the program `source` once with `stdin` as its input, within `limits`."""
    return next(run_cases(source, [stdin], limits))


def run_asserts(source: str, setup: str, asserts: list[str], limits: Limits = Limits(),
                deadline_s: float | None = None) -> list[str | None]:
    """Judge `asserts` (Python assert statements, after the `setup` code) on the program `source`, run once as module
    "solution" within `limits` and `deadline_s` wall seconds; each assert's outcome: None when it held, else its
    failure kind (tasks/judge/asserts.py)."""
    deadline_s = limits.wall_s if deadline_s is None else deadline_s
    modules, test_names = _test_names((setup, *asserts))
    job = {"mode": "asserts", "setup": setup, "asserts": asserts, "modules": modules, "test_names": test_names}
    records, _, timed_out = _judge(source, job, limits, deadline_s, cap=256 * len(asserts))
    by_assert = {record.get("assert"): record.get("failure") for record in records if "assert" in record}
    missing = "timeout" if timed_out else "sandbox_error"
    return [by_assert[i] if i in by_assert else missing for i in range(len(asserts))]


@functools.lru_cache(maxsize=4096)
def _test_names(tests: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What the test's sources `tests` (its setup and asserts) hold as their own, once per problem (every answer to
    it has the same tests): (the standard library's top-level modules they use as modules, `math` in
    `math.isclose(...)`: a name whose attribute they read, which the judge gives them as its own, whatever the program
    defines; the names they bind themselves: imports, assignments, definitions, loop and `as` targets, but not the
    names they import from `solution`, which they ask of the program). No name of either is the program's in the
    judge's namespace, nor exported to a `from solution import *` (asserts.py's `_namespace`)."""
    read, bound = set(), set()
    for node in (node for source in tests for node in ast.walk(ast.parse(source))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            read.add(node.value.id)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.Import) or isinstance(node, ast.ImportFrom) and node.module != "solution":
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names if alias.name != "*")
    return tuple(sorted(read & sys.stdlib_module_names)), tuple(sorted(bound))


def _judge(source: str, job: dict, limits: Limits, deadline_s: float, cap: int) -> tuple[list[dict], str, bool]:
    """Run the judge on `job` in the sandbox; its records, the end of its stderr (for a sandbox error's message) and
    whether our wall timer (`deadline_s` + STARTUP_GRACE_S) ended it. `cap`: the most bytes its records can take
    (beyond its "ready" and "done" ones): what is read past it is dropped unread."""
    kind, python = sandbox_kind(), interpreter()
    limits_record = dataclasses.asdict(limits)
    job = {**job, "limits": limits_record, "python": python, "deadline_s": deadline_s, "stderr_keep": STDERR_KEEP}
    workdir, files = None, []  # files: the fds of the in-memory files bwrap copies into the sandbox
    try:
        if kind == BWRAP:
            # the program and the judge's files are copied in from memory (bwrap, run as nobody when we are root,
            # may not be able to enter the directory this checkout lives in)
            data = {"/tmp/main.py": source.encode(), **{f"/sandbox/{n}": b for n, b in _judge_sources().items()}}
            files = [(_memory_file(os.path.basename(path), content), path) for path, content in data.items()]
            job.update(workdir="/tmp", program="/tmp/main.py", pid_namespace=True, env=_BWRAP_ENV)
            job_fd = _memory_file("job", marshal.dumps(job))
            command = [*_bwrap_options(shutil.which("bwrap"), python, limits, files), "--chdir", "/tmp",
                       python, "-I", "-S", "/sandbox/judge.pyc", "--job-fd", str(job_fd)]
            popen = {"pass_fds": (*(fd for fd, _ in files), job_fd), "cwd": "/"}
        else:
            workdir = _private_dir(source)
            job.update(workdir=workdir, program=os.path.join(workdir, "main.py"), pid_namespace=False,
                       env={**ENV, "HOME": workdir, "TMPDIR": workdir}, keep=list(_JUDGE_FILES))
            job_fd = _memory_file("job", marshal.dumps(job))
            command = [python, "-I", "-S", os.path.join(workdir, "judge.pyc"), "--job-fd", str(job_fd)]
            popen = {"pass_fds": (job_fd,), "cwd": workdir}
        try:
            return _read_judge(command, deadline_s + STARTUP_GRACE_S, cap + 4096, env=job["env"], **popen)
        finally:
            os.close(job_fd)
    finally:
        for fd, _ in files:
            os.close(fd)
        if workdir is not None:
            _remove_tree(workdir)


def _read_judge(command: list[str], wall_s: float, cap: int, **popen) -> tuple[list[dict], str, bool]:
    """Start the judge in a new session, read its records until it is done or `wall_s` passes, then kill its process
    group (under bwrap that takes the sandbox's PID namespace with it). A judge that did not say it was ready is a
    sandbox error: its stderr (bwrap's or the interpreter's) is returned."""
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, **_sandbox_user(), **popen)
    except OSError as e:
        return [], f"could not start the sandbox: {e}", False
    try:
        out, err, timed_out = _collect(proc, time.monotonic() + wall_s, cap)
    finally:
        _kill_group(proc)
    records = []
    for line in out.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break  # cut at our cap or by the kill: the records before it stand
    stderr = err.decode(errors="replace")[-STDERR_KEEP:]
    if not records or records[0] != {"ready": True}:
        return [], stderr or f"the judge exited with status {proc.returncode} before it was ready", timed_out
    return records[1:], stderr, timed_out


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool]:
    """The judge's stdout and stderr until both close or `deadline` (monotonic) passes (then True); at most `cap`
    bytes of stdout (the judge is ours: it caps what it reports, this is a bound on a bug)."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), True
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                buffer += data[:max(0, (cap if key.fd == proc.stdout.fileno() else STDERR_KEEP * 4) - len(buffer))]
    return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), False


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process's group (it leads it, not reaped yet: the group id cannot have been reused); reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # all of the group have exited
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"sandbox process {proc.pid} did not exit 10 s after SIGKILL") from None
    finally:
        proc.stdout.close()
        proc.stderr.close()


def _bwrap_options(bwrap: str, python: str, limits: Limits, files: list[tuple[int, str]] = ()) -> list[str]:
    """The bwrap command (`bwrap`: its path) up to the program's working directory: namespaces, a clean environment,
    the interpreter's files read-only (`sandbox_root`), `files` ((fd of an in-memory file, its path inside), copied in
    read-only: the program, the judge at /sandbox), /proc, a minimal /dev and a /tmp of file_mb MiB, the root
    read-only (see the module docstring)."""
    scratch = str(limits.file_mb << 20)
    env = [word for name, value in _BWRAP_ENV.items() for word in ("--setenv", name, value)]
    return [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1", "--clearenv", *env, *_interpreter_binds(python),
            "--proc", "/proc", "--dev", "/dev", "--size", scratch, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
            "--size", scratch, "--tmpfs", "/tmp",
            *(word for fd, path in files for word in ("--ro-bind-data", str(fd), path)), "--remount-ro", "/"]


@functools.cache
def _judge_sources() -> dict[str, bytes]:
    """{file name: content} of the judge's files, compiled once per process by this interpreter (the sandbox's is
    of the same minor version: `interpreter`, so of the same bytecode), unchecked: no source beside them to check."""
    files = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in _JUDGE_FILES:
            compiled = py_compile.compile(str(JUDGE_DIR / name.removesuffix("c")), os.path.join(scratch, name),
                                          doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
            files[name] = Path(compiled).read_bytes()
    return files


def _interpreter_binds(python: str) -> tuple[str, ...]:
    try:
        return interpreter_binds(python)
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxError(f"cannot find the files {python} needs in the sandbox: {e}") from None


@functools.cache
def _bwrap_problem(bwrap: str | None) -> str | None:
    """Why bwrap (at path `bwrap`) cannot sandbox here, None when it can: not installed, or a trial run fails (as
    where user namespaces are not allowed, e.g. in a default Docker container). Tried once per process."""
    if bwrap is None:
        return "bwrap is not installed (Debian/Ubuntu package: bubblewrap)"
    python = interpreter()
    try:
        trial = subprocess.run([*_bwrap_options(bwrap, python, Limits()), python, "-I", "-S", "-c", "import json"],
                               capture_output=True, text=True, timeout=30, cwd="/", env=ENV, **_sandbox_user())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap is installed but does not run: {e}"
    if trial.returncode != 0:
        return f"bwrap is installed but fails: {trial.stderr.strip() or f'exit status {trial.returncode}'}"
    return None


def _sandbox_user() -> dict:
    """Popen arguments that run the child as NOBODY when we are root (none otherwise)."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


@functools.cache
def interpreter() -> str:
    """The Python that runs programs: ours, or when we are root and NOBODY cannot run ours, the system's of the same
    version."""
    ours = os.path.realpath(sys.executable)
    if os.geteuid() != 0:
        return ours
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (ours, f"/usr/local/bin/{version}", f"/usr/bin/{version}"):
        if os.path.isfile(python) and _runs_as_nobody(python):
            return python
    raise SandboxError(f"uid {NOBODY}, which runs sandboxed programs when we are root, cannot run {ours} (a directory "
                       f"on its path is closed to other users) and there is no /usr/bin/{version} or "
                       f"/usr/local/bin/{version}: install Python where other users can read it")


def _runs_as_nobody(python: str) -> bool:
    try:  # a trial run: the interpreter, its shared library and its standard library must all be open to NOBODY
        trial = subprocess.run([python, "-I", "-S", "-c", "import encodings, json"], capture_output=True, timeout=30,
                               cwd="/", env=ENV, **_sandbox_user())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return trial.returncode == 0


def _memory_file(name: str, data: bytes) -> int:
    """A file descriptor of an in-memory file holding `data`, positioned at its start."""
    fd = os.memfd_create(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _private_dir(source: str) -> str:
    """A new directory holding the program as main.py and the judge, owned by the program's user (the fallback's
    working directory)."""
    if os.geteuid() == 0 and not _open_to_others(tempfile.gettempdir()):
        raise SandboxError(f"the temporary directory {tempfile.gettempdir()} is closed to uid {NOBODY}, which runs "
                           "sandboxed programs when we are root; set TMPDIR to one other users can enter (/tmp)")
    path = tempfile.mkdtemp(prefix="scalerl-sandbox-")
    with open(os.path.join(path, "main.py"), "w", encoding="utf-8") as f:
        f.write(source)
    for name, content in _judge_sources().items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(content)
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    return path


def _open_to_others(path: str) -> bool:
    """Whether users other than the owners may enter `path` and each directory above it."""
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def _remove_tree(path: str) -> None:
    """Remove the private directory, also directories the program made unreadable to us (root reads them anyway, and
    never chmods there: a program's process left running could swap a directory for a link)."""
    if os.geteuid() != 0:
        os.chmod(path, 0o700)
        for parent, dirs, _ in os.walk(path):
            for name in dirs:
                child = os.path.join(parent, name)
                if not os.path.islink(child):  # chmod follows links
                    os.chmod(child, 0o700)
    shutil.rmtree(path)
