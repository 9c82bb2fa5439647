"""Output told once (issue 30.3): lines several tasks print alike within a moment shown once naming the
tasks, `logs` keeping every task's own lines; a failing task's traceback shown once (live, or in the
summary when the screen did not show it); a survivor's collective abort in one line; the summary's tail
without the start-up chatter the live stream hides."""

from __future__ import annotations

from pathlib import Path

from conftest import launcher_traceback, status_json, write_spec

from launcher.run.failure import FailureKind, of_task
from launcher.run.screen import ABORTED, Window, is_noise, tasks_label

# ---------------------------------------------------------------- the window (pure)


def shown(entries) -> list[str]:
    return [e.prefix + e.text for e in entries]


def test_a_line_printed_alike_by_several_tasks_within_the_window_is_shown_once_naming_them():
    w = Window(window=0.5)
    w.add(0, "h0", ["epoch 1/5", "only mine"], now=0.0)
    w.add(2, "h2", ["epoch 1/5"], now=0.2)
    w.add(1, "h1", ["epoch 1/5"], now=0.4)
    assert w.due(0.49) == []  # held for the moment, no longer
    assert shown(w.due(0.5)) == ["task0-2 | epoch 1/5", "task0 h0 | only mine"]
    w.add(3, "h3", ["epoch 1/5"], now=2.0)  # the same line later: a line of its own
    assert shown(w.drain()) == ["task3 h3 | epoch 1/5"]


def test_lines_differing_in_numbers_stay_apart_and_each_task_keeps_its_order():
    w = Window()
    w.add(0, "h", ["loss 0.31", "a", "b"], now=0.0)
    w.add(1, "h", ["loss 0.32", "b", "a"], now=0.1)  # its 'loss' line goes before the 'b' it joins
    assert shown(w.drain()) == ["task0 h | loss 0.31", "task0 h | a", "task1 h | loss 0.32", "task0-1 | b",
                                "task1 h | a"]


def test_a_line_joining_an_older_one_brings_its_own_lines_forward_never_later_than_their_moment():
    w = Window(window=0.5)
    w.add(0, "h", ["loss 0.31", "epoch 1/5"], now=0.0)
    w.add(1, "h", ["loss 0.32"], now=0.3)
    w.add(1, "h", ["epoch 1/5"], now=0.4)
    assert shown(w.due(0.5)) == ["task0 h | loss 0.31", "task1 h | loss 0.32", "task0-1 | epoch 1/5"]


def test_epoch_lines_differing_only_in_each_tasks_own_rate_are_alike_and_show_the_chiefs():
    w = Window()
    w.add(1, "h", ["epoch 1/5 loss=0.5 accuracy=0.9 samples/s=771"], now=0.0)  # task 1's came first: task 0's rate
    w.add(0, "h", ["epoch 1/5 loss=0.5 accuracy=0.9 samples/s=750"], now=0.1)  # is the group's, as status gives it
    assert shown(w.drain()) == ["task0-1 | epoch 1/5 loss=0.5 accuracy=0.9 samples/s=750"]
    w.add(0, "h", ["epoch 1/5 loss=0.5 accuracy=0.9 samples/s=750"], now=0.0)
    w.add(1, "h", ["epoch 1/5 loss=0.5 accuracy=0.9 samples/s=771"], now=0.1)
    w.add(1, "h", ["epoch 2/5 loss=0.4 accuracy=0.9 samples/s=771"], now=0.2)  # its own metrics: apart
    w.add(0, "h", ["epoch 2/5 loss=0.3 accuracy=0.9 samples/s=750", "steps samples/s=1"], now=0.3)
    w.add(1, "h", ["steps samples/s=2"], now=0.3)  # not an epoch line: its numbers count
    assert shown(w.drain()) == ["task0-1 | epoch 1/5 loss=0.5 accuracy=0.9 samples/s=750",
                                "task1 h | epoch 2/5 loss=0.4 accuracy=0.9 samples/s=771",
                                "task0 h | epoch 2/5 loss=0.3 accuracy=0.9 samples/s=750",
                                "task0 h | steps samples/s=1", "task1 h | steps samples/s=2"]


