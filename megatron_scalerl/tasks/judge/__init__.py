"""The code sandbox's trusted side, run inside the sandbox as plain scripts (standard library only): `judge.py` runs
the program and observes how it ended, `asserts.py` judges function asserts on the values the program returns."""
