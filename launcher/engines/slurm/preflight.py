"""The Slurm preflight: Slurm's commands, its controller, the shared workdir, the partition's nodes,
time and GPUs, and Slurm's own verdict on the request (sbatch --test-only). Nothing is submitted."""

from __future__ import annotations

import os
import shutil

from launcher.engines.slurm.commands import slurm
from launcher.engines.slurm.job import gpus, parse_time, record_of
from launcher.engines.slurm.script import batch_script, sbatch_options
from launcher.spec.cluster import SlurmSpec
from launcher.spec.slurm import Slurm
from worker.task.lines import printable

BATCH_TOOLS = ("sbatch", "squeue", "scontrol", "scancel")
STEP_TOOLS = ("srun", "scontrol", "scancel", "squeue")
UNUSABLE = ("down", "drain", "drng", "fail", "failg", "maint", "inval", "futr", "unk", "npc", "pow_dn")  # sinfo %t
SHOWN = 10  # unusable nodes named in the paragraph
SAID_MAX = 600  # characters of Slurm's own words quoted in a problem


def batch_problems(spec: SlurmSpec, run_id: str) -> list[str]:
    """What stops the run's job from starting on this Slurm cluster: the partition first (a node count it
    cannot grant is refused at once), then Slurm's own verdict on the request (sbatch --test-only)."""
    problems = _here(spec, BATCH_TOOLS)
    if problems is not None:
        return problems
    problems = _workdir(spec) + partition_problems(spec.slurm, spec.launch.connect_timeout)
    if not problems:  # Slurm's own verdict on the whole request (accounts, QOS, the spec's sbatch options)
        test = slurm(["sbatch", "--test-only", *sbatch_options(spec, run_id)], spec.launch.connect_timeout,
                     input=batch_script(spec, run_id, 0))
        if test.returncode != 0:
            said = printable(" ".join((test.stderr or test.stdout).strip().splitlines()[:3]), SAID_MAX)
            problems.append(f"Slurm refuses the job ('sbatch --test-only': {said}); check [slurm].sbatch and "
                            "the other [slurm] keys")
    return problems


def allocation_problems(spec: SlurmSpec, job_id: str | None) -> list[str]:
    """What stops a step of this run in the allocation `up` runs in."""
    problems = _here(spec, STEP_TOOLS)
    if problems is not None:
        return problems
    problems, cfg = _workdir(spec), spec.slurm
    have = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 0)
    if have < cfg.nodes:
        problems.append(f"[slurm].nodes = {cfg.nodes}, but this allocation (job {job_id}) has {have} "
                        f"node(s); ask for {cfg.nodes} (salloc -N {cfg.nodes}) or lower [slurm].nodes")
    return problems


