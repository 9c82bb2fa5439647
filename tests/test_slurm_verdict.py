"""The Slurm engine's reading of its job, pure (no cluster: `scontrol` answers with recorded records):
when a scheduler's verdict is worth waiting for, waiting for a requeued job to run again, and the one
watcher that asks Slurm for everyone."""

from __future__ import annotations

import threading
import time

import pytest

from launcher.engines.base import SchedulerCause
from launcher.engines.slurm import job as jobs
from launcher.engines.slurm.batch import BatchJob
from launcher.engines.slurm.watch import Watcher
from launcher.spec.file import parse_spec
from worker.host.clock import wait_until

RUN_ID = "20260101-000000-abcd"


def _job(state: str, restarts: int = 0, run_time: str = "00:00:30", limit: str = "00:01:00") -> str:
    """A job's record as `scontrol -o show job` prints it (Slurm 22.05)."""
    return (f"JobId=41 JobName=mgpu-{RUN_ID} UserId=root(0) JobState={state} Reason=None Requeue=1 "
            f"Restarts={restarts} BatchFlag=1 ExitCode=0:0 RunTime={run_time} TimeLimit={limit} NodeList=node[1-2]\n")


@pytest.mark.parametrize("text,before,notices,expected", [
    (_job("RUNNING"), 0, set(), False),  # a hang, a lost or failed task: nothing from Slurm, do not wait
    (_job("CONFIGURING"), 0, set(), False),
    (_job("RUNNING", limit="UNLIMITED"), 0, set(), False),
    (_job("RUNNING", restarts=1), 1, set(), False),  # the requeue already followed: nothing new
    (_job("RUNNING"), 0, {"SIGTERM"}, True),  # the tasks had notice: an outside scancel, a requeue
    (_job("RUNNING"), 0, {"SIGUSR1"}, True),  # the time limit's notice
    (_job("RUNNING", restarts=1), 0, set(), True),  # requeued (and running again)
    (_job("RUNNING", run_time="00:01:02"), 0, set(), True),  # past its time limit: Slurm is ending it
    (_job("COMPLETING"), 0, set(), True),  # ending: how, Slurm tells once it is done
    (_job("PENDING", restarts=1), 0, set(), True),
    (_job("CANCELLED"), 0, set(), True),
    (_job("RUNNING", run_time="INVALID"), 0, set(), False),
])
def test_a_verdict_is_waited_for_only_when_something_says_slurm_is_ending_the_job(text, before, notices, expected):
    assert jobs.ending(jobs.record_of(text), before, notices) is expected
    assert jobs.ending(None, 0, {"SIGTERM"}) is False  # purged, or no answer: nothing more to learn


class Replay:
    """`scontrol show job` answered from recorded records (the last one repeats), counting the questions."""

    def __init__(self, *records: str):
        self.records, self.asked = list(records), 0

    def __call__(self, job_id: str) -> dict | None:
        assert job_id == "41", job_id
        text = self.records[min(self.asked, len(self.records) - 1)]
        self.asked += 1
        return jobs.record_of(text)


@pytest.fixture
def job(tmp_path):
    """The run's batch job 41, its watcher asked from the test's thread only (not started)."""
    spec = parse_spec({"slurm": {"nodes": 2, "workdir": str(tmp_path)}, "training": {"command": ["prog"]}})
    replay = Replay()
    made = BatchJob(spec, RUN_ID, watcher=Watcher("41", ask=replay, poll_s=0.01))
    made.replay = replay
    yield made
    made.watcher.close()


def test_a_job_still_running_with_nothing_from_slurm_gives_no_verdict_at_once(job):
    """After a hang or a lost task the peers are stopped at once, not SETTLE_S later."""
    job.replay.records = [_job("RUNNING")]
    t0 = time.monotonic()
    assert job.verdict(0, set()) is None
    assert time.monotonic() - t0 < 1.0 and job.replay.asked == 1


def test_after_a_notice_the_verdict_waits_for_slurm_to_show_how_the_job_ended(job):
    job.replay.records = [_job("RUNNING"), _job("COMPLETING"), _job("COMPLETING"), _job("CANCELLED")]
    found = job.verdict(0, {"SIGTERM"})
    assert found is not None and found.cause == SchedulerCause.CANCELLED, found
    assert job.replay.asked == 4


def test_a_requeued_job_completing_its_last_run_is_waited_for_not_ended_before_it_ran(job):
    """The requeue's verdict came while the job still showed COMPLETING: the next attempt follows the same
    job through COMPLETING and the queue until it runs (attempt numbers stay SLURM_RESTART_COUNT's)."""
    job.replay.records = [_job("COMPLETING", restarts=1)]
    assert job.verdict(0, set()).cause == SchedulerCause.REQUEUED and job.requeued
    job.replay.records, job.replay.asked = [_job("COMPLETING", 1), _job("COMPLETING", 1), _job("PENDING", 1),
                                            _job("RUNNING", 1)], 0
    said, told = [], []
    assert job.launch(1, said.append, told.append) is None
    assert job.replay.asked >= 3 and jobs.state_of(job.watcher.record()) == "RUNNING"  # through the queue
    assert job.job_ids == [] and told == []  # followed, not resubmitted
    assert said == []  # a queue reason of None is not said


def test_a_job_gone_before_it_ran_is_told(job):
    job.requeued, job.replay.records = True, [_job("PENDING", 1), _job("COMPLETING", 1), _job("CANCELLED", 1)]
    why = job.launch(1, lambda _text: None, lambda _job: None)
    assert why is not None and "ended before it ran (CANCELLED" in why, why


def test_the_watcher_caches_the_record_for_everyone_and_asks_one_question_at_a_time():
    """Readers share the last record (kept while Slurm does not answer); `fresh(max_age)` asks only when the
    cache is older; concurrent questions are asked one after the other."""
    answers = Replay(_job("PENDING"), _job("RUNNING"))
    watcher = Watcher("41", ask=answers)
    assert watcher.record() is None and jobs.state_of(watcher.fresh()) == "PENDING"
    assert jobs.state_of(watcher.fresh(max_age=60)) == "PENDING" and answers.asked == 1  # from the cache
    assert jobs.state_of(watcher.fresh()) == "RUNNING" and jobs.state_of(watcher.record()) == "RUNNING"
    silent = Watcher("41", ask=lambda _id: None)
    silent._record = jobs.record_of(_job("RUNNING"))
    assert silent.fresh() is None and jobs.state_of(silent.record()) == "RUNNING"  # no answer: the last record stays
    inside, most = [0], [0]

    def slow(job_id):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        inside[0] -= 1
        return jobs.record_of(_job("RUNNING"))

    busy = Watcher("41", ask=slow)
    threads = [threading.Thread(target=busy.fresh) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most[0] == 1
    polled = Replay(_job("RUNNING"))
    watched = Watcher(None, ask=polled, poll_s=0.01)
    watched.watch("41")  # polled by its own thread from now on
    try:
        assert wait_until(lambda: polled.asked >= 3, 10, 0.01) and jobs.state_of(watched.record()) == "RUNNING"
    finally:
        watched.close()
    asked = polled.asked
    time.sleep(0.1)
    assert polled.asked <= asked + 1  # closed: no more questions
