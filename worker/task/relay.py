"""What a running task tells the launcher through its core's channel: its output (as the channel has room, a flood
thinned), progress.json and stats. Its methods run once the task does: worker.host.protocol is imported by then."""

from __future__ import annotations

import random
import subprocess
import time
from typing import Any, Callable

from worker.host import layout
from worker.host.devices import GpuMeter
from worker.host.system import Meter
from worker.task.channel import Channel
from worker.task.folder import TaskFolder
from worker.task.lines import NOTE, Lines
from worker.task.warm import Forked

# progress.json is read about once a second: each wake-up takes a core from the training (4 a second cost ~2% of
# the steps on 2 cores); each read 0.5 to 1.5 s after the last, or epochs of about 1 s are read at one step each
PROGRESS_POLL_S, POLL_JITTER = 1.0, 0.5
FORWARD_EVERY_S = 0.1  # output is sent at most this often (a flood in batches)
FORWARD_MAX_LINES = 400  # per batch; beyond that a flood is thinned (worker.log keeps all)
FORWARD_MAX_BYTES = 8192  # per batch: a slow link holds little output ahead of an exit or a beat


class Relay:
    """The task's output, progress and stats, sent on the channel. What it needs of the core is handed in: its
    folder, channel and output lines, how to say things (emit a record, tell), and noticed(ago), called when
    progress.json says the task took a notice `ago` seconds before (a preemption: the core's to act on)."""

    def __init__(self, folder: TaskFolder, channel: Channel, lines: Lines, emit: Callable[[Any], None],
                 tell: Callable[[str], None], noticed: Callable[[float], None]):
        self.folder, self.channel, self.lines = folder, channel, lines
        self.emit, self.tell, self.noticed = emit, tell, noticed
        self.last_progress = b""
        self.gpus_said = False  # what nvidia-smi's readings left out, said once

    def forward(self, final: bool = False) -> bool:
        """Send output the channel has room for now; what it has no room for waits, and a flood is
        thinned (so output is bounded by what the link drains, never ahead of an exit or a beat)."""
        from worker.host import protocol
        if not self.channel.room():
            if final:
                self.lines.drop_pending()
            return False
        lines, dropped = self.lines.take(FORWARD_MAX_LINES, FORWARD_MAX_BYTES)
        if lines or dropped:
            self.emit(protocol.Output(lines=lines, dropped=dropped))
        return bool(lines or dropped)

    def send_progress(self, notice_only: bool = False) -> None:
        """progress.json as a Progress record (`notice_only`: only one that says "preempting"); one that cannot
        be read, parsed or encoded is no progress (the training writes it: untrusted input)."""
        from worker.host import protocol
        try:
            with open(layout.file(self.folder.path, layout.PROGRESS), "rb") as f:
                raw = f.read(protocol.FILE_MAX_BYTES + 1)
            if raw == self.last_progress:  # read on each output batch too: most reads find nothing new
                return
            data = protocol.json_object(raw)
            if notice_only and protocol.ProgressState.of(data) != protocol.ProgressState.PREEMPTING:
                return
            self.last_progress = raw
            if data is None:
                return
            record = protocol.encode(protocol.Progress(progress=data))
        except (OSError, ValueError, RecursionError, MemoryError):
            return
        self.channel.send(record)
        if protocol.ProgressState.of(data) == protocol.ProgressState.PREEMPTING:
            self.noticed(self.since(data.get("time")))

    @staticmethod
    def since(written: Any) -> float:
        """How long ago the task wrote a record that says `time: written`; we read it up to a poll later."""
        try:
            elapsed = time.time() - float(written)
        except (TypeError, ValueError, OverflowError):  # no time, or not one (a user's own record)
            return 0.0
        return min(elapsed, PROGRESS_POLL_S * (1 + POLL_JITTER)) if elapsed > 0 else 0.0  # (NaN, a clock step back)

    def watch(self, child: subprocess.Popen[bytes] | Forked, meter: Meter, gpus: GpuMeter | None) -> None:
        """Forward output, progress and stats until the task ends. Wakes when output arrives (at most
        every FORWARD_EVERY_S) or a poll is due, not on a fixed tick."""
        from worker.host import protocol
        poll_at = stats_at = 0.0
        while child.poll() is None:
            spoke = self.forward()
            if spoke:
                time.sleep(FORWARD_EVERY_S)  # more is coming: send it in batches
            now = time.monotonic()
            # also read it when the task spoke: the worker prints its notice just after writing
            # "preempting", and preempt_grace may be shorter than a poll. Only a notice goes out then:
            # progress read at each epoch line would show a short epoch's step as its last, always
            if now >= poll_at:
                poll_at = now + PROGRESS_POLL_S * random.uniform(1 - POLL_JITTER, 1 + POLL_JITTER)
                self.send_progress()
            elif spoke:
                self.send_progress(notice_only=True)
            if now - stats_at >= protocol.BEAT_S:
                stats_at = now
                self.send_stats(meter, gpus)
            wait = max(0.0, min(poll_at, stats_at + protocol.BEAT_S) - time.monotonic())
            if self.lines.pending:  # output that waits for room on the channel: look again soon
                time.sleep(min(wait, FORWARD_EVERY_S))
            else:
                self.lines.arrived.wait(wait)

    def send_stats(self, meter: Meter, gpus: GpuMeter | None) -> None:
        """CPU%, RSS, state and GPUs of the task, and in any case a record: the launcher counts a core
        silent for its lifeline as lost."""
        from worker.host import protocol
        cpu, rss, status = meter.read()
        figures = gpus.latest if gpus else None
        if gpus is not None and gpus.dropped and not self.gpus_said:
            self.gpus_said = True
            said = (f"{gpus.dropped}; the task goes on, and its GPUs show only the figures kept (check "
                    "nvidia-smi on this host)")
            self.folder.log_write((NOTE + said + "\n").encode())  # in its log; on screen once, as the launcher's
            self.tell(said)
        self.emit(protocol.Stats(cpu_percent=cpu, rss=rss, status=status, gpus=figures))
