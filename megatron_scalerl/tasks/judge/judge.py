"""The trusted side of a sandboxed run: the judge, which runs the untrusted program and decides what happened.

This file is a standalone script (standard library only) that `tasks/sandbox.py` starts inside the sandbox as
`python -I -S judge.py --job-fd N`, beside asserts.py (the asserts mode).

The judge reads its job (marshal data from the host: the mode, the limits, the inputs or the asserts with their expected
values) from fd N and closes it, then makes itself non-dumpable (`PR_SET_DUMPABLE` 0): a process of the same user can
then read none of its memory, fds, environment or stack through /proc and cannot ptrace it. Under bwrap it is the
sandbox's PID 1, which no process inside can kill. It starts the program as a child (a fresh interpreter: nothing of the
judge's memory survives the exec), with only the fds it needs, its own limits and a clean environment, and reports to
its stdout, a channel the program holds no fd of, one JSON line per result:

- "case" mode (one stdin/stdout test; every case gets a sandbox and a judge of its own): a run of the program on the
  input, on its stdin; the record holds the bytes it printed (up to the output cap, as base64: the judge decodes
  nothing) and the failure kind the judge observed. The host compares the output: the expected outputs never enter
  the sandbox.
- "asserts" mode (asserts.py): the program runs once, as module "solution", in a runner child that only answers
  calls: the judge executes the test's setup and asserts itself, in its own interpreter, with every name the program
  defines standing for a proxy that forwards the call (arguments as plain data) to the runner and takes back plain data
  (`encode`/`decode`: None, bool, int, float, str, bytes, complex, list, tuple, set, frozenset, dict, exactly those
  types). A value that is not plain data is a wrong answer; an instance of a class the program defines stays in the
  runner, seen by the judge only as a handle whose methods it may call. So `==`, builtins and `assert` itself run in
  the judge, on values, where the program cannot patch or fake them.

Failure kinds are decided from what the judge observed of the program's processes, never from text they printed or an
exit status they chose (`observed_failure`).
"""

from __future__ import annotations

import binascii
import marshal
import os
import resource
import selectors
import signal
import sys
import time

PR_SET_DUMPABLE, PR_SET_PDEATHSIG = 4, 1
TICK_S = 0.05  # seconds between looks at the program's task count while it runs
# the kernel counts a new task before it checks RLIMIT_NPROC, so forks at once each hold a count the judge cannot see:
# a fork bomb's refused forks left the limit less 1 (about 15% of runs) or less 2 (about 1%) of tasks on two cores
FORKS_IN_FLIGHT = 2
CPUCLOCK_PROF = 0  # linux/posix-timers.h: a process CPU clock counting user + system ticks, the one RLIMIT_CPU reads
MEMORY_SHARE = 0.75  # a failed run whose peak resident memory reached this share of its limit failed on memory


# ---- what the judge observed of a program's processes ----

def observed_failure(status: int, cpu_s: float, peak_rss_mb: float, peak_tasks: int, files_full: bool,
                     limits: dict, task_limit: int) -> str | None:
    """The failure kind of a run of the program's main process, from what the judge observed: None when it exited 0;
    "timeout" when it used its CPU seconds; "processes" when its user's tasks came within FORKS_IN_FLIGHT of
    `task_limit` (its RLIMIT_NPROC: a fork or a new thread was refused then); "memory" when its peak resident memory
    reached MEMORY_SHARE of the limit; "filesystem" when it filled its scratch space or wrote a file of the largest
    size; else "runtime_error" (any other exit status or signal). `status`: os.waitstatus_to_exitcode."""
    if status == 0:
        return None
    if cpu_s >= 0.9 * limits["cpu_s"]:  # (the limit's own clock reads it at or just past the limit: 2.004 of 2)
        return "timeout"
    if peak_tasks >= task_limit - FORKS_IN_FLIGHT:
        return "processes"
    if peak_rss_mb >= MEMORY_SHARE * limits["memory_mb"]:
        return "memory"
    if files_full:
        return "filesystem"
    return "runtime_error"


