"""The time words of the orchestrator's console line: `elapsed` over the run's launches, `eta` at the recent pace
to the run's last batch or its GPU-hour budget, whichever comes first."""

import pytest

from megatron_scalerl.orchestrator.progress import RECENT_BATCHES, Progress, duration, eta_seconds


@pytest.mark.parametrize(("seconds", "words"), [(0, "0s"), (-3, "0s"), (59.9, "59s"), (60, "1m00s"), (723, "12m03s"),
                                                (3599, "59m59s"), (3600, "1h00m"), (11_220, "3h07m"),
                                                (200_000, "55h33m")])
def test_a_duration_reads_in_the_largest_two_units(seconds, words):
    assert duration(seconds) == words


def test_the_eta_is_the_batches_left_at_the_recent_pace_or_the_budget_left_whichever_ends_first():
    # 10 batches in 100 s, 0.1 GPU-h; 40 batches left: 400 s; without a budget that is the end
    recent = [(0.0, 50, 1.0), (100.0, 60, 1.1)]
    assert eta_seconds(recent, max_batches=100, budget=None) == pytest.approx(400.0)
    assert eta_seconds(recent, max_batches=100, budget=5.0) == pytest.approx(400.0)  # the budget lasts longer
    assert eta_seconds(recent, max_batches=100, budget=1.3) == pytest.approx(200.0)  # 0.2 GPU-h left: 200 s
    assert eta_seconds(recent, max_batches=100, budget=1.0) == 0.0  # spent: the run ends at this batch
    assert eta_seconds(recent[:1], max_batches=100, budget=None) is None  # no pace yet
    assert eta_seconds([(0.0, 5, 1.0), (10.0, 5, 1.0)], max_batches=9, budget=None) is None  # no progress


def test_the_progress_words_go_by_the_last_batches_and_the_runs_hours_over_its_launches():
    """A resumed run: 1.5 h before this launch; its first 3 batches took 60 s each, the next ones 10 s: the pace is
    that of the last RECENT_BATCHES batches (this process's start included while it is among them)."""
    progress = Progress(max_batches=40, budget=None, written=10, gpu_hours=2.0, now=0.0)
    assert progress.words(written=11, gpu_hours=2.1, wall_hours=1.5 + 60 / 3600, now=60.0) == \
        "elapsed 1h31m | eta 29m00s"  # 29 batches left at 60 s
    now, written = 60.0, 11
    for pace in (60.0, 60.0, *[10.0] * RECENT_BATCHES):
        now, written = now + pace, written + 1
        words = progress.words(written=written, gpu_hours=2.0 + now / 600, wall_hours=1.5 + now / 3600, now=now)
    assert written == 23 and words == "elapsed 1h34m | eta 2m50s"  # 17 batches left at 10 s
