"""Rewards: grade a completion's answer against the gold answer in worker processes, with a per-answer timeout.

A completion is graded in three steps:
  1. `strip_thinking` keeps the answer part. Our prompt template opens with the model thinking, so everything up to
     the last `</think>` is thinking; a completion with no `</think>` never finished thinking and has no answer ("").
  2. A verifier `fn(answer_text, gold) -> bool` decides correctness. Verifiers are named: built-in ones through
     `register_verifier` (the built-in "math" uses math-verify), any other top-level function as
     "package.module:function". They run in worker processes, which import the function by that path.
  3. `reward_of` maps the Grade to the scalar reward (recipe: algorithm.reward_correct / reward_incorrect, +1/-1).

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
import importlib
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megatron_scalerl.errors import UserError
from megatron_scalerl.tasks.prompts import THINK_CLOSE, THINK_OPEN


class VerifierError(UserError):
    """A verifier name does not resolve to a function; the message lists the known names."""


def strip_thinking(completion: str) -> str:
    """The answer part of a completion: the text after the last `</think>`, up to a `<think>` that opens again.

    Our prompt template opens the assistant turn already thinking, so a completion without any `</think>` is all
    thinking (it hit the length cap or never stopped) and has no answer: "". Leading/trailing whitespace is removed.
    """
    if THINK_CLOSE not in completion:
        return ""
    answer = completion.rsplit(THINK_CLOSE, 1)[1]
    return answer.split(THINK_OPEN, 1)[0].strip()


# ---- verifier registry: name -> "module:function" path, so a worker process can import the function ----

_REGISTRY: dict[str, str] = {}


def register_verifier(name: str) -> Callable[[Callable[[str, str], bool]], Callable[[str, str], bool]]:
    """Decorator: register a top-level function `fn(answer_text: str, gold: str) -> bool` under `name`.

    The registry stores the function's import path; the worker imports it, so the defining module must be importable
    in another process (the worker imports it by that path). Functions that cannot be imported by path (nested, lambdas)
    are refused.
    """

    def decorate(fn: Callable[[str, str], bool]) -> Callable[[str, str], bool]:
        if "<" in fn.__qualname__ or "." in fn.__qualname__:
            raise VerifierError(f"verifier {name!r}: {fn.__qualname__} is not a top-level function; "
                                "worker processes import verifiers by module path")
        _REGISTRY[name] = f"{fn.__module__}:{fn.__qualname__}"
        return fn

    return decorate


def known_verifiers() -> list[str]:
    return sorted(_REGISTRY)  # names; any top-level function also works as "package.module:function"


def _import_path(path: str) -> Callable[[str, str], bool]:
    module, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise TypeError(f"{path} is not callable")
    return fn


def resolve_verifier(name: str) -> str:
    """The import path ("module:function") of a verifier given by registered name or by path; checked here, in the
    caller's process, so a typo fails at once rather than as an error grade per answer."""
    path = _REGISTRY.get(name, name)
    if ":" not in path:
        raise VerifierError(f"unknown verifier {name!r}; known: {', '.join(known_verifiers())} "
                            "(or name a top-level function as 'package.module:function')")
    try:
        _import_path(path)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise VerifierError(f"verifier {name!r}: cannot import {path}: {e}") from e
    return path


def _gold_latex(gold: str) -> str:
    """A bare gold ("33", "\\frac{1}{2}") wrapped in $...$ so math-verify's LaTeX extraction sees it."""
    gold = gold.strip()
    if "$" in gold or "\\boxed" in gold or "\\(" in gold or "\\[" in gold:
        return gold
    return f"${gold}$"


@register_verifier("math")
def verify_math(answer: str, gold: str) -> bool:
    """math-verify: gold first (`verify(gold, pred)` is not symmetric). 33 == 033, 1/2 == 0.5 == \\frac{1}{2}."""
    from math_verify import parse, verify

    return bool(verify(parse(_gold_latex(gold)), parse(answer)))


# ---- worker process ----

WORKER_PRELOAD = ["math_verify", "megatron_scalerl.tasks.rewards"]  # imported once, in the forkserver


def _worker_context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    return ctx


