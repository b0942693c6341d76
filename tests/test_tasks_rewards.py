"""Rewards: answer extraction, math-verify grading in worker processes, timeouts, errors, registry, cleanup."""

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from megatron_scalerl.errors import UserError
from megatron_scalerl.tasks.rewards import Grade, RewardGrader, reward_of, strip_thinking
from megatron_scalerl.tasks.verifiers import VerifierError, known_verifiers, register_verifier

TIMEOUT_S = 2.0


def hang(answer: str, gold: str) -> bool:
    """A verifier that never answers in time (an adversarial input to a real one)."""
    time.sleep(60)
    return True


def boom(answer: str, gold: str) -> bool:
    raise ValueError(f"cannot grade {answer!r}")


def crash(answer: str, gold: str) -> bool:
    os._exit(3)  # a verifier that takes its worker down (segfault, OOM kill)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_dead(pids, within_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def grader():
    with RewardGrader(num_workers=2, timeout_s=TIMEOUT_S) as g:
        yield g
        pids = [w.proc.pid for w in g._workers]
    assert _wait_dead(pids) == []


def test_strip_thinking_rule():
    assert strip_thinking("let me think... 33?</think>The answer is \\boxed{34}.") == "The answer is \\boxed{34}."
    assert strip_thinking("a</think>b</think> final 7 ") == "final 7"  # after the last </think>
    assert strip_thinking("still thinking, maybe 33") == ""  # template opens thinking: never closed -> no answer
    assert strip_thinking("<think>still thinking, maybe 33") == ""
    assert strip_thinking("done</think> 12 <think> reopened 13") == "12"


@pytest.mark.parametrize("completion, gold, correct", [
    ("ok</think>\\boxed{33}", "33", True),
    ("ok</think>033", "33", True),  # AIME answers are written with leading zeros
    ("ok</think>\\boxed{033}", "33", True),
    ("ok</think>\\boxed{33}", "033", True),
    ("ok</think>\\boxed{\\frac{1}{2}}", "0.5", True),
    ("ok</think>\\boxed{\\frac{1}{2}}", "1/2", True),
    ("ok</think>0.5", "\\frac{1}{2}", True),
    ("ok</think>We add 5 and 7 apples, so the final answer is $\\boxed{33}$. Done.", "33", True),
    ("ok</think>\\boxed{34}", "33", False),
    ("ok</think>I could not solve it.", "33", False),
    ("ok</think>", "33", False),
    ("the answer is \\boxed{33}</think>so the answer is \\boxed{34}", "33", False),  # right only while thinking
    ("the answer is \\boxed{33}", "33", False),  # thinking never closed
])
def test_math_answers(grader, completion, gold, correct):
    grade = asyncio.run(grader.grade(completion, gold))
    assert grade.correct is correct, grade
    assert not grade.timed_out and grade.error is None


def test_grade_many_in_order(grader):
    grades = grader.grade_many([("x</think>\\boxed{33}", "33"), ("x</think>\\boxed{32}", "33"),
                                ("x</think>4", "4", "math")])
    assert [g.correct for g in grades] == [True, False, True]


def test_many_concurrent_grades(grader):
    async def run():
        return await asyncio.gather(*(grader.grade(f"t</think>\\boxed{{{i + (i % 3 == 0)}}}", str(i))
                                      for i in range(50)))

    grades = asyncio.run(run())
    assert [g.correct for g in grades] == [i % 3 != 0 for i in range(50)]
    assert all(g.error is None and not g.timed_out and g.seconds < TIMEOUT_S for g in grades)


def test_hanging_verifier_times_out_and_worker_is_replaced(grader):
    before = grader.counters()
    old_pids = {w.proc.pid for w in grader._workers}
    start = time.monotonic()
    grade = asyncio.run(grader.grade("x</think>42", "42", verifier=f"{__name__}:hang"))
    elapsed = time.monotonic() - start
    assert grade == Grade(correct=False, timed_out=True, error=None, seconds=grade.seconds, failure="grader_timeout")
    assert TIMEOUT_S <= grade.seconds < TIMEOUT_S + 1 and elapsed < TIMEOUT_S + 3
    after = grader.counters()
    assert after["timed_out"] == before["timed_out"] + 1 and after["graded"] == before["graded"] + 1
    killed = old_pids - {w.proc.pid for w in grader._workers}
    assert len(killed) == 1 and _wait_dead(killed) == []
    # the pool (replacement worker included) grades correctly afterwards
    grades = grader.grade_many([("x</think>\\boxed{7}", "7")] * 4 + [("x</think>8", "7")])
    assert [g.correct for g in grades] == [True] * 4 + [False]
    assert all(not g.timed_out for g in grades)