def test_progress_frames_and_trailing_blanks_do_not_make_lines_differ():
    w = Window()
    w.add(0, "h", ["10%\r50%\r100% done  "], now=0.0)
    w.add(1, "h", ["100% done"], now=0.1)
    assert [e.printed_by for e in w.drain()] == [[0, 1]]


def test_a_flood_is_never_held_beyond_the_bound():
    w = Window(window=0.5, held_max=100)
    out = []
    for i in range(1000):
        w.add(i % 2, "h", [f"x {i}"], now=0.0)
        out += w.due(0.0)
    assert len(w.held) <= 100 and len(out) == 900
    assert [e.text for e in out] == [f"x {i}" for i in range(900)]  # in order


def test_tasks_label():
    assert tasks_label([0, 1, 2, 3, 4, 5, 6, 7]) == "task0-7"
    assert tasks_label([5, 0, 2, 1]) == "task0-2,5"
    assert tasks_label([0, 2]) == "task0,2"


# What a survivor of TensorFlow 2.21 printed when its peer raised (TF_CPP_MIN_LOG_LEVEL=0).
ABORT_LOG = """\
E0000 00:00:1795604560.893782    5056 ring_alg.cc:291] Aborting RingReduce with UNAVAILABLE: Socket closed
Additional GRPC error information from remote target /job:worker/replica:0/task:1 while calling /tensorflow.WorkerService/RecvBuf:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}
E0000 00:00:1795604560.893845    5056 base_collective_executor.cc:252] BaseCollectiveExecutor::StartAbort UNAVAILABLE: Socket closed
Traceback (most recent call last):
  File "/tmp/oexp/raise.py", line 19, in <module>
    model.fit(ds, epochs=20, steps_per_epoch=5, callbacks=[Boom()], verbose=0)
  File "/usr/lib/python3.11/multiprocessing/pool.py", line 48, in mapstar
    return list(map(*args))
           ^^^^^^^^^^^^^^^^
tensorflow.python.framework.errors_impl.UnavailableError: {{function_node __wrapped__CollectiveReduceV2}} Collective ops is aborted by: Socket closed
Additional GRPC error information from remote target /job:worker/replica:0/task:1 while calling /tensorflow.WorkerService/RecvBuf:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}
The error could be from a previous operation. Restart your program to reset. [Op:CollectiveReduceV2] name: """.splitlines()


def test_a_collective_abort_is_one_line_and_the_task_own_lines_come_back_after_it():
    w = Window()
    w.add(2, "h", ["epoch 2 done", *ABORT_LOG, "[mgpu task] stopping task"], now=0.0)
    assert shown(w.drain()) == ["task2 h | epoch 2 done", f"task2 h | {ABORTED}", "task2 h | [mgpu task] stopping task"]
    assert w.hidden[2] == len(ABORT_LOG)


def test_an_abort_seen_only_at_the_end_of_its_traceback_takes_the_traceback_back():
    """TF_CPP_MIN_LOG_LEVEL=3: no C++ line first; the traceback held in the window is taken off the screen."""
    traceback = ABORT_LOG[ABORT_LOG.index("Traceback (most recent call last):"):]
    w = Window()
    w.add(0, "h", ["epoch 2 done", *traceback], now=0.0)
    w.add(1, "h", ["epoch 2 done", *traceback], now=0.1)  # both survivors alike: one line for both
    assert shown(w.drain()) == ["task0-1 | epoch 2 done", f"task0-1 | {ABORTED}"]


def test_the_supervisors_stop_note_inside_an_abort_is_shown_and_the_traceback_after_it_still_hidden():
    """The supervisor's stop note may come between TensorFlow's abort line and its traceback (CI saw it
    over SSH): the note is shown, the abort stays one line."""
    stop = "[mgpu task] stopping task (a peer failed; KILL at once)"
    w = Window()
    w.add(0, "h", ["epoch 2 done", ABORT_LOG[0], stop, *ABORT_LOG[1:], "[mgpu task] killed"], now=0.0)
    assert shown(w.drain()) == ["task0 h | epoch 2 done", f"task0 h | {ABORTED}", f"task0 h | {stop}",
                                "task0 h | [mgpu task] killed"]
    assert w.hidden[0] == len(ABORT_LOG)
    traceback = ABORT_LOG[ABORT_LOG.index("Traceback (most recent call last):"):]
    w = Window()  # no C++ line first: the note inside the traceback held so far does not stop its taking back
    w.add(1, "h", ["epoch 2 done", *traceback[:3], stop, *traceback[3:]], now=0.0)
    assert shown(w.drain()) == ["task1 h | epoch 2 done", f"task1 h | {stop}", f"task1 h | {ABORTED}"]


