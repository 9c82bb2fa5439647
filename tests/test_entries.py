"""The on-host entries' arguments have one definition (worker.host.entries): what each engine writes, its entry
reads back whole, and no entry or engine spells an option of its own."""

from __future__ import annotations

import re

import pytest

from conftest import REPO
from launcher.spec.file import parse_spec
from worker.host.entries import PodArgs, SlurmArgs, SupervisedArgs
from worker.host.env import Backend

PY = "/usr/bin/python3"


def test_what_the_hosts_engine_writes_its_supervisor_reads_back():
    from launcher.plan import plan_tasks

    spec = parse_spec({"hosts": [{"address": "localhost", "port": 21000, "cpus": [0, 1]}],
                       "training": {"command": ["python3", "train.py"]},
                       "launch": {"stop_grace": 2.5, "preempt_grace": 30, "max_restarts": 1}})
    plan = plan_tasks(spec, "r1")[0]
    argv = plan.supervisor_args(3, lifeline=40.0, standby=True)
    args = SupervisedArgs.parse(argv)
    assert (args.run_dir, args.attempt, args.port, args.grace, args.preempt_grace) == (plan.run_dir, 3, 21000, 2.5, 30)
    assert (args.cpus, args.lifeline, args.env_stdin, args.warm, args.standby) == ((0, 1), 40.0, True, True, True)
    assert args.program == ("python3", "train.py") and SupervisedArgs.parse(args.argv()) == args


def test_what_the_slurm_engine_writes_its_task_entry_reads_back():
    from launcher.engines.slurm.script import srun_argv

    spec = parse_spec({"slurm": {"nodes": 2, "workdir": "/shared", "port": 23000},
                       "training": {"command": ["python3", "train.py", "--lr", "0.1"]},
                       "launch": {"preempt_grace": 7.5}})
    argv = srun_argv(spec, "20260101-000000-abcd", 2)
    start = argv.index(SlurmArgs.module) + 1
    args = SlurmArgs.parse(argv[start:])
    assert (args.attempt, args.port, args.preempt_grace, args.lifeline) == (2, 23000, 7.5, spec.launch.lifeline)
    assert args.run_dir.startswith("/shared/") and args.program == ("python3", "train.py", "--lr", "0.1")


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_what_the_kubernetes_render_writes_its_pod_entry_reads_back(backend):
    from launcher.engines.kubernetes.render import pod_command

    spec = parse_spec({"kubernetes": {"image": "x", "workers": 3, "python": PY, "name": "job", "volume_claim": "runs"},
                       "training": {"entrypoint": "worker.examples.digits:task", "backend": backend,
                                    "local_replicas": 2}})
    command = pod_command(spec)
    args = PodArgs.parse(command[command.index(PodArgs.module) + 1:])
    assert (args.run_id, args.workers, args.port, args.safe_path) == ("job", 3, 20000, True)
    assert args.backend is Backend(backend) and args.cpu_devices == (2 if backend == "jax" else None)
    assert args.hosts.format(i=1).startswith("job-")


def test_every_field_round_trips_and_a_missing_program_is_a_usage_error():
    full = PodArgs(run_id="r", run_dir="/w", hosts="h{i}", workers=4, port=1, grace=0.5, preempt_grace=9.0,
                   safe_path=True, backend=Backend.JAX, cpu_devices=8, program=("p", "--", "-x"))
    assert PodArgs.parse(full.argv()) == full
    with pytest.raises(SystemExit) as exited:
        SlurmArgs.parse(["--run-dir", "/r"])
    assert exited.value.code == 2


def test_no_entry_or_engine_spells_an_entrys_option_of_its_own():
    sources = ["worker/task/supervised.py", "worker/task/slurm.py", "worker/task/pod.py", "launcher/plan.py",
               "launcher/engines/slurm/script.py", "launcher/engines/kubernetes/render.py"]
    spelled = {path: re.findall(r'"--(?:run-dir|attempt|grace|preempt-grace|lifeline|env-stdin|safe-path|backend|'
                                r'cpu-devices|workers|hosts|run-id)"', (REPO / path).read_text())
               for path in sources}
    assert not any(spelled.values()), spelled
    assert all("add_argument" not in (REPO / path).read_text() for path in sources[:3])
