"""A run's task logs as `mgpu-cluster logs` shows them: each task's worker.log read as bytes from its host
(the engine's read_log), decoded as UTF-8 across reads with each byte that is not UTF-8 shown as U+FFFD (the
offset counts bytes, so nothing is skipped), a partial last line kept until its newline comes or the log is
done; a log that cannot be read is one paragraph naming the task, its host, the path and what to do."""

from __future__ import annotations

import codecs
import time

from launcher.engines.base import Inspecting, parallel
from launcher.errors import MgpuError, RunFailed, RunNotFound
from launcher.run import record
from launcher.run.output import Output
from worker.host import layout
from worker.host.files import READ_MAX_BYTES


class Lines:
    """One task's log as lines, from its bytes as they come."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.partial = ""

    def feed(self, data: bytes, final: bool = False) -> list[str]:
        lines = (self.partial + self.decoder.decode(data, final)).split("\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = ""
        return [line.removesuffix("\r") for line in lines]


def screen(line: str, width: int) -> str:
    """What a terminal shows of a log line: its last `\r` frame (a progress bar redrawn in place), cut to `width`
    characters, saying how many were left out."""
    line = line.rstrip("\r").rsplit("\r", 1)[-1]
    return line if len(line) <= width else f"{line[:width]}… ({len(line) - width} more characters)"


def never_started(run: record.RunRecord, follow: bool) -> record.RunRecord:
    """The run, once it has started a task (`follow` waits while its preflight runs); RunNotFound for a run
    that never started one (a preflight refused it): it has no logs."""
    while not run.attempts:
        ended = run.ended or not record.launcher_alive(run)
        if ended or not follow:
            why = f", {run.failure.kind}" if run.failure else ""
            raise RunNotFound(
                f"run {run.run_id} never started a task (run state: {run.state}{why}), so it has no logs; what its "
                f"launcher said is in {record.run_path(run.run_id) / 'launcher.log'}, and 'mgpu-cluster status "
                f"{run.run_id}' shows why." if ended else
                f"run {run.run_id} has not started its tasks yet (it is in its preflight), so they have no logs yet; "
                f"'mgpu-cluster logs -f {run.run_id}' waits for them.")
        time.sleep(0.5)
        run = record.load(run.run_id)
    return run


def unreadable(run: record.RunRecord, engine: Inspecting, index: int, exc: BaseException) -> str:
    """One paragraph for a task whose log could not be read: the task, its host, the path, what to do."""
    task, plan = run.task(index), engine.plan[index]
    path = layout.file(plan.run_dir, layout.WORKER_LOG)
    why = str(exc).removeprefix(f"{plan.label}: ").rstrip(". ") or type(exc).__name__
    head = f"task {index} ({task.host}): " + (why if path in why else f"cannot read {path}: {why}")
    if task.started_at is None:
        return f"{head}. Task {index} was never started in this run, so it has no log."
    again = f"'mgpu-cluster logs {run.run_id} --task {index}'"
    if isinstance(exc, MgpuError):  # it says already what to check
        return f"{head}. Once it answers, run {again} again: the log stays on its host."
    return f"{head}. Check that {task.host} answers and that the task's folder is still there, then run {again} again."


def show(run: record.RunRecord, engine: Inspecting, chosen: list[int], follow: bool, tail: int | None) -> None:
    """Print the logs of tasks `chosen` (the last `tail` lines of each), then, with `follow`, what comes until
    the run ends or its launcher is gone; RunFailed naming each log that could not be read."""
    out = Output(threaded=False)
    offsets, readers = {i: 0 for i in chosen}, {i: Lines() for i in chosen}

    def say(i: int, lines: list[str]) -> None:
        if len(chosen) > 1:
            out.task_lines(i, run.task(i).host, lines)
        else:
            for line in lines:
                print(line)

    first, last_round = True, False
    while True:
        n = tail if first else None
        results = parallel(lambda i: engine.read_log(i, offsets[i], n), chosen)
        first, failed, cut = False, [], False
        for i, res in zip(chosen, results):
            if res.error is not None:
                failed.append(unreadable(run, engine, i, res.error))
                continue
            assert res.value is not None  # read_log returned
            data, offsets[i] = res.value
            cut |= len(data) >= READ_MAX_BYTES  # one read's most: there is more
            say(i, readers[i].feed(data))
        if failed:
            raise RunFailed(failed[0] if len(failed) == 1 else
                            "cannot read the logs of some tasks:\n  " + "\n  ".join(failed))
        done = not follow or last_round
        if cut and done:
            continue  # a long log comes in pieces: read on at once to its end
        if done:
            for i in chosen:  # the log is done: its last line, with or without a newline
                say(i, readers[i].feed(b"", final=True))
            return
        run = record.load(run.run_id)
        # the run ended, or its launcher is gone: one more read for the last lines, then stop
        last_round = run.ended or not record.launcher_alive(run)
        time.sleep(0.2 if last_round else 0.5)
