"""The run's SLURM job list (`RUN/slurm_jobs.txt`, `gpu_hours.record_job`): each job once, whoever records at the
same time, and the list replaced whole, never appended to in place. sacct over it: tests/test_launch_slurm.py."""

import os
from multiprocessing import Process

from megatron_scalerl.run.gpu_hours import JOBS_FILE, record_job, run_jobs

JOBS = range(1000, 1030)


def _record_all(run_dir):
    for job in JOBS:
        record_job(run_dir, job)


def test_jobs_recorded_at_once_by_several_processes_are_each_listed_once(tmp_path):
    procs = [Process(target=_record_all, args=(tmp_path,)) for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    assert [proc.exitcode for proc in procs] == [0] * 4
    assert sorted(run_jobs(tmp_path)) == [str(job) for job in JOBS]  # none lost, none twice
    assert (tmp_path / JOBS_FILE).read_text().endswith("\n")


def test_the_list_is_replaced_whole(tmp_path):
    record_job(tmp_path, 7)
    before = os.stat(tmp_path / JOBS_FILE).st_ino
    record_job(tmp_path, 8)
    assert os.stat(tmp_path / JOBS_FILE).st_ino != before  # a new file renamed into place: a reader sees one or the other
    assert (tmp_path / JOBS_FILE).read_text() == "7\n8\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{JOBS_FILE}.lock", JOBS_FILE]  # no temporary file left