def test_raising_verifier_is_wrong_with_error(grader):
    before = grader.counters()["errored"]
    grade = asyncio.run(grader.grade("x</think>42", "42", verifier=f"{__name__}:boom"))
    assert not grade.correct and not grade.timed_out
    assert grade.error == "ValueError: cannot grade '42'"
    assert grader.counters()["errored"] == before + 1
    assert asyncio.run(grader.grade("x</think>42", "42")).correct  # the worker survives an exception


def test_worker_death_is_wrong_with_error_and_replaced(grader):
    grade = asyncio.run(grader.grade("x</think>42", "42", verifier=f"{__name__}:crash"))
    assert not grade.correct and not grade.timed_out and grade.error == "reward worker died (exit code 3)"
    assert all(g.correct for g in grader.grade_many([("x</think>\\boxed{5}", "5")] * 4))


def test_unknown_verifier_is_a_clear_error(grader):
    with pytest.raises(VerifierError, match=r"unknown verifier 'nope'; known: .*math") as e:
        asyncio.run(grader.grade("x</think>1", "1", verifier="nope"))
    assert isinstance(e.value, UserError)
    with pytest.raises(VerifierError, match="cannot import"):
        grader.grade_many([("x</think>1", "1", f"{__name__}:no_such_function")])


def test_register_verifier_by_name(grader):
    register_verifier("test-boom")(boom)
    assert "test-boom" in known_verifiers() and "math" in known_verifiers()
    assert "ValueError" in asyncio.run(grader.grade("x</think>1", "1", verifier="test-boom")).error
    with pytest.raises(VerifierError, match="not a top-level function"):
        register_verifier("nested")(lambda answer, gold: True)


def test_reward_of():
    assert reward_of(Grade(correct=True)) == 1.0
    assert reward_of(Grade(correct=False)) == -1.0
    assert reward_of(Grade(correct=False, timed_out=True)) == -1.0
    assert reward_of(Grade(correct=True), reward_correct=1.0, reward_incorrect=0.0) == 1.0
    assert reward_of(Grade(correct=False, error="x"), reward_correct=1.0, reward_incorrect=0.0) == 0.0


def test_no_workers_left_after_close_or_gc():
    g = RewardGrader(num_workers=1, timeout_s=TIMEOUT_S)
    assert g.grade_many([("x</think>1", "1")])[0].correct
    pids = [w.proc.pid for w in g._workers]
    g.close()
    assert _wait_dead(pids) == []
    with pytest.raises(RuntimeError, match="closed"):
        g.grade_many([("x</think>1", "1")])

    g = RewardGrader(num_workers=1)
    pids = [w.proc.pid for w in g._workers]
    del g
    gc.collect()
    assert _wait_dead(pids) == []


def test_no_workers_left_after_owner_crash():
    """The owner dies without cleanup (os._exit) while one worker hangs in a verifier: both workers exit."""
    script = textwrap.dedent("""
        import os, threading, time
        from megatron_scalerl.tasks.rewards import RewardGrader
        if __name__ == "__main__":
            g = RewardGrader(num_workers=2, timeout_s=60)
            assert all(grade.correct for grade in g.grade_many([("x</think>1", "1")] * 4))  # both workers ready
            threading.Thread(target=g.grade_many, args=([("x</think>1", "1", "tests.test_tasks_rewards:hang")],),
                             daemon=True).start()
            time.sleep(0.5)
            print(*[w.proc.pid for w in g._workers], flush=True)
            os._exit(1)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    pids = [int(p) for p in out.stdout.split()]
    assert pids, out.stderr
    assert _wait_dead(pids, within_s=10) == []
