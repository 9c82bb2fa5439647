"""Checkpoints with nothing shared (issue 50): SSH hosts in network namespaces, each with a disk of its own (a
private tmpfs in its sshd's mount namespace, where the workdir is, so each host's checkpoint folder is its own).
A restart copies the run's backup from the chief's host to every host that lacks it, checked by size and
SHA-256, before any task starts; the group resumes at the saved step and ends with equal weights."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import Cli, latest_state, namespace_hosts, need, reap, status_json, wait_for, wait_gone
from shared_runs import paced_source

PY = sys.executable
PORT = 20000
PACE_S = 0.15  # a step at least: a kill lands mid-run whatever the machine's speed


@pytest.fixture(scope="module")
def th(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diskhosts")
    yield from namespace_hosts(3, folder, disk=str(folder / "disk"))


@pytest.fixture
def cli(tmp_path, th):
    c = Cli(tmp_path / "mgpu-home", tmp_path)
    c.env = th.env(c.env)
    yield c
    left = reap(wait_gone(tmp_path, 30))
    assert not left, f"processes of the run left on the hosts: {[(p.pid, p.info['cmdline']) for p in left]}"


def workdir_of(tmp_path, th) -> str:
    return f"{th.disk}{tmp_path}"


def put_program(tmp_path, th, i: int) -> None:
    """Host i's workdir on its own disk, with the paced digits example (paced.py) and a program that notes its
    environment at each attempt (env_each.py) in it."""
    workdir = workdir_of(tmp_path, th)
    for name, text in (("paced.py", paced_source(PACE_S)), ("env_each.py", ENV_EACH_ATTEMPT)):
        subprocess.run(["ssh", "-F", str(th.ssh_config), th.addresses[i], f"mkdir -p {workdir} && cat > {workdir}/{name}"],
                       input=text.encode(), check=True, timeout=60)


def write_spec(tmp_path, th, training: str, launch: str = "", n: int = 2) -> os.PathLike:
    """`n` hosts, each with its workdir on its own disk (its path holds the test's folder: the orphan check finds
    the run's processes by it)."""
    workdir = f"{th.disk}{tmp_path}"
    for i in range(n):
        put_program(tmp_path, th, i)
    hosts = "".join(f'[[hosts]]\naddress = "{a}"\nport = {PORT}\n' for a in th.addresses[:n])
    spec = tmp_path / "cluster.toml"
    spec.write_text(f'''[defaults]
python = "{PY}"
gpus = "none"
workdir = "{workdir}"
env = {{ TF_CPP_MIN_LOG_LEVEL = "2", MGPU_PROGRESS_INTERVAL = "0" }}
{hosts}
[training]
{training}
[launch]
connect_timeout = 5
heartbeat_timeout = 120
{launch}
''')
    return spec


def steps(cli, at_least: int):
    """The run's state once every task has trained past `at_least` global steps."""
    st = latest_state(cli)
    if st and st["state"] == "running" and all((t.get("progress") or {}).get("global_step", 0) > at_least
                                               for t in st["tasks"]):
        return st
    return None


def test_a_restart_copies_the_chiefs_backup_to_the_host_without_it_and_both_resume_there(cli, th, tmp_path):
    weights = tmp_path / "weights"  # outside the hosts' own disks: the test reads them
    weights.mkdir()
    spec = write_spec(tmp_path, th, f'''entrypoint = "paced:task"
epochs = 3
steps_per_epoch = 12
batch_size_per_replica = 16
checkpoint_every_steps = 4
args = ["--save-weights", "{weights}/w-{{task}}.npz"]''', "max_restarts = 1")
    with cli.running("up", spec) as up:
        st = wait_for(lambda: up.poll() is not None or steps(cli, 5), 240, "both tasks past global step 5")
        assert st is not True, up.communicate()[0]  # up ended first
        os.kill(st["tasks"][1]["pid"], signal.SIGKILL)  # no notice: the chief's periodic backup is where they go on
        out, _ = up.communicate(timeout=300)
    assert up.returncode == 0, out
    # from the chief's folder, or from the spare that task 1 finished when the kill cut the chief's own backup short
    # (the newest whole copy a live host holds is the truth)
    copied = re.search(r"copied the run's backup \(global step (\d+)\) from (?:task 0|the spare copy kept by task 1) "
                       r"\(\S+\) to (?:task 0 \(\S+\), )?task 1 \(\S+\): ([\d.]+) MB in [\d.]+ s, checked by size and "
                       r"SHA-256", out)
    assert copied, out
    saved = int(copied.group(1))
    assert saved % 4 == 0 and 4 <= saved < 36 and float(copied.group(2)) > 0, out  # mid-run
    epoch, step = divmod(saved, 12)
    assert f"resuming at epoch {epoch + 1} step {step + 1}" in out or (step == 0 and f"resuming at epoch {epoch + 1}"
                                                                      in out), out
    snap = status_json(cli)
    assert snap["state"] == "succeeded" and snap["attempts"][1]["outcome"] == "succeeded", snap["attempts"]
    ph = snap["attempts"][1]["phases"]
    assert ph["copy_bytes"] > 0 and ph["copy_s"] >= 0 and "backup copy" in out, ph
    equal_weights(weights, [0, 1])

    # the model the chief saved on its own disk, fetched here whole
    saved_at = re.search(r"task0 \S+ \| done: fit took [\d.]+s; model saved to (\S+)", out)
    assert saved_at and saved_at.group(1).startswith(f"{th.disk}{tmp_path}/"), out
    there = subprocess.run(["ssh", "-F", str(th.ssh_config), th.addresses[0], "sha256sum", saved_at.group(1)],
                           capture_output=True, text=True, timeout=60).stdout.split()[0]
    r = cli("fetch", "-o", tmp_path / "model.keras", timeout=120)
    assert r.returncode == 0 and "SHA-256 checked" in r.stderr, r.stdout + r.stderr
    assert hashlib.sha256((tmp_path / "model.keras").read_bytes()).hexdigest() == there
    assert not list(tmp_path.glob(".model.keras.*")), "a partial file was left"


def test_a_checkpoint_folder_every_host_shares_is_checked_and_nothing_is_copied(cli, th, tmp_path):
    """checkpoint_dir on storage both hosts see (outside their own disks, as on NFS): at the restart each host
    lists the same bytes, and the run says that nothing was copied."""
    spec = write_spec(tmp_path, th, f'''entrypoint = "paced:task"
epochs = 2
steps_per_epoch = 12
batch_size_per_replica = 16
checkpoint_every_steps = 4
checkpoint_dir = "{tmp_path / 'shared'}"''', "max_restarts = 1")
    with cli.running("up", spec) as up:
        st = wait_for(lambda: up.poll() is not None or steps(cli, 5), 240, "both tasks past global step 5")
        assert st is not True, up.communicate()[0]  # up ended first
        os.kill(st["tasks"][1]["pid"], signal.SIGKILL)
        out, _ = up.communicate(timeout=300)
    assert up.returncode == 0, out
    said = re.search(r"every host holds the run's backup \(global step (\d+)\) already, the same bytes \(shared "
                     r"storage\): nothing copied", out)
    assert said and int(said.group(1)) % 4 == 0 and "copied the run's backup" not in out, out
    ph = status_json(cli)["attempts"][1]["phases"]
    assert ph["copy_bytes"] == 0 and "backup copy" in out, ph


def equal_weights(weights, tasks: list[int]) -> None:
    import numpy as np

    loaded = [np.load(weights / f"w-{i}.npz") for i in tasks]
    assert all(sorted(w.files) == sorted(loaded[0].files) for w in loaded) and loaded[0].files
    diff = max(float(np.max(np.abs(loaded[0][k] - w[k]))) for w in loaded[1:] for k in loaded[0].files)
    assert diff <= 1e-6, f"the tasks ended with different weights (max abs diff {diff})"


def test_the_chiefs_host_crashed_shrinks_from_the_spare_copy_and_is_taken_back_when_it_answers_again(cli, th, tmp_path):
    """min_hosts = 2 of 3, the chief's host crashed (its disk, with the chief's backup, gone with it): task 1's host
    kept a spare copy at each backup, which every live host is given, and the group goes on from its step,
    rescaled by the total replicas (2 local replicas each: 6 in sync, then 4). The host comes back (its sshd
    started again, its disk empty): it answers and passes the preflight, the group saves at its next step and
    takes it back (the backup copied to it), at the spec's global batch again, and every host ends with equal
    weights (issues 50 and 52)."""
    weights = tmp_path / "weights"
    weights.mkdir()
    spec = write_spec(tmp_path, th, f'''entrypoint = "paced:task"
epochs = 3
steps_per_epoch = 30
batch_size_per_replica = 16
checkpoint_every_steps = 4
local_replicas = 2
args = ["--save-weights", "{weights}/w-{{task}}.npz"]''', "min_hosts = 2", n=3)
    try:
        with cli.running("up", spec) as up:
            st = wait_for(lambda: up.poll() is not None or steps(cli, 5), 240, "every task past global step 5")
            assert st is not True, up.communicate()[0]  # up ended first
            th.crash(0)  # the chief's host, and its disk with the chief's backup
            wait_for(lambda: up.poll() is not None or (latest_state(cli) or {}).get("hosts_lost") == [0], 120,
                     "task 0 left out")
            th.revive(0)  # back, with an empty disk: its workdir and the program made again, as a host's own
            put_program(tmp_path, th, 0)
            out, _ = up.communicate(timeout=400)
    finally:
        th.revive(0)
    assert up.returncode == 0, out
    assert f"task 0 ({th.addresses[0]}:{PORT}) is left out" in out and "going on with 2 task(s)" in out, out
    assert "6 replica(s) in sync, global batch 96 (16/replica)" in out, out  # 3 workers x 2 local replicas
    shrunk = out[out.index("going on with 2 task(s)"):]
    assert "4 replica(s) in sync, global batch 64 (16/replica)" in shrunk, out  # rescaled by the total
    # either host's spare: each keeps one at every backup (the newer where the crash cut one short)
    copied = re.search(rf"copied the run's backup \(global step (\d+)\) from the spare copy kept by task [12] "
                       rf"\(198[\d.]+:{PORT}\) to task 1 \(\S+\), task 2 \(\S+\): [\d.]+ MB in "
                       rf"[\d.]+ s, checked by size and SHA-256; the group goes on from global step (\d+)", out)
    assert copied and copied.group(1) == copied.group(2), out
    saved = int(copied.group(1))
    assert saved % 4 == 0 and saved >= 4, out
    assert f"resuming at epoch {saved // 30 + 1}" in out, out
    # taken back: the group saved on notice, the backup went to the host that came back, the spec's batch again
    assert f"task 0 ({th.addresses[0]}:{PORT}) answers again and passed the preflight" in shrunk, out
    grown = shrunk[shrunk.index("going on with 3 task(s)"):]
    assert re.search(rf"copied the run's backup \(global step \d+\) from \S.* to task 0 \({re.escape(th.addresses[0])}:"
                     rf"{PORT}\)", grown), out
    assert "6 replica(s) in sync, global batch 96 (16/replica)" in grown, out
    assert ": succeeded, 6 replicas in sync" in grown, out  # the group that ended
    snap = status_json(cli)
    assert snap["state"] == "succeeded" and snap["hosts_lost"] == [], snap
    assert [(r["kind"], r["tasks"]) for r in snap["regroups"]] == [("shrank", [0]), ("grew", [0])], snap["regroups"]
    outcomes = [a["outcome"] for a in snap["attempts"]]
    assert outcomes == ["shrunk", "regrouped", "succeeded"] and snap["restarts"] == 0, snap["attempts"]
    assert snap["attempts"][-1]["tasks"] == [0, 1, 2] and snap["attempts"][1]["phases"]["copy_bytes"] > 0, snap
    assert snap["regroups"][1]["took_s"] and snap["regroups"][1]["took_s"] > 0, snap["regroups"]
    # no saved step lost or trained twice: the grown group resumed at the step the shrunk one saved on notice
    ph = snap["attempts"][2]["phases"]
    assert ph["resumed_step"] == ph["reached_step"] and ph["steps_redone"] == 0, ph
    assert "in group s" in out, out  # each host's time in the group, in the end table
    equal_weights(weights, [0, 1, 2])


ENV_EACH_ATTEMPT = """
import json, os, sys, time
d = os.environ["MGPU_RUN_DIR"]
json.dump({k: os.environ.get(k) for k in ("MGPU_TASK_INDEX", "MGPU_NUM_WORKERS", "NCCL_SOCKET_IFNAME", "TF_CONFIG")},
          open(os.path.join(d, f"seen-{os.environ['MGPU_ATTEMPT']}.json"), "w"))
while not os.path.exists(sys.argv[1]):
    time.sleep(0.2)
"""


def test_a_host_that_comes_back_and_fails_again_is_kept_out_longer_each_time_and_the_run_still_ends(cli, th, tmp_path):
    """min_hosts = 1 of 2, a `command` (a regroup starts it again): host 0 crashes, comes back and is taken back,
    three times over. Each time it is lost again soon after it came back it is kept out for a cooldown first, twice
    as long each time (rejoin_cooldown = 2, then 4); growing and shrinking spend no restart, and the run ends when
    its program does. Task 1 keeps its index (MGPU_TASK_INDEX) while its rank follows the group (TF_CONFIG), and
    the NCCL_SOCKET_IFNAME the preflight found for its host (kept in the run record: no preflight at a shrink)."""
    end = tmp_path / "end"
    spec = write_spec(tmp_path, th, f'command = ["{PY}", "env_each.py", "{end}"]',
                      "min_hosts = 1\nrejoin_cooldown = 2\nrejoin_cooldown_max = 8")

    def at(attempt: int, tasks: list[int]):
        st = latest_state(cli)
        return st and st["attempt"] == attempt and st["state"] == "running" and st["attempts"][-1]["tasks"] == tasks

    try:
        with cli.running("up", spec) as up:
            for n in range(3):
                wait_for(lambda: up.poll() is not None or at(2 * n, [0, 1]), 180, f"both tasks in attempt {2 * n}")
                assert up.poll() is None, up.communicate()[0]
                th.crash(0)
                wait_for(lambda: up.poll() is not None or at(2 * n + 1, [1]), 120, "the group going on without task 0")
                assert up.poll() is None, up.communicate()[0]
                if n < 2:
                    th.revive(0)
                    put_program(tmp_path, th, 0)  # its workdir, on the empty disk it came back with
            end.write_text("")
            out, _ = up.communicate(timeout=120)
    finally:
        th.revive(0)
    assert up.returncode == 0, out
    host = f"task 0 ({th.addresses[0]}:{PORT})"
    assert out.count(f"{host} is left out") == 3 and out.count(f"{host} answers again and passed the preflight") == 2
    assert "it is asked again from time to time" in out, out  # the first loss: no cooldown
    kept = re.findall(r"so it is kept out for ([\d.]+) s", out)
    assert kept == ["2", "4"], out  # lost again soon after it came back: twice as long each time
    snap = status_json(cli)
    assert snap["state"] == "succeeded" and snap["restarts"] == 0 and snap["hosts_lost"] == [0], snap
    assert [(r["kind"], r["tasks"]) for r in snap["regroups"]] == [("shrank", [0]), ("grew", [0])] * 2 + [
        ("shrank", [0])], snap["regroups"]
    assert [a["outcome"] for a in snap["attempts"]] == ["shrunk", "regrouped"] * 2 + ["shrunk", "succeeded"]
    # task 1 in each attempt: its index kept, its rank and the workers as the group was then, its host's finding kept
    # (an attempt whose host 0 crashed at once may have ended task 1's program before it wrote; those alone ran)
    listing = subprocess.run(["ssh", "-n", "-F", str(th.ssh_config), th.addresses[1],
                              f"cd {workdir_of(tmp_path, th)}/{snap['tasks'][1]['run_dir']} && head -v seen-*.json"],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=True).stdout
    seen = {int(n): json.loads(text) for n, text in re.findall(r"==> seen-(\d+)\.json <==\n(.*)", listing)}
    assert {1, 3, 5} <= set(seen), listing  # task 1 alone: it ran until the group grew (or the end)
    for attempt, env in seen.items():
        alone = attempt % 2 == 1
        assert env["MGPU_TASK_INDEX"] == "1" and env["MGPU_NUM_WORKERS"] == ("1" if alone else "2"), (attempt, env)
        assert json.loads(env["TF_CONFIG"])["task"]["index"] == (0 if alone else 1), (attempt, env)
    assert json.loads(seen[1]["TF_CONFIG"])["cluster"]["worker"] == [f"{th.addresses[1]}:{PORT}"], seen[1]
    found = latest_state(cli)["tasks"][1]["env_found"]  # the preflight's, at the start: kept for every attempt
    assert found["NCCL_SOCKET_IFNAME"] and all(env["NCCL_SOCKET_IFNAME"] == found["NCCL_SOCKET_IFNAME"]
                                               for env in seen.values()), (found, seen)


PACED_JAX = '''
import time
from dataclasses import replace

from worker.examples.digits_keras3 import task as digits


def task():
    import keras

    class Paced(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.3)

    return replace(digits(), callbacks=lambda: [Paced()])
'''


def test_up_resume_of_a_jax_run_whose_hosts_share_nothing_brings_its_backup_to_every_host(cli, th, tmp_path):
    """Keras 3 on JAX: a run stopped (`down`: both stop at one epoch end, the chief's backup on its own disk) goes
    on with `up --resume`: before its first step the stopped run's backup is copied to the host without it, and
    both tasks resume at the next epoch and end with equal weights."""
    need("jax")
    weights = tmp_path / "weights"
    weights.mkdir()
    for address in th.addresses[:2]:
        subprocess.run(["ssh", "-F", str(th.ssh_config), address, f"mkdir -p {th.disk}{tmp_path} && cat > "
                        f"{th.disk}{tmp_path}/paced3.py"], input=PACED_JAX.encode(), check=True, timeout=60)
    spec = write_spec(tmp_path, th, f'''backend = "jax"
entrypoint = "paced3:task"
epochs = 5
steps_per_epoch = 6
batch_size_per_replica = 16
args = ["--save-weights", "{weights}/w-{{task}}.npz"]''', launch="stop_grace = 60")
    with cli.running("up", spec) as up:
        # `down` lands at the end of epoch 1 or, on a loaded machine, a later one: epochs are left to resume. The
        # epoch's end may be seconds after the TERM there: the default stop_grace (1 s) would KILL before the save
        st = wait_for(lambda: up.poll() is not None or steps(cli, 3), 300, "both tasks in epoch 1")
        assert st is not True, up.communicate()[0]  # up ended first
        stopped = cli("down", timeout=120)
        up.communicate(timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    first = status_json(cli)
    assert first["state"] == "stopped", first["state"]
    r = cli("up", spec, "--resume", timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    copied = re.search(rf"copied the resumed run's backup \(global step (\d+)\) from task 0 "
                       rf"\({re.escape(th.addresses[0])}:{PORT}\) to task 1 \({re.escape(th.addresses[1])}:{PORT}\): "
                       r"[\d.]+ MB in [\d.]+ s, checked by size and SHA-256", out)
    assert copied and int(copied.group(1)) % 6 == 0 and int(copied.group(1)) >= 6, out
    assert f"resuming at epoch {int(copied.group(1)) // 6 + 1}" in out, out
    snap = status_json(cli)
    assert snap["state"] == "succeeded" and snap["attempts"][0]["phases"]["copy_bytes"] > 0, snap
    equal_weights(weights, [0, 1])


def backup_folder(root, steps_done: int = 8, data: bytes = b"weights"):
    """A checkpoint folder as the chief leaves it: tf_keras's backup and the owner file."""
    (root / "chief").mkdir(parents=True)
    (root / "chief" / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    (root / "chief" / "ckpt-1.data-00000-of-00001").write_bytes(data)
    (root / "owner.json").write_text(json.dumps({"run": "r1", "epoch": 1, "step": 9, "steps_done": steps_done}))
    return root


def test_a_hosts_listing_names_each_backup_file_with_its_size_and_sha256_and_the_owners_steps(tmp_path):
    from worker.task.backup import held

    listed = held(str(backup_folder(tmp_path / "ck")))
    assert (listed.run, listed.steps_done, listed.folder) == ("r1", 8, str(tmp_path / "ck"))
    assert listed.files["chief/ckpt-1.data-00000-of-00001"] == (7, hashlib.sha256(b"weights").hexdigest())
    assert set(listed.files) == {"chief/checkpoint", "chief/ckpt-1.data-00000-of-00001", "owner.json"}
    assert held(str(tmp_path / "none")).files == {}  # no folder: nothing held, no error


def test_a_copy_is_put_in_place_only_when_every_file_matches_the_listing(tmp_path):
    import shutil

    from worker.task.backup import STAGE_PREFIX, held, install

    source = held(str(backup_folder(tmp_path / "src")))
    target = backup_folder(tmp_path / "dst", steps_done=4, data=b"older")
    for damage, why in (("changed", "ckpt-1.data"), ("missing", "ckpt-1.data"), (None, "")):
        stage = target / f"{STAGE_PREFIX}x"
        shutil.copytree(tmp_path / "src", stage)
        if damage == "changed":
            (stage / "chief" / "ckpt-1.data-00000-of-00001").write_bytes(b"weightz")
        elif damage == "missing":
            (stage / "chief" / "ckpt-1.data-00000-of-00001").unlink()
        said = install(str(target), str(stage), source)
        assert (why in said) if why else said == "", (damage, said)
        assert not stage.exists()  # removed, put in place or not
        now = held(str(target))
        if damage is not None:  # the host's own backup untouched
            assert (now.steps_done, (target / "chief" / "ckpt-1.data-00000-of-00001").read_bytes()) == (4, b"older")
    assert held(str(target)).files == source.files and held(str(target)).steps_done == 8


def test_a_copy_into_a_full_disk_ends_the_run_in_one_paragraph_and_starts_no_task(cli, th, tmp_path):
    spec = write_spec(tmp_path, th, '''entrypoint = "paced:task"
epochs = 3
steps_per_epoch = 12
batch_size_per_replica = 16''', "max_restarts = 1")  # a backup at each epoch's end only
    workdir = f"{th.disk}{tmp_path}"
    fill = (f"cd {workdir} && head -c $(( $(df -B1 --output=avail . | tail -1) - 200000 )) /dev/zero > filler; "
            "true")  # ENOSPC ends head once the disk is full: what is left is what the tasks still write
    with cli.running("up", spec) as up:
        st = wait_for(lambda: up.poll() is not None or steps(cli, 13), 240, "both tasks in epoch 2")
        assert st is not True, up.communicate()[0]  # up ended first
        subprocess.run(["ssh", "-F", str(th.ssh_config), th.addresses[1], fill], check=True, timeout=60)
        os.kill(st["tasks"][1]["pid"], signal.SIGKILL)  # before the next backup, at epoch 2's end
        out, _ = up.communicate(timeout=300)
    assert up.returncode == 1 and "Traceback" not in out, out
    failure = status_json(cli)["failure"]
    assert failure["kind"] == "not_started" and failure["task"] == 1 and failure["host"] == th.addresses[1], failure
    message = failure["message"]
    assert message.startswith(f"task 1 ({th.addresses[1]}:{PORT}): the copy of the run's backup from task 0 ("), message
    assert f"{workdir}/.mgpu/runs/" in message and "No space left on device" in message, message
    assert "no task was started" in message and "Free space there" in message and message in out, (message, out)
    snap = status_json(cli)
    assert snap["state"] == "failed" and len(snap["attempts"]) == 2, snap["attempts"]
    assert snap["attempts"][1]["outcome"] == "failed" and not any(t["attempt"] == 1 for t in snap["tasks"]), snap
    r = cli("fetch", timeout=120)  # a run that never ended its training has no model
    assert r.returncode == 1 and "no saved model to fetch from task 0" in r.stderr and "Traceback" not in r.stderr, \
        r.stdout + r.stderr
    assert not list(tmp_path.glob("*.keras")) and not list(tmp_path.glob(".*.partial"))


def test_the_first_task_of_each_host_but_the_chiefs_keeps_a_spare_copy_and_the_plan_asks_it_to():
    import tomllib

    from launcher.plan import plan_tasks
    from launcher.spec.file import parse_spec
    from worker.host.env import SPARE_BACKUP, keeps_spare

    workers = ["a:1", "a:2", "b:1", "b:2", "[fe80::1]:1"]
    assert [keeps_spare(workers, r) for r in range(5)] == [False, False, True, False, True]
    hosts = "".join(f'[[hosts]]\naddress = "{a}"\nport = {p}\n' for a, p in (("10.0.0.1", 1), ("10.0.0.2", 1),
                                                                             ("10.0.0.2", 2)))
    for training, spares in (('entrypoint = "m:task"', ["", "1", ""]), ('command = ["python3", "t.py"]', ["", "", ""])):
        spec = parse_spec(tomllib.loads(f'[defaults]\ngpus = "none"\n{hosts}[training]\n{training}\n'))
        assert [p.env.get(SPARE_BACKUP, "") for p in plan_tasks(spec, "r1")] == spares, training


def test_a_spare_copy_is_replaced_whole_and_listed_beside_the_folders_own_backup(tmp_path, monkeypatch):
    from worker.training import checkpoints
    from worker.host.env import RUN_ID, SPARE_BACKUP, TASK_INDEX
    from worker.host.startpoint import StartPoint
    from worker.task.backup import listing

    monkeypatch.setenv(RUN_ID, "r1")
    monkeypatch.setenv(TASK_INDEX, "2")
    monkeypatch.setenv(SPARE_BACKUP, "1")
    folder = backup_folder(tmp_path / "ck")
    spare = checkpoints.spare_folder(str(folder))
    assert spare == str(folder / "spares" / "2")

    def fill(data: bytes):
        def put(stage: str) -> None:
            os.makedirs(f"{stage}/chief")
            with open(f"{stage}/chief/ckpt-1.data-00000-of-00001", "wb") as f:
                f.write(data)
        return put

    checkpoints.keep_spare(spare, fill(b"step 4"), StartPoint("r1", 1, 5, 4))
    checkpoints.keep_spare(spare, fill(b"step 8"), StartPoint("r1", 1, 9, 8))

    def broken(stage: str) -> None:
        fill(b"half")(stage)
        raise OSError(28, "No space left on device")

    checkpoints.keep_spare(spare, broken, StartPoint("r1", 2, 1, 12))  # said once; the copy before stays whole
    own, *spares = listing(str(folder))
    assert (own.folder, own.steps_done) == (str(folder), 8) and len(spares) == 1
    assert (spares[0].folder, spares[0].run, spares[0].steps_done) == (spare, "r1", 8)
    assert spares[0].files["chief/ckpt-1.data-00000-of-00001"] == (6, hashlib.sha256(b"step 8").hexdigest())
    assert sorted(os.listdir(folder / "spares")) == ["2"]  # no stage or old copy left
    monkeypatch.delenv(SPARE_BACKUP)
    assert checkpoints.spare_folder(str(folder)) is None


def test_the_newest_backup_of_the_run_is_the_source_the_chiefs_own_folder_first_among_equals():
    from launcher.engines.supervised.backups import Place, Wanted, newest
    from worker.task.backup import Held

    class Plan:
        def __init__(self, index):
            self.index = index

    def place(index, steps, run="r1", spare=False, finished=None):
        files = {"owner.json": (1, "x")} if steps is not None or finished else {}
        return Place(Plan(index), None, Held(f"/f{index}{spare}", run, steps, files, finished), spare)  # type: ignore[arg-type]

    restart = Wanted(("r1", "r0"), "r1")
    chief, spare1, own1 = place(0, 8), place(1, 8, spare=True), place(1, 4)
    assert newest([own1, spare1, chief], restart) is chief
    assert newest([own1, spare1], restart) is spare1  # the chief's host gone: its spare copy, newer than own1
    assert newest([place(0, 12, run="other"), own1], restart) is own1  # another run's backup is never taken
    assert newest([place(1, 16, run="r0"), own1], restart).held.steps_done == 16  # the run it went on from
    done = place(1, None, run=None, finished="r1")
    assert newest([chief, done], restart) is done  # its training had ended: nothing left to train
    assert newest([place(0, None, run=None)], restart) is None
    resume = Wanted(("r0",), None, "old/checkpoint")
    assert newest([place(0, 8), place(1, 4, run="r0")], resume).plan.index == 1