def _worker_main(conn, lifeline) -> None:
    """Loop of one worker: receive (verifier path, answer, gold), send ("ok", bool) or ("error", text).
    Exits on pipe EOF, or when the owner goes away, also while a verifier hangs: a watchdog thread waits on
    `lifeline`, a pipe whose only writing end the owner holds. (The forkserver, our parent, outlives the owner while
    any of its workers lives, so the parent cannot tell.)"""

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
    cache: dict[str, Callable[[str, str], bool]] = {}
    while True:
        try:
            path, answer, gold = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fn = cache.get(path)
            if fn is None:
                fn = cache[path] = _import_path(path)
            conn.send(("ok", bool(fn(answer, gold))))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    """Parent-side handle of one worker process; used by one thread at a time."""

    def __init__(self, ctx):
        self.conn, child = ctx.Pipe(duplex=True)
        lifeline, self._lifeline = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_worker_main, args=(child, lifeline), daemon=True, name="reward-worker")
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
    the verifier raised (or of a worker that died). Timed out or errored answers are not correct."""

    correct: bool
    timed_out: bool = False
    error: str | None = None
    seconds: float = 0.0


def reward_of(grade: Grade, reward_correct: float = 1.0, reward_incorrect: float = -1.0) -> float:
    """The scalar reward of a grade (recipe: algorithm.reward_correct / algorithm.reward_incorrect)."""
    return reward_correct if grade.correct else reward_incorrect


class RewardGrader:
    """A pool of `num_workers` verifier processes; `timeout_s` is the wall-clock limit per answer, in seconds, counted
    from when a worker receives the answer (waiting for a free worker is not counted). `startup_timeout_s` bounds a
    (re)started worker's import of math-verify. Use as a context manager or call `close()`."""

    def __init__(self, num_workers: int | None = None, timeout_s: float = 10.0, startup_timeout_s: float = 120.0):
        self.num_workers = num_workers or max(1, min(8, os.cpu_count() or 1))
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._ctx = _worker_context()
        self._lock = threading.Lock()
        self._closed = False
        self._counts = {"graded": 0, "timed_out": 0, "errored": 0}
        # one thread per worker process drives it: the blocking pipe waits stay off the caller's event loop
        self._executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="reward-grader")
        self._workers = [_Worker(self._ctx) for _ in range(self.num_workers)]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for w in self._workers:
            self._idle.put(w)
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._executor, self._lock)

    async def grade(self, completion: str, gold: str, verifier: str = "math") -> Grade:
        """Grade one completion (thinking is stripped first); safe to call concurrently from one event loop."""
        self._check_open()
        path = resolve_verifier(verifier)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._grade_blocking, strip_thinking(completion), gold, path)

    def grade_many(self, items: Iterable[tuple[str, str] | tuple[str, str, str]]) -> list[Grade]:
        """Blocking: grade (completion, gold) or (completion, gold, verifier) tuples in parallel; results in order."""
        self._check_open()
        jobs = [(strip_thinking(it[0]), it[1], resolve_verifier(it[2] if len(it) > 2 else "math")) for it in items]
        return list(self._executor.map(lambda job: self._grade_blocking(*job), jobs))

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

    def _grade_blocking(self, answer: str, gold: str, path: str) -> Grade:
        if not answer:
            return self._count(Grade(correct=False))
        worker = self._take_worker()
        start = time.monotonic()
        try:
            worker.wait_ready(self.startup_timeout_s)
            start = time.monotonic()
            worker.conn.send((path, answer, gold))
            answered = worker.conn.poll(self.timeout_s)
            seconds = time.monotonic() - start
            if not answered:
                worker = self._replace(worker)
                return self._count(Grade(correct=False, timed_out=True, seconds=seconds))
            kind, value = worker.conn.recv()
            ok = kind == "ok"
            return self._count(Grade(correct=ok and value, error=None if ok else value, seconds=seconds))
        except (EOFError, OSError) as e:  # the worker died under the verifier (or the grader was closed)
            if self._closed:
                raise RuntimeError("RewardGrader is closed") from e
            dead, worker = worker, self._replace(worker)  # _replace reaps the dead one: its exit code is known
            return self._count(Grade(correct=False, error=f"reward worker died (exit code {dead.proc.exitcode})",
                                     seconds=time.monotonic() - start))
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
            fresh = _Worker(self._ctx)
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
