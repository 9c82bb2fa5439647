"""`status --watch` as a person sees it: frames read from a real terminal (a pty of 80 and of 160 columns)
while a real digits run trains: the same columns in every frame, `starting` until a task's first step, and
both tasks of one frame read at one moment."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import termios
import threading
import time

from conftest import DIGITS, wait_for, write_spec

MOVE = re.compile(r"\x1b\[\d*[AK]")  # a redraw moves up a line and erases it: a new line of the next frame
STYLE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
EPOCHS = 500  # about 1 s each here (22 steps of 2 x 32 of 1,437 images, validation, a backup): stopped before
NEEDED = ("task", "state", "epoch", "step", "own samples/s", "heartbeat")
RATE = "own samples/s"  # each task's own measure; the group's is on the group line


class Terminal:
    """A command on a real pty of `cols` columns; what it draws, read in a thread, each chunk with its time."""

    def __init__(self, argv: list[str], env: dict, cwd, cols: int, rows: int = 50):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = {**env, "COLUMNS": str(cols), "LINES": str(rows), "TERM": "xterm-256color"}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
                                     start_new_session=True)
        os.close(slave)
        self.master, self.cols, self.chunks = master, cols, []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the command ended and closed its side
                return
            if not data:
                return
            self.chunks.append((time.monotonic(), data))

    def close(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(5)
            os.close(self.master)

    def frames(self) -> list[tuple[float, list[str]]]:
        """Each frame drawn (it starts at its title, `run ID: STATE`): when it arrived, and its lines."""
        raw, ends, size = b"", [], 0
        for at, data in list(self.chunks):  # (the reader thread appends meanwhile)
            raw, size = raw + data, size + len(data)
            ends.append((size, at))
        starts = [m.start() for m in re.finditer(rb"run \d{8}-\d{6}-\w+: ", raw)]
        frames = []
        for start, stop in zip(starts, starts[1:] + [len(raw)]):
            at = next(t for end, t in ends if end > start)
            text = STYLE.sub("", MOVE.sub("\n", raw[start:stop].decode("utf-8", "replace")))
            frames.append((at, [line.rstrip() for line in text.split("\n") if line.strip()]))
        return frames


def table(lines: list[str]) -> list[dict]:
    """The rows of a frame's status table, as {column: cell}."""
    cells = [[c.strip() for c in line.strip("┃│").split("┃" if "┃" in line else "│")]
             for line in lines if line.startswith(("┃", "│"))]
    head, rows = cells[0], cells[1:]
    return [dict(zip(head, r)) for r in rows]


def left_out(lines: list[str], cols: int) -> set[str]:
    """The columns a frame says it did not show (its note may wrap over two lines)."""
    found = re.search(rf"not shown at {cols} columns: (.*?) \(", " ".join(lines))
    return set(found.group(1).split(", ")) if found else set()


def drawn(term: Terminal) -> list[tuple[float, list[dict]]]:
    """Each frame with a table, and its rows."""
    return [(at, table(lines)) for at, lines in term.frames() if any(x.startswith("┏") for x in lines)]


def training(frames: list[tuple[float, list[dict]]]) -> list[tuple[float, list[dict]]]:
    """The frames that show every task training: running, its steps timed (its samples/s shown)."""
    return [(at, rows) for at, rows in frames if all(r["state"] == "running" and r.get(RATE) for r in rows)]


