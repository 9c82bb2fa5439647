"""The Slurm engine: Slurm starts, signals and stops the tasks; the launcher submits, follows, reports.

`up` writes a batch script into the run's folder under [slurm].workdir (shared by every node) and
submits it; the job runs one `srun --kill-on-bad-exit=1` step (one task per node, each task
`python -m worker.task.slurm`), and starts the step again itself after a failure while
max_restarts allows. Inside an existing allocation (SLURM_JOB_ID set) `up` runs the step with
`srun` directly and the agent restarts it. The launcher follows the tasks through their files in
the shared run folder (task.json, worker.log, progress.json, exit_code) and the job through
`scontrol`; `down` is `scancel`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from pydantic import PrivateAttr

from launcher.engines.base import Engine, EngineKind, Result, Sink, TaskCheck
from launcher.plan import TaskPlan, mask_env, worker_argv
from launcher.spec import ClusterSpec, Host
from worker import protocol
from worker.task.files import write_private
from worker.protocol import TaskState
from worker.task.lines import Lines

TOOLS = ("sbatch", "squeue", "scontrol", "scancel")
POLL_S = 0.2  # the tasks' files
JOB_POLL_S = 0.5  # the job's state
SETTLE_S = 1.5  # after the job (or step) ended, how long a task's exit code may take to appear
READ_MAX = 1 << 20  # bytes of a log read per task per poll
FORWARD_MAX_LINES = 400  # lines per poll and task on the screen; beyond that a flood is thinned
QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
RUNNING = {"CONFIGURING", "RUNNING", "SUSPENDED", "SIGNALING", "RESIZING", "STOPPED"}
SAFE = re.compile(r"^[\w./@%:=+,-]+$")


def run_folder(spec: ClusterSpec, run_id: str) -> str:
    """The run's folder under [slurm].workdir (seen by every node): tasks, checkpoint, batch script."""
    return os.path.join(os.path.expanduser(spec.slurm.workdir), ".mgpu", "runs", run_id)


def job_name(run_id: str) -> str:
    return f"mgpu-{run_id}"


# --------------------------------------------------------------------------- plans

class SlurmHost(Host):
    """A task's host before Slurm has placed it ("slurm"), then its node (filled in at start)."""

    port: int = 0  # 0: derived from the job id, known once the task runs
    _where: dict = PrivateAttr(default_factory=dict)

    @property
    def label(self) -> str:
        return self._where.get("node") or "slurm"

    @property
    def tf_port(self) -> int:
        return self._where.get("port") or self.port


@dataclasses.dataclass(frozen=True)
class SlurmTaskPlan(TaskPlan):
    title: str = ""  # a preflight row about the whole job

    @property
    def label(self) -> str:
        if self.title:
            return self.title
        port = self.host.tf_port
        return f"task {self.index} ({self.host.label}:{port})" if port else f"task {self.index} ({self.host.label})"


def common_env(spec: ClusterSpec, run_id: str) -> dict[str, str]:
    """What every task gets (env.json); worker.task.slurm adds TF_CONFIG, MGPU_TASK_INDEX, MGPU_RUN_DIR."""
    cfg = spec.slurm
    env = {"MGPU_RUN_ID": run_id, "MGPU_NUM_WORKERS": str(cfg.nodes), "TF_USE_LEGACY_KERAS": "1",
           "PYTHONUNBUFFERED": "1"}
    if cfg.gpus_per_node == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(cfg.env or {})
    return env


def plan_slurm(spec: ClusterSpec, run_id: str) -> list[TaskPlan]:
    cfg, root = spec.slurm, run_folder(spec, run_id)
    common = common_env(spec, run_id)
    plans = []
    for i in range(cfg.nodes):
        run_dir = f"{root}/task-{i}"
        plans.append(SlurmTaskPlan(
            index=i, host=SlurmHost(address="slurm", port=cfg.port or 0), python=cfg.python,
            cwd=os.path.expanduser(cfg.workdir), run_dir=run_dir, argv=worker_argv(spec, cfg.python),
            env={**common, "MGPU_TASK_INDEX": str(i), "MGPU_RUN_DIR": run_dir}, grace=spec.launch.stop_grace,
            preempt_grace=spec.launch.preempt_grace))
    return plans


