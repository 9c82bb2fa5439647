"""The Slurm lifecycle told truthfully, on the real Slurm cluster of deploy/: a requeue and a node set
DOWN are preemptions that resume from the checkpoint in the same job; a time limit and an outside
`scancel` end the run with failure kind `scheduler`, saved tasks recorded preempted, and no
"restarting" line; a job waiting in the queue (at first, or requeued and held) is a run still going.
After each, nothing of the run is left in the queue or on a node."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from conftest import write_slurm_spec, launcher_traceback, latest_state, status_json, wait_for, wait_gone

PY = sys.executable


@pytest.fixture
def sc(make_slurm_cluster, cli):
    """A private cluster for each test: it sets nodes down and leaves finished jobs that others would see."""
    cluster = make_slurm_cluster(2)
    cli.env.update(cluster.env)
    yield cluster
    cluster.command("scancel", "--user=root", check=False)


def write_spec(tmp_path: Path, epochs: int, slurm: str = "", launch: str = "") -> Path:
    command = [PY, "-m", "worker", "--entrypoint", "worker.examples.digits:task", "--epochs", str(epochs),
               "--steps-per-epoch", "40", "--batch-size-per-replica", "8", "--checkpoint-dir",
               str(tmp_path / "shared" / "ckpt")]
    return write_slurm_spec(tmp_path, f"command = {json.dumps(command)}", slurm, f"preempt_grace = 15\n{launch}")


def training_at(cli, epoch: int):
    """The run's record once both tasks train at `epoch` or later (their progress.json says so)."""
    st = latest_state(cli)
    if not st or st["state"] != "running" or not st.get("job"):
        return None
    for t in st["tasks"]:
        try:
            if json.loads((Path(t["run_dir"]) / "progress.json").read_text()).get("epoch", 0) < epoch:
                return None
        except (OSError, ValueError):
            return None
    return st



def nothing_left(sc, cli, run_id: str) -> None:
    assert wait_for(lambda: f"mgpu-{run_id}" not in sc.command("squeue", "-h", "-o", "%j").stdout.split(), 30,
                    "no job of the run in the queue")
    assert not wait_gone(cli.home, 15), "a process of the run is left on a node"


def requeued_at_once(sc, job_id: str) -> None:
    """Slurm makes a requeued job eligible 2 minutes later; an administrator's StartTime=now here
    keeps the test short (the launcher waits for the job however long it takes)."""
    wait_for(lambda: (sc.job(job_id) or {}).get("JobState") == "PENDING", 60, "the job back in the queue")
    sc.command("scontrol", "update", f"jobid={job_id}", "StartTime=now")


@pytest.mark.parametrize("how", ["scontrol requeue", "node set DOWN"])
def test_a_requeue_is_a_preemption_and_the_group_resumes_in_the_same_job(sc, cli, tmp_path, how):
    spec = write_spec(tmp_path, epochs=4)

    def take_back(_up, st):
        job_id = st["job"]["id"]
        if how == "scontrol requeue":
            sc.command("scontrol", "requeue", job_id)
        else:
            sc.command("scontrol", "update", "nodename=node2", "state=down", "reason=test")
        requeued_at_once(sc, job_id)
        if how == "node set DOWN":
            sc.command("scontrol", "update", "nodename=node2", "state=resume", check=False)

    code, out = cli.up_while(spec, lambda: training_at(cli, 2), take_back, "epoch 2 on both tasks",
                             ready_timeout=300, timeout=400)
    assert code == 0 and not launcher_traceback(out), out
    assert "was preempted" in out and "restarting the whole group after preemption 1" in out, out
    assert "attempt 0 failed" not in out and "error:" not in out and "lost" not in out, out
    snap = status_json(cli)
    assert snap["state"] == "succeeded" and snap["failure"] is None, snap
    assert (snap["preemptions"], snap["restarts"], snap["attempt"]) == (1, 0, 1), snap
    assert snap["attempts"][0]["outcome"] == "preempted" and "requeued" in snap["attempts"][0]["reason"], snap
    assert snap["job"]["ids"] == [snap["job"]["id"]], snap  # the same job ran again: nothing resubmitted
    for t in snap["tasks"]:
        p = json.loads((Path(t["run_dir"]) / "progress.json").read_text())
        assert p["first_epoch"] >= 2 and p["epoch"] == 4, p  # resumed from the checkpoint, not from scratch
    nothing_left(sc, cli, snap["run_id"])


