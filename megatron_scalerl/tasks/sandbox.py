"""Run one untrusted Python program in a sandbox, with limits on CPU, wall time, memory, processes and output.

`run_python(source, stdin, limits)` starts a fresh interpreter on the program (`python -I -S`: isolated mode, no
site-packages, so only the standard library imports), gives it `stdin`, and returns what it printed, how it ended and,
unless it exited 0, the kind of failure. The run ends when the program's process exits (or a limit stops it); what it
left running is killed then (but see the fallback's gap below).

Two sandboxes; `sandbox_kind()` says which one runs here (SCALERL_SANDBOX=bwrap or =rlimits forces one):

- bwrap (bubblewrap; used where it is installed and works): the program has its own user, PID, network, IPC and UTS
  namespaces. It sees the host's files read-only, a fresh /dev and /proc, an empty /run (no host sockets), and a
  writable /tmp of `file_mb` MiB in memory, its working directory (the program is /tmp/main.py): nothing it writes
  reaches the host's disk. Its network is a loopback device of its own, so no connection leaves the sandbox. All its
  processes live in its PID namespace, which dies with it.
- rlimits (the fallback, weaker: no network or filesystem isolation): the same limits, a new session, a private
  working directory on the host's disk (removed afterwards; as root, TMPDIR must be open to uid 65534), a clean
  environment, and the program's process dies with ours. It does not stop the program from connecting anywhere the
  host can, reading what its user can read, or writing where its user can write (when we are not root that is our
  own user, who owns our files); and its children can outlive the call: one that calls os.setsid() escapes the kill
  of the process group, and all do when our process is killed mid-run.

When we are root, the program runs as uid/gid 65534 ("nobody"), never as root: the kernel does not enforce
RLIMIT_NPROC for root, and root owns the files. That user must be able to run the interpreter: ours
(`sys.executable`) where it can, else the system's python3.X of the same version (a pyenv Python under /root, mode
0700, it cannot).

Limits (`Limits`) are rlimits of each of the program's processes: CPU seconds (SIGXCPU, SIGKILL one second later),
address space, file size, no core files, and tasks (processes and threads); plus the wall time and the output we read,
both enforced here. Memory is capped per process, not per sandbox. RLIMIT_NPROC counts a user's tasks: under bwrap
within the sandbox's own user namespace, so per sandbox; in the fallback machine-wide, so there the limit is the tasks
that user has when the program starts plus `processes` (concurrent sandboxes share that headroom).

How a run ended, in order: our wall timer fired -> "timeout"; the output passed its cap -> "output_limit"; bwrap
itself failed -> "sandbox_error"; exit 0 -> no failure; killed by SIGXCPU, or by a SIGKILL we did not send (the CPU
hard limit; the kernel's OOM killer also sends one) -> "timeout"; by SIGXFSZ -> "filesystem"; otherwise by the text of
the last exception line in stderr (`exception_kind`): "memory", "processes", "network", "filesystem",
"syntax_error", else "runtime_error". The last is judged by text only: a program can print a traceback it did not
raise, which changes only the kind of its own failure.
"""

from __future__ import annotations

import functools
import os
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from megatron_scalerl.errors import UserError

FAILURE_KINDS = ("timeout", "memory", "output_limit", "processes", "network", "filesystem", "runtime_error",
                 "syntax_error", "sandbox_error")
BWRAP = "bwrap"
RLIMITS = "rlimits (weaker: no network or filesystem isolation)"
NOBODY = 65534  # uid and gid the program runs as when we are root
STDERR_KEEP = 8000  # characters of stderr kept in a RunResult: its end, where the traceback is
_READ_BYTES = 1 << 16
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}

# The first code run in the sandbox, as the program's user: it sets the limits on itself (under bwrap only from inside
# is RLIMIT_NPROC counted per sandbox), then becomes the program's interpreter. argv: cpu_s, address space bytes,
# tasks, file bytes, the pid to die with (0: none; bwrap kills the sandbox itself), the program's file.
_LAUNCHER = """\
import os, resource, sys
cpu, memory, tasks, file_bytes, parent = map(int, sys.argv[1:6])
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
if parent:
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != parent:
        os._exit(1)
os.execv(sys.executable, [sys.executable, "-I", "-S", sys.argv[6]])
"""


class SandboxError(UserError):
    """The sandbox cannot be used as asked (SCALERL_SANDBOX names one that does not work here, no usable Python)."""


@dataclass(frozen=True)
class Limits:
    """Limits on one run. `cpu_s`: CPU seconds of each process; `wall_s`: wall seconds of the whole run; `memory_mb`:
    address space of each process, MiB; `processes`: tasks (processes and threads) at once; `output_bytes`: stdout
    and stderr together, bytes; `file_mb`: the largest file it may write, MiB (under bwrap also the size of /tmp)."""

    cpu_s: int = 2
    wall_s: float = 4.0
    memory_mb: int = 512
    processes: int = 32
    output_bytes: int = 1 << 20
    file_mb: int = 16

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mb", "processes", "output_bytes", "file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")
        if int(self.cpu_s) != self.cpu_s:
            raise ValueError(f"Limits.cpu_s must be whole seconds (an rlimit), got {self.cpu_s!r}")