# --------------------------------------------------------------------------- the job

def sbatch_options(spec: ClusterSpec, run_id: str) -> list[str]:
    """Every sbatch option of the run: ours, then the spec's own (`sbatch`, passed as they are)."""
    cfg, root = spec.slurm, run_folder(spec, run_id)
    opts = [f"--job-name={job_name(run_id)}", f"--nodes={cfg.nodes}", "--ntasks-per-node=1"]
    if cfg.partition:
        opts.append(f"--partition={cfg.partition}")
    if cfg.time:
        opts.append(f"--time={cfg.time}")
    if cfg.gpus_per_node:
        opts.append(f"--gpus-per-node={cfg.gpus_per_node}")
    opts += [f"--chdir={os.path.expanduser(cfg.workdir)}", f"--output={root}/job.out", "--open-mode=append",
             # hooks for preemption: USR1 to the script before the time limit; a preempted job comes back
             f"--signal=B:USR1@{math.ceil(spec.launch.preempt_grace)}", "--requeue"]
    return opts + list(cfg.sbatch)


def srun_argv(spec: ClusterSpec, run_id: str, attempt: str) -> list[str]:
    """The step: one task per node, the whole step ended by Slurm when one task fails."""
    cfg, root = spec.slurm, run_folder(spec, run_id)
    wrapper = [cfg.python, "-m", "worker.task.slurm", "--run-dir", root, "--attempt", attempt,
               "--grace", f"{spec.launch.stop_grace:g}", "--preempt-grace", f"{spec.launch.preempt_grace:g}"]
    if cfg.port:
        wrapper += ["--port", str(cfg.port)]
    return ["srun", "--kill-on-bad-exit=1", f"--nodes={cfg.nodes}", f"--ntasks={cfg.nodes}",
            "--ntasks-per-node=1", f"--job-name={job_name(run_id)}", *wrapper, "--", *worker_argv(spec, cfg.python)]


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


def batch_script(spec: ClusterSpec, run_id: str) -> str:
    """The job's script: the step, started again after a failure while max_restarts allows (it resumes
    from the run's checkpoint); an exit 75 (preempted: saved on notice) counts against max_preemptions."""
    root, launch = run_folder(spec, run_id), spec.launch
    opts = sbatch_options(spec, run_id)
    directives = _directives(opts)
    argv = srun_argv(spec, run_id, "0")
    at = argv.index("--attempt") + 1  # the attempt is the script's own variable
    step = f'{shlex.join(argv[:at])} "$attempt" {shlex.join(argv[at + 1:])}'
    return "\n".join([
        "#!/bin/bash",
        f"# mgpu-cluster run {run_id}: {spec.slurm.nodes} task(s), one per node. Written by `mgpu-cluster up`, which",
        "# submits it with every option below on sbatch's command line; `mgpu-cluster down` cancels it.",
        *directives,
        "set -u",
        f"run={shlex.quote(root)}",
        f"max_restarts={launch.max_restarts}",
        f"max_preemptions={launch.max_preemptions}",
        "restarts=0 preemptions=0 attempt=0 notice=0 step=",
        "# Preemption hook: Slurm sends USR1 to this script before the time limit (--signal); the tasks get",
        "# TERM (they save a checkpoint and exit 75) and no further attempt starts here; --requeue brings",
        "# a preempted job back, and it resumes from the checkpoint.",
        'on_notice() { notice=1; echo "mgpu-cluster: notice (USR1) at $(date +%s)"; touch "$run/notice";',
        '  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null; }',
        "trap on_notice USR1",
        "# Lifeline: the launcher touches $run/launcher.alive while it follows the run; when that stops for",
        f"# {launch.lifeline:g} s (it was killed, or its machine went away) the job ends itself: nothing is left.",
        f"lifeline={launch.lifeline:.0f}",
        '( while sleep 2; do last=$(stat -c %Y "$run/launcher.alive" 2>/dev/null || echo 0)',
        '    if [ $(( $(date +%s) - last )) -gt "$lifeline" ]; then',
        '      echo "mgpu-cluster: no word from the launcher for over $lifeline s: cancelling the job"',
        '      touch "$run/stop"; scancel "$SLURM_JOB_ID"; exit; fi; done ) &',
        'echo "mgpu-cluster: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (restart count ${SLURM_RESTART_COUNT:-0})"',
        "while :; do",
        f"  {step} &",
        "  step=$!",
        '  while :; do wait "$step"; rc=$?; kill -0 "$step" 2>/dev/null || break; done  # a trap ends a wait early',
        '  echo "mgpu-cluster: attempt $attempt ended with exit code $rc"',
        '  if [ "$rc" -eq 0 ] || [ "$notice" -eq 1 ] || [ -e "$run/stop" ]; then exit "$rc"; fi',
        f'  if [ "$rc" -eq {protocol.EXIT_PREEMPTED} ]; then',
        '    preemptions=$((preemptions + 1)); [ "$preemptions" -le "$max_preemptions" ] || exit "$rc"',
        "  else",
        '    restarts=$((restarts + 1)); [ "$restarts" -le "$max_restarts" ] || exit "$rc"',
        "  fi",
        "  attempt=$((attempt + 1))",
        '  echo "mgpu-cluster: starting attempt $attempt (restart $restarts of $max_restarts); it resumes from its '
        'last checkpoint"',
        "done",
        "",
    ])