def test_a_time_limit_is_told_as_a_time_limit(sc, cli, tmp_path):
    spec = write_spec(tmp_path, epochs=1000, slurm='time = "1"', launch="max_restarts = 2")
    r = cli("up", spec, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and not launcher_traceback(out), out
    assert "restarting" not in out, out  # no restart follows a scheduler's end, so none is announced
    snap = status_json(cli)
    failure = snap["failure"]
    assert failure["kind"] == "scheduler" and "time limit" in failure["message"], failure
    assert snap["restarts"] == 0 and [t["state"] for t in snap["tasks"]] == ["preempted", "preempted"], snap
    nothing_left(sc, cli, snap["run_id"])


def test_an_outside_scancel_is_told_as_cancelled_from_outside(sc, cli, tmp_path):
    spec = write_spec(tmp_path, epochs=1000, launch="max_restarts = 2")
    code, out = cli.up_while(spec, lambda: training_at(cli, 1),
                             lambda _up, st: sc.command("scancel", st["job"]["id"]), "both tasks training",
                             ready_timeout=300, timeout=120)
    assert code == 1 and not launcher_traceback(out), out
    assert "restarting" not in out, out
    snap = status_json(cli)
    failure = snap["failure"]
    assert failure["kind"] == "scheduler" and "cancelled from outside" in failure["message"], failure
    assert snap["restarts"] == 0 and "lost" not in [t["state"] for t in snap["tasks"]], snap
    nothing_left(sc, cli, snap["run_id"])


def test_a_queued_and_a_requeued_job_are_left_going_and_shown_waiting(sc, cli, tmp_path, monkeypatch, capfd):
    """`up --detach` whose job waits in the queue past the detach's wait leaves the run going; so does a job
    that Slurm requeues and holds in the queue (its node DOWN): the run is `starting` again with its
    launcher alive, `status` shows the job pending with Slurm's reason; once the node is back the same job
    runs again (the next attempt), and `down` stops it."""
    from launcher.run import detach, record

    monkeypatch.setattr(detach, "DETACH_WAIT_S", 5.0)  # the real wait is minutes
    for k, v in {**sc.env, "MGPU_HOME": str(cli.home)}.items():
        monkeypatch.setenv(k, v)
    shared = tmp_path / "shared"
    shared.mkdir()
    spec = tmp_path / "cluster.toml"
    spec.write_text(f'[slurm]\nnodes = 2\nworkdir = "{shared}"\npartition = "debug"\npython = "{PY}"\n'
                    f'[training]\ncommand = {json.dumps([PY, "-c", "import time; time.sleep(600)"])}\n'
                    "[launch]\npreempt_grace = 5\n")
    blocker = sc.command("sbatch", "--parsable", "-N1", "-w", "node2", "-o", "/dev/null", "--wrap",
                         "sleep 300").stdout.strip()
    wait_for(lambda: (sc.job(blocker) or {}).get("JobState") == "RUNNING", 30, "the blocker running")
    run_id = record.new_run_id()
    detach.start_detached(spec, run_id, 2)  # the job waits behind the blocker: the wait runs out
    said = capfd.readouterr().out
    assert "not running yet" in said and "not stopped" in said, said
    snap = status_json(cli)
    assert snap["run_id"] == run_id and snap["launcher_alive"] and snap["state"] == "starting", snap
    assert snap["job"]["state"] == "pending" and snap["job"]["reason"] in ("Resources", "Priority"), snap["job"]
    assert [t["state"] for t in snap["tasks"]] == ["pending", "pending"], snap["tasks"]
    job_id = snap["job"]["id"]

    sc.command("scancel", blocker)
    assert wait_for(lambda: (lambda s: s if s["state"] == "running" else None)(status_json(cli)), 60, "the run running")
    # requeued; held in the queue (Slurm makes a requeued job eligible only minutes later)
    sc.command("scontrol", "update", "nodename=node2", "state=down", "reason=test")
    held = wait_for(lambda: (lambda s: s if s["attempt"] == 1 and s["job"]["state"] == "pending" else None)(
        status_json(cli)), 90, "the next attempt waiting for the requeued job")
    time.sleep(3)  # held: no task can report; the run waits for the job, however long
    snap = status_json(cli)
    assert snap["launcher_alive"] and snap["state"] == "starting" and snap["attempt"] == 1, snap
    assert snap["job"]["state"] == "pending" and snap["job"]["reason"] and snap["job"]["id"] == job_id, snap["job"]
    assert snap["preemptions"] == 1 and snap["attempts"][0]["outcome"] == "preempted", snap
    assert held["job"]["ids"] == [job_id]  # the same job: nothing resubmitted

    sc.command("scontrol", "update", "nodename=node2", "state=resume", check=False)  # it may be back already
    requeued_at_once(sc, job_id)
    again = wait_for(lambda: (lambda s: s if s["state"] == "running" else None)(status_json(cli)), 90,
                     "the requeued job running again")
    assert again["attempt"] == 1 and again["job"]["id"] == job_id and again["job"]["state"] == "running", again
    d = cli("down", timeout=120)
    assert d.returncode == 0, d.stdout + d.stderr
    assert status_json(cli)["state"] == "stopped"
    nothing_left(sc, cli, run_id)
