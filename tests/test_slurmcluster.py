"""The local Slurm test cluster (deploy/slurmcluster.py): real slurmctld and slurmd, nothing mocked."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_fixtures import REPO, private_cluster, require_slurm  # the fixtures come from conftest's pytest_plugins
from slurmcluster import _alive, _link_names, _netns_list, _netns_pids

# One task: its own address, the port bound (no SO_REUSEADDR) while every task holds it.
NET_TASK = r"""
import os, socket, sys, time
from pathlib import Path
port, controller, sync = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
rank, ntasks = os.environ["SLURM_PROCID"], int(os.environ["SLURM_STEP_NUM_TASKS"])
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((controller, 9))
listener = socket.socket()
listener.bind(("0.0.0.0", port))
listener.listen()
(sync / f"bound-{rank}").touch()
deadline = time.time() + 20
while len(list(sync.glob("bound-*"))) < ntasks and time.time() < deadline:
    time.sleep(0.01)
print(rank, os.environ["SLURMD_NODENAME"], probe.getsockname()[0], os.readlink("/proc/self/ns/net"),
      len(list(sync.glob("bound-*"))), flush=True)
"""

# A long-running task that says when it is ready; optionally ignores SIGTERM (as TensorFlow does).
SLEEP_TASK = r"""
import os, signal, sys, time
from pathlib import Path
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path(sys.argv[1], "ready-" + os.environ["SLURM_PROCID"]).touch()
time.sleep(300)
"""


def task_pids(sc, marker: str) -> dict[int, list[int]]:
    """{node index: pids of the live tasks (not srun) in its namespace whose command line holds marker}."""
    found = {}
    for i in range(len(sc.nodes)):
        for pid in sc.pids(i):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                task = marker in cmdline and Path(f"/proc/{pid}/comm").read_text().strip() != "srun"
            except OSError:
                continue
            if task and _alive(pid):
                found.setdefault(i, []).append(pid)
    return found


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def sleep_argv(folder: Path, mode: str = "die-on-term") -> list[str]:
    """argv of SLEEP_TASK; `folder` (in its command line) tells its processes from any other."""
    folder.mkdir(exist_ok=True)
    (folder / "sleep_task.py").write_text(SLEEP_TASK)
    return [sys.executable, str(folder / "sleep_task.py"), str(folder), mode]


def start_sleepers(sc, folder: Path, *sbatch_args) -> tuple[str, dict[int, list[int]]]:
    """sbatch a 2-node job whose srun step sleeps on both nodes; return its id and the task pids."""
    job_id = sc.command("sbatch", "--parsable", "-N2", "-o", folder.parent / "sleep-%j.out", *sbatch_args, "--wrap",
                        "srun " + " ".join(sleep_argv(folder))).stdout.strip()
    pids = wait_for(lambda: (p := task_pids(sc, str(folder))) and len(p) == 2 and p, 20, "both tasks")
    return job_id, pids


def test_cluster_comes_up(slurm_cluster):
    sc = slurm_cluster
    assert sc.partition == "debug" and sc.conf.is_file() and sc.env == {"SLURM_CONF": str(sc.conf)}
    assert [name for name, _ in sc.nodes] == ["node1", "node2"]
    for name, address in sc.nodes:
        assert re.fullmatch(r"198\.1[89]\.\d+\.\d+", address)
        info = sc.command("scontrol", "-o", "show", "node", name).stdout
        assert f"NodeAddr={address} " in info and "CPUTot=1 " in info
    assert sc.node_states() == {"node1": "idle", "node2": "idle"}
    part = sc.command("sinfo", "-h", "-p", "debug", "-o", "%P %a %D").stdout.split()
    assert part == ["debug*", "up", "2"]
    assert {sc.netns("ctl"), sc.netns(0), sc.netns(1)} <= _netns_list()
    print(f"start: {sc.timings['start']:.2f}s")


def test_srun_one_task_per_node_each_with_its_own_network(slurm_cluster, tmp_path):
    sc = slurm_cluster
    out = sc.command("srun", "-N2", "-n2", sys.executable, "-c", NET_TASK, 20000,
                     sc.controller_address, tmp_path).stdout
    rows = sorted(line.split() for line in out.splitlines())
    assert [r[0] for r in rows] == ["0", "1"], out
    assert {(r[1], r[2]) for r in rows} == set(sc.nodes)        # node1/node2 at their own addresses
    assert rows[0][3] != rows[1][3] != os.readlink("/proc/self/ns/net")   # separate network stacks
    assert [r[4] for r in rows] == ["2", "2"]                   # both held port 20000 at once
    # right after a job the nodes are "completing" for a moment; a job asked for then waits
    # for the controller's next scheduling pass (once a second): time an srun on idle nodes
    wait_for(lambda: set(sc.node_states().values()) == {"idle"}, 10, "idle nodes")
    t = time.perf_counter()
    sc.command("srun", "-N2", "-n2", "true")
    print(f"srun -N2 -n2 true: {time.perf_counter() - t:.3f}s")


def test_sbatch_runs_to_completion_and_keeps_final_state(slurm_cluster, tmp_path):
    sc = slurm_cluster
    t = time.perf_counter()
    ok = sc.command("sbatch", "--parsable", "-N2", "-o", tmp_path / "ok-%j.out",
                    "--wrap", "srun -N2 -n2 hostname -I").stdout.strip()
    info = sc.wait_job(ok, timeout=30)
    elapsed = time.perf_counter() - t
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "node[1-2]")
    assert sorted((tmp_path / f"ok-{ok}.out").read_text().split()) == sorted(a for _, a in sc.nodes)
    bad = sc.command("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "exit 3").stdout.strip()
    info = sc.wait_job(bad, timeout=30)
    assert (info["JobState"], info["ExitCode"], info["Reason"]) == ("FAILED", "3:0", "NonZeroExitCode")
    listed = sc.command("squeue", "-h", "-t", "all", "-o", "%i %T").stdout.split("\n")
    assert f"{ok} COMPLETED" in listed and f"{bad} FAILED" in listed
    comp = sc.jobcomp_file.read_text()
    assert f"JobId={ok} " in comp and re.search(rf"JobId={bad} .*JobState=FAILED .*ExitCode=3:0", comp)
    print(f"sbatch to completion: {elapsed:.2f}s")


def test_scancel_ends_the_job_processes(slurm_cluster, tmp_path):
    sc = slurm_cluster
    job_id, pids = start_sleepers(sc, tmp_path / "scancel")
    assert sc.job(job_id)["JobState"] == "RUNNING"
    t = time.perf_counter()
    sc.command("scancel", job_id)
    wait_for(lambda: not any(_alive(p) for ps in pids.values() for p in ps), 10, "tasks to end")
    gone = time.perf_counter() - t
    assert sc.wait_job(job_id, timeout=30)["JobState"] == "CANCELLED"
    print(f"scancel: tasks gone after {gone:.2f}s, final state after {time.perf_counter() - t:.2f}s")


@pytest.mark.parametrize("mode", ["die-on-term", "ignore-term"])
def test_kill_on_bad_exit_ends_the_other_task(slurm_cluster, tmp_path, mode):
    sc = slurm_cluster
    srun = subprocess.Popen(["srun", "-N2", "-n2", "--kill-on-bad-exit=1", *sleep_argv(tmp_path, mode)],
                            env=sc.environ(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 2, 20, "both tasks ready")
        pids = task_pids(sc, str(tmp_path))
        assert sorted(pids) == [0, 1]
        t = time.perf_counter()
        os.kill(pids[1][0], 9)
        limit = 3 + (sc.kill_wait if mode == "ignore-term" else 0)   # TERM, KillWait s, then KILL
        wait_for(lambda: not any(_alive(p) for p in pids[0]), limit, "the other task to end")
        elapsed = time.perf_counter() - t
        assert srun.wait(timeout=10) != 0
    finally:
        srun.kill()
        output = srun.communicate()[0]
    assert "task 1: Killed" in output, output
    print(f"kill-on-bad-exit ({mode}): other task gone after {elapsed:.2f}s")


@pytest.fixture(scope="module")
def spare(request):
    """A private cluster of this module's own, apart from the session's: test_go_away_and_revive breaks and revives
    a node of it, then test_stop_removes_everything_and_clusters_do_not_clash stops it (one start, and one first
    scheduling pass of a fresh controller, for both). Stopped here too (stop() is idempotent), also after a failure."""
    yield from private_cluster(request)


@pytest.mark.cluster
def test_go_away_and_revive(spare, tmp_path):
    sc = spare
    # batch jobs are requeued after a node failure by default (JobRequeue=1): not this one
    job_id, pids = start_sleepers(sc, tmp_path / "away", "--no-requeue")
    killed = sc.go_away(1)
    assert set(pids[1]) <= set(killed) and sc.pids(1) == []
    # slurmctld would notice after about 3 x SlurmdTimeout; an admin (or a test) says so at once
    sc.command("scontrol", "update", "nodename=node2", "state=down", "reason=went-away")
    assert sc.wait_job(job_id, timeout=20)["JobState"] == "NODE_FAIL"
    wait_for(lambda: not any(_alive(p) for p in pids[0]), 10, "node1's task to end")
    sc.revive(1)
    assert sc.node_states() == {"node1": "idle", "node2": "idle"}
    assert sc.command("srun", "-N2", "-n2", "true").returncode == 0


@pytest.mark.cluster
def test_stop_removes_everything_and_clusters_do_not_clash(slurm_cluster, spare, tmp_path):
    sc = spare
    wait_for(lambda: set(sc.node_states().values()) == {"idle"}, 30, "both nodes idle")  # after test_go_away_and_revive
    assert sc.prefix != slurm_cluster.prefix and sc.subnet != slurm_cluster.subnet
    job_id, pids = start_sleepers(sc, tmp_path / "stop")
    waiting = subprocess.Popen(["srun", "-N1", "true"], env=sc.environ(), stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # pending: nodes busy
    wait_for(lambda: sc.command("squeue", "-h", "-t", "PD").stdout.strip(), 10, "a pending srun")
    everything = [p for key in ["ctl", 0, 1] for p in sc.pids(key)] + [waiting.pid]
    assert len(everything) >= 8   # slurmctld, 2 slurmd, stepds, 2 tasks, srun (+ their reapers)
    t = time.perf_counter()
    sc.stop()
    print(f"stop: {time.perf_counter() - t:.2f}s")
    assert waiting.wait(timeout=5) != 0
    assert [p for p in everything if _alive(p)] == []
    assert sc.leftovers() == [] and not sc.workdir.exists()
    assert not {n for n in _netns_list() | _link_names() if n.startswith(sc.prefix)}
    assert not any(_netns_pids(sc.netns(k)) for k in ["ctl", 0, 1])
    sc.stop()   # idempotent (the fixture stops it once more)
    assert slurm_cluster.command("srun", "-N2", "-n2", "true").returncode == 0   # the other one lives


def test_cli_up_and_down(tmp_path):
    require_slurm()
    script = REPO / "deploy" / "slurmcluster.py"
    up = subprocess.run([sys.executable, script, "up", "1"], capture_output=True, text=True, timeout=60)
    assert up.returncode == 0, up.stderr
    conf = Path(re.fullmatch(r"export SLURM_CONF=(\S+)\n", up.stdout).group(1))
    try:
        out = subprocess.run(["srun", "-N1", "hostname", "-I"], env={**os.environ, "SLURM_CONF": str(conf)},
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and out.stdout.split()[0].startswith("198.1"), out.stderr
        prefix = re.search(r"ClusterName=(\S+)", conf.read_text()).group(1)
    finally:
        down = subprocess.run([sys.executable, script, "down", "--state", conf.parent],
                              capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert not conf.parent.exists()
    assert not {n for n in _netns_list() | _link_names() if n.startswith(prefix)}
