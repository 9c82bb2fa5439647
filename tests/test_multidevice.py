"""Several replicas per worker without a GPU: the CPU split into logical devices, for real.

One host with 2 local replicas (MirroredStrategy), two workers with 2 local replicas each
(MultiWorkerMirroredStrategy, 4 in sync), a preemption of such a run and its resume; the
preflight's device counts (check and up refuse unequal ones) and, on SSH test hosts, the
NCCL_SOCKET_IFNAME each remote task is given.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, free_port, namespace_hosts, reap, wait_gone, write_spec
from test_preempt_worker import (EXIT_PREEMPTED, STEPS, assert_resumed_at, assert_same_weights, mid_epoch_2,
                                 progress, run, start, wait_until)  # noqa: F401 (run: a fixture)
from test_worker import Workers, read_progress, run_ok
from train_shared import digits_alone
from within_probe import assert_within_epochs_are_means, copied_to

from launcher.preflight.devices import TaskDevices, device_problems, loopback_warnings, nccl_env
from worker.host.devices import task_devices

DIGITS = ["--entrypoint", "worker.examples.digits:task"]


def accuracy(workers: Workers, i: int = 0) -> float:
    return read_progress(str(workers.task_dir(i)))["metrics"]["val_accuracy"]


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """One replica (no TF_CONFIG, default strategy), global batch 64 at learning rate 0.004: what the
    multi-replica runs below reach after their warm-up (one run per session: train_shared, test_worker's too)."""
    return digits_alone(tmp_path_factory)


@pytest.mark.cluster
def test_one_host_with_two_local_replicas_trains_with_mirrored_strategy(tmp_path, tmp_path_factory):
    with Workers(tmp_path / "run", [*DIGITS, "--local-replicas", "2", "--batch-size-per-replica", "32"], n=1) as one:
        alone = digits_alone(tmp_path_factory)  # one process each: the one-replica run (once a session) meanwhile
        codes = one.wait()
    assert codes == [0], one.tails()
    assert "MirroredStrategy, 2 replica(s) in sync, global batch 64 (32/replica)" in one.log(0), one.log(0)
    p = read_progress(str(one.task_dir(0)))
    assert (p["replicas"], p["steps_per_epoch"], p["state"]) == (2, 1437 // 64, "done"), p
    assert accuracy(one) >= 0.90 and abs(accuracy(one) - accuracy(alone)) <= 0.02, (accuracy(one), accuracy(alone))


def test_two_workers_with_two_local_replicas_each_train_four_in_sync(cli, tmp_path, alone):
    # the spec's [training] local_replicas reaches every worker; the learning rate 4 x 0.001 after warm-up
    # within_probe: the digits example, each batch's progress copied; every batch written (interval 0)
    copied_to(tmp_path)
    spec = write_spec(tmp_path, training='entrypoint = "within_probe:task"\nlocal_replicas = 2\n'
                                         "batch_size_per_replica = 16\nlearning_rate = 0.001",
                      env='TF_CPP_MIN_LOG_LEVEL = "2", MGPU_PROGRESS_INTERVAL = "0"')
    r = cli("up", spec, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("CollectiveAllReduceStrategy, 4 replica(s) in sync, global batch 64 (16/replica)") == 2
    assert ", 4 replicas in sync" in r.stdout  # the summary
    snap = json.loads(cli("status", "--json", timeout=60).stdout)
    for t in snap["tasks"]:
        assert (t["replicas"], t["global_step"]) == (4, 5 * (1437 // 64)), t
    four = snap["tasks"][0]["metrics"]["val_accuracy"]
    assert four >= 0.90 and abs(four - accuracy(alone)) <= 0.02, (four, accuracy(alone))
    assert "replicas in sync: 4 over 2 worker(s)" in cli("status", timeout=60).stdout
    for t in snap["tasks"]:  # loss and metrics within epochs: means over the 4 replicas, not their sum
        assert_within_epochs_are_means(t["run_dir"], 5)


@pytest.mark.cluster
def test_preempted_four_replica_run_resumes_at_the_step_it_saved(run):  # noqa: F811
    local = ["--local-replicas", "2", "--batch-size-per-replica", "16"]  # 4 x 16: the same 22 steps an epoch
    with start(run, 0, *local, SLOW="0.05") as first:
        wait_until(first, lambda: mid_epoch_2(first, 1))
        os.killpg(first.procs[1].pid, signal.SIGTERM)
        codes = first.wait(60)
    assert codes == [EXIT_PREEMPTED] * 2, first.tails()
    saved = progress(first, 0)["global_step"]
    assert STEPS < saved < 2 * STEPS and progress(first, 1)["global_step"] == saved, first.tails()
    second = run_ok(start(run, 1, *local))
    assert "4 replica(s) in sync" in second.log(0)
    assert_resumed_at(second, 1, saved)
    assert_same_weights(run)


@pytest.mark.cluster
def test_the_private_local_devices_hook_fails_loudly_where_tensorflow_moved_it():
    code = ("from tensorflow.python.distribute import collective_all_reduce_strategy as c\n"
            "from worker.tensorflow.replicas import LocalReplicasUnsupported, cpu_local_devices\n"
            "original = c.CollectiveAllReduceExtended._initialize_local_devices\n"
            "with cpu_local_devices(3):\n"
            "    assert c.CollectiveAllReduceExtended._initialize_local_devices(None, None, '/job:worker/task:1') == "
            "(tuple(f'/job:worker/task:1/device:CPU:{i}' for i in range(3)), 'CPU')\n"
            "assert c.CollectiveAllReduceExtended._initialize_local_devices is original\n"
            "del c.CollectiveAllReduceExtended._initialize_local_devices\n"
            "try:\n    cpu_local_devices(2).__enter__()\nexcept LocalReplicasUnsupported as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert r.returncode == 0, r.stderr
    assert "CollectiveAllReduceExtended._initialize_local_devices" in r.stdout and "moved it" in r.stdout, r.stdout


# --------------------------------------------------------------------------- the preflight's device counts

def test_device_verdicts_are_pure_functions():
    a = TaskDevices(0, "task 0 (a:1)", devices=2, interface="eth0", address="a")
    b = TaskDevices(1, "task 1 (b:1)", devices=1, interface="ens5", address="b")
    problems = device_problems([a, b])
    assert set(problems) == {0, 1} and "task 0 (a:1): 2, task 1 (b:1): 1" in problems[0]
    assert device_problems([a, TaskDevices(1, "t1", devices=2)]) == {}
    assert device_problems([a]) == {}  # one worker: nothing to match
    unknown = device_problems([a, TaskDevices(1, "t1", unknown="no nvidia-smi here")])
    assert list(unknown) == [1] and "no nvidia-smi here" in unknown[1]
    lo = TaskDevices(1, "task 1 (b:1)", devices=2, loopback=True, address="b", ips=("127.0.1.1",))
    assert len(loopback_warnings([a, lo])) == 1 and "127.0.1.1" in loopback_warnings([a, lo])[0]
    assert loopback_warnings([lo]) == []  # every task on this machine: fine
    assert nccl_env([a, b], remote=lambda i: True, env=lambda i: {"NCCL_SOCKET_IFNAME": "x"} if i else {}) == \
        {0: "eth0"}
    # a host's own count: gpus = [] is CUDA_VISIBLE_DEVICES="" (no GPU, like "none"), whatever nvidia-smi says
    for have in (None, set(), {0, 1}):
        assert task_devices({"gpus": [], "local_replicas": 2}, have) == (2, None)
    assert task_devices({"gpus": [1], "local_replicas": None}, {0, 1}) == (1, None)
    assert task_devices({"gpus": "all"}, None)[0] is None


def test_spec_passes_local_replicas_and_collective_to_the_worker():
    from launcher.errors import SpecError
    from launcher.plan import worker_argv
    from launcher.spec.file import parse_spec

    hosts = [{"address": "localhost", "port": 20000}]
    spec = parse_spec({"hosts": hosts, "training": {"entrypoint": "m:f", "local_replicas": 2, "collective": "ring"}})
    argv = worker_argv(spec, "python3")
    assert argv[argv.index("--local-replicas") + 1] == "2" and argv[argv.index("--collective") + 1] == "ring"
    assert "--local-replicas" not in worker_argv(parse_spec({"hosts": hosts, "training": {"entrypoint": "m:f"}}), "p")
    for bad, words in (({"entrypoint": "m:f", "collective": "mpi"}, "'auto', 'ring' or 'nccl'"),
                       ({"entrypoint": "m:f", "local_replicas": 0}, "local_replicas"),
                       ({"command": ["x"], "local_replicas": 2}, "settings of the built-in runner")):
        with pytest.raises(SpecError, match=words):
            parse_spec({"hosts": hosts, "training": bad})


def test_gpu_memory_grows_unless_an_allocator_or_a_value_is_given():
    from worker.host.env import tf_defaults

    for env, expected in (({}, "true"), ({"TF_FORCE_GPU_ALLOW_GROWTH": "false"}, "false"),
                          ({"TF_GPU_ALLOCATOR": "cuda_malloc_async"}, None)):
        tf_defaults(env)
        assert env.get("TF_FORCE_GPU_ALLOW_GROWTH") == expected, env
        assert env["TF_USE_LEGACY_KERAS"] == "1" and env["TF_CPP_MIN_LOG_LEVEL"] == "1", env


SPEC = """[[hosts]]
address = "localhost"
port = {p0}
gpus = {g0}
[[hosts]]
address = "localhost"
port = {p1}
gpus = {g1}
[training]
entrypoint = "worker.examples.digits:task"
"""


@pytest.mark.parametrize("command", ["check", "up"])
def test_unequal_device_counts_are_refused(cli, tmp_path, command):
    # this machine has no GPU: an nvidia-smi that lists two stands in for the hardware
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\nprintf "0\\n1\\n"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    spec = tmp_path / "c.toml"
    spec.write_text(SPEC.format(p0=free_port(), p1=free_port(), g0="[0, 1]", g1="[1]"))
    plain = cli.env
    cli.env = {**plain, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = cli(command, spec, timeout=60)
    cli.env = plain
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "different numbers of devices (task 0 (localhost:" in out and "): 2, task 1 (localhost:" in out, out
    assert "Traceback" not in out and not list(tmp_path.rglob("worker.log")), out  # nothing started

    spec.write_text(SPEC.format(p0=free_port(), p1=free_port(), g0='"all"', g1='"none"'))  # no nvidia-smi
    r = cli(command, spec, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "asks for all its GPUs, but this host has no nvidia-smi" in out, out


# --------------------------------------------------------------------------- SSH test hosts

ENV_PROBE = ("import os, pathlib; pathlib.Path(os.environ['MGPU_RUN_DIR'], 'nccl.txt')"
             ".write_text(os.environ.get('NCCL_SOCKET_IFNAME', '-'))")


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    yield from namespace_hosts(2, tmp_path_factory.mktemp("sshhosts"))


def test_a_remote_task_gets_the_interface_of_its_address_as_nccl_socket_ifname(two_hosts, tmp_path):
    from test_ssh import PY, SSHCli
    from test_ssh import write_spec as write_ssh_spec

    cli = SSHCli(tmp_path / "mgpu-home", tmp_path, two_hosts)
    spec = write_ssh_spec(tmp_path, two_hosts.addresses, {"command": [PY, "-c", ENV_PROBE]},
                      hosts=[{}, {"env": {"NCCL_SOCKET_IFNAME": "mine"}}])
    r = cli("up", spec, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = {p.parent.name: p.read_text() for p in Path(tmp_path / "wd").glob(".mgpu/runs/*/task-*/nccl.txt")}
    assert seen == {"task-0": "eth0", "task-1": "mine"}, (seen, r.stdout)  # the spec's own value stands
    assert not reap(wait_gone(tmp_path, 30))
