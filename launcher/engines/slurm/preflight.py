"""The Slurm preflight: Slurm's commands, its controller, the shared workdir, the partition's nodes,
time and GPUs, and Slurm's own verdict on the request (sbatch --test-only). Nothing is submitted."""

from __future__ import annotations

import os
import shutil

from launcher.engines.slurm.job import _gpus, parse_time, record_of, slurm
from launcher.engines.slurm.plan import Mode
from launcher.engines.slurm.script import batch_script, sbatch_options
from launcher.spec import ClusterSpec

TOOLS = ("sbatch", "squeue", "scontrol", "scancel")


def problems(spec: ClusterSpec, run_id: str, mode: Mode, job_id: str | None) -> list[str]:
    """What stops this run from starting on this Slurm cluster (checked here, nothing submitted)."""
    cfg, timeout = spec.slurm, spec.launch.connect_timeout
    tools = ("srun", "scontrol", "scancel", "squeue") if mode == Mode.ALLOCATION else TOOLS
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return [f"Slurm's commands are not on PATH ({', '.join(missing)} not found): run mgpu-cluster on a login "
                "node of your Slurm cluster (where sites use modules: 'module load slurm'), or name your machines "
                "with [[hosts]] instead of [slurm]"]
    ping = slurm(["scontrol", "ping"], timeout)
    if ping.returncode != 0 or " is UP" not in ping.stdout:
        said = (ping.stderr or ping.stdout).strip().splitlines()
        return [f"the Slurm controller does not answer ('scontrol ping': {said[-1] if said else 'no answer'}); "
                "check that slurmctld runs and that SLURM_CONF (or /etc/slurm/slurm.conf) names it"]
    workdir = os.path.expanduser(cfg.workdir)
    problems = []
    if not os.path.isdir(workdir):
        problems.append(f"[slurm].workdir {workdir} does not exist here; it must be a folder every node sees "
                        "(shared storage), e.g. in your home or project folder")
    elif not os.access(workdir, os.W_OK | os.X_OK):
        problems.append(f"[slurm].workdir {workdir} is not writable: the run's files go there")
    if mode == Mode.ALLOCATION:
        have = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 0)
        if have < cfg.nodes:
            problems.append(f"[slurm].nodes = {cfg.nodes}, but this allocation (job {job_id}) has {have} "
                            f"node(s); ask for {cfg.nodes} (salloc -N {cfg.nodes}) or lower [slurm].nodes")
        return problems
    problems += partition_problems(cfg, timeout)
    if not problems:  # Slurm's own verdict on the whole request (accounts, QOS, the spec's sbatch options)
        test = slurm(["sbatch", "--test-only", *sbatch_options(spec, run_id)], timeout,
                     input=batch_script(spec, run_id, 0))
        if test.returncode != 0:
            said = " ".join(line.strip() for line in (test.stderr or test.stdout).strip().splitlines()[:3])
            problems.append(f"Slurm refuses the job ('sbatch --test-only': {said}); check [slurm].sbatch and "
                            "the other [slurm] keys")
    return problems

def partition_problems(cfg, timeout: float) -> list[str]:
    listing = slurm(["scontrol", "-o", "show", "partition"], timeout)
    parts = [record_of(line) for line in listing.stdout.splitlines() if line.strip()]
    names = [p.get("PartitionName") for p in parts]
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
    total = int(part.get("TotalNodes") or 0)
    max_nodes = part.get("MaxNodes", "UNLIMITED")
    if total < cfg.nodes:
        problems.append(f"[slurm].nodes = {cfg.nodes}, but partition {name} has {total} node(s)")
    elif max_nodes.isdigit() and int(max_nodes) < cfg.nodes:
        problems.append(f"[slurm].nodes = {cfg.nodes}, but partition {name} allows at most {max_nodes} per job")
    else:
        states = slurm(["sinfo", "-h", "-N", "-p", name, "-o", "%N %t"], timeout).stdout.split("\n")
        nodes = dict(line.split() for line in states if len(line.split()) == 2)
        bad = {n: s for n, s in nodes.items() if s.rstrip("*~#!%$@^-") in (
            "down", "drain", "drng", "fail", "failg", "maint", "inval", "futr", "unk", "npc", "pow_dn")
            or s.endswith("*")}
        if nodes and len(nodes) - len(bad) < cfg.nodes:
            problems.append(f"[slurm].nodes = {cfg.nodes}, but only {len(nodes) - len(bad)} of partition {name}'s "
                            f"{len(nodes)} nodes are usable ({', '.join(f'{n}: {s}' for n, s in sorted(bad.items()))}); "
                            "the job would wait until an administrator brings them back")
    limit, asked = parse_time(part.get("MaxTime")), parse_time(cfg.time)
    if limit is not None and asked is not None and asked > limit:
        problems.append(f"[slurm].time = {cfg.time!r} is longer than partition {name}'s limit "
                        f"{part.get('MaxTime')}")
    if cfg.gpus_per_node:
        shown = slurm(["scontrol", "-o", "show", "node", part.get("Nodes", "")], timeout).stdout
        gpus = [_gpus(record_of(line).get("Gres", "")) for line in shown.splitlines() if line.strip()]
        enough = sum(g >= cfg.gpus_per_node for g in gpus)
        if enough < cfg.nodes:
            problems.append(f"[slurm].gpus_per_node = {cfg.gpus_per_node}, but only {enough} node(s) of partition "
                            f"{name} have that many GPUs (Gres); lower it, or choose a GPU partition")
    return problems