def _here(spec: SlurmSpec, tools: tuple[str, ...]) -> list[str] | None:
    """Slurm's commands and its controller, or what is missing (then nothing else can be asked)."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return [f"Slurm's commands are not on PATH ({', '.join(missing)} not found): run mgpu-cluster on a login "
                "node of your Slurm cluster (where sites use modules: 'module load slurm'), or name your machines "
                "with [[hosts]] instead of [slurm]"]
    ping = slurm(["scontrol", "ping"], spec.launch.connect_timeout)
    if ping.returncode != 0 or " is UP" not in ping.stdout:
        said = (ping.stderr or ping.stdout).strip().splitlines()
        answer = printable(said[-1]) if said else "no answer"
        return [f"the Slurm controller does not answer ('scontrol ping': {answer}); "
                "check that slurmctld runs and that SLURM_CONF (or /etc/slurm/slurm.conf) names it"]
    return None


def _workdir(spec: SlurmSpec) -> list[str]:
    workdir = os.path.expanduser(spec.slurm.workdir)
    if not os.path.isdir(workdir):
        return [f"[slurm].workdir {workdir} does not exist here; it must be a folder every node sees "
                "(shared storage), e.g. in your home or project folder"]
    if not os.access(workdir, os.W_OK | os.X_OK):
        return [f"[slurm].workdir {workdir} is not writable: the run's files go there"]
    return []


def partition_problems(cfg: Slurm, timeout: float) -> list[str]:
    """The partition: it exists and is up, can grant the nodes (usable ones), the time and the GPUs."""
    listing = slurm(["scontrol", "-o", "show", "partition"], timeout)
    parts = [record_of(line) for line in listing.stdout.splitlines() if line.strip()]
    names = [p.get("PartitionName", "") for p in parts]
    if cfg.partition:
        found = [p for p in parts if p.get("PartitionName") == cfg.partition]
        if not found:
            return [f"[slurm].partition = {cfg.partition!r}: no such partition; partitions here: "
                    f"{', '.join(names) or '(none)'} ('sinfo -s' lists them)"]
    else:
        found = [p for p in parts if p.get("Default") == "YES"]
        if not found:
            return [f"this cluster has no default partition: set [slurm].partition to one of "
                    f"{', '.join(names) or '(none)'}"]
    part = found[0]
    name, problems = part["PartitionName"], []
    if part.get("State") != "UP":
        problems.append(f"partition {name} is {part.get('State')}: jobs there do not start; choose another "
                        f"[slurm].partition ({', '.join(n for n in names if n != name) or 'there is no other'})")
    total, most = int(part.get("TotalNodes") or 0), part.get("MaxNodes", "UNLIMITED")
    # a count the partition cannot grant is refused before anything that grows with the partition is asked
    if total < cfg.nodes:
        others = ", ".join(n for n in names if n != name) or "there is no other"
        return problems + [f"[slurm].nodes = {cfg.nodes}, but partition {name} has {total} node(s): Slurm cannot "
                           f"grant that many, so the job would never start; lower [slurm].nodes to at most {total}, "
                           f"or choose a larger [slurm].partition ({others})"]
    if most.isdigit() and int(most) < cfg.nodes:
        return problems + [f"[slurm].nodes = {cfg.nodes}, but partition {name} allows at most {most} per job: "
                           f"Slurm cannot grant that many; lower [slurm].nodes to at most {most}"]
    states = slurm(["sinfo", "-h", "-N", "-p", name, "-o", "%N %t"], timeout).stdout.split("\n")
    nodes = dict(line.split() for line in states if len(line.split()) == 2)
    bad = sorted((n, s) for n, s in nodes.items() if s.rstrip("*~#!%$@^-") in UNUSABLE or s.endswith("*"))
    if nodes and len(nodes) - len(bad) < cfg.nodes:
        shown = ", ".join(f"{n}: {s}" for n, s in bad[:SHOWN]) + (f", and {len(bad) - SHOWN} more" if len(bad) > SHOWN else "")
        problems.append(f"[slurm].nodes = {cfg.nodes}, but only {len(nodes) - len(bad)} of partition {name}'s "
                        f"{len(nodes)} nodes are usable ({shown}); the job would wait until an administrator "
                        "brings them back")
    limit, asked = parse_time(part.get("MaxTime")), parse_time(cfg.time)
    if limit is not None and asked is not None and asked > limit:
        problems.append(f"[slurm].time = {cfg.time!r} is longer than partition {name}'s limit "
                        f"{part.get('MaxTime')}")
    if cfg.gpus_per_node:
        shown = slurm(["scontrol", "-o", "show", "node", part.get("Nodes", "")], timeout).stdout
        enough = sum(gpus(record_of(line).get("Gres", "")) >= cfg.gpus_per_node
                     for line in shown.splitlines() if line.strip())
        if enough < cfg.nodes:
            problems.append(f"[slurm].gpus_per_node = {cfg.gpus_per_node}, but only {enough} node(s) of partition "
                            f"{name} have that many GPUs (Gres); lower it, or choose a GPU partition")
    return problems
