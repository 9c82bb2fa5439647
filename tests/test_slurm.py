"""The Slurm engine against a real slurmctld and two slurmd, each node in its own network namespace
(tests/slurm_fixtures.py): `up` of a [slurm] spec (TensorFlow, and Keras 3 on JAX), kill -9, down, Ctrl-C, a
restart as a new job, bad [slurm] tables, a run inside an existing allocation. Plus the pure parts (TF_CONFIG, the script, the
verdict from recorded job records, following events files, status rows). The lifecycle (requeue, node
down, time limit, outside scancel) is in test_slurm_lifecycle.py."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import (STACK_HEADER, Cli, launcher_traceback, latest_state, need, reap, run_processes, status_json,
                      wait_for, wait_gone, write_slurm_spec)
from slurm_fixtures import _start, _stop, require_slurm
from launcher.engines.base import SchedulerCause
from launcher.engines.slurm import follow
from launcher.engines.slurm.follow import POLL_S, Follower
from launcher.engines.slurm.job import parse_time, record_of, settled, verdict_of
from launcher.engines.slurm.plan import plan_slurm
from launcher.engines.slurm.script import batch_script, sbatch_options, srun_argv
from launcher.engines.slurm import status
from launcher.engines.slurm.status import last_records, latest_attempt
from launcher.engines import engine_for
from launcher.run import record
from launcher.spec.file import load_spec, parse_spec
from worker.host import protocol
from worker.host import env as task_env
from worker.host import layout
from worker.host.clock import wait_until
from worker.task import slurm as slurm_task

PY = sys.executable
DIGITS = ["-m", "worker", "--entrypoint", "worker.examples.digits:task"]
SLEEP = f'command = ["{PY}", "-c", "import time; print(\'up\', flush=True); time.sleep(600)"]'
STEPS = "command = " + json.dumps([PY, "-c", (  # a task that trains a step every 0.2 s, for the heartbeat
    "import json, os, time\nd = os.environ['MGPU_RUN_DIR']\nfor n in range(1, 10 ** 6):\n"
    "    open(d + '/p.tmp', 'w').write(json.dumps({'global_step': n, 'epoch': 1}))\n"
    "    os.replace(d + '/p.tmp', d + '/progress.json')\n    time.sleep(0.2)")])


def events_path(root: Path, index: int, attempt: int) -> Path:
    return layout.events_file(layout.task_dir(root, index), attempt)


# --------------------------------------------------------------------------- against a real Slurm
# (first: the trainings that `sc` starts train on while these tests and the pure ones below run)

@pytest.fixture(scope="module")
def killed_launcher(request, tmp_path_factory):
    """The run of test_a_job_whose_launcher_is_killed_ends_itself, on a cluster of its own, started with the
    module's first test that uses a cluster (`sc`): a thread starts `up` of tasks that sleep (lifeline 10 s),
    kills it with SIGKILL once they run, and the 10 s of the lifeline run out while the other tests run."""
    require_slurm()
    failed_before = request.session.testsfailed
    tmp_path = tmp_path_factory.mktemp("killed-launcher")
    cluster = _start(2)
    run = types.SimpleNamespace(cluster=cluster, cli=Cli(tmp_path / "mgpu-home", tmp_path), code=None, error=None)
    run.cli.env.update(cluster.env)
    spec = write_spec(tmp_path, SLEEP, launch="heartbeat_timeout = 5")  # lifeline: 10 s
    with open(tmp_path / "up.out", "w") as out:
        up = subprocess.Popen(run.cli.argv("up", spec), cwd=run.cli.cwd, env=run.cli.env, stdout=out,
                              stderr=subprocess.STDOUT)
    stop = threading.Event()

    def drive():
        try:
            wait_for(lambda: stop.is_set() or (lambda s: s and s["state"] == "running")(latest_state(run.cli)), 240,
                     "tasks running")
            if not stop.is_set():
                up.kill()
                run.code = up.wait()
        except BaseException as e:  # noqa: BLE001  (the test raises it)
            run.error = e

    run.driver = threading.Thread(target=drive, daemon=True, name="killed-launcher")
    run.driver.start()
    try:
        yield run
    finally:
        stop.set()
        run.driver.join(30)
        if up.poll() is None:
            up.kill()
            up.wait()
        try:
            cluster.command("scancel", "--user=root", check=False)
        finally:
            _stop(cluster, request, failed_before)
        left = reap(run_processes(run.cli.home))
        assert not left, f"processes left running after the run: {[(p.pid, p.info) for p in left]}"


@pytest.fixture(scope="module")
def trainings(request, tmp_path_factory):
    """The module's TensorFlow and JAX trainings (digits on two nodes, Keras 3 on JAX, a restart that resumes at
    epoch 3), one after another on a cluster of their own, driven by a thread that starts with the module's first
    test on a cluster (`sc`): they train while the tests of the launcher's own behaviour (command tasks, on the
    session's cluster) run. Each training's test reads what its run gave with `result(name)`."""
    require_slurm()
    failed_before = request.session.testsfailed
    cluster = _start(2)
    stopping = threading.Event()
    runs = {name: types.SimpleNamespace(name=name, cluster=cluster, done=threading.Event(), error=None)
            for name in ("digits", "keras3", "restart")}

    def cli_for(run) -> Cli:
        tmp = tmp_path_factory.mktemp(run.name)
        run.tmp, run.cli = tmp, Cli(tmp / "mgpu-home", tmp)
        run.cli.env.update(cluster.env)
        return run.cli

    def digits_run(run):
        cli = cli_for(run)
        run.weights = run.tmp / "shared" / "weights-{task}.npz"
        spec = write_spec(run.tmp, digits("--epochs", "5", "--save-weights", str(run.weights)))
        run.dry = cli("up", "--dry-run", spec, timeout=60)
        run.jobs_before = our_jobs(cluster)
        run.up = cli("up", spec, timeout=600)
        run.snap = status_json(cli)
        run.logs = cli("logs", "--task", "1", "--tail", "3", timeout=60)
        run.left = wait_gone(cli.home, 10)

    def keras3_run(run):
        need("jax")
        cli = cli_for(run)
        for name in ("TF_CONFIG", "TF_USE_LEGACY_KERAS"):
            cli.env.pop(name, None)  # srun passes the launcher's own environment on
        run.weights = run.tmp / "shared" / "weights-{task}.npz"
        args = ["--steps-per-epoch", "6", "--save-weights", str(run.weights)]
        spec = write_slurm_spec(run.tmp, f'backend = "jax"\nentrypoint = "worker.examples.digits_keras3:task"\n'
                                         f"local_replicas = 2\nbatch_size_per_replica = 16\nepochs = 2\n"
                                         f"args = {json.dumps(args)}")
        run.up = cli("up", spec, timeout=600)
        run.snap = status_json(cli)
        run.left = wait_gone(cli.home, 10)

    def restart_run(run):
        cli = cli_for(run)
        # the kill must land inside epoch 3 (progress.json is written every 0.25 s at most): 100 steps give it time
        spec = write_spec(run.tmp, digits("--epochs", "4", "--steps-per-epoch", "100", "--batch-size-per-replica", "8"),
                          launch="max_restarts = 1")
        run.code, run.out = cli.up_while(spec, lambda: training(cli, epoch=3),
                                         lambda _up, st: os.kill(st["tasks"][1]["pid"], signal.SIGKILL),
                                         "epoch 3 to begin", timeout=400)
        run.snap = status_json(cli)

    def drive():
        for run, train in zip(runs.values(), (digits_run, keras3_run, restart_run)):
            try:
                if stopping.is_set():
                    raise RuntimeError("the module ended before this training ran")
                train(run)
                wait_for(lambda: not cluster.command("squeue", "-h", check=False).stdout.strip(), 60, "no jobs left")
            except BaseException as e:  # noqa: BLE001  (result() raises it in the training's test)
                run.error = e
            finally:
                run.done.set()

    def result(name: str):
        run = runs[name]
        assert run.done.wait(900), f"the {name} training did not end in 15 minutes"
        if run.error is not None:
            raise run.error
        return run

    driver = threading.Thread(target=drive, daemon=True, name="trainings")
    driver.start()
    try:
        yield types.SimpleNamespace(result=result)
    finally:
        finished = not driver.is_alive()
        stopping.set()
        homes = [run.cli.home for run in runs.values() if hasattr(run, "cli")]
        if not finished:  # a test was deselected, or failed: what still trains is stopped, not reported
            for home in homes:
                reap(run_processes(home))
        driver.join(120)
        try:
            cluster.command("scancel", "--user=root", check=False)
        finally:
            _stop(cluster, request, failed_before)
        left = [p for home in homes for p in reap(run_processes(home))]
        assert not left, f"processes left running after the trainings: {[(p.pid, p.info) for p in left]}"


@pytest.fixture
def sc(slurm_cluster, cli, killed_launcher, trainings):
    """The session's cluster, clients pointed at it; every job of a test ends with the test.
    (`killed_launcher` and `trainings` only start those runs early, on clusters of their own.)"""
    cli.env.update(slurm_cluster.env)
    yield slurm_cluster
    slurm_cluster.command("scancel", "--user=root", check=False)
    wait_for(lambda: not slurm_cluster.command("squeue", "-h", check=False).stdout.strip(), 60, "no jobs left")
    wait_for(lambda: set(slurm_cluster.node_states().values()) == {"idle"}, 30, "idle nodes")


def write_spec(tmp_path: Path, training: str, slurm: str = "", launch: str = "", nodes: int = 2,
               partition: str = "debug") -> Path:
    return write_slurm_spec(tmp_path, training, slurm, launch, nodes, partition,
                            env='TF_CPP_MIN_LOG_LEVEL = "2", MY_TOKEN = "hunter2"')


def digits(*extra: str) -> str:
    return "command = " + json.dumps([PY, *DIGITS, "--batch-size-per-replica", "32", "--learning-rate", "0.002",
                                      *extra])



def progress(task: dict) -> dict:
    try:
        return json.loads((Path(task["run_dir"]) / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def started_record(task: dict, attempt: int):
    """The Started record the task core wrote for `attempt` in its events file."""
    from worker.host import protocol

    lines = (Path(task["run_dir"]) / f"events-{attempt}.jsonl").read_bytes().splitlines()
    return next(ev for ev in map(protocol.decode, lines) if isinstance(ev, protocol.Started))


def training(cli, epoch: int = 1):
    """The newest run's state once both tasks train (task 1 at `epoch` or later)."""
    st = latest_state(cli)
    if st and st["state"] == "running" and all((progress(t).get("global_step") or 0) > 0 for t in st["tasks"]) \
            and progress(st["tasks"][1]).get("epoch", 0) >= epoch:
        return st
    return None


