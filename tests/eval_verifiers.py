"""Verifiers the evaluation tests plug into the grader by name (`--verifier tests.eval_verifiers:hang`)."""

import time


def hang(answer: str, gold: str) -> bool:
    """A verifier that never finishes (as math-verify can on adversarial input): the grader's timeout must end it."""
    time.sleep(3600)
    return False