def cpu_clock_s(pid: int) -> float | None:
    """The CPU seconds of process `pid` (a child that has exited and is not reaped yet) on its PROF clock, the tick
    count RLIMIT_CPU is enforced on; None where it cannot be read. rusage's count, scaled to the scheduler's runtime,
    can be far under it on a loaded machine: a busy loop beside a fork bomb got SIGXCPU at its 2 s with rusage at
    1.6 s, which read as a runtime error."""
    try:
        return time.clock_gettime((~pid << 3) | CPUCLOCK_PROF)  # the kernel's clock id of a process's PROF clock
    except OSError:
        return None


# ---- the judge ----

def _prctl(option: int, value: int) -> None:
    import ctypes  # deferred: ~9 ms of imports, for two calls

    if ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


class Child:
    """A process of the program's that the judge started: its pid and the read ends of its stdout and stderr pipes
    (None: they go to /dev/null). (Not a dataclass: importing dataclasses costs every sandbox ~15 ms.)"""

    __slots__ = ("pid", "stdout", "stderr")

    def __init__(self, pid: int, stdout: int | None, stderr: int | None):
        self.pid, self.stdout, self.stderr = pid, stdout, stderr

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Judge:
    """Runs the program's processes for one job (see the module docstring) and watches them."""

    memory_share, tick_s = MEMORY_SHARE, TICK_S

    def __init__(self, job: dict, json_text):
        self.job, self.limits = job, job["limits"]
        self.workdir, self.program = job["workdir"], job["program"]
        self.own_namespace = job["pid_namespace"]  # the judge is PID 1 of a PID namespace of its own
        self.json_text = json_text  # asserts.json_text: JSON without importing json (and re, enum, ...)
        # RLIMIT_NPROC of the program's processes: counted per user, so the judge's own task counts in our namespace;
        # in the fallback every task of our uid machine-wide does (other runs' too), so the program gets those and
        # its own `processes`
        self.nproc = self.limits["processes"] + (1 if self.own_namespace else self._task_counts(None)[0])

    def report(self, record: dict) -> None:
        """Write one result record, a JSON line, to the judge's stdout: the channel to the host."""
        view = memoryview((self.json_text(record) + "\n").encode())
        while view:
            view = view[os.write(1, view):]

    def start(self, argv: list[str], stdin: int | None = None, pass_fds: tuple[int, ...] = (), quiet: bool = False
              ) -> Child:
        """Start a child process of the program (a fresh interpreter running `argv`) in a session of its own, with its
        limits, a clean environment and no fd but its stdin (`stdin`, closed here; None: /dev/null), its stdout and
        stderr (pipes to us, or /dev/null when `quiet`) and `pass_fds`. (A plain fork and exec: the judge is
        single-threaded.)"""
        stdin = os.open(os.devnull, os.O_RDONLY) if stdin is None else stdin
        outputs = [os.pipe(), os.pipe()] if not quiet else []
        devnull = os.open(os.devnull, os.O_WRONLY) if quiet else -1
        pid = os.fork()
        if pid == 0:
            try:
                self._become_program(argv, stdin, [w for _, w in outputs] or [devnull, devnull], pass_fds)
            finally:
                os._exit(127)
        os.close(stdin)
        if quiet:
            os.close(devnull)
            return Child(pid, None, None)
        for _, write in outputs:
            os.close(write)
        return Child(pid, outputs[0][0], outputs[1][0])

    def _become_program(self, argv: list[str], stdin: int, outputs: list[int], pass_fds: tuple[int, ...]) -> None:
        """In the forked child: its standard fds, nothing else open but `pass_fds`, its limits, then the exec."""
        limits, parent = self.limits, os.getppid()
        os.setsid()
        for fd, source in zip((0, 1, 2), (stdin, *outputs), strict=True):
            os.dup2(source, fd)
        keep = {0, 1, 2, *pass_fds}
        for name in os.listdir("/proc/self/fd"):
            if int(name) not in keep:
                try:
                    os.close(int(name))
                except OSError:
                    pass  # the directory's own fd, closed by listdir
        for fd in pass_fds:
            os.set_inheritable(fd, True)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (self.nproc,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mb"] << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["files"],) * 2)
        if not self.own_namespace:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)
        os.chdir(self.workdir)
        os.execve(self.job["python"], [self.job["python"], "-I", "-S", *argv], self.job["env"])

    def observed(self, status: int, cpu_s: float, rss_mb: float, peak_tasks: int,
                 entries: list[tuple[str, bool]] | None = None) -> str | None:
        """`observed_failure` of a run that has ended, with this job's limits and its working directory (`entries`:
        what the program left there, when the caller has listed it already)."""
        full = status != 0 and self.files_full(self._entries() if entries is None else entries)
        return observed_failure(status, cpu_s, rss_mb, peak_tasks, full, self.limits, self.nproc)

    def tasks(self, child: Child) -> int:
        """Tasks (processes and threads) of the program's user now, as RLIMIT_NPROC counts them (`nproc` is that
        limit); 0 unless the program itself has more than one: only a program that forks or starts threads can have
        been refused one."""
        count, own = self._task_counts(child.pid)
        return count if own > 1 else 0

    def _task_counts(self, session: int | None) -> tuple[int, int]:
        """(tasks of our user: in our own PID namespace every one, ours included, in the fallback every one of our
        uid machine-wide; those of the program among them: every one but ours, in the fallback those of `session`)."""
        count = own = 0
        uid, ours = os.getuid(), os.getpid()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if not self.own_namespace and os.stat(f"/proc/{name}").st_uid != uid:
                    continue
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                tasks, in_session = max(1, int(fields[17])), int(fields[3]) == session  # a zombie still counts
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            count += tasks
            if (int(name) != ours) if self.own_namespace else in_session:
                own += tasks
        return count, own

    def end(self, child: Child) -> tuple[int, float, float]:
        """Wait for the child (it has exited or been killed), then kill and reap what it left running. Returns its
        status (os.waitstatus_to_exitcode), its CPU seconds as RLIMIT_CPU counts them (`cpu_clock_s`, read before it
        is reaped; rusage's where that clock cannot be read) and its peak resident memory (MiB)."""
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: its clock can still be read
        cpu_s = cpu_clock_s(child.pid)
        _, status, usage = os.wait4(child.pid, 0)
        if self.own_namespace:
            try:
                os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of the namespace
            except ProcessLookupError:
                pass  # none left
            while True:
                try:
                    os.wait()
                except ChildProcessError:
                    break
        else:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for fd in (child.stdout, child.stderr):
            if fd is not None:
                os.close(fd)
        if cpu_s is None:
            cpu_s = usage.ru_utime + usage.ru_stime
        return os.waitstatus_to_exitcode(status), cpu_s, usage.ru_maxrss / 1024

    def files_full(self, entries: list[tuple[str, bool]]) -> bool:
        """Whether the program filled its scratch space (under bwrap a tmpfs of file_mb) or wrote a file of the
        largest size it may (`entries`: what it left, `_entries`)."""
        largest = self.limits["file_mb"] << 20
        if self.own_namespace:
            stats = os.statvfs(self.workdir)
            if stats.f_bavail * stats.f_frsize < 64 << 10:
                return True
        return any(os.lstat(path).st_size >= largest for path, is_dir in entries if not is_dir)

    def _entries(self) -> list[tuple[str, bool]]:
        """Every path the program left in its working directory, parents before children, as (path, is a real
        directory); iterative (a tree thousands deep is no recursion), never through a link, each directory opened to
        us first, the working directory too (a program may chmod one 000; nothing of the program's runs by now)."""
        keep = {os.path.basename(self.program), *self.job.get("keep", [])}
        found, pending = [], [self.workdir]
        while pending:
            directory = pending.pop()
            try:
                os.chmod(directory, 0o700)
                names = os.listdir(directory)
            except OSError:
                continue
            for name in names:
                path = os.path.join(directory, name)
                if directory == self.workdir and name in keep:
                    continue
                is_dir = os.path.isdir(path) and not os.path.islink(path)
                found.append((path, is_dir))
                if is_dir:
                    pending.append(path)
        return found

    @staticmethod
    def clear(entries: list[tuple[str, bool]]) -> None:
        """Remove what the program left in its working directory (`entries`, `_entries`): children first."""
        for path, is_dir in reversed(entries):
            try:
                (os.rmdir if is_dir else os.unlink)(path)
            except OSError:
                pass

    def run_case(self, stdin: str, deadline: float) -> dict:
        """Run the program on one input until it exits, its wall time (`deadline`, monotonic) passes or its output
        passes the cap; the record of what it printed (the raw bytes, as base64: nothing is decoded here) and how it
        ended."""
        start = time.monotonic()
        memfd = os.memfd_create("stdin")
        os.write(memfd, stdin.encode())
        os.lseek(memfd, 0, os.SEEK_SET)
        child = self.start([self.program], stdin=memfd)
        out, err, stopped, peak_tasks = self.collect(child, deadline)
        status, cpu_s, rss_mb = self.end(child)
        # listed once, to judge a full disk and to empty the directory here, iteratively: the fallback's host removes
        # the directory after us, and a tree thousands deep would overflow its rmtree
        entries = self._entries()
        failure = stopped or self.observed(status, cpu_s, rss_mb, peak_tasks, entries)
        self.clear(entries)
        return {"case": 0, "stdout": _base64(out), "stderr": _base64(err[-self.job["stderr_keep"]:]),
                "status": status, "failure": failure, "seconds": time.monotonic() - start}

    def collect(self, child: Child, deadline: float) -> tuple[bytes, bytes, str | None, int]:
        """Read the child's stdout and stderr until it has exited and they hold no more (what it left running may keep
        them open: once it has exited, what they hold then is all), killing it at `deadline` (monotonic) or past the
        output cap. Returns (stdout, stderr, "timeout" | "output_limit" | None, the peak task count seen)."""
        cap, out, err = self.limits["output_bytes"], bytearray(), bytearray()
        buffers = {child.stdout: out, child.stderr: err}
        stopped, exited, peak_tasks, next_look = None, False, 0, time.monotonic() + TICK_S
        pidfd = os.pidfd_open(child.pid)  # readable once the child has exited; unlike wait(), it does not reap it
        try:
            with selectors.DefaultSelector() as selector:
                for fd in (*buffers, pidfd):
                    selector.register(fd, selectors.EVENT_READ)
                while selector.get_map() and stopped is None:
                    now = time.monotonic()
                    if now >= deadline and not exited:
                        stopped = "timeout"
                        break
                    if now >= next_look and not exited:
                        peak_tasks, next_look = max(peak_tasks, self.tasks(child)), now + TICK_S
                    events = selector.select(0 if exited else max(0.0, min(deadline, next_look) - now))
                    if exited and not events:
                        break
                    for key, _ in events:
                        if key.fd == pidfd:
                            exited = True
                            selector.unregister(pidfd)
                            peak_tasks = max(peak_tasks, self.tasks(child))  # what it leaves running counts too
                            continue
                        data = os.read(key.fd, 1 << 16)
                        if not data:
                            selector.unregister(key.fd)
                            continue
                        room = cap - len(out) - len(err)
                        buffers[key.fd] += data[:room]
                        if len(data) > room:
                            stopped = "output_limit"
        finally:
            os.close(pidfd)
        if stopped:
            child.kill()
        return bytes(out), bytes(err), stopped, peak_tasks

    def run_one_case(self) -> None:
        self.report(self.run_case(self.job["stdin"], time.monotonic() + self.limits["wall_s"]))


def _base64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode()


def main() -> None:
    job_fd = int(sys.argv[sys.argv.index("--job-fd") + 1])
    with os.fdopen(job_fd, "rb") as f:
        job = marshal.loads(f.read())  # written by the host (tasks/sandbox.py): trusted
    _prctl(PR_SET_DUMPABLE, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python's handler would let a program's SIGINT reach PID 1
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I left the script's directory out
    import asserts  # deferred: a sibling file (plain data, the asserts mode), found once the path above is set

    judge = Judge(job, asserts.json_text)
    judge.report({"ready": True})
    if job["mode"] == "case":
        judge.run_one_case()
    else:
        asserts.judge_asserts(judge)
    judge.report({"done": True})


if __name__ == "__main__":
    main()