def print_dry_run(spec: ClusterSpec, run_id: str, say: Callable[[str], None]) -> None:
    root = run_folder(spec, run_id)
    if os.environ.get("SLURM_JOB_ID"):
        say(f"# inside allocation {os.environ['SLURM_JOB_ID']}: the step runs directly, in {root}")
        say(shlex.join(srun_argv(spec, run_id, "0")))
    else:
        say(f"# submitted with: sbatch --parsable {shlex.join(sbatch_options(spec, run_id))} {root}/job.sh")
        say(f"# {root}/job.sh:")
        say(batch_script(spec, run_id))
    say(f"# {root}/env.json (every task; each adds TF_CONFIG, MGPU_TASK_INDEX and MGPU_RUN_DIR when it starts):")
    for k, v in mask_env(common_env(spec, run_id)).items():
        say(f"#   {k}={v}")
    say("# TF_CONFIG of task i: the step's nodes in Slurm's order (scontrol show hostnames), each at its NodeAddr, "
        f"port {spec.slurm.port or 'from the job id (20000 + job id % 10000)'}; index = SLURM_PROCID")


# --------------------------------------------------------------------------- asking Slurm

def slurm(argv: list[str], timeout: float = 30.0, input: str | None = None) -> subprocess.CompletedProcess:
    """A Slurm command; a missing command or a time-out reads as a failed command (code 127 / 124)."""
    try:
        return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                              stdin=None if input is not None else subprocess.DEVNULL, start_new_session=True)
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: not found on PATH")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"`{shlex.join(argv)}` did not answer within {timeout:g} s")


