"""Rewards: grade a completion's answer in worker processes, with a per-answer timeout.

A completion is graded in three steps:
  1. `answer_part` keeps the answer. A thinking prompt opens with the model thinking, so everything up to the last
     `</think>` is thinking (`strip_thinking`); a completion with no `</think>` never finished thinking and has no
     answer (""). A problem without thinking (its source's `thinking: false`) is answered by its whole reply.
  2. The problem's verifier (tasks/verifiers.py: "math" with math-verify against the gold answer, "code" running the
     problem's tests in a sandbox, a verl-form `compute_score`, or any "package.module:function") decides
     correctness. Verifiers run in worker processes, which import the function by its path.
  3. `reward_of` maps the Grade to the scalar reward (recipe: algorithm.reward_correct / reward_incorrect, +1/-1;
     a verl-form score s: reward_incorrect + s x (reward_correct - reward_incorrect)).

`RewardGrader` owns N worker processes (math-verify uses signal.alarm, which works only in a process's main thread),
forked from a multiprocessing forkserver that imported this module and math-verify once (`WORKER_PRELOAD`): starting
or replacing a worker costs a fork, not a fresh interpreter and ~2 CPU-seconds of imports. (The forkserver is one per
owning process: where the trainer's local workers started it first, with their own preload, a new worker imports
math-verify itself before it says it is ready.) Each answer gets `timeout_s` seconds of wall time on a worker; past
that the worker is killed and replaced, and the answer scores as wrong with `timed_out=True`. An adversarial answer
can therefore cost at most `timeout_s` seconds of one worker, never stall the run. A verifier that raises scores as
wrong with the error text kept. Workers exit on their own when the owning process dies (pipe EOF, or a watchdog on a
lifeline pipe, also while a verifier hangs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import queue
import re
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from megatron_scalerl.tasks.problems import Problem
from megatron_scalerl.tasks.prompts import THINK_CLOSE, THINK_OPEN
from megatron_scalerl.tasks.sandbox import Limits, RunResult, run_python
from megatron_scalerl.tasks.verifiers import (
    NO_ANSWER,
    Verdict,
    Verifier,
    call_verifier,
    import_verifier,
    resolve_verifier,
    verify_math,
)


def strip_thinking(completion: str) -> str:
    """The answer part of a completion: the text after the last `</think>`, up to a `<think>` that opens again.

    Our prompt template opens the assistant turn already thinking, so a completion without any `</think>` is all
    thinking (it hit the length cap or never stopped) and has no answer: "". Leading/trailing whitespace is removed.
    """
    if THINK_CLOSE not in completion:
        return ""
    answer = completion.rsplit(THINK_CLOSE, 1)[1]
    return answer.split(THINK_OPEN, 1)[0].strip()


def answer_part(completion: str, thinking: bool = True) -> str:
    """What the verifier grades: the text after the thinking (`strip_thinking`), or for a reply without thinking
    the whole of it, stripped."""
    return strip_thinking(completion) if thinking else completion.strip()


# ---- worker process ----

GRADER_TIMEOUT = "grader_timeout"  # Grade.failure of an answer whose verifier ran past the grader's timeout
RUN_PROGRAM = "run_program"  # a worker job that is not a verifier's path: run a tool program (`RewardGrader.run_python`)


def grade_here(completion: str, problem: Problem) -> Verdict:
    """`completion` graded in this process as the workers grade it (thinking stripped; no answer: "no_answer"), but
    without their per-answer timeout: for a caller grading a few completions of its own (the demo's warm start)."""
    answer = answer_part(completion, problem.thinking)
    if not answer:
        return Verdict(False, 0.0, NO_ANSWER)
    return call_verifier(import_verifier(resolve_verifier(problem.verifier)), answer, problem.row())


# imported once, in the forkserver
WORKER_PRELOAD = ["math_verify", "megatron_scalerl.tasks.rewards", "megatron_scalerl.tasks.code_verifier"]


def _worker_context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    return ctx


# Environment variables a worker drops when it starts (API keys, tokens, passwords): a program the code verifier runs
# must find no secret in its grader, whatever the sandbox.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)


def _hide_secrets(code_sandbox: str) -> None:
    """Drop every secret from this process's environment, make it non-dumpable (no process of the same user can
    read its memory, fds or initial environment through /proc, nor ptrace it) and set the code sandbox it uses."""
    import ctypes  # deferred: only grader workers call prctl

    for name in [name for name in os.environ if SECRET_NAME.search(name)]:
        del os.environ[name]
    os.environ["SCALERL_SANDBOX"] = code_sandbox
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0


def _worker_main(conn, lifeline, code_sandbox: str) -> None:
    """Loop of one worker: receive (verifier path, answer, problem row), send ("ok", Verdict) or ("error", text);
    (RUN_PROGRAM, program, limits as a dict): send ("ok", sandbox.RunResult) of the program run in the sandbox.
    Exits on pipe EOF, or when the owner goes away, also while a verifier hangs: a watchdog thread waits on
    `lifeline`, a pipe whose only writing end the owner holds. (The forkserver, our parent, outlives the owner while
    any of its workers lives, so the parent cannot tell.) It first hides its secrets (`_hide_secrets`)."""
    _hide_secrets(code_sandbox)

    def watchdog() -> None:
        with contextlib.suppress(EOFError, OSError):
            lifeline.recv()  # nothing is ever sent: returns at EOF, when the owner's end closes
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's to handle; we follow it out
    try:
        verify_math("1", "1")  # import sympy/math-verify and build its parsers before the first timed answer
    except Exception:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    cache: dict[str, Verifier] = {}
    while True:
        try:
            path, answer, row = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if path == RUN_PROGRAM:
                conn.send(("ok", run_python(answer, limits=Limits(**row))))
                continue
            fn = cache.get(path)
            if fn is None:
                fn = cache[path] = import_verifier(path)
            conn.send(("ok", call_verifier(fn, answer, row)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    """Parent-side handle of one worker process; used by one thread at a time."""

    def __init__(self, ctx, code_sandbox: str):
        self.conn, child = ctx.Pipe(duplex=True)
        lifeline, self._lifeline = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_worker_main, args=(child, lifeline, code_sandbox), daemon=True,
                                name="reward-worker")
        self.proc.start()
        child.close()  # only the worker holds these ends: our death reads as EOF there
        lifeline.close()
        self.ready, self.failure = False, None

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for "ready" (sent once math-verify is imported); a worker that failed to start keeps raising."""
        if not self.ready and self.failure is None:
            try:
                if not self.conn.poll(timeout_s):
                    self.failure = f"did not start within {timeout_s:.0f} s"
                else:
                    kind, detail = self.conn.recv()
                    self.ready = kind == "ready"
                    self.failure = None if self.ready else f"failed to start:\n{detail}"
            except (EOFError, OSError):
                self.failure = f"exited while starting (exit code {self.proc.exitcode})"
        if self.failure is not None:
            raise RuntimeError(f"reward worker pid {self.proc.pid} {self.failure}")

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()
        self._lifeline.close()


def _shutdown(workers: list[_Worker], executor: ThreadPoolExecutor, lock: threading.Lock) -> None:
    executor.shutdown(wait=False, cancel_futures=True)
    with lock:
        doomed = list(workers)
        workers.clear()
    for w in doomed:
        w.kill()


@dataclass(frozen=True)
class Grade:
    """The verdict on one answer. `seconds`: wall seconds on the worker (0 when there was no answer to verify);
    `timed_out`: the verifier passed the grader's timeout and its worker was replaced; `error`: text of the exception
    the verifier raised (or of a worker that died). Timed out or errored answers are not correct. `fraction`: the
    share of the problem's tests passed (0 or 1 for a verifier without tests); `failure`: the verifier's kind of
    failure ("wrong_answer", "no_answer", "grader_timeout", "error", the code verifier's "timeout", "memory", ...),
    None when correct; `score`, `metrics`: a verl-form reward's score and other figures (None, {} otherwise)."""

    correct: bool
    timed_out: bool = False
    error: str | None = None
    seconds: float = 0.0
    fraction: float = 0.0
    failure: str | None = None
    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def reward_of(grade: Grade, reward_correct: float = 1.0, reward_incorrect: float = -1.0) -> float:
    """The scalar reward of a grade (recipe: algorithm.reward_correct / algorithm.reward_incorrect): all or
    nothing, or for a verl-form score s the way from incorrect to correct, reward_incorrect + s x (reward_correct -
    reward_incorrect) (a format score of 0.1 is a tenth of the way)."""
    if grade.score is not None:
        return reward_incorrect + grade.score * (reward_correct - reward_incorrect)
    return reward_correct if grade.correct else reward_incorrect


class RewardGrader:
    """A pool of `num_workers` verifier processes; `timeout_s` is the wall-clock limit per answer, in seconds, counted
    from when a worker receives the answer (waiting for a free worker is not counted). `startup_timeout_s` bounds a
    (re)started worker's import of math-verify. `code_sandbox`: the sandbox the code verifier uses in the workers
    ("bwrap" or "rlimits", recipe: data.code_sandbox). Use as a context manager or call `close()`."""

    def __init__(self, num_workers: int | None = None, timeout_s: float = 10.0, startup_timeout_s: float = 120.0,
                 code_sandbox: str = "bwrap"):
        self.num_workers = num_workers or max(1, min(8, os.cpu_count() or 1))
        self.code_sandbox = code_sandbox
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._ctx = _worker_context()
        self._lock = threading.Lock()
        self._closed = False
        self._counts = {"graded": 0, "timed_out": 0, "errored": 0}
        # one thread per worker process drives it: the blocking pipe waits stay off the caller's event loop
        self._executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="reward-grader")
        self._workers = [_Worker(self._ctx, code_sandbox) for _ in range(self.num_workers)]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for w in self._workers:
            self._idle.put(w)
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._executor, self._lock)

    async def grade(self, completion: str, problem: Problem | str, verifier: str | None = None) -> Grade:
        """Grade one completion (thinking is stripped first) on `problem` with its verifier, or on a gold answer
        string with `verifier` (default "math"); safe to call concurrently from one event loop."""
        job = self._job(completion, problem, verifier)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._grade_blocking, *job)

    async def run_python(self, program: str, limits: Limits) -> RunResult:
        """Run `program` once, empty stdin, in the grader's sandbox (`code_sandbox`) on one of its workers, within
        `limits` (tasks/sandbox.py); past the grader's `timeout_s` its worker is replaced and the run is a
        "timeout". For an environment's tool calls (tasks/environments.py): the workers hold no secret."""
        self._check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._run_blocking, program, limits)

    def _run_blocking(self, program: str, limits: Limits) -> RunResult:
        answer = self._ask_worker((RUN_PROGRAM, program, dataclasses.asdict(limits)))
        if answer is None or answer[0] != "ok":
            return RunResult("", "" if answer is None else str(answer[1]), -1, 0.0,
                             "timeout" if answer is None else "sandbox_error")
        return answer[1]

    def grade_many(self, items: Iterable[tuple[str, Problem | str] | tuple[str, str, str]]) -> list[Grade]:
        """Blocking: grade (completion, problem or gold) or (completion, gold, verifier) tuples in parallel; results
        in order."""
        jobs = [self._job(*item) for item in items]
        return list(self._executor.map(lambda job: self._grade_blocking(*job), jobs))

    def _job(self, completion: str, problem: Problem | str, verifier: str | None = None) -> tuple[str, dict, str]:
        """(answer, problem row, verifier path) for a worker."""
        self._check_open()
        if isinstance(problem, str):
            return strip_thinking(completion), Problem("", "", problem).row(), resolve_verifier(verifier or "math")
        return answer_part(completion, problem.thinking), problem.row(), resolve_verifier(verifier or problem.verifier)

    def counters(self) -> dict[str, int]:
        """Answers graded, timed out and errored since the grader started (for metrics)."""
        with self._lock:
            return dict(self._counts)

    def _count(self, grade: Grade) -> Grade:
        with self._lock:
            self._counts["graded"] += 1
            self._counts["timed_out"] += grade.timed_out
            self._counts["errored"] += grade.error is not None
        return grade

    def _grade_blocking(self, answer: str, row: dict, path: str) -> Grade:
        if not answer:
            return self._count(Grade(correct=False, failure=NO_ANSWER))
        start = time.monotonic()
        reply = self._ask_worker((path, answer, row))
        seconds = time.monotonic() - start
        if reply is None:
            return self._count(Grade(correct=False, timed_out=True, seconds=seconds, failure=GRADER_TIMEOUT))
        kind, value = reply
        if kind != "ok":
            return self._count(Grade(correct=False, error=value, seconds=seconds, failure="error"))
        verdict: Verdict = value
        return self._count(Grade(correct=verdict.correct, seconds=seconds, fraction=verdict.fraction,
                                 failure=verdict.failure, score=verdict.score, metrics=dict(verdict.metrics)))

    def _ask_worker(self, job: tuple) -> tuple[str, object] | None:
        """`job` on a free worker: its reply (kind, value), ("error", why) when the worker died under it, None when
        it passed `timeout_s` (the worker is replaced)."""
        worker = self._take_worker()
        try:
            worker.wait_ready(self.startup_timeout_s)
            worker.conn.send(job)
            if not worker.conn.poll(self.timeout_s):
                worker = self._replace(worker)
                return None
            return worker.conn.recv()
        except (EOFError, OSError) as e:  # the worker died under the job (or the grader was closed)
            if self._closed:
                raise RuntimeError("RewardGrader is closed") from e
            dead, worker = worker, self._replace(worker)  # _replace reaps the dead one: its exit code is known
            return "error", f"reward worker died (exit code {dead.proc.exitcode})"
        finally:
            if not self._closed:
                self._idle.put(worker)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RewardGrader is closed")

    def _take_worker(self) -> _Worker:
        while True:  # one driver thread per worker: a wait here is short, unless the grader was closed meanwhile
            self._check_open()
            with contextlib.suppress(queue.Empty):
                return self._idle.get(timeout=0.5)

    def _replace(self, worker: _Worker) -> _Worker:
        """Kill `worker` and start a new one in its place (it gets ready in the background)."""
        worker.kill()
        with self._lock:
            if self._closed:
                return worker
            fresh = _Worker(self._ctx, self.code_sandbox)
            self._workers[self._workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        """Stop all workers (killed; they hold no state) and the driver threads. Idempotent."""
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> RewardGrader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
