"""One task of a Slurm run, started by `srun` on its node (no TensorFlow here).

    python -m worker.task.slurm --run-dir RUN --attempt N [--port P] [--grace S] [--preempt-grace S] -- PROGRAM ARGS...

It builds the task's environment (TF_CONFIG from the step's nodes in Slurm's order, mapped to
their NodeAddr, rank from SLURM_PROCID; MGPU_*; RUN/env.json), writes pid, task.json, stats.json
and exit_code into RUN/task-<rank>/, runs PROGRAM there with its output in worker.log, and ends it
as the supervisor does: INT or HUP stop it (TERM, KILL after --grace); TERM or USR1 are a notice
(passed on as TERM; KILL after --preempt-grace). PROGRAM stays in this process group, so Slurm
(`--kill-on-bad-exit`, `scancel`) signals it too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from worker.protocol import EXIT_PREEMPTED
from worker.task.files import write_private

PORT_BASE, PORT_SPAN = 20000, 10000
EXIT_SETUP = 2  # this task could not be set up (Slurm's view of the step, a busy port): see worker.log
STATS_EVERY_S = 2.0


# --------------------------------------------------------------------------- pure

def default_port(job_id: int | str) -> int:
    """The TF port when the spec names none: from the job id, so two jobs sharing a node differ."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address and not address.startswith("[") else f"{address}:{port}"


def tf_config(nodes: list[str], addresses: dict[str, str], port: int, rank: int) -> dict:
    """TF_CONFIG of the task of `rank`: workers in the step's node order (as Slurm lists them, never
    sorted), each at its node's address (its name where Slurm gave none) and `port`."""
    if not 0 <= rank < len(nodes):
        raise ValueError(f"rank {rank} is not one of the step's {len(nodes)} task(s)")
    workers = [endpoint(addresses.get(n) or n, port) for n in nodes]
    return {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}


def parse_nodes(text: str) -> dict[str, str]:
    """{NodeName: NodeAddr} from `scontrol -o show node` (one node per line)."""
    found = {}
    for line in text.splitlines():
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if fields.get("NodeName"):
            found[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return found


def task_environment(common: dict[str, str], nodes: list[str], addresses: dict[str, str], port: int, rank: int,
                     run_dir: str) -> dict[str, str]:
    """What the training gets on top of Slurm's environment (the README's contract)."""
    return {
        **common,
        "TF_CONFIG": json.dumps(tf_config(nodes, addresses, port, rank)),
        "MGPU_TASK_INDEX": str(rank),
        "MGPU_NUM_WORKERS": str(len(nodes)),
        "MGPU_RUN_DIR": run_dir,
        "TF_USE_LEGACY_KERAS": "1",
        "PYTHONUNBUFFERED": "1",
    }


# --------------------------------------------------------------------------- asking Slurm

class SetupError(Exception):
    """Slurm's view of the step does not give this task a place in the cluster."""


def _scontrol(*args: str) -> str:
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"`scontrol {' '.join(args)}` failed: {exc}") from None
    if proc.returncode != 0:
        raise SetupError(f"`scontrol {' '.join(args)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def step_cluster(environ: dict[str, str]) -> tuple[list[str], dict[str, str], int, int]:
    """(nodes in Slurm's order, their addresses, this task's rank, job id) of the running step."""
    try:
        rank, job_id = int(environ["SLURM_PROCID"]), int(environ["SLURM_JOB_ID"])
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]
    except (KeyError, ValueError) as exc:
        raise SetupError(f"not started by srun ({exc} missing from the environment)") from None
    nodes = _scontrol("show", "hostnames", nodelist).split()
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS") or len(nodes))
    me = environ.get("SLURMD_NODENAME", "")
    if tasks != len(nodes) or rank >= len(nodes) or (me and nodes[rank] != me):
        raise SetupError(f"task {rank} of {tasks} runs on {me or '?'}, but the step's nodes are {nodes}: "
                         "mgpu-cluster needs one task per node, in node order (srun --ntasks-per-node=1)")
    return nodes, parse_nodes(_scontrol("-o", "show", "node", nodelist)), rank, job_id


# --------------------------------------------------------------------------- the task



def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Task:
    def __init__(self, run: Path, attempt: int, argv: list[str], port: int | None, grace: float,
                 preempt_grace: float):
        self.run, self.attempt, self.argv, self.port = run, attempt, argv, port
        self.grace, self.preempt_grace = grace, preempt_grace
        self.proc: subprocess.Popen | None = None
        self.deadline: float | None = None  # KILL the program at this time (monotonic)
        self.dir: Path | None = None
        self.log = None
        self.env: dict[str, str] = {}
        self.node = ""

    def note(self, text: str) -> None:
        try:
            self.log.write(f"[mgpu slurm_task] {text}\n".encode())
        except (OSError, ValueError, AttributeError):
            print(f"[mgpu slurm_task] {text}", file=sys.stderr, flush=True)

    def run_task(self) -> int:
        environ = dict(os.environ)
        rank = int(environ.get("SLURM_PROCID", "0"))
        self.dir = self.run / f"task-{rank}"
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for stale in ("exit_code", "reason", "progress.json", "pid", "task.json", "stats.json"):
            (self.dir / stale).unlink(missing_ok=True)
        fd = os.open(self.dir / "worker.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.log = os.fdopen(fd, "ab", buffering=0)
        node = self.node = environ.get("SLURMD_NODENAME", "")
        self.log.write(f"--- attempt {self.attempt} on {node} (job {environ.get('SLURM_JOB_ID')}, step "
                       f"{environ.get('SLURM_STEP_ID')}): {' '.join(self.argv)}\n".encode())
        info = {"run_id": "", "index": rank, "attempt": self.attempt, "node": node, "address": "",
                "port": self.port, "job_id": environ.get("SLURM_JOB_ID"), "step_id": environ.get("SLURM_STEP_ID"),
                "restart_count": int(environ.get("SLURM_RESTART_COUNT") or 0)}
        try:
            common = json.loads((self.run / "env.json").read_text())["env"]
            nodes, addresses, rank, job_id = step_cluster(environ)
            port = self.port or default_port(job_id)
            self.env = task_environment(common, nodes, addresses, port, rank, str(self.dir))
            info.update(run_id=self.env.get("MGPU_RUN_ID", ""), address=addresses.get(node, node), port=port)
            self.port = port
        except (SetupError, OSError, ValueError, KeyError) as exc:
            return self.refuse(info, f"cannot set up this task: {exc}")
        from worker.task.supervised import port_holder  # no TensorFlow there either

        holder = port_holder(port)
        if holder:
            return self.refuse(info, f"port {port} on {node} is taken by {holder}, so the task was not started; "
                                     "stop that process or set [slurm].port to another port")
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                         env={**environ, **self.env}, preexec_fn=_die_with_parent)
        except OSError as exc:
            return self.refuse(info, f"cannot start {self.argv[0]!r} on {node}: {exc.strerror}", code=127)
        self.write_info(info, self.proc.pid)
        if self.deadline is not None:  # a signal came while it started
            self.proc.send_signal(signal.SIGTERM)
        code = self.wait()
        self.sweep()
        return self.finish(code)

    def write_info(self, info: dict, pid: int) -> None:
        import psutil

        me = psutil.Process()
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            created = time.time()
        write_private(self.dir / "pid", f"{pid}\n")
        write_private(self.dir / "task.json", json.dumps({
            **info, "pid": pid, "create_time": created, "supervisor_pid": me.pid,
            "supervisor_create_time": me.create_time(), "time": time.time()}))

    def refuse(self, info: dict, reason: str, code: int = EXIT_SETUP) -> int:
        self.note(reason)
        self.write_info(info, os.getpid())
        write_private(self.dir / "reason", reason + "\n")
        return self.finish(code, reason)

    def finish(self, code: int, reason: str = "") -> int:
        # exits.jsonl keeps every attempt's end (the next attempt may start before the launcher looked)
        line = json.dumps({"attempt": self.attempt, "code": code, "time": time.time(), "reason": reason,
                           "pid": self.proc.pid if self.proc else os.getpid(), "node": self.node,
                           "port": self.port}) + "\n"
        fd = os.open(self.dir / "exits.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(line)
        write_private(self.dir / "exit_code", f"{code}\n")
        return 128 - code if code < 0 else code

    def wait(self) -> int:
        import psutil

        stats_at, ps = 0.0, None
        while True:
            try:
                return self.proc.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.deadline is not None and now > self.deadline:
                self.note("the program did not end in time after the signal: KILL")
                self.kill()
                self.deadline = None
            if now - stats_at >= STATS_EVERY_S:
                stats_at = now
                try:
                    if ps is None:
                        ps = psutil.Process(self.proc.pid)
                        ps.cpu_percent(None)
                    else:
                        rss = sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)])
                        write_private(self.dir / "stats.json", json.dumps({
                            "cpu_percent": round(ps.cpu_percent(None), 1), "rss": rss, "status": ps.status(),
                            "time": time.time()}))
                except (psutil.Error, OSError):
                    pass

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.sweep(grace=0)

    def sweep(self, grace: float = 1.0) -> None:
        """Every process still carrying this task's run id and index (setsid children, servers) goes too."""
        from worker.task import procs

        run_id, index = self.env.get(procs.ENV_RUN), self.env.get(procs.ENV_TASK)
        if run_id and index is not None:
            left = procs.of_task(run_id, index)
            if left:
                self.note(f"stopping {len(left)} process(es) the task left behind: {[p.pid for p in left]}")
                procs.stop(left, grace)

    def peer_failed(self) -> bool:
        """Another task of this attempt already failed: a TERM now is Slurm ending the step
        (--kill-on-bad-exit), not a notice to save."""
        for log in self.run.glob("task-*/exits.jsonl"):
            try:
                lines = log.read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("attempt") == self.attempt and rec.get("code") not in (0, EXIT_PREEMPTED):
                    return True
        return False

    def on_signal(self, signum: int, _frame) -> None:
        notice = signum in (signal.SIGTERM, signal.SIGUSR1) and not (signum == signal.SIGTERM and self.peer_failed())
        grace = self.preempt_grace if notice else self.grace
        deadline = time.monotonic() + grace
        if self.deadline is not None and self.deadline <= deadline:
            return
        self.deadline = deadline
        self.note(f"{signal.Signals(signum).name}: {'notice, ' if notice else ''}TERM to the program, KILL after "
                  f"{grace:g} s")
        if self.proc is not None:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                try:
                    self.proc.send_signal(sig)
                except OSError:
                    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.task.slurm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, type=Path, help="the run's folder, shared by every node")
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--port", type=int, default=None, help="TF port (default: from the job id)")
    parser.add_argument("--grace", type=float, default=1.0, help="INT/HUP to KILL, seconds")
    parser.add_argument("--preempt-grace", type=float, default=None, help="TERM/USR1 (notice) to KILL, seconds")
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("give the program to run after --")
    task = Task(args.run_dir.resolve(), args.attempt, program, args.port, args.grace,
                args.grace if args.preempt_grace is None else args.preempt_grace)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, task.on_signal)
    return task.run_task()


if __name__ == "__main__":
    sys.exit(main())