def test_verbose_shows_an_abort_whole():
    w = Window(collapse=False)
    w.add(0, "h", ABORT_LOG, now=0.0)
    assert [e.text for e in w.drain()] == ABORT_LOG


def test_a_failure_tail_leaves_out_the_start_up_chatter_unless_it_is_all_there_is():
    noise = ["I0000 00:00:1795604554.006639    4707 grpc_server_lib.cc:467] Started server with target: grpc://x:1",
             "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"]
    assert all(is_noise(line) for line in noise)
    f = of_task(FailureKind.EXITED, "exited with code 1", 1, "task 1 (h:1)", "h", "h:/log",
                [noise[0], "epoch 2 done", noise[1], "ValueError: boom"], "RUN", 1)
    assert f.tail == ["epoch 2 done", "ValueError: boom"] and "grpc_server_lib" not in f.message
    only = of_task(FailureKind.EXITED, "exited with code 1", 1, "task 1 (h:1)", "h", "h:/log", noise, "RUN", 1)
    assert only.tail == noise


# ---------------------------------------------------------------- real runs

BARRIER = """
import os, sys, time
i, n = os.environ["MGPU_TASK_INDEX"], int(os.environ["MGPU_NUM_WORKERS"])
here = os.path.dirname(os.environ["MGPU_RUN_DIR"])  # every local task's folder is in it
open(os.path.join(here, "ready-" + i), "w").close()
end = time.time() + 60
while sum(f.startswith("ready-") for f in os.listdir(here)) < n and time.time() < end:
    time.sleep(0.01)
"""

ALIKE = BARRIER + """
print("shared line one", flush=True)
print("shared line two", flush=True)
print(f"loss 0.{i}1", flush=True)
print(f"own line of task {i}", flush=True)
"""


