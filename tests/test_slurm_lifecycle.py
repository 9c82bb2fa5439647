"""The Slurm lifecycle told truthfully, on the real Slurm cluster of deploy/: a requeue and a node set
DOWN are preemptions that resume from the checkpoint in the same job; a time limit and an outside
`scancel` end the run with failure kind `scheduler`, tasks that had notice recorded preempted, and no
"restarting" line; a job waiting in the queue (at first, or requeued and held) is a run still going.
After each, nothing of the run is left in the queue or on a node."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import (Cli, launcher_traceback, latest_state, reap, run_processes, status_json, wait_for, wait_gone,
                      write_slurm_spec)
from slurm_fixtures import _start, _stop, private_cluster, require_slurm

PY = sys.executable
pytestmark = pytest.mark.cluster  # every test here runs on a real Slurm cluster (some through module fixtures)
SLEEP = "command = " + json.dumps([PY, "-c", "import time; time.sleep(600)"])
PROGRESS = "command = " + json.dumps([PY, "-c", (  # trains a "step" every 0.2 s at epoch 1; dies on the first TERM
    "import json, os, time\nd = os.environ['MGPU_RUN_DIR']\nfor n in range(1, 10 ** 6):\n"
    "    open(d + '/p.tmp', 'w').write(json.dumps({'global_step': n, 'epoch': 1}))\n"
    "    os.replace(d + '/p.tmp', d + '/progress.json')\n    time.sleep(0.2)")])


def settle(cluster) -> None:
    """Leave a cluster as a test found it: no job in the queue, both nodes up and idle."""
    cluster.command("scancel", "--user=root", check=False)
    cluster.command("scontrol", "update", "nodename=node2", "state=resume", check=False)  # if a test left it down
    wait_for(lambda: not cluster.command("squeue", "-h", check=False).stdout.strip(), 60, "no jobs left")
    wait_for(lambda: set(cluster.node_states().values()) == {"idle"}, 60, "idle nodes")


@pytest.fixture(scope="module")
def cluster(request):
    """A private cluster for the tests that run here in turn (they set nodes down and leave finished jobs that
    the session's cluster should not see); each test leaves it with no job and both nodes idle."""
    yield from private_cluster(request)


@pytest.fixture
def sc(cluster, cli):
    cli.env.update(cluster.env)
    yield cluster
    settle(cluster)


def module_cli(tmp_path: Path, cluster) -> Cli:
    """A CLI with its own MGPU_HOME for a run that a module fixture starts (the `cli` fixture is per test)."""
    made = Cli(tmp_path / "mgpu-home", tmp_path)
    made.env.update(cluster.env)
    return made


def no_leftovers(made: Cli) -> None:
    left = reap(run_processes(made.home))
    assert not left, f"processes left running after the run: {[(p.pid, p.info) for p in left]}"


def write_spec(tmp_path: Path, epochs: int, slurm: str = "", launch: str = "") -> Path:
    command = [PY, "-m", "worker", "--entrypoint", "worker.examples.digits:task", "--epochs", str(epochs),
               "--steps-per-epoch", "40", "--batch-size-per-replica", "8", "--checkpoint-dir",
               str(tmp_path / "shared" / "ckpt")]
    return write_slurm_spec(tmp_path, f"command = {json.dumps(command)}", slurm, f"preempt_grace = 15\n{launch}")


def progress(task: dict) -> dict | None:
    try:
        return json.loads((Path(task["run_dir"]) / "progress.json").read_text())
    except (OSError, ValueError):
        return None


def training_at(cli, epoch: int, attempt: int = 0):
    """The run's record once both tasks of `attempt` train at `epoch` or later (their progress.json says so)."""
    st = latest_state(cli)
    if not st or st["state"] != "running" or not st.get("job") or st["attempt"] != attempt:
        return None
    for t in st["tasks"]:
        p = progress(t)
        # an earlier attempt's progress.json says "preempted" (saved on notice) until this attempt's worker writes
        if not p or p.get("epoch", 0) < epoch or attempt and p.get("state") != "training":
            return None
    return st


def nothing_left(sc, cli, run_id: str) -> None:
    assert wait_for(lambda: f"mgpu-{run_id}" not in sc.command("squeue", "-h", "-o", "%j").stdout.split(), 30,
                    "no job of the run in the queue")
    assert not wait_gone(cli.home, 15), "a process of the run is left on a node"


def requeued_at_once(sc, job_id: str, wait=wait_for) -> None:
    """Slurm makes a requeued job eligible 2 minutes later; an administrator's StartTime=now here
    keeps the test short (the launcher waits for the job however long it takes)."""
    wait(lambda: (sc.job(job_id) or {}).get("JobState") == "PENDING", 60, "the job back in the queue")
    sc.command("scontrol", "update", f"jobid={job_id}", "StartTime=now")


class Background:
    """A run that a module fixture starts on a Slurm cluster of its own, with the module's first test, and that
    a thread drives (`drive(run)`, optional) while the other tests run; its test reads it with `result()`.
    Slurm's waits (a time limit is checked every 30 s; a requeue, TensorFlow starting twice) overlap so."""

    def __init__(self, request, tmp_path_factory, name: str):
        require_slurm()
        self.request, self.failed_before = request, request.session.testsfailed
        self.tmp = tmp_path_factory.mktemp(name)
        self.cluster = _start(2)
        self.cli = module_cli(self.tmp, self.cluster)
        self.up: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.code = self.out = self.snap = None

    def start(self, spec: Path, drive=None) -> "Background":
        with open(self.tmp / "up.out", "w") as out:
            self.up = subprocess.Popen(self.cli.argv("up", spec), cwd=self.cli.cwd, env=self.cli.env, stdout=out,
                                       stderr=subprocess.STDOUT)
        self.thread = threading.Thread(target=self._drive, args=(drive,), daemon=True, name=self.tmp.name)
        self.thread.start()
        return self

    def wait(self, cond, timeout: float, what: str):
        """wait_for, given up when the fixture is torn down."""
        def check():
            if self.stopping.is_set():
                raise RuntimeError(f"stopped while waiting for {what}")
            if self.up is not None and self.up.poll() is not None:  # told now, not after the timeout
                raise AssertionError(f"the run ended (exit {self.up.returncode}) before {what}:\n"
                                     + (self.tmp / "up.out").read_text(errors="replace")[-4000:])
            return cond()
        return wait_for(check, timeout, what)

    def _drive(self, drive) -> None:
        try:
            if drive is not None:
                drive(self)
            self.code = self.up.wait(timeout=400)
            self.out = (self.tmp / "up.out").read_text()
            self.snap = status_json(self.cli)
        except BaseException as e:  # noqa: BLE001  (result() raises it in the test)
            self.error = e

    def result(self) -> "Background":
        self.thread.join(600)
        assert not self.thread.is_alive(), "the run did not end in 10 minutes"
        if self.error is not None:
            raise self.error
        return self

    def close(self) -> None:
        self.stopping.set()
        if self.up is not None and self.up.poll() is None:
            self.up.kill()
            self.up.wait()
        if self.thread is not None:
            self.thread.join(60)
        try:
            settle(self.cluster)
        finally:
            _stop(self.cluster, self.request, self.failed_before)
        no_leftovers(self.cli)


@pytest.fixture(scope="module")
def time_limit_run(request, tmp_path_factory):
    """The time-limit test's run: tasks that sleep, a 1-minute limit. Slurm checks time limits (and sends
    --signal's notice) only every 30 s, at a moment of its own; preempt_grace = 30 asks for the notice 30 s
    before the limit, so at the first check after the job starts."""
    run = Background(request, tmp_path_factory, "time-limit")
    try:
        yield run.start(write_slurm_spec(run.tmp, SLEEP, 'time = "1"', "preempt_grace = 30\nmax_restarts = 2"))
    finally:
        run.close()


EPOCHS = 8


@pytest.fixture(scope="module")
def requeued(request, tmp_path_factory):
    """One training that Slurm requeues twice, in the same job: by `scontrol requeue` at epoch 2, then, once
    it trains again (attempt 1) at epoch 3, by its node set DOWN; it finishes its 8 epochs in attempt 2 (5
    left attempt 1 a few seconds past epoch 3, which a loaded machine's poll could miss).
    What both tasks' progress.json said while attempt 1 trained is kept (`resumed`)."""
    def drive(run):
        st = run.wait(lambda: training_at(run.cli, 2), 300, "epoch 2 on both tasks")
        job_id = st["job"]["id"]
        run.cluster.command("scontrol", "requeue", job_id)
        requeued_at_once(run.cluster, job_id, run.wait)
        st = run.wait(lambda: training_at(run.cli, 3, attempt=1), 300, "attempt 1 at epoch 3 on both tasks")
        run.resumed = [progress(t) for t in st["tasks"]]
        run.cluster.command("scontrol", "update", "nodename=node2", "state=down", "reason=test")
        requeued_at_once(run.cluster, job_id, run.wait)
        run.cluster.command("scontrol", "update", "nodename=node2", "state=resume", check=False)

    run = Background(request, tmp_path_factory, "requeue")
    try:
        yield run.start(write_spec(run.tmp, epochs=EPOCHS), drive)
    finally:
        run.close()


@pytest.fixture(scope="module", autouse=True)
def _background_runs(time_limit_run, requeued):
    """Starts both runs with the module's first test (see Background)."""


def test_an_outside_scancel_is_told_as_cancelled_from_outside(sc, cli, tmp_path):
    spec = write_slurm_spec(tmp_path, PROGRESS, "", "preempt_grace = 15\nmax_restarts = 2")
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


@pytest.mark.parametrize("how", ["scontrol requeue", "node set DOWN"])
def test_a_requeue_is_a_preemption_and_the_group_resumes_in_the_same_job(requeued, how):
    """Both ways in one run (`requeued`): the `scontrol requeue` is its preemption 1, the node set DOWN its
    preemption 2; each resumes from the checkpoint in the same job."""
    run = requeued.result()
    code, out, snap = run.code, run.out, run.snap
    n = 1 if how == "scontrol requeue" else 2  # which preemption of the run this way of requeueing was
    assert code == 0 and not launcher_traceback(out), out
    assert "was preempted" in out and f"restarting the whole group after preemption {n}" in out, out
    assert "attempt 0 failed" not in out and "attempt 1 failed" not in out, out
    assert "error:" not in out and "lost" not in out, out
    assert snap["state"] == "succeeded" and snap["failure"] is None, snap
    assert (snap["preemptions"], snap["restarts"], snap["attempt"]) == (2, 0, 2), snap
    ended = snap["attempts"][n - 1]
    assert ended["outcome"] == "preempted" and "requeued" in ended["reason"], snap
    assert snap["job"]["ids"] == [snap["job"]["id"]], snap  # the same job ran again: nothing resubmitted
    final = [json.loads((Path(t["run_dir"]) / "progress.json").read_text()) for t in snap["tasks"]]
    # resumed from the checkpoint, not from scratch: attempt n began at the epoch it was requeued at (2, then 3)
    for p in run.resumed if n == 1 else final:
        assert p["first_epoch"] >= n + 1, p
    for p in final:
        assert p["epoch"] == EPOCHS, p  # and the run trained every epoch
    nothing_left(run.cluster, run.cli, snap["run_id"])


def test_a_time_limit_is_told_as_a_time_limit(time_limit_run):
    run = time_limit_run.result()
    code, out = run.code, run.out
    assert code == 1 and not launcher_traceback(out), out
    assert "restarting" not in out, out  # no restart follows a scheduler's end, so none is announced
    snap = run.snap
    failure = snap["failure"]
    assert failure["kind"] == "scheduler" and "time limit" in failure["message"], failure
    assert snap["restarts"] == 0 and [t["state"] for t in snap["tasks"]] == ["preempted", "preempted"], snap
    nothing_left(run.cluster, run.cli, snap["run_id"])