def test_watch_moves_during_training_and_keeps_the_needed_columns_on_80_columns(cli, tmp_path):
    spec = write_spec(tmp_path, training=DIGITS + f"\nepochs = {EPOCHS}")
    r = cli("up", "--detach", spec, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    terms = {cols: Terminal(cli.argv("status", "--watch"), cli.env, cli.cwd, cols) for cols in (80, 160)}
    try:  # 7 frames of training, however fast this machine trains, then the run is stopped: the watch ends
        wait_for(lambda: all(len(training(drawn(t))) >= 7 for t in terms.values()), 240, "7 frames of training")
    finally:
        down = cli("down", timeout=120)
        codes = {cols: term.close(timeout=60) for cols, term in terms.items()}  # each watch ends with the run
    assert down.returncode == 0, down.stdout + down.stderr
    frames = {cols: [(at, lines) for at, lines in term.frames() if any(x.startswith("┏") for x in lines)]
              for cols, term in terms.items()}
    assert codes == {80: 0, 160: 0}, frames
    for cols, seen in frames.items():
        assert seen[-1][1][0].endswith(": stopped"), seen[-1]  # the last frame: the run's end
        assert [row["state"] for row in table(seen[-1][1])] == ["stopped", "stopped"], seen[-1]  # saved or not
        headers = {tuple(table(lines)[0]) for _, lines in seen}
        assert len(headers) == 1, (cols, headers)  # chosen from the width alone, never from what the cells hold
        for task in (0, 1):  # `starting` (importing, joining the group) until its first step, then never again
            states = [table(lines)[task]["state"] for _, lines in seen]
            trained = next(n for n, (_, lines) in enumerate(seen) if table(lines)[task][RATE])
            assert "starting" in states[:trained] and "starting" not in states[trained:], (cols, task, states)
        for _, lines in seen:
            assert all(len(line) <= cols for line in lines), (cols, lines)
            if all(r["state"] == "running" and r[RATE] for r in table(lines)):  # the group at one moment, named
                assert any(re.match(r"group \(task [01]'s record, the newest\): epoch \d+/500", x) for x in lines), lines
            rows = table(lines)
            assert len(rows) == 2 and all(set(NEEDED) <= set(row) for row in rows), (cols, lines)
            hidden = {"task", "host", "pid", "state", "epoch", "step", "behind", "loss", "heartbeat", RATE, "cpu%",
                      "rss MB"} - set(rows[0])
            assert left_out(lines, cols) == hidden and (hidden != set()) == (cols == 80), (cols, lines)
            for row in rows:  # blank while TensorFlow starts (no `epoch 0/0`), then `3/500` and `7/22`
                assert re.fullmatch(rf"|[1-9]\d*/{EPOCHS}", row["epoch"]), row
                assert re.fullmatch(r"|\d+/22", row["step"]), row

    for cols, term in terms.items():
        seen = training(drawn(term))
        pairs = [(a, b) for (t0, a), (t1, b) in zip(seen, seen[1:]) if 1.5 <= t1 - t0 <= 3.5]  # WATCH_S apart
        assert len(pairs) >= 5, (cols, seen)
        # most frames moved on (a step or an epoch further); between epochs (validation, the backup) a task stays
        # at its last step for a while, and what a frame shows is up to about 2 s old (progress.json, its
        # supervisor's read, the launcher's record)
        moved = [all((x["epoch"], x["step"]) != (y["epoch"], y["step"]) for x, y in zip(a, b)) for a, b in pairs]
        assert sum(moved) * 2 >= len(pairs), (cols, pairs)
        assert any(all(x["step"] != y["step"] and x[RATE] != y[RATE] for x, y in zip(a, b))
                   for a, b in pairs), (cols, pairs)
        assert any(re.fullmatch(r"([1-9]|1\d|2[01])/22", row["step"]) for _, rows in seen for row in rows), seen
        # the two tasks train in lockstep: read at one moment they are within a few steps, never an epoch apart
        steps = [[(int(r["epoch"].split("/")[0]) - 1) * 22 + int(r["step"].split("/")[0]) for r in rows]
                 for _, rows in seen]
        assert all(abs(a - b) <= 11 for a, b in steps), (cols, steps)


def test_one_position_rule_and_the_group_at_one_moment():
    """Pure: a record at an epoch's last step and one just past it read alike; the group is the newest record
    (ties: the lowest task); a running task of the attempt is shown where its group is, an ended one where it
    stopped; the run's phases follow each other and sum to its wall time."""
    from launcher.run.phases import run_intervals
    from launcher.run.progress import position
    from launcher.run.view import group, shown_position

    assert position({"global_step": 612, "steps_per_epoch": 102, "epoch": 7, "step": 0}) == (6, 102)
    assert position({"global_step": 613, "steps_per_epoch": 102}) == (7, 1)
    assert position({"epoch": 2, "step": 5}) == (2, 5) and position({}) == (None, None)  # a script's own record
    records = [(0, {"global_step": 194, "steps_per_epoch": 22, "samples_per_sec": 2374.0, "loss": 0.5}),
               (1, {"global_step": 211, "steps_per_epoch": 22, "samples_per_sec": 2397.2, "loss": 0.4})]
    g = group(records)
    assert (g["task"], g["epoch"], g["step"], g["samples_per_sec"]) == (1, 10, 13, 2397.2), g
    assert group([(1, {"global_step": 5}), (0, {"global_step": 5})])["task"] == 0 and group([(0, {})]) is None
    row = {"state": "running", "attempt": 1, "behind": 17, "epoch": 9, "step": 18}
    assert shown_position(row, g, attempt=1) == [10, 13]  # steps with its group: not an epoch apart
    assert shown_position({**row, "state": "failed"}, g, attempt=1) == [9, 18]  # where it stopped
    assert shown_position(row, g, attempt=2) == [9, 18]  # not of this attempt
    marks = {"preflight_s": 0.5, "spawn_started": 101.0, "all_started": 104.0, "first_step": 109.0, "end": 150.0}
    found = run_intervals(100.0, marks, 151.5)
    assert [(p.name, p.seconds) for p in found] == [("preflight", 0.5), ("setup", 0.5), ("spawn", 3.0),
                                                     ("to first step", 5.0), ("training", 41.0), ("teardown", 1.5)]
    assert sum(p.seconds for p in found) == 151.5 - 100.0
    failed = run_intervals(100.0, {**marks, "end": None}, 151.5, until=151.0)  # a run that failed: until its end
    assert [p.name for p in failed][-2:] == ["training", "teardown"] and sum(p.seconds for p in failed) == 51.5