def script(tmp_path: Path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return f'command = ["python3", "{tmp_path / name}"]'


def test_lines_printed_alike_are_shown_once_and_logs_keep_every_task_own_lines(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "alike.py", ALIKE), n=3)
    r = cli("up", spec, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for text in ("shared line one", "shared line two"):
        assert [line for line in lines if line.endswith(f"| {text}")] == [f"task0-2 | {text}"], r.stdout
    assert lines.index("task0-2 | shared line one") < lines.index("task0-2 | shared line two")
    for i in range(3):  # a line of one task keeps its own prefix; numbers that differ make lines differ
        assert f"task{i} localhost | loss 0.{i}1" in lines and f"task{i} localhost | own line of task {i}" in lines
        logs = cli("logs", "--task", i, timeout=60)
        assert logs.returncode == 0, logs.stderr
        own = ["shared line one", "shared line two", f"loss 0.{i}1", f"own line of task {i}"]
        assert [line for line in logs.stdout.splitlines() if line in own] == own
    every = cli("logs", timeout=60).stdout.splitlines()  # several tasks: each its own prefix, nothing merged
    for i in range(3):
        assert every.count(f"task{i} localhost | shared line one") == 1, every


RAISE_ONCE = BARRIER + """
flag = os.path.join(here, "failed-once")
print("shared line one", flush=True)
if i == "1" and not os.path.exists(flag):
    open(flag, "w").close()
    raise ValueError("a bug in the user's script")
"""


def test_a_failure_that_restarts_is_told_without_its_traceback_twice(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "once.py", RAISE_ONCE), launch="max_restarts = 1")
    r = cli("up", spec, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("Traceback (most recent call last)") == 1, out
    assert "task1 localhost | ValueError: a bug in the user's script" in out
    said = next(line for line in out.splitlines() if "attempt 0 failed: task 1" in line)
    assert "ends with the lines shown above" in said, out
    assert "Traceback" in status_json(cli)["attempts"][0]["failure"]["message"]  # the record keeps the tail


# Two MultiWorkerMirroredStrategy tasks; task 1 raises after two epochs. The survivor ignores TERM for
# stop_grace, so that it lives to print the collective abort that its peer's exit causes.
RAISE_TF = """
import os, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
from worker import import_keras, strategy_from_env
from worker.examples.digits import build_model, load
keras = import_keras()
import tensorflow as tf
strategy = strategy_from_env()
(x, y), _ = load()
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True).repeat()
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
class Boom(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch + 1} done", flush=True)
        if epoch == 1 and os.environ["MGPU_TASK_INDEX"] == "1":
            raise ValueError("a bug in the user's script")
model.fit(ds, epochs=50, steps_per_epoch=3, callbacks=[Boom()], verbose=0)
"""


def worker_log(cli, index: int) -> str:
    return next((cli.home / "runs").rglob(f"task-{index}/worker.log")).read_text(errors="replace")


def test_a_raising_task_traceback_is_shown_once_and_the_survivor_abort_in_one_line(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "raise.py", RAISE_TF), launch="stop_grace = 20")
    r = cli("up", spec, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and not launcher_traceback(out), out
    assert "Collective ops is aborted" in worker_log(cli, 0)  # the survivor did abort
    assert out.count("Traceback (most recent call last)") == 1 and "task1 localhost | Traceback" in out, out
    assert f"task0 localhost | {ABORTED}" in r.stdout and "Collective ops is aborted" not in out, out
    assert not any(line.startswith("task0") and ("GRPC" in line or "  File" in line) for line in out.splitlines())
    assert "exited with code 1" in r.stderr and "ends with the lines shown above" in r.stderr, r.stderr
    assert "ValueError: a bug in the user's script" in r.stderr  # the error itself, named in the summary
    failure = status_json(cli)["failure"]
    assert failure["task"] == 1 and "Around it in its log" in failure["message"]  # `status` tells it whole
    logs = cli("logs", "--task", "0", timeout=60).stdout
    assert "Collective ops is aborted" in logs and "Traceback" in logs  # `logs` keeps it all


def test_the_summary_tail_shows_what_the_screen_did_not_without_start_up_chatter(cli, tmp_path):
    spec = write_spec(tmp_path, script(tmp_path, "raise.py", RAISE_TF), env='TF_CPP_MIN_LOG_LEVEL = "0"')
    r = cli("up", "--quiet", spec, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    raw_tail = worker_log(cli, 1).splitlines()[-15:]
    assert any(is_noise(line) for line in raw_tail), raw_tail  # there was chatter to leave out
    paragraph = r.stderr
    assert "Around it in its log" in paragraph and "ValueError: a bug" in paragraph  # the lines of its cause
    tail = [line[4:] for line in paragraph.splitlines() if line.startswith("    ")]
    assert tail and not any(is_noise(line) for line in tail), paragraph
    failure = status_json(cli)["failure"]
    assert not any(is_noise(line) for line in failure["tail"]) and failure["tail"][-1].startswith("ValueError")


def test_a_line_of_ours_reaches_an_unbuffered_stdout_in_one_write(monkeypatch):
    """With PYTHONUNBUFFERED (as under the tests' and many users' shells) each write of the text layer is a write
    to the fd: print() makes two (the text, then its newline) and a C++ library's line (gloo's) landed between
    them on a loaded machine; worker.training.lines.say makes one."""
    import io

    from worker.training.lines import say

    class Fd(io.RawIOBase):
        def __init__(self):
            self.writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)

    fd = Fd()
    monkeypatch.setattr("sys.stdout", io.TextIOWrapper(fd, write_through=True))  # what -u makes of stdout
    print("task 1 of 2 (worker): DataParallel (jax)", flush=True)
    assert len(fd.writes) == 2, fd.writes  # the reason for say()
    fd.writes.clear()
    say("task 1 of 2 (worker): DataParallel (jax)")
    assert fd.writes == [b"task 1 of 2 (worker): DataParallel (jax)\n"]