@dataclass(frozen=True)
class RunResult:
    """How one run ended. `stdout`: all of it, up to the output cap; `stderr`: its last STDERR_KEEP characters;
    `returncode`: the exit status, -N when killed by signal N (under bwrap its exit status 128+N reads as signal N);
    `seconds`: wall seconds; `failure`: None when it exited 0, else one of FAILURE_KINDS (see the module docstring)."""

    stdout: str
    stderr: str
    returncode: int
    seconds: float
    failure: str | None


def sandbox_kind() -> str:
    """The sandbox `run_python` uses here: BWRAP, or RLIMITS (with the reason when bwrap is installed but fails).
    SCALERL_SANDBOX=bwrap where bwrap does not work raises SandboxError."""
    choice = os.environ.get("SCALERL_SANDBOX", "")
    if choice not in ("", "bwrap", "rlimits"):
        raise SandboxError(f"SCALERL_SANDBOX={choice!r}: expected 'bwrap' or 'rlimits' (unset: bwrap where it works)")
    if choice == "rlimits":
        return RLIMITS
    bwrap = shutil.which("bwrap")
    problem = _bwrap_problem(bwrap)
    if choice == "bwrap" and problem:
        raise SandboxError(f"SCALERL_SANDBOX=bwrap, but {problem}")
    if problem is None:
        return BWRAP
    return RLIMITS if bwrap is None else f"{RLIMITS}; {problem}"