def our_jobs(sc) -> list[str]:
    """Every mgpu job the controller knows (finished ones too: MinJobAge is an hour)."""
    return [n for n in sc.command("squeue", "-h", "-t", "all", "-o", "%j").stdout.split() if n.startswith("mgpu-")]


def job_state(sc, job_id: str, *final: str) -> str:
    """The job's state; with `final` states, once it reached one of them (COMPLETING passes in seconds)."""
    state = lambda: (sc.job(job_id) or {}).get("JobState", "")  # noqa: E731
    return wait_for(lambda: state() in final and state(), 20, f"job {job_id} in {final}") if final else state()


def test_each_task_gets_the_environment_contract(sc, cli, tmp_path):
    """A fixed port; TF_CONFIG and MGPU_* as each task saw them."""
    dump = "import json, os; json.dump(dict(os.environ), open(os.environ['MGPU_RUN_DIR'] + '/env.json', 'w'))"
    spec = write_spec(tmp_path, f"command = {json.dumps([PY, '-c', dump])}", slurm="port = 23456")
    r = cli("up", spec, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    st = latest_state(cli)
    workers = [f"{address}:23456" for _, address in sc.nodes]
    for i, t in enumerate(st["tasks"]):
        env = json.loads((Path(t["run_dir"]) / "env.json").read_text())
        assert json.loads(env["TF_CONFIG"]) == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
        assert (env["MGPU_RUN_ID"], env["MGPU_TASK_INDEX"], env["MGPU_NUM_WORKERS"]) == (st["run_id"], str(i), "2")
        assert env["MGPU_RUN_DIR"] == t["run_dir"] and env["SLURMD_NODENAME"] == f"node{i + 1}"
        assert (env["TF_USE_LEGACY_KERAS"], env["CUDA_VISIBLE_DEVICES"], env["MY_TOKEN"]) == ("1", "", "hunter2")
        assert t["port"] == 23456


def test_each_task_of_a_jax_spec_gets_kerass_variables(sc, cli, tmp_path):
    """backend = "jax": the coordinator (the first node's address, the port) and the task's rank, built on its
    node from what the launcher wrote; no TF_CONFIG, no TF_USE_LEGACY_KERAS."""
    for name in ("TF_CONFIG", "TF_USE_LEGACY_KERAS"):
        cli.env.pop(name, None)  # srun passes the launcher's own environment on
    dump = "import json, os; json.dump(dict(os.environ), open(os.environ['MGPU_RUN_DIR'] + '/env.json', 'w'))"
    spec = write_slurm_spec(tmp_path, f'backend = "jax"\ncommand = {json.dumps([PY, "-c", dump])}',
                            slurm="port = 23457")
    r = cli("up", spec, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    st = latest_state(cli)
    coordinator = f"{sc.nodes[0][1]}:23457"
    for i, t in enumerate(st["tasks"]):
        env = json.loads((Path(t["run_dir"]) / "env.json").read_text())
        assert [env.get(k) for k in task_env.KERAS_VARIABLES] == ["jax", coordinator, "2", str(i)]
        assert "TF_CONFIG" not in env and "TF_USE_LEGACY_KERAS" not in env and env["MGPU_TASK_INDEX"] == str(i)


def test_kill_9_of_a_task_ends_the_job_and_names_it(sc, cli, tmp_path):
    spec = write_spec(tmp_path, STEPS)  # the launcher's and Slurm's doing: no TensorFlow needed
    took = {}

    def kill_task_1(up, st):
        victim, other = st["tasks"][1], st["tasks"][0]
        survivors = [psutil.Process(other["pid"]), psutil.Process(other["supervisor_pid"])]
        os.kill(victim["pid"], signal.SIGKILL)
        t0 = time.time()
        _gone, alive = psutil.wait_procs(survivors, timeout=30)
        took["other task"] = time.time() - t0
        assert not alive
        # every process of the run (tasks, their wrappers, the job's script and srun), but `up` itself
        wait_for(lambda: not [p for p in run_processes(cli.home) if p.pid != up.pid], 30, "the run's processes gone")
        took["every process"] = time.time() - t0

    code, out = cli.up_while(spec, lambda: training(cli), kill_task_1, "both tasks training")
    assert code == 1, out
    failure = status_json(cli)["failure"]  # a failure is data, for a Slurm run as for the others
    assert (failure["task"], failure["kind"], failure["signal"], failure["host"]) == (1, "killed", "SIGKILL", "node2")
    assert failure["message"].startswith("task 1 (node2:") and "SIGKILL" in failure["message"], failure
    assert "task 1" in out and not launcher_traceback(out)
    job_id = latest_state(cli)["job"]["id"]
    wait_for(lambda: job_id not in sc.command("squeue", "-h", "-o", "%i").stdout.split(), 10, "the job off squeue")
    assert job_state(sc, job_id, "FAILED", "CANCELLED")
    assert not wait_gone(cli.home, 5)
    print(f"\nkill -9 of task 1: task 0 gone after {took['other task']:.2f} s, every process of the run after "
          f"{took['every process']:.2f} s")
    assert took["every process"] < 10.0, took  # typically ~1 s; a wide margin on 2 shared cores


def test_a_hung_task_has_its_peer_stopped_within_seconds_of_the_hang_being_named(sc, cli, tmp_path):
    """Task 1 frozen (SIGSTOP): named hung, stacks taken; the job still runs and nothing says Slurm is ending
    it, so the peer is stopped at once (no wait for a scheduler's verdict that cannot come)."""
    # no TensorFlow: its own heartbeats would end the peer by themselves (~10 s), hiding the launcher's delay
    spec = write_spec(tmp_path, STEPS, launch="heartbeat_timeout = 4")
    took = {}

    def freeze_task_1(_up, st):
        log = cli.home / "runs" / st["run_id"] / "launcher.log"
        peer = [psutil.Process(st["tasks"][0]["pid"]), psutil.Process(st["tasks"][0]["supervisor_pid"])]
        os.kill(st["tasks"][1]["pid"], signal.SIGSTOP)
        t0 = time.time()
        wait_for(lambda: "taken before stopping anything" in log.read_text(), 60, "the hang named, its stacks taken")
        named = time.time()
        _gone, alive = psutil.wait_procs(peer, timeout=60)
        took.update(named=named - t0, peer=time.time() - named)
        assert not alive

    code, out = cli.up_while(spec, lambda: training(cli), freeze_task_1, "both tasks training")
    assert code == 1 and not launcher_traceback(out), out
    failure = status_json(cli)["failure"]
    assert (failure["task"], failure["kind"]) == (1, "hung") and "SIGSTOP" in failure["message"], failure
    log = (cli.home / "runs" / latest_state(cli)["run_id"] / "launcher.log").read_text()
    # taken on each task's node inside the job: where it landed comes from the live run record
    # a thread's header, whatever name py-spy reads for it (it may read "" for the main thread)
    assert "stacks at the hang: task 1 (node2)" in log and STACK_HEADER.search(log) and "no stacks" not in log, log[-3000:]
    assert not wait_gone(cli.home, 10)
    print(f"\nSIGSTOP of task 1: hang named (stacks taken) after {took['named']:.2f} s, task 0 stopped "
          f"{took['peer']:.2f} s after that")
    assert took["peer"] < 5.0, took  # under 0.1 s; it was 10 s more, waiting for a scheduler's verdict


def test_down_cancels_a_detached_run(sc, cli, tmp_path, monkeypatch):
    spec = write_spec(tmp_path, SLEEP)
    r = cli("up", "--detach", spec, timeout=300)
    assert r.returncode == 0 and "running detached" in r.stdout, r.stdout + r.stderr
    snap = status_json(cli)
    assert snap["state"] == "running" and [t["state"] for t in snap["tasks"]] == ["running", "running"]
    assert snap["job"]["state"] == "running" and [t["host"] for t in snap["tasks"]] == ["node1", "node2"]
    plain = cli("status", timeout=60).stdout
    assert f"slurm job {snap['job']['id']}: running" in plain
    # a command on task 1's node, inside the job (what `stacks` uses): an engine made from the run record
    for k, v in sc.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MGPU_HOME", str(cli.home))
    st = latest_state(cli)
    # as status, logs and down make theirs: where each task landed and the job come from the run record
    engine = engine_for(load_spec(spec), st["run_id"], landed=record.load(st["run_id"]))
    code, text, err = engine.call(1, ["sh", "-c", 'echo "$SLURMD_NODENAME $SLURM_JOB_ID $PWD"'], 60)
    assert (code, text.split()) == (0, ["node2", snap["job"]["id"], st["tasks"][1]["run_dir"]]), err
    engine.close()  # made for a command: it leaves the job alone
    assert job_state(sc, snap["job"]["id"]) == "RUNNING"
    d = cli("down", timeout=120)
    assert d.returncode == 0, d.stdout + d.stderr
    assert job_state(sc, snap["job"]["id"], "CANCELLED")
    assert not wait_gone(cli.home, 10)
    after = status_json(cli)
    assert after["state"] == "stopped" and after["job"]["state"] == "cancelled"
    assert cli("down", timeout=120).returncode == 0  # safe to repeat


def test_down_of_a_run_whose_launcher_was_killed(sc, cli, tmp_path):
    """`down` from a fresh shell with only the record and the spec copy: scancel of the recorded job."""
    spec = write_spec(tmp_path, SLEEP)
    assert cli("up", "--detach", spec, timeout=300).returncode == 0
    st = latest_state(cli)
    psutil.Process(st["agent_pid"]).kill()
    job_id = st["job"]["id"]
    assert job_state(sc, job_id) == "RUNNING"  # the job does not depend on the launcher
    d = cli("down", timeout=120)
    assert d.returncode == 0, d.stdout + d.stderr
    assert job_state(sc, job_id, "CANCELLED")
    assert not wait_gone(cli.home, 10)


@pytest.mark.cluster
def test_a_job_whose_launcher_is_killed_ends_itself(killed_launcher):
    """kill -9 of `up`: the job's lifeline (the launcher touches launcher.alive) runs out and the job
    cancels itself: nothing is left running on any node. (The run: `killed_launcher`, on a cluster of its own.)"""
    run = killed_launcher
    run.driver.join(300)
    if run.error is not None:
        raise run.error
    assert run.code == -signal.SIGKILL
    job_id = latest_state(run.cli)["job"]["id"]
    assert wait_for(lambda: (run.cluster.job(job_id) or {}).get("JobState") in ("CANCELLED", "COMPLETED", "FAILED"),
                    60, "the job to end itself")
    assert not wait_gone(run.cli.home, 15)
    assert status_json(run.cli)["state"] == "lost"


def test_ctrl_c_on_up_cancels_the_job_and_exits_130(sc, cli, tmp_path):
    spec = write_spec(tmp_path, SLEEP)
    running = lambda: (lambda s: s if s and s["state"] == "running" else None)(latest_state(cli))  # noqa: E731
    code, out = cli.up_while(spec, running, lambda up, _st: up.send_signal(signal.SIGINT), "tasks running")
    assert code == 130, out
    assert "interrupted" in out.lower() and not launcher_traceback(out)
    st = latest_state(cli)
    job_id = st["job"]["id"]
    assert job_state(sc, job_id, "CANCELLED")
    assert not wait_gone(cli.home, 10)
    assert status_json(cli)["state"] == "stopped"


def test_a_queued_job_shows_pending_with_its_reason(sc, cli, tmp_path):
    blocker = sc.command("sbatch", "--parsable", "-N1", "-w", "node2", "-o", "/dev/null", "--wrap",
                         "sleep 300").stdout.strip()
    spec = write_spec(tmp_path, SLEEP)
    up = cli.popen("up", spec)
    try:
        def pending():
            r = cli("status", "--json", timeout=60)  # exit 2 until the run is recorded
            s = json.loads(r.stdout) if r.returncode == 0 else {}
            return s if s.get("job") and s["job"]["state"] == "pending" and s["job"]["reason"] else None

        snap = wait_for(pending, 60, "the job pending")
        assert snap["job"]["reason"] in ("Resources", "Priority"), snap["job"]
        assert [t["state"] for t in snap["tasks"]] == ["pending", "pending"] and snap["state"] == "starting"
        time.sleep(0.5)  # `up` polls the queue every 0.5 s
        t0 = time.monotonic()
        up.send_signal(signal.SIGINT)  # while queued: cancels the job, and no task can report: returns at once
        out, _ = up.communicate(timeout=60)
        took = time.monotonic() - t0
        assert up.returncode == 130, out
        assert "waiting in the queue (" in out and "did not confirm their stop" not in out, out
        assert job_state(sc, snap["job"]["id"], "CANCELLED")
        after = status_json(cli)
        assert after["state"] == "stopped" and after["job"]["state"] == "cancelled", after
        print(f"\nCtrl-C of up while its job is queued: exit 130 after {took:.2f} s")
        assert took < 5.0, took  # was stop_grace + 8 s, waiting for exit reports of tasks that never ran
    finally:
        if up.poll() is None:
            up.kill()
        sc.command("scancel", blocker, check=False)


def test_up_inside_an_allocation_runs_srun_directly(sc, cli, tmp_path):
    dump = "import os; open(os.environ['MGPU_RUN_DIR'] + '/tf_config', 'w').write(os.environ['TF_CONFIG'])"
    spec = write_spec(tmp_path, f"command = {json.dumps([PY, '-c', dump])}")
    r = subprocess.run(["salloc", "-N2", *cli.argv("up", spec)], cwd=cli.cwd, env=cli.env, capture_output=True,
                       text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "inside allocation" in out and "submitted" not in out
    st = latest_state(cli)
    alloc = st["job"]["id"]
    assert st["job"]["mode"] == "allocation" and alloc
    assert f"mgpu-{st['run_id']}" not in our_jobs(sc)  # no job of its own: the step ran in salloc's job
    port = slurm_task.default_port(alloc)
    for i, t in enumerate(st["tasks"]):
        cfg = json.loads((Path(t["run_dir"]) / "tf_config").read_text())
        assert cfg["cluster"]["worker"] == [f"{a}:{port}" for _, a in sc.nodes] and cfg["task"]["index"] == i
    assert status_json(cli)["state"] == "succeeded"


def test_refused_before_anything_is_submitted(sc, cli, tmp_path):
    before = our_jobs(sc)
    for kw, needle in [({"partition": "gpu"}, "[slurm].partition = 'gpu': no such partition; partitions here: debug"),
                       ({"nodes": 3}, "[slurm].nodes = 3, but partition debug has 2 node(s)")]:
        r = cli("up", write_spec(tmp_path, SLEEP, **kw), timeout=120)
        assert r.returncode == 2 and needle in r.stderr and "nothing was started" in r.stderr, r.stdout + r.stderr
    bare = tmp_path / "bin"  # no Slurm on PATH: exit 2, with the fix
    bare.mkdir()
    saved, cli.env = cli.env, {**cli.env, "PATH": str(bare)}
    try:
        r = cli("up", write_spec(tmp_path, SLEEP), timeout=120)
    finally:
        cli.env = saved
    assert r.returncode == 2 and "Slurm's commands are not on PATH" in r.stderr and "[[hosts]]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert our_jobs(sc) == before
    assert not run_processes(cli.home)


def test_a_node_count_the_partition_cannot_grant_is_refused_at_once(sc, cli, tmp_path):
    """The largest count the spec takes, on a 2-node partition: `check` plans it and refuses in one
    paragraph naming [slurm].nodes, in seconds (was: planning alone kept it at 100% CPU for half an hour)."""
    t0 = time.monotonic()
    r = cli("check", write_spec(tmp_path, SLEEP, nodes=65533), timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "[slurm].nodes = 65533, but partition debug has 2 node(s): Slurm cannot grant that many" in r.stderr
    assert "lower [slurm].nodes to at most 2" in r.stderr and r.stderr.count("[slurm].nodes = ") == 1, r.stderr
    print(f"\ncheck of 65533 nodes on a 2-node partition: refused in {took:.2f} s (the CLI's start included)")
    assert took < 15.0, took


def test_down_inside_a_users_batch_job_cancels_only_the_runs_step(sc, cli, tmp_path):
    """`mgpu-cluster up` in the user's own batch script: the step runs in that job; `down` ends the
    run's step and leaves the user's job running."""
    spec = write_spec(tmp_path, SLEEP)
    script = " ".join(cli.argv("up", spec)) + "; sleep 300"
    job = sc.command("sbatch", "--parsable", "-N2", "-o", tmp_path / "user-job.out", "-D", cli.cwd, "--wrap", script,
                     env=cli.env).stdout.strip()
    st = wait_for(lambda: (lambda s: s if s and s["state"] == "running" else None)(latest_state(cli)), 120,
                  "the run running in the user's job")
    assert st["job"]["id"] == job and st["job"]["mode"] == "allocation"
    d = cli("down", timeout=120)
    assert d.returncode == 0, d.stdout + d.stderr
    assert status_json(cli)["state"] == "stopped"
    wait_for(lambda: not any(f"{job}." in w and not w.endswith((".batch", ".extern")) for w in
                             sc.command("squeue", "-h", "-s", "-o", "%i").stdout.split()), 20, "the run's step ended")
    assert job_state(sc, job) == "RUNNING"  # the user's allocation is theirs
    assert not any(psutil.pid_exists(t["pid"]) and psutil.Process(t["pid"]).status() != "zombie"
                   for t in st["tasks"])


# --------------------------------------------------------------------------- pure: no cluster needed

def test_tf_config_keeps_slurms_node_order_and_uses_addresses():
    nodes = ["node9", "node10", "gpu-a"]  # Slurm's order: not sorted as strings
    addrs = {"node9": "10.0.0.9", "node10": "10.0.0.10", "gpu-a": "fd00::7"}
    for rank in range(3):
        cfg = slurm_task.tf_config(nodes, addrs, 20007, rank)
        assert cfg == {"cluster": {"worker": ["10.0.0.9:20007", "10.0.0.10:20007", "[fd00::7]:20007"]},
                       "task": {"type": "worker", "index": rank}}
    assert slurm_task.tf_config(["n1"], {}, 1, 0)["cluster"]["worker"] == ["n1:1"]  # no address: the name
    with pytest.raises(ValueError):
        slurm_task.tf_config(nodes, addrs, 20007, 3)
    assert slurm_task.default_port(12345) == 22345 and slurm_task.default_port(7) == 20007
    assert slurm_task.default_port(7) != slurm_task.default_port(8)  # jobs sharing a node differ
    text = "NodeName=node1 Arch=x86_64 NodeAddr=198.18.1.11 NodeHostName=node1\nNodeName=node2 NodeAddr=h2 X=1\n"
    assert slurm_task.parse_nodes(text) == {"node1": "198.18.1.11", "node2": "h2"}
    # the entry calls the one builder directly with the step's workers
    env = task_env.task_environment({"A": "1"}, slurm_task.workers(["a", "b"], {"a": "1.1.1.1"}, 5), 1, "r", "/x/task-1")
    assert json.loads(env.pop("TF_CONFIG"))["cluster"]["worker"] == ["1.1.1.1:5", "b:5"]
    assert env == {"MGPU_RUN_ID": "r", "A": "1", "MGPU_TASK_INDEX": "1", "MGPU_NUM_WORKERS": "2",
                   "MGPU_RUN_DIR": "/x/task-1", "TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.cluster
def test_tf_config_round_trips_through_tensorflow(monkeypatch):
    tf = need("tensorflow")
    nodes, addrs = ["node2", "node10"], {"node2": "10.1.0.2", "node10": "10.1.0.10"}
    for rank in range(2):
        monkeypatch.setenv("TF_CONFIG", json.dumps(slurm_task.tf_config(nodes, addrs, 20000, rank)))
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        assert resolver.cluster_spec().as_dict() == {"worker": ["10.1.0.2:20000", "10.1.0.10:20000"]}
        assert (resolver.task_type, resolver.task_id) == ("worker", rank)


def test_example_slurm_spec_is_valid():
    from conftest import REPO
    from launcher.spec.cluster import SlurmSpec
    from launcher.spec.file import load_spec

    spec = load_spec(REPO / "cluster.slurm.toml")
    assert isinstance(spec, SlurmSpec) and spec.slurm.nodes == spec.num_workers == 2 and spec.launch.max_restarts == 1
    script = batch_script(spec, "20260101-000000-abcd", 0)
    assert "#SBATCH --gpus-per-node=1" in script and "#SBATCH --account=myproject" in script


def test_parse_time():
    assert parse_time("30") == 1800 and parse_time("2:00:00") == 7200 and parse_time("5:30") == 330
    assert parse_time("1-12") == 36 * 3600 and parse_time("1-00:00:10") == 86410
    assert parse_time("UNLIMITED") is None and parse_time(None) is None


def test_script_quotes_every_value(tmp_path):
    """Spec values never become shell syntax: a workdir, an argument and sbatch options with spaces,
    quotes and $(...) reach the job as they are (bash -n parses it; nothing runs)."""
    work = tmp_path / "my runs $(touch pwned)"
    spec = parse_spec({"slurm": {"nodes": 2, "workdir": str(work), "python": "/opt/py 3/bin/python",
                                 "sbatch": ["--comment=a b; $(touch pwned)", "--account", "it's"]},
                       "training": {"command": ["prog", "$(touch pwned)", "a'b", "`id`"]}})
    script = batch_script(spec, "20260101-000000-abcd", 0)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "'$(touch pwned)'" in script and "`id`" not in script.replace("'`id`'", "")
    assert "#SBATCH --account" not in script  # a value with a quote: on the command line only
    opts = sbatch_options(spec, "20260101-000000-abcd")
    assert opts[-3:] == ["--comment=a b; $(touch pwned)", "--account", "it's"]  # argv, no shell
    plan = plan_slurm(spec, "20260101-000000-abcd")[1]
    assert plan.run_dir == f"{work}/.mgpu/runs/20260101-000000-abcd/task-1" and plan.label == "task 1 (slurm)"
    assert not list(tmp_path.rglob("pwned"))


def test_batch_script_is_one_attempt_one_step_and_no_policy():
    """The job's script is its directives and one `exec srun`: no loop, no trap, no lifeline in bash
    (the agent decides restarts; the task core watches launcher.alive)."""
    spec = parse_spec({"slurm": {"nodes": 2, "workdir": "/shared", "time": "10"},
                       "training": {"command": ["prog", "--x"]}, "launch": {"preempt_grace": 7.5}})
    script = batch_script(spec, "20260101-000000-abcd", 3)
    body = [line for line in script.splitlines() if line and not line.startswith("#")]
    assert len(body) == 1 and body[0].startswith("exec srun --kill-on-bad-exit=1 "), script
    for word in ("while", "until", "for ", "trap", "sleep", "touch", "if "):
        assert word not in body[0], word
    opts = sbatch_options(spec, "20260101-000000-abcd")
    assert "--signal=USR1@8" in opts and not [o for o in opts if "B:" in o] and "--requeue" in opts, opts
    assert "#SBATCH --signal=USR1@8" in script and "#SBATCH --time=10" in script
    assert "#SBATCH --job-name=mgpu-20260101-000000-abcd" in script
    argv = srun_argv(spec, "20260101-000000-abcd", 3)
    core = argv[argv.index("worker.task.slurm") + 1:argv.index("--")]
    assert core == ["--run-dir", "/shared/.mgpu/runs/20260101-000000-abcd", "--attempt", "3", "--grace", "1",
                    "--preempt-grace", "7.5", "--lifeline", f"{spec.launch.lifeline:g}"], core
    assert argv[argv.index("--") + 1:] == ["prog", "--x"]
    assert shlex.split(body[0])[1:] == argv


def _job(state: str, reason: str = "None", restarts: int = 0) -> dict:
    """A job's record as `scontrol -o show job` prints it (Slurm 22.05), read by record_of."""
    return record_of(f"JobId=41 JobName=mgpu-r UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 "
                     f"Account=(null) QOS=(null) JobState={state} Reason={reason} Dependency=(null) Requeue=1 "
                     f"Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:01:02 TimeLimit=00:01:00 "
                     f"TimeMin=N/A NodeList=node[1-2] BatchHost=node1 NumNodes=2\n")


@pytest.mark.parametrize("info,before,notices,cause,words", [
    (_job("PENDING", "BeginTime", 1), 0, set(), SchedulerCause.REQUEUED, ["requeue", "BeginTime"]),
    (_job("RUNNING", "None", 1), 0, set(), SchedulerCause.REQUEUED, ["requeue"]),  # already running again
    (_job("REQUEUED", "NodeDown", 1), 0, {"SIGTERM"}, SchedulerCause.REQUEUED, ["requeue", "NodeDown"]),
    (_job("PENDING", "BeginTime", 2), 1, set(), SchedulerCause.REQUEUED, ["requeue"]),  # its second requeue
    (_job("TIMEOUT", "TimeLimit"), 0, {"SIGUSR1"}, SchedulerCause.TIME_LIMIT, ["time limit", "'1'", "TimeLimit"]),
    (_job("COMPLETED"), 0, {"SIGUSR1"}, SchedulerCause.TIME_LIMIT, ["time limit"]),  # saved before the limit
    (_job("COMPLETING"), 0, {"SIGUSR1"}, SchedulerCause.TIME_LIMIT, ["time limit"]),
    (_job("CANCELLED"), 0, {"SIGTERM"}, SchedulerCause.CANCELLED, ["cancelled from outside", "scancel"]),
    (_job("NODE_FAIL", "NodeDown"), 0, set(), SchedulerCause.NODE_FAIL, ["node", "NodeDown", "not requeued"]),
    (_job("OUT_OF_MEMORY"), 0, set(), SchedulerCause.ENDED, ["OUT_OF_MEMORY"]),
    (_job("PREEMPTED"), 0, set(), SchedulerCause.ENDED, ["PREEMPTED"]),
    (_job("COMPLETED"), 0, set(), None, []),  # the tasks ended it
    (_job("FAILED", "NonZeroExitCode"), 0, set(), None, []),  # a task failed: the task is to blame
    (_job("RUNNING", "None", 1), 1, set(), None, []),  # the requeue already followed: nothing new
    (None, 0, set(), None, []),  # purged, or the controller did not answer
])
def test_verdict_from_recorded_scontrol_records(info, before, notices, cause, words):
    assert verdict_of(info, before, notices, "41", "1", we_stopped=True) is None  # our own stop is no verdict
    found = verdict_of(info, before, notices, "41", "1")
    assert (found.cause if found else None) == cause, found
    for word in words:
        assert word in found.reason, (word, found.reason)
    if found:
        assert "41" in found.reason


class _Sink:
    def __init__(self):
        self.seen: list[tuple] = []

    def event(self, index, event):
        self.seen.append((index, event))

    def output(self, index, lines, dropped):
        self.seen.append((index, "output", list(lines)))

    def garbage(self, index, text):
        self.seen.append((index, "garbage", text))


def _record(ev) -> bytes:
    return protocol.encode(ev)


@pytest.mark.cluster
def test_follower_tails_events_files_into_the_pump(tmp_path):
    """Records written in pieces reach the sink whole and in order; exits of one round go in the order they
    happened; a task with no Exit is Lost once the job is over and the settle time passed."""
    sink, over = _Sink(), {"why": None}
    for i in (0, 1, 2):
        events_path(tmp_path, i, 1).parent.mkdir()
    events_path(tmp_path, 0, 0).write_bytes(_record(protocol.Output(["an older attempt"])))
    started = protocol.Started(pid=7, create_time=1.0, supervisor_pid=6, time=1.0, host="n1", port=5)
    with open(events_path(tmp_path, 0, 1), "ab", buffering=0) as f0:
        follower = Follower(tmp_path, [0, 1], 1, sink, lambda: None, lambda ev: None)
        try:
            f0.write(_record(started)[:10])
            time.sleep(3 * POLL_S)
            assert sink.seen == []  # half a line waits for the rest
            f0.write(_record(started)[10:] + _record(protocol.Output(["step 1", "step 2"])) + b"not a record\n")
            assert wait_for(lambda: len(sink.seen) == 3, 10, "three records of task 0")
            assert sink.seen == [(0, started), (0, "output", ["step 1", "step 2"]), (0, "garbage", "not a record")]
        finally:
            follower.stop()
            follower.thread.join(5)
    # attempt 2: both exits are there at the first round; task 2 never reports
    events_path(tmp_path, 0, 2).write_bytes(_record(protocol.Exit(code=-15, time=11.0, notice="SIGTERM")))
    events_path(tmp_path, 1, 2).write_bytes(_record(protocol.Exit(code=-9, time=10.0)))
    sink.seen.clear()
    notices = []
    follower = Follower(tmp_path, [0, 1, 2], 2, sink, lambda: over["why"], lambda ev: notices.append(ev.notice))
    try:
        assert wait_for(lambda: len(sink.seen) == 2, 10, "two exits")
        assert [(i, ev.code) for i, ev in sink.seen] == [(1, -9), (0, -15)], sink.seen  # task 1 failed first
        assert notices == ["", "SIGTERM"]
        time.sleep(3 * POLL_S + follow.SETTLE_S)
        assert len(sink.seen) == 2 and follower.thread.is_alive()  # the job is not over: task 2 may still start
        over["why"] = "Slurm job 41 ended (FAILED)"
        t0 = time.monotonic()
        follower.thread.join(15)
        assert not follower.thread.is_alive() and time.monotonic() - t0 >= follow.SETTLE_S
        assert sink.seen[2:] == [(2, protocol.Lost("Slurm job 41 ended (FAILED)"))], sink.seen
    finally:
        follower.stop()


def test_follower_ends_an_attempt_whose_job_runs_again_without_its_exit_reports(tmp_path):
    """A requeued job's tasks killed before they reported (Slurm's KillWait, a loaded node), the job running again
    at once (its state never seen out of RUNNING): once the next attempt's events file is there, the tasks that
    did not report are Lost, saying so, and the follower of this attempt is done."""
    sink = _Sink()
    for i in (0, 1):
        events_path(tmp_path, i, 0).parent.mkdir()
        events_path(tmp_path, i, 0).write_bytes(_record(protocol.Output(["preempted: saved a checkpoint"])))
    events_path(tmp_path, 1, 0).write_bytes(_record(protocol.Exit(code=75, time=1.0, notice="SIGTERM")))
    follower = Follower(tmp_path, [0, 1], 0, sink, lambda: None, lambda ev: None)  # Slurm: the job is RUNNING
    try:
        assert wait_for(lambda: len(sink.seen) == 2, 10, "task 0's output and task 1's exit")
        time.sleep(3 * POLL_S + follow.SETTLE_S)
        assert len(sink.seen) == 2 and follower.thread.is_alive()  # nothing says the attempt is over yet
        events_path(tmp_path, 1, 1).write_bytes(b"")  # the requeued job's next run began
        follower.thread.join(15)
        assert not follower.thread.is_alive()
        (index, lost), = sink.seen[2:]
        assert index == 0 and isinstance(lost, protocol.Lost), sink.seen
        assert "requeued its job and runs it again (attempt 1 started)" in lost.reason, lost
    finally:
        follower.stop()


def test_follower_reads_an_events_file_made_anew_from_its_start(tmp_path):
    """A task folder deleted mid-run: the task core makes its events file again, and the exit it then
    writes there (at an offset below what was read of the old file) reaches the pump."""
    sink, path = _Sink(), events_path(tmp_path, 0, 0)
    path.parent.mkdir()
    path.write_bytes(_record(protocol.Output(["x" * 500])) * 4)
    follower = Follower(tmp_path, [0], 0, sink, lambda: None, lambda ev: None)
    try:
        assert wait_for(lambda: len(sink.seen) == 4, 10, "the old file's records")
        shutil.rmtree(path.parent)
        path.parent.mkdir()
        path.write_bytes(_record(protocol.Exit(code=0, time=1.0)))
        assert wait_for(lambda: len(sink.seen) == 5, 10, "the exit in the new file")
        assert sink.seen[4] == (0, protocol.Exit(code=0, time=1.0)), sink.seen[4]
    finally:
        follower.stop()


def test_wait_until_gives_the_first_true_answer_or_none_at_its_time_limit():
    answers = iter([0, "", None, "there"])
    t0 = time.monotonic()
    assert wait_until(lambda: next(answers), 30, 0.01) == "there" and time.monotonic() - t0 < 5
    t0 = time.monotonic()
    assert wait_until(lambda: [], 0.3, 0.05) is None and 0.3 <= time.monotonic() - t0 < 5
    assert [settled(_job(s), 0) for s in ("RUNNING", "COMPLETING", "COMPLETED", "PENDING", "TIMEOUT")] == \
        [False, False, True, True, True] and settled(None, 0)
    assert settled(_job("RUNNING", restarts=1), 0) and not settled(_job("RUNNING", restarts=1), 1)  # requeued


def test_status_reads_a_tasks_latest_events(tmp_path):
    assert latest_attempt(tmp_path, 0) is None and last_records(events_path(tmp_path, 0, 0)) == {}
    events_path(tmp_path, 0, 0).parent.mkdir()
    events_path(tmp_path, 0, 0).write_bytes(_record(protocol.Exit(code=75, time=1.0, notice="SIGTERM")))
    records = [protocol.Started(pid=1, create_time=1.0, supervisor_pid=2, time=2.0, host="node2", port=20041),
               protocol.Stats(cpu_percent=50.0, rss=10), protocol.Progress({"epoch": 1}),
               protocol.Stats(cpu_percent=99.0, rss=20)]
    events_path(tmp_path, 0, 2).write_bytes(b"".join(map(_record, records)) + b'{"kind": "exit", "co')
    (tmp_path / "task-0" / "events-x.jsonl").write_text("")
    assert latest_attempt(tmp_path, 0) == 2
    last = last_records(events_path(tmp_path, 0, 2))
    assert last == {"started": records[0], "stats": records[3], "progress": records[2]}  # no exit yet
    running = status.job_row({"id": "41", "ids": ["40", "41"], "mode": "batch"}, _job("RUNNING", "None", 1))
    assert running == {"id": "41", "ids": ["40", "41"], "mode": "batch", "state": "running", "reason": None,
                       "nodes": "node[1-2]"}
    row = status.task_row(tmp_path, 0, running, stopping=False)
    assert (row.alive, row.host, row.port, row.pid, row.exit_code) == (True, "node2", 20041, 1, None)
    assert (row.progress, row.cpu_percent, row.rss, row.state) == ({"epoch": 1}, 99.0, 20, None)
    queued = status.job_row({"id": "41", "ids": ["41"], "mode": "batch"}, _job("PENDING", "Resources"))
    assert status.task_row(tmp_path, 0, queued, stopping=False).state == "pending" and queued["reason"] == "Resources"
    ended = status.task_row(tmp_path, 1, status.job_row({"id": "41", "ids": ["41"], "mode": "batch"},
                                                        _job("CANCELLED")), stopping=True)
    assert (ended.state, ended.alive, ended.pid) == ("stopped", False, None)


def test_logs_read_a_tasks_worker_log_as_bytes(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    spec = parse_spec({"slurm": {"nodes": 2, "workdir": str(tmp_path)}, "training": {"command": ["prog"]}})
    engine = engine_for(spec, "20260101-000000-abcd")
    try:
        assert engine.read_log(0, 5) == (b"", 5)  # not written yet (its job may still wait in the queue)
        log = Path(layout.file(layout.task_dir(engine.root, 0), layout.WORKER_LOG))
        log.parent.mkdir(parents=True)
        log.write_bytes(b"one\ntwo\nthr\xc3\xa9e\n")
        assert engine.read_log(0, 0, tail=2) == (b"two\nthr\xc3\xa9e\n", 15)
        assert engine.read_log(0, 4) == (b"two\nthr\xc3\xa9e\n", 15) and engine.read_log(0, 0, tail=0) == (b"", 15)
    finally:
        engine.close()


def test_planning_is_linear_in_nodes(monkeypatch):
    """10000 nodes are planned, shown by the dry run and refused where Slurm is missing in well under a
    second (was 19 s: each plan held a TF_CONFIG of every node); the one builder's result is shown for task 0."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no Slurm: the preflight refuses without asking anything
    spec = parse_spec({"slurm": {"nodes": 10000, "workdir": "/shared"}, "training": {"command": ["prog"]}})
    lines = []
    t0 = time.monotonic()
    engine = engine_for(spec, "20260101-000000-abcd")
    try:
        engine.dry_run(lines.append)
        checks = engine.preflight(None, lambda _text: None)
    finally:
        engine.close()
    took = time.monotonic() - t0
    assert len(engine.plans) == 10000 and engine.plans[9999].run_dir.endswith("/task-9999")
    assert "TF_CONFIG" not in engine.plans[0].env and engine.plans[0].env == {"CUDA_VISIBLE_DEVICES": ""}
    shown = next(line for line in lines if "TF_CONFIG=" in line)
    assert '"<node 0>:<port>", "<node 1>:<port>"' in shown and "characters)" in shown and len(shown) < 1200
    assert "#   MGPU_NUM_WORKERS=10000" in lines and "#   MGPU_TASK_INDEX=0" in lines
    assert not checks[0].ok and "not on PATH" in checks[0].problems[0]
    print(f"\n10000 nodes: planned, dry run and preflight in {took:.3f} s")
    assert took < 2.0, took


@pytest.mark.parametrize("table,needle", [
    ("nodes = 0\nworkdir = '/tmp'", "slurm.nodes"),
    ("nodes = 2\nworkdir = '/tmp'\npartiton = 'debug'", "did you mean 'partition'"),
    ("nodes = 2", "slurm.workdir: required"),
    ("nodes = 2\nworkdir = 'runs'", "absolute path"),
    ("nodes = 2\nworkdir = '/tmp'\ntime = '2 hours'", "slurm.time"),
    ("nodes = 2\nworkdir = '/tmp'\nsbatch = ['--nodes=4']", "set it with [slurm].nodes"),
    ("nodes = 2\nworkdir = '/tmp'\nsbatch = ['--part=debug']", "set it with [slurm].partition"),  # a prefix
    ("nodes = 2\nworkdir = '/tmp'\nsbatch = ['--signal=TERM@5']", "sets this option itself"),
    ("nodes = 2\nworkdir = '/tmp'\nsbatch = ['--no-requeue']", "sets this option itself"),
    ("nodes = 2\nworkdir = '/tmp'\nport = 70000", "slurm.port"),
])
def test_bad_slurm_table_is_refused_by_validation(cli, tmp_path, table, needle):
    spec = tmp_path / "cluster.toml"
    spec.write_text(f"[slurm]\n{table}\n[training]\n{SLEEP}\n")
    r = cli("up", spec, timeout=60)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert not (cli.home / "runs").exists() or not list((cli.home / "runs").glob("*/state.json"))


def test_hosts_and_slurm_together_refused(cli, tmp_path):
    spec = tmp_path / "cluster.toml"
    spec.write_text(f'[[hosts]]\naddress = "localhost"\nport = 20000\n[slurm]\nnodes = 2\nworkdir = "/tmp"\n'
                    f"[training]\n{SLEEP}\n")
    r = cli("check", spec, timeout=60)
    assert r.returncode == 2 and "exactly one of [[hosts]]" in r.stderr and "[slurm]" in r.stderr


# --------------------------------------------------------------------------- the trainings (`trainings`)

@pytest.mark.cluster
def test_up_trains_digits_on_two_nodes_with_equal_weights(trainings):
    run = trainings.result("digits")
    dry, r, snap = run.dry, run.up, run.snap
    assert dry.returncode == 0 and "srun --kill-on-bad-exit=1" in dry.stdout and "#!/bin/bash" in dry.stdout
    assert "MY_TOKEN=****" in dry.stdout and "hunter2" not in dry.stdout and not run.jobs_before
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "task0 node1 |" in out and "task1 node2 |" in out and not launcher_traceback(out)
    assert snap["state"] == "succeeded" and snap["engine"] == "slurm", snap
    assert [t["state"] for t in snap["tasks"]] == ["succeeded", "succeeded"]
    assert snap["job"]["state"] == "completed"
    for t in snap["tasks"]:
        assert t["epoch"] == t["epochs"] == 5 and t["metrics"]["val_accuracy"] >= 0.90, t
    # one job; the tasks on the two nodes, both on the port derived from the job id, as their records said
    started = [started_record(t, 0) for t in snap["tasks"]]
    port = slurm_task.default_port(snap["job"]["id"])
    assert [(ev.host, ev.port) for ev in started] == [(n, port) for n, _ in run.cluster.nodes]
    assert [t["port"] for t in snap["tasks"]] == [port, port] and [t["host"] for t in snap["tasks"]] == ["node1", "node2"]
    a, b = (np.load(str(run.weights).format(task=i)) for i in (0, 1))
    assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)  # synchronous: same weights
    assert run.logs.returncode == 0 and len(run.logs.stdout.strip().splitlines()) == 3
    first_step = next(line for line in out.splitlines() if "phases:" in line)
    print(f"\n{first_step}")  # 'to first step' counts from the submission (sbatch) to the first trained step
    assert not run.left


@pytest.mark.cluster
def test_digits_keras3_on_jax_trains_in_step_on_two_nodes(trainings):
    """backend = "jax" in one job: each node's task with 2 CPU devices (XLA's host platform), JAX's coordinator on
    the first node, gloo between the nodes' namespaces; 4 replicas in sync and the same weights on both."""
    run = trainings.result("keras3")
    r, snap = run.up, run.snap
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("DataParallel (jax), 4 replica(s) in sync, global batch 64 (16/replica)") == 2, out
    assert "task0 node1 |" in out and "task1 node2 |" in out and not launcher_traceback(out)
    assert (snap["state"], snap["engine"], snap["job"]["state"]) == ("succeeded", "slurm", "completed"), snap
    for t in snap["tasks"]:
        assert (t["state"], t["epoch"], t["epochs"], t["global_step"], t["replicas"]) == ("succeeded", 2, 2, 12, 4), t
    a, b = (np.load(str(run.weights).format(task=i)) for i in (0, 1))
    assert a.files and a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files), "weights differ"
    assert not run.left


@pytest.mark.cluster
def test_max_restarts_resumes_at_epoch_3_in_a_job_the_agent_submits(trainings):
    """The agent decides the restart, as for every engine (no policy in the batch script): it submits
    the next attempt's job, which resumes from the checkpoint."""
    run = trainings.result("restart")
    code, out, snap = run.code, run.out, run.snap
    assert code == 0, out
    assert "restarting the whole group" in out and "resuming at epoch 3" in out
    assert snap["state"] == "succeeded" and snap["attempt"] == 1 and snap["restarts"] == 1, snap
    assert snap["job"]["state"] == "completed"
    for t in snap["tasks"]:
        p = progress(t)
        assert p["first_epoch"] == 3 and p["epoch"] == 4, p
        assert started_record(t, 1).host == t["host"]  # attempt 1's records, in the second job's events file
        assert (Path(t["run_dir"]) / "events-0.jsonl").exists() and not (Path(t["run_dir"]) / "events-2.jsonl").exists()
    first, second = snap["job"]["ids"]  # one job an attempt, the last one the run's job now
    assert second == snap["job"]["id"] and job_state(run.cluster, first, "FAILED", "CANCELLED")
    assert len([n for n in our_jobs(run.cluster) if n == f"mgpu-{snap['run_id']}"]) == 2