def record_of(text: str) -> dict:
    """The first record of `scontrol -o show ...` as {Key: Value}."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


def parse_time(text: str | None) -> float | None:
    """Seconds of a Slurm time limit; None: no limit (or none given)."""
    if not text or text.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        parts += [0] * (3 - len(parts))
        h, m, s = parts
    elif len(parts) == 3:
        h, m, s = parts
    elif len(parts) == 2:  # minutes:seconds
        h, m, s = 0, parts[0], parts[1]
    else:  # minutes
        h, m, s = 0, parts[0], 0
    return (int(days or 0) * 24 + h) * 3600 + m * 60 + s


def _gpus(gres: str) -> int:
    """GPUs in a node's Gres (e.g. "gpu:a100:4(S:0-1),shard:8")."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _exit_of(d: Path, attempt: int) -> dict | None:
    """How attempt `attempt` of the task in `d` ended ({code, time, reason}), from its exits.jsonl; None: not yet."""
    for line in reversed((_read(d / "exits.jsonl") or "").splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # being written
        if isinstance(rec, dict) and rec.get("attempt") == attempt and isinstance(rec.get("code"), int):
            return rec
    return None


def _code(path: Path) -> int | None:
    text = (_read(path) or "").strip()
    return int(text) if text.lstrip("-").isdigit() else None




@dataclasses.dataclass
class _Follow:
    """What the launcher has seen of one task: its log (all attempts) and the current attempt."""

    lines: Lines = dataclasses.field(default_factory=Lines)
    offset: int = 0
    attempt: int = -1
    started: bool = False
    exited: bool = False
    progress: str = ""
    stats: str = ""


# --------------------------------------------------------------------------- the engine

class SlurmEngine(Engine):
    kind = EngineKind.SLURM

    def __init__(self, spec: ClusterSpec, run_id: str, only: list[int] | None = None):
        super().__init__(spec, run_id, only)
        plans = self.plans
        self.cfg = spec.slurm
        self.root = Path(run_folder(spec, self.run_id))
        saved = _json(self.root / "job.json")  # a run started before (status, logs, down)
        self.job_id: str | None = saved.get("job_id")
        self.mode = saved.get("mode") or ("allocation" if os.environ.get("SLURM_JOB_ID") else "batch")
        if self.mode == "allocation" and not self.job_id:
            self.job_id = os.environ.get("SLURM_JOB_ID")
        self.restarts_itself = self.mode == "batch"  # the job's script restarts the step; the agent follows
        self.say: Callable[[str], None] = lambda _text: None
        self.lock = threading.Lock()
        self.attempt, self.sink = 0, None
        self.follow = {p.index: _Follow() for p in plans}
        for p in plans:  # where a task of this run ran last (for `logs` and `status` of an earlier run)
            info = _json(self.root / f"task-{p.index}" / "task.json")
            p.host._where.update(node=info.get("node") or "", port=info.get("port") or 0)
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.srun: subprocess.Popen | None = None
        self.job: dict = {}  # the job's last `scontrol show job` record
        self.ended_since: float | None = None

    def plan_tasks(self, only: list[int] | None) -> list[TaskPlan]:
        return plan_slurm(self.spec, self.run_id)

    def dry_run(self, say: Callable[[str], None]) -> None:
        print_dry_run(self.spec, self.run_id, say)

    def call(self, index: int, argv: list[str], timeout: float) -> tuple[int, str, str]:
        raise NotImplementedError

    # ---- preflight
    def preflight(self, base: Path | None, say: Callable[[str], None], for_start: bool = False) -> list:
        self.say = say
        title = (f"the Slurm job ({self.cfg.nodes} node(s), partition {self.cfg.partition or '(default)'})"
                 if self.mode == "batch" else f"the step in allocation {self.job_id}")
        plan = dataclasses.replace(self.plans[0], title=title)
        return [TaskCheck(plan=plan, problems=self._problems())]

    def _problems(self) -> list[str]:
        cfg, timeout = self.cfg, self.spec.launch.connect_timeout
        tools = ("srun", "scontrol", "scancel", "squeue") if self.mode == "allocation" else TOOLS
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
        if self.mode == "allocation":
            have = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 0)
            if have < cfg.nodes:
                problems.append(f"[slurm].nodes = {cfg.nodes}, but this allocation (job {self.job_id}) has {have} "
                                f"node(s); ask for {cfg.nodes} (salloc -N {cfg.nodes}) or lower [slurm].nodes")
            return problems
        problems += self._partition_problems(timeout)
        if not problems:  # Slurm's own verdict on the whole request (accounts, QOS, the spec's sbatch options)
            test = slurm(["sbatch", "--test-only", *sbatch_options(self.spec, self.run_id)], timeout,
                         input=batch_script(self.spec, self.run_id))
            if test.returncode != 0:
                said = " ".join(line.strip() for line in (test.stderr or test.stdout).strip().splitlines()[:3])
                problems.append(f"Slurm refuses the job ('sbatch --test-only': {said}); check [slurm].sbatch and "
                                "the other [slurm] keys")
        return problems

    def _partition_problems(self, timeout: float) -> list[str]:
        cfg = self.cfg
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

    # ---- start
    def start(self, attempt: int, sink: Sink) -> dict[int, str]:
        with self.lock:
            self.attempt, self.sink, self.ended_since = attempt, sink, None
        if self.mode == "allocation":
            return self._start_step(attempt)
        if attempt == 0 or self.job_id is None:
            why = self._submit()
            if why:
                return {p.index: why for p in self.plans}
            self._ensure_thread()
            return self._wait_queue()
        # the job's script starts this attempt itself; end what is left of the last one at once
        self._signal_steps(signal.SIGINT, attempt - 1)
        info = self._job_info()
        if info and self._ended(info):
            return {p.index: self._ended_reason(info) for p in self.plans}
        return {}

    def _prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        write_private(self.root / "env.json", json.dumps({"env": common_env(self.spec, self.run_id)}))

    def _save_job(self, **extra) -> None:
        data = {**_json(self.root / "job.json"), "job_id": self.job_id, "mode": self.mode, "name": job_name(self.run_id),
                **extra}
        write_private(self.root / "job.json", json.dumps(data))

    def _alive(self) -> None:
        """The job's lifeline (see batch_script): touched while this launcher follows the run."""
        try:
            (self.root / "launcher.alive").touch()
        except OSError:
            pass

    def _submit(self) -> str | None:
        self._prepare()
        self._alive()
        script = self.root / "job.sh"
        write_private(script, batch_script(self.spec, self.run_id))
        argv = ["sbatch", "--parsable", *sbatch_options(self.spec, self.run_id), str(script)]
        t0 = time.time()
        res = slurm(argv, 60.0)
        if res.returncode != 0:
            return f"sbatch refused the job: {(res.stderr or res.stdout).strip()}"
        self.job_id = res.stdout.strip().split(";")[0]
        self._save_job(submitted_at=t0)
        self.say(f"submitted Slurm job {self.job_id} ({job_name(self.run_id)}) in {time.time() - t0:.2f} s; "
                 f"'mgpu-cluster down' or 'scancel {self.job_id}' cancels it")
        return None

    def _wait_queue(self) -> dict[int, str]:
        """Return once the job runs (time in the queue is not start-up time); Ctrl-C here cancels it."""
        said, t0 = None, time.time()
        while True:
            info = self._job_info()
            state = (info or {}).get("JobState", "")
            if state in RUNNING:
                if said:
                    self.say(f"job {self.job_id} runs on {info.get('NodeList')} after {time.time() - t0:.1f} s in the "
                             "queue")
                return {}
            if info and self._ended(info):
                return {p.index: self._ended_reason(info) for p in self.plans}
            reason = info.get("Reason") if info else None
            if state in QUEUED and reason not in (None, "None", said):
                said = reason
                self.say(f"job {self.job_id} is waiting in the queue ({reason}); 'mgpu-cluster status' shows it, "
                         "Ctrl-C cancels it")
            time.sleep(0.2)

    def _start_step(self, attempt: int) -> dict[int, str]:
        """Inside an allocation: run the step ourselves (the agent restarts it)."""
        self._prepare()
        self._save_job()
        self.stopping = False
        log = os.open(self.root / f"step-{attempt}.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.srun = subprocess.Popen(srun_argv(self.spec, self.run_id, str(attempt)),
                                         cwd=os.path.expanduser(self.cfg.workdir), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True)
        except OSError as exc:
            return {p.index: f"cannot run srun: {exc.strerror}" for p in self.plans}
        finally:
            os.close(log)
        self.say(f"inside allocation {self.job_id}: attempt {attempt} runs as an srun step of it "
                 f"({job_name(self.run_id)})")
        self._ensure_thread()
        return {}

    def _ensure_thread(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._follow_loop, name="slurm-follow", daemon=True)
            self.thread.start()

    # ---- the job and its steps
    def _job_info(self) -> dict | None:
        if not self.job_id:
            return None
        res = slurm(["scontrol", "-o", "show", "job", self.job_id], 30.0)
        if res.returncode != 0 or not res.stdout.strip():
            return None  # purged (MinJobAge), or the controller does not answer
        info = record_of(res.stdout)
        self.job = info
        if self.mode == "batch" and self._ended(info) and not _json(self.root / "job.json").get("final"):
            try:  # kept, for `status` once Slurm has forgotten the job
                self._save_job(final={"state": info.get("JobState"), "reason": info.get("Reason"),
                                      "exit_code": info.get("ExitCode"), "nodes": info.get("NodeList")})
            except OSError:
                pass
        return info

    @staticmethod
    def _ended(info: dict) -> bool:
        state = info.get("JobState", "")
        return bool(state) and state not in QUEUED and state not in RUNNING

    def _ended_reason(self, info: dict) -> str:
        state, code = info.get("JobState"), info.get("ExitCode")
        tail = (_read(self.root / "job.out") or "").strip().splitlines()[-5:]
        said = ("; the end of its job.out:\n      " + "\n      ".join(tail)) if tail else ""
        return f"Slurm job {self.job_id} ended ({state}, exit code {code}, reason {info.get('Reason')}){said}"

    def _steps(self, attempt: int | None = None) -> list[str]:
        """Our steps that still run ("JOB.STEP"): those of the tasks' task.json (of `attempt`), and any
        step named after the run; squeue says which still run."""
        found = set()
        for p in self.plans:
            info = _json(self.root / f"task-{p.index}" / "task.json")
            if info.get("step_id") not in (None, "") and (attempt is None or info.get("attempt") == attempt):
                found.add(f"{info['job_id']}.{info['step_id']}")
        jobs = {self.job_id, *(f.split(".")[0] for f in found)} - {None}
        if not jobs:
            return []
        res = slurm(["squeue", "-h", "-s", "-j", ",".join(sorted(jobs)), "-o", "%i %j"], 10.0)
        if res.returncode != 0:
            return sorted(found)  # Slurm does not say: try them all
        running = [w for w in (line.split() for line in res.stdout.splitlines()) if len(w) == 2]
        named = {w[0] for w in running if w[1] == job_name(self.run_id)} if attempt is None else set()
        return sorted((found & {w[0] for w in running}) | named)

    def _signal_steps(self, sig: int, attempt: int | None = None) -> None:
        for step in self._steps(attempt):
            slurm(["scancel", f"--signal={sig.name.removeprefix('SIG')}", step], 10.0)

    def _cancel(self) -> None:
        """Stop the run: its tasks get INT (KILL after stop_grace), then the job (or our step) is cancelled."""
        self.stopping = True
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            (self.root / "stop").touch()  # the job's script starts no further attempt
        except OSError:
            pass
        if self.mode == "allocation":
            self._signal_steps(signal.SIGINT)
            for step in self._steps():
                slurm(["scancel", step], 10.0)
            if self.srun is not None and self.srun.poll() is None:
                threading.Thread(target=self._end_srun, daemon=True).start()
            return
        if self.job_id:
            if (self.job or {}).get("JobState") in RUNNING:
                slurm(["scancel", "--signal=INT", self.job_id], 10.0)  # steps only: quicker than Slurm's KillWait
            slurm(["scancel", self.job_id], 10.0)
        # a job submitted just before an interrupt, whose id we never learnt: by its name
        slurm(["scancel", f"--name={job_name(self.run_id)}"], 10.0)

    def _end_srun(self) -> None:
        deadline = time.time() + self.spec.launch.stop_grace + 5.0
        while self.srun.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        if self.srun.poll() is None:
            self.srun.send_signal(signal.SIGTERM)

    def stop(self, indices: list[int]) -> None:
        self._cancel()

    def stop_from_folders(self, indices: list[int]) -> list[Result[dict]]:
        if self.mode == "batch" and not self.job_id and not shutil.which("scancel"):
            err = RuntimeError("scancel is not on PATH: run 'mgpu-cluster down' where Slurm's commands work")
            return [Result(error=err) for _ in indices]
        self._cancel()
        deadline = time.time() + self.spec.launch.stop_grace + 60.0
        while True:  # until Slurm has ended it (its processes are gone)
            if self.mode == "allocation":
                left = self._steps()
                if not left and (self.srun is None or self.srun.poll() is not None):
                    break
                what = f"step(s) {', '.join(left)}"
            else:
                info = self._job_info()
                if info is None or self._ended(info) and info.get("JobState") != "COMPLETING":
                    break
                what = f"job {self.job_id} ({info.get('JobState')})"
            if time.time() > deadline:
                err = RuntimeError(f"Slurm has not ended {what} after 'scancel'; see 'scontrol show job {self.job_id}'")
                return [Result(error=err) for _ in indices]
            time.sleep(0.2)
        return self.probe(indices)

    # ---- following the tasks
    def _follow_loop(self) -> None:
        next_job = 0.0
        while not self.closed.wait(POLL_S):
            self._alive()
            with self.lock:
                attempt, sink = self.attempt, self.sink
            if sink is None:
                continue
            exits = []
            for p in self.plans:
                try:
                    exits += self._follow_task(p, attempt, sink)
                except Exception as exc:  # a file caught half-written: next round
                    sink.garbage(p.index, f"(reading its files: {type(exc).__name__}: {exc})")
            # exits seen in one round go in the order they happened: the task that failed first is named,
            # not a peer that Slurm (--kill-on-bad-exit) or TensorFlow ended a moment later
            for _when, index, event in sorted(exits, key=lambda e: e[0]):
                sink.event(index, event)
            now = time.monotonic()
            if now < next_job:
                continue
            next_job = now + JOB_POLL_S
            why = self._step_ended()
            if why is None:
                self.ended_since = None
                continue
            self.ended_since = self.ended_since or now
            if now - self.ended_since < SETTLE_S:
                continue
            for p in self.plans:  # the job (or step) is over: a task with no exit code will never give one
                f = self.follow[p.index]
                if f.attempt == attempt and f.exited:
                    continue
                f.attempt, f.exited = attempt, True
                if self.stopping:
                    sink.event(p.index, protocol.Exit(code=-signal.SIGKILL, time=time.time(), tail=list(f.lines.tail),
                                                      reason="stopped: Slurm ended it"))
                else:
                    sink.event(p.index, protocol.Lost(reason=why))

    def _step_ended(self) -> str | None:
        """Why the current attempt can report no more (its job or step is over), or None."""
        if self.mode == "allocation":
            if self.srun is not None and self.srun.poll() is not None:
                tail = (_read(self.root / f"step-{self.attempt}.out") or "").strip().splitlines()[-5:]
                return (f"its srun step ended (exit code {self.srun.returncode}) without an exit code from this task"
                        + ("; srun said:\n      " + "\n      ".join(tail) if tail else ""))
            return None
        info = self._job_info()
        if info is None:
            return None if not self.job else f"Slurm job {self.job_id} is no longer known to Slurm"
        if self._ended(info):
            return self._ended_reason(info) + " without an exit code from this task"
        return None

    def _follow_task(self, plan: TaskPlan, attempt: int, sink: Sink) -> list[tuple[float, int, protocol.Exit]]:
        """Report what is new of one task; its exit is returned (with when it happened), not reported."""
        f, d = self.follow[plan.index], self.root / f"task-{plan.index}"
        if f.attempt != attempt:
            f.attempt, f.started, f.exited, f.progress, f.stats = attempt, False, False, "", ""
        if not f.started:
            info = _json(d / "task.json")
            if info.get("attempt") != attempt or not info.get("pid"):
                ended = _exit_of(d, attempt)  # so short that the next attempt's files are there already
                if ended is None:
                    self._forward(plan.index, d, f, sink)
                    return []
                info = {"pid": ended.get("pid") or 0, "node": ended.get("node"), "port": ended.get("port"),
                        "time": ended.get("time")}
            f.started = True
            where = plan.host._where
            where.update(node=info.get("node") or "", address=info.get("address") or "", port=info.get("port") or 0)
            sink.event(plan.index, protocol.Started(
                pid=int(info["pid"]), create_time=float(info.get("create_time") or 0),
                supervisor_pid=int(info.get("supervisor_pid") or 0), time=float(info.get("time") or time.time()),
                host=where["node"], port=int(where["port"] or 0)))
        ended = None if f.exited else _exit_of(d, attempt)
        self._forward(plan.index, d, f, sink, final=ended is not None)
        current = ended is None and _json(d / "task.json").get("attempt") == attempt  # not a later attempt's files
        text = (_read(d / "progress.json") or "") if current else ""
        if text and text != f.progress:
            try:
                data = json.loads(text)
            except ValueError:
                data = None
            if isinstance(data, dict):
                f.progress = text
                sink.event(plan.index, protocol.Progress(progress=data))
        stats = (_read(d / "stats.json") or "") if current else ""
        if stats and stats != f.stats:
            f.stats = stats
            data = _json(d / "stats.json")
            sink.event(plan.index, protocol.Stats(cpu_percent=data.get("cpu_percent"), rss=data.get("rss"),
                                                  status=data.get("status")))
        if ended is None:
            return []
        f.exited = True
        when = float(ended.get("time") or time.time())
        return [(when, plan.index, protocol.Exit(code=int(ended["code"]), time=when, tail=list(f.lines.tail),
                                                 reason=ended.get("reason") or ""))]

    def _forward(self, index: int, d: Path, f: _Follow, sink: Sink, final: bool = False) -> None:
        """New lines of worker.log to the screen: long lines cut, a flood thinned, never more than READ_MAX."""
        try:
            with open(d / "worker.log", "rb") as log:
                log.seek(f.offset)
                chunk = log.read(READ_MAX)
        except OSError:
            chunk = b""
        if chunk:
            f.offset += len(chunk)
            f.lines.feed(chunk)
        if final:
            f.lines.close()
        lines, dropped = f.lines.take(FORWARD_MAX_LINES)
        if lines or dropped:
            sink.output(index, lines, dropped)

    # ---- status, logs
    def probe(self, indices: list[int]) -> list[Result[dict]]:
        saved = _json(self.root / "job.json")
        info = self._job_info() if (self.job_id and shutil.which("scontrol")) else None
        if info:
            state, reason = info.get("JobState", ""), info.get("Reason")
        elif saved.get("final"):
            state, reason = saved["final"].get("state") or "", saved["final"].get("reason")
        else:
            state, reason = "", None
        job = {"id": self.job_id, "mode": self.mode, "state": state.lower() or None,
               "reason": reason if reason not in (None, "None") else None, "nodes": (info or {}).get("NodeList")}
        latest = max([_json(self.root / f"task-{i}" / "task.json").get("attempt", -1) for i in indices] + [-1])
        rows = []
        for i in indices:
            d = self.root / f"task-{i}"
            task, code, stats = _json(d / "task.json"), _code(d / "exit_code"), _json(d / "stats.json")
            current = task.get("attempt") == latest
            alive = state in RUNNING and bool(task) and code is None and current
            row = {"dir": str(d), "pid": task.get("pid"), "alive": alive, "exit_code": code, "host": task.get("node"),
                   "port": task.get("port"), "progress": _json(d / "progress.json") or None,
                   "cpu_percent": stats.get("cpu_percent") if alive else None,
                   "rss": stats.get("rss") if alive else None, "status": stats.get("status") if alive else None,
                   "gpu_util": None, "time": time.time(), "job": job}
            if state in QUEUED or (state in RUNNING and code is None and not alive):
                row["state"] = str(TaskState.PENDING)
            elif not alive and code is None and self.stopping:
                row["state"] = str(TaskState.STOPPED)
            rows.append(Result(value=row))
        return rows

    def read_log(self, index: int, offset: int, tail: int | None = None) -> tuple[str, int]:
        path = self.root / f"task-{index}" / "worker.log"
        try:
            with open(path, "rb") as log:
                size = os.fstat(log.fileno()).st_size
                if tail is not None:
                    start, data = size, b""
                    while start > 0 and data.count(b"\n") <= tail:
                        start = max(0, start - 65536)
                        log.seek(start)
                        data = log.read(size - start)
                    lines = data.decode("utf-8", "replace").splitlines()[-tail:] if tail else []
                    return "".join(line + "\n" for line in lines), size
                log.seek(offset)
                data = log.read()
        except FileNotFoundError:
            return "", offset
        return data.decode("utf-8", "replace"), offset + len(data)

    def close(self) -> None:
        self.closed.set()
        if self.thread is not None:
            self.thread.join(timeout=2.0)
            if self.mode == "batch" and not self.stopping:  # every task ended by itself: so does the job, in a moment
                deadline = time.time() + 10.0
                while time.time() < deadline and (info := self._job_info()) and (
                        not self._ended(info) or info.get("JobState") == "COMPLETING"):
                    time.sleep(0.1)
        if self.srun is not None and self.srun.poll() is None:  # inside an allocation: our step goes with us
            self._cancel()
            try:
                self.srun.wait(self.spec.launch.stop_grace + 5.0)
            except subprocess.TimeoutExpired:
                self.srun.kill()
