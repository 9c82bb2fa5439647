"""The Slurm engine's reading of its job, pure (no cluster: `scontrol` answers with recorded records):
when a scheduler's verdict is worth waiting for, and waiting for a requeued job to run again."""

from __future__ import annotations

import subprocess
import time

import pytest

import launcher.engines.slurm as slurm_engine
from launcher.engines import engine_for
from launcher.engines.base import SchedulerCause
from launcher.engines.slurm import job as jobs
from launcher.specfile import parse_spec

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


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A batch-mode engine whose `scontrol show job` answers from `records` (the last one repeats)."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    spec = parse_spec({"slurm": {"nodes": 2, "workdir": str(tmp_path)}, "training": {"command": ["prog"]}})
    eng = engine_for(spec, RUN_ID)
    eng.job_id, eng.records, eng.asked = "41", [], 0

    def slurm(argv, timeout=30.0, input=None):
        assert argv[:4] == ["scontrol", "-o", "show", "job"], argv
        text = eng.records[min(eng.asked, len(eng.records) - 1)]
        eng.asked += 1
        return subprocess.CompletedProcess(argv, 0, text, "")

    monkeypatch.setattr(jobs, "slurm", slurm)
    monkeypatch.setattr(slurm_engine, "JOB_POLL_S", 0.01)
    monkeypatch.setattr(eng, "_watch_start", lambda: None)  # the job is asked from the test's thread only
    yield eng
    eng.close()


def test_a_job_still_running_with_nothing_from_slurm_gives_no_verdict_at_once(engine):
    """After a hang or a lost task the peers are stopped at once, not SETTLE_S later."""
    engine.records = [_job("RUNNING")]
    t0 = time.monotonic()
    assert engine.verdict(0) is None
    assert time.monotonic() - t0 < 1.0 and engine.asked == 1


def test_after_a_notice_the_verdict_waits_for_slurm_to_show_how_the_job_ended(engine):
    engine.records = [_job("RUNNING"), _job("COMPLETING"), _job("COMPLETING"), _job("CANCELLED")]
    engine.notices = {"SIGTERM"}
    found = engine.verdict(0)
    assert found is not None and found.cause == SchedulerCause.CANCELLED, found
    assert engine.asked == 4


def test_a_requeued_job_completing_its_last_run_is_waited_for_not_ended_before_it_ran(engine):
    """The requeue's verdict came while the job still showed COMPLETING: the next attempt follows the same
    job through COMPLETING and the queue until it runs (attempt numbers stay SLURM_RESTART_COUNT's)."""
    engine.records = [_job("COMPLETING", restarts=1), _job("RUNNING", restarts=1)]
    assert engine.verdict(0).cause == SchedulerCause.REQUEUED and engine.requeued
    engine.records, engine.asked = [_job("COMPLETING", 1), _job("COMPLETING", 1), _job("PENDING", 1),
                                    _job("RUNNING", 1)], 0
    assert engine._run_job(1) is None
    assert engine.asked == 4 and engine.job_ids == []  # followed, not resubmitted


def test_a_job_gone_before_it_ran_is_told(engine):
    engine.requeued, engine.records = True, [_job("PENDING", 1), _job("COMPLETING", 1), _job("CANCELLED", 1)]
    why = engine._run_job(1)
    assert why is not None and "ended before it ran (CANCELLED" in why, why