def run_python(source: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """Run the Python program `source` in the sandbox (`sandbox_kind()`) with `stdin` as its input, within
    `limits`; see the module docstring. Raises SandboxError only when no sandbox can be set up here."""
    kind = sandbox_kind()
    command = [_interpreter(), "-I", "-S", "-c", _LAUNCHER, str(limits.cpu_s), str(limits.memory_mb << 20)]
    stdin_fd = _memory_file("stdin", stdin.encode())
    program_fd = workdir = None
    try:
        if kind == BWRAP:
            program_fd = _memory_file("program", source.encode())
            command = [*_bwrap_options(shutil.which("bwrap"), limits),
                       "--ro-bind-data", str(program_fd), "/tmp/main.py", "--chdir", "/tmp",
                       *command, str(limits.processes), str(limits.file_mb << 20), "0", "main.py"]
            return _run(command, stdin_fd, limits, bwrap=True, pass_fds=(program_fd,), cwd="/", env=_ENV)
        workdir = _private_dir(source)
        tasks = _tasks_of(NOBODY if os.geteuid() == 0 else os.getuid()) + limits.processes
        command += [str(tasks), str(limits.file_mb << 20), str(os.getpid()), "main.py"]
        env = {**_ENV, "HOME": workdir, "TMPDIR": workdir}
        return _run(command, stdin_fd, limits, bwrap=False, cwd=workdir, env=env)
    finally:
        os.close(stdin_fd)
        if program_fd is not None:
            os.close(program_fd)
        if workdir is not None:
            _remove_tree(workdir)


_EXCEPTION_LINE = re.compile(r"([A-Za-z_][\w.]*)(?::\s?(.*))?")


def exception_kind(line: str) -> str | None:
    """The failure kind of a Python exception from the last line of its traceback ("Type: message"), by its text;
    None when it is none of the kinds the sandbox tells apart (a plain runtime error)."""
    match = _EXCEPTION_LINE.fullmatch(line.strip())
    if not match:
        return None
    name, message = match.group(1).rsplit(".", 1)[-1], match.group(2) or ""
    if name == "MemoryError":
        return "memory"
    if name in ("SyntaxError", "IndentationError", "TabError"):
        return "syntax_error"
    if (name == "BlockingIOError" and "Resource temporarily unavailable" in message
            or "can't start new thread" in message):
        return "processes"  # fork or thread creation refused: RLIMIT_NPROC
    if (name in ("gaierror", "herror", "ConnectionRefusedError", "ConnectionResetError", "ConnectionAbortedError")
            or "Network is unreachable" in message or "No route to host" in message):
        return "network"
    if (name == "PermissionError" or "Read-only file system" in message or "File too large" in message
            or "No space left on device" in message):
        return "filesystem"
    return None


def _failure(returncode: int, stderr: str, bwrap: bool) -> str | None:
    """The failure kind of a run that ended by itself (see the module docstring)."""
    if bwrap and returncode == 1 and stderr.startswith("bwrap: "):
        return "sandbox_error"
    if returncode == 0:
        return None
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if returncode == -signal.SIGXFSZ:
        return "filesystem"
    if returncode < 0:
        return "runtime_error"
    # the last exception line that names a kind: a program that forks may leave several tracebacks, interleaved
    kinds = [exception_kind(line) for line in stderr.splitlines() if line and not line[0].isspace()]
    return next((kind for kind in reversed(kinds) if kind), "runtime_error")


def _run(command: list[str], stdin_fd: int, limits: Limits, bwrap: bool, **popen) -> RunResult:
    """Start `command` in a new session, read its output until it is done, within the wall limit and the output cap,
    then kill its process group (under bwrap that takes the sandbox's PID namespace with it)."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, **_sandbox_user(), **popen)
    except OSError as e:
        return RunResult("", f"could not start the sandbox: {e}", -1, time.monotonic() - start, "sandbox_error")
    try:
        out, err, stopped = _collect(proc, start + limits.wall_s, limits.output_bytes)
    finally:
        _kill_group(proc)
    returncode = proc.returncode
    if bwrap and returncode > 128:
        returncode = 128 - returncode  # bwrap exits 128+N when the program died of signal N
    stderr = err.decode(errors="replace")
    return RunResult(out.decode(errors="replace"), stderr[-STDERR_KEEP:], returncode, time.monotonic() - start,
                     stopped or _failure(returncode, stderr, bwrap))


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Read the process's stdout and stderr until it has exited and they hold no more (what it left running may keep
    them open), keeping at most `cap` bytes of the two together. Stops early at `deadline` (monotonic seconds;
    returns "timeout") or past `cap` ("output_limit"); else returns None as the third item. (pidfd: Linux 5.3+.)"""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    out, err = buffers.values()
    pidfd = os.pidfd_open(proc.pid)  # readable once the process has exited; unlike wait(), it does not reap it
    exited = False
    try:
        with selectors.DefaultSelector() as selector:
            for fd in (*buffers, pidfd):
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not exited:
                    return bytes(out), bytes(err), "timeout"
                # once it has exited, take what the pipes hold now: what it left running may keep them open
                events = selector.select(0 if exited else remaining)
                if exited and (not events or remaining <= 0):
                    break
                for key, _ in events:
                    data = b"" if key.fd == pidfd else os.read(key.fd, _READ_BYTES)
                    exited = exited or key.fd == pidfd
                    if not data:
                        selector.unregister(key.fd)
                        continue
                    room = cap - len(out) - len(err)
                    buffers[key.fd] += data[:room]
                    if len(data) > room:
                        return bytes(out), bytes(err), "output_limit"
    finally:
        os.close(pidfd)
    return bytes(out), bytes(err), None


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


def _bwrap_options(bwrap: str, limits: Limits) -> list[str]:
    """The bwrap command (`bwrap`: its path) up to the program's file and working directory (see the module
    docstring)."""
    scratch = str(limits.file_mb << 20)
    env = [word for name, value in {**_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}.items()
           for word in ("--setenv", name, value)]
    return [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--clearenv", *env, "--ro-bind", "/", "/", "--proc", "/proc",
            "--dev", "/dev", "--size", scratch, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
            "--tmpfs", "/run", "--remount-ro", "/run", "--size", scratch, "--tmpfs", "/tmp"]


@functools.cache
def _bwrap_problem(bwrap: str | None) -> str | None:
    """Why bwrap (at path `bwrap`) cannot sandbox here, None when it can: not installed, or a trial run fails (as
    where user namespaces are not allowed, e.g. in a default Docker container). Tried once per process."""
    if bwrap is None:
        return "bwrap is not installed (Debian/Ubuntu package: bubblewrap)"
    try:
        trial = subprocess.run([*_bwrap_options(bwrap, Limits()), "true"], capture_output=True, text=True, timeout=30,
                               cwd="/", env=_ENV, **_sandbox_user())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap is installed but does not run: {e}"
    if trial.returncode != 0:
        return f"bwrap is installed but fails: {trial.stderr.strip() or f'exit status {trial.returncode}'}"
    return None


def _sandbox_user() -> dict:
    """Popen arguments that run the child as NOBODY when we are root (none otherwise)."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


@functools.cache
def _interpreter() -> str:
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
                               cwd="/", env=_ENV, **_sandbox_user())
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
    """A new directory holding the program as main.py, owned by the program's user (the fallback's working dir)."""
    if os.geteuid() == 0 and not _open_to_others(tempfile.gettempdir()):
        raise SandboxError(f"the temporary directory {tempfile.gettempdir()} is closed to uid {NOBODY}, which runs "
                           "sandboxed programs when we are root; set TMPDIR to one other users can enter (/tmp)")
    path = tempfile.mkdtemp(prefix="scalerl-sandbox-")
    with open(os.path.join(path, "main.py"), "w", encoding="utf-8") as f:
        f.write(source)
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


def _tasks_of(uid: int) -> int:
    """Tasks (processes and threads) whose real uid is `uid`, machine-wide: what RLIMIT_NPROC counts."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:
            continue  # exited meanwhile
        if int(status["Uid"].split()[0]) == uid:
            count += int(status["Threads"])
    return count
