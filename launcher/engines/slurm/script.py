"""The job: sbatch options, the batch script (one srun step: one attempt; no policy in bash; the agent
decides restarts), the step's command line, and the environment the dry run shows."""

from __future__ import annotations

import math
import os
import re
import shlex
from typing import Callable

from launcher.engines.slurm.plan import JOB_OUT, described_environment, job_name, run_folder
from launcher.plan import mask_env, worker_argv
from launcher.spec.cluster import SlurmSpec
from worker.host import layout
from worker.host.entries import SlurmArgs
from worker.host.env import Backend
from worker.host.spawn import module_argv

SAFE = re.compile(r"^[\w./@%:=+,-]+\Z")
SHOWN_CHARS = 1000  # of one value in the dry run (TF_CONFIG grows with the nodes)


def sbatch_options(spec: SlurmSpec, run_id: str) -> list[str]:
    """Every sbatch option of the run: ours, then the spec's own (`sbatch`, passed as they are)."""
    cfg, root = spec.slurm, run_folder(spec, run_id)
    opts = [f"--job-name={job_name(run_id)}", f"--nodes={cfg.nodes}", "--ntasks-per-node=1"]
    if cfg.partition:
        opts.append(f"--partition={cfg.partition}")
    if cfg.time:
        opts.append(f"--time={cfg.time}")
    if cfg.gpus_per_node:
        opts.append(f"--gpus-per-node={cfg.gpus_per_node}")
    opts += [f"--chdir={os.path.expanduser(cfg.workdir)}", f"--output={os.path.join(root, JOB_OUT)}",
             "--open-mode=append",
             # the tasks get USR1 preempt_grace before the time limit (a notice: they save); a job
             # that Slurm requeues (scontrol requeue, a node failure) comes back as the next attempt
             f"--signal=USR1@{math.ceil(spec.launch.preempt_grace)}", "--requeue"]
    return opts + list(cfg.sbatch)


def srun_argv(spec: SlurmSpec, run_id: str, attempt: int) -> list[str]:
    """The step: one task per node (each under the task core), the whole step ended by Slurm when one
    task fails; each task stops itself when the launcher stops touching its lifeline (layout.ALIVE)."""
    cfg, root, launch = spec.slurm, run_folder(spec, run_id), spec.launch
    core = SlurmArgs(run_dir=root, attempt=attempt, grace=launch.stop_grace, preempt_grace=launch.preempt_grace,
                     lifeline=launch.lifeline, port=cfg.port or None, program=worker_argv(spec, cfg.python))
    return ["srun", "--kill-on-bad-exit=1", f"--nodes={cfg.nodes}", f"--ntasks={cfg.nodes}",
            "--ntasks-per-node=1", f"--job-name={job_name(run_id)}", *module_argv(cfg.python, core.module),
            *core.argv()]


def _directives(opts: list[str]) -> list[str]:
    """`#SBATCH` lines of the options (an option and the value that follows it on one line), quoted as sbatch
    reads them; one it cannot read there (a single quote inside) is left out: the command line has it."""
    groups: list[list[str]] = []
    for opt in opts:
        if groups and not opt.startswith("-") and not groups[-1][-1].partition("=")[1]:
            groups[-1].append(opt)
        else:
            groups.append([opt])
    lines = []
    for group in groups:
        if any("'" in word for word in group):
            continue
        words = []
        for word in group:
            name, eq, value = word.partition("=")
            if SAFE.match(word):
                words.append(word)
            elif eq and word.startswith("--"):
                words.append(f"{name}={shlex.quote(value)}")
            else:
                words.append(shlex.quote(word))
        lines.append("#SBATCH " + " ".join(words))
    return lines


def batch_script(spec: SlurmSpec, run_id: str, attempt: int) -> str:
    """The job's script: one attempt, one srun step. Slurm's USR1 before the time limit (--signal) and
    its TERM on a requeue or a cancel reach the tasks, which take them as a notice; the agent decides
    what follows."""
    opts = sbatch_options(spec, run_id)
    return "\n".join([
        "#!/bin/bash",
        f"# mgpu-cluster run {run_id}, attempt {attempt}: {spec.slurm.nodes} task(s), one per node. Written by",
        "# `mgpu-cluster up`, which submits it with every option below on sbatch's command line and decides",
        "# restarts itself; `mgpu-cluster down` cancels it.",
        *_directives(opts),
        f"exec {shlex.join(srun_argv(spec, run_id, attempt))}",
        "",
    ])


def show_environment(spec: SlurmSpec, run_id: str, say: Callable[[str], None]) -> None:
    """The dry run's account of task 0's environment: what the one builder makes on its node (secrets masked)."""
    say(f"# task 0's environment, built on its node when it starts (the launcher's part in {layout.ENV}), for "
        "the step's nodes <node 0>..<node N-1>:")
    for k, v in mask_env(described_environment(spec, run_id)).items():
        say(f"#   {k}={v if len(v) <= SHOWN_CHARS else v[:SHOWN_CHARS] + f'... ({len(v)} characters)'}")
    port = spec.slurm.port or "from the job id (20000 + job id % 10000)"
    if spec.training.backend is Backend.JAX:
        say("# KERAS_DISTRIBUTION_JOB_ADDRESSES of every task: the step's first node in Slurm's order (scontrol show "
            f"hostnames), at its NodeAddr, port {port}; KERAS_DISTRIBUTION_PROCESS_ID = SLURM_PROCID")
        return
    say("# TF_CONFIG of task i: the step's nodes in Slurm's order (scontrol show hostnames), each at its NodeAddr, "
        f"port {port}; index = SLURM_PROCID")
