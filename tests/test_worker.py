"""The worker runtime for real: `python -m worker` processes with TF_CONFIG, real TensorFlow.

Two workers train the digits example on two free ports of localhost; every test reaps the processes it
started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from train_shared import digits_alone
from worker.training.progress import ProgressWriter, format_epoch_line, read_progress
from worker.tensorflow.strategy import cluster_from_env, task_id_from_env, wait_for_chief

REPO = Path(__file__).resolve().parents[1]
WRITER_FIELDS = {"task", "state", "epoch", "epochs", "step", "steps_per_epoch", "global_step",
                 "first_epoch", "first_global_step", "loss", "metrics", "samples_per_sec", "epoch_samples",
                 "epoch_train_s", "time", "pid", "epoch_ends"}
PROGRESS_FIELDS = WRITER_FIELDS | {"compute_ms", "wait_ms", "replicas", "first_step_at"}  # the built-in runner adds these


# --- helpers: start workers as plain processes, reap them ------------------------------------

def worker_ports(n: int) -> list[int]:
    """Free ports from the kernel: 20000 and up are the example's, which other tests' runs take meanwhile."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("0.0.0.0", 0))  # TensorFlow binds every address: so does the check
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(ports: list[int], index: int) -> str:
    return json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


class Workers:
    """N worker processes of one run (N=1: no TF_CONFIG at all); killed in `close()`."""

    def __init__(self, run: Path, args: list[str], n: int = 2, mgpu_env: bool = True,
                 env: dict | None = None, argv: list[str] | None = None, cwd: Path | None = None,
                 attempt: int = 0, task_args: dict[int, list[str]] | None = None):
        self.run, self.n = run, n
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        ports = worker_ports(n)
        run.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items()
                if k != "TF_CONFIG" and not k.startswith("MGPU_")}
        base.update(PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                    PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                    **(env or {}))
        for i in range(n):
            proc_env = dict(base)
            if n > 1:
                proc_env["TF_CONFIG"] = tf_config(ports, i)
            if mgpu_env:
                proc_env.update(MGPU_RUN_ID="test", MGPU_TASK_INDEX=str(i),
                                MGPU_NUM_WORKERS=str(n), MGPU_RUN_DIR=str(self.task_dir(i)),
                                TF_USE_LEGACY_KERAS="1")
            log = run / f"worker-{i}.attempt-{attempt}.log"
            self.logs.append(log)
            with open(log, "w") as out:
                command = argv or [sys.executable, "-m", "worker", *args,
                                   *(task_args or {}).get(i, [])]
                self.procs.append(subprocess.Popen(
                    command, cwd=cwd or run, env=proc_env, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True))

    def task_dir(self, i: int) -> Path:
        return self.run / f"task-{i}"

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def tails(self) -> str:
        return "\n".join(f"--- worker {i} ---\n{self.log(i)[-3000:]}" for i in range(self.n))

    def wait(self, timeout: float = 150) -> list[int]:
        deadline = time.time() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.close()
                pytest.fail(f"workers still running after {timeout} s\n{self.tails()}")
        return [p.returncode for p in self.procs]

    def kill(self, i: int) -> None:
        if self.procs[i].poll() is None:
            os.killpg(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait(30)

    def close(self) -> None:
        for i in range(len(self.procs)):
            try:
                self.kill(i)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_ok(workers: Workers, timeout: float = 150) -> Workers:
    with workers:
        codes = workers.wait(timeout)
    assert codes == [0] * workers.n, workers.tails()
    return workers


def fit_tails(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"fit returned ([0-9.]+)s after the last epoch", text)]


def assert_prompt_end(workers: Workers) -> None:
    """The end of fit is prompt: no tf.data autotune shutdown stall (see README)."""
    for i in range(workers.n):
        tails = fit_tails(workers.log(i))
        assert tails and max(tails) < 3.0, f"worker {i}: fit returned late: {tails}"


# --- pure parts ------------------------------------------------------------------------------

def test_cluster_from_env_reads_tf_config():
    two = {"TF_CONFIG": tf_config([20000, 20001], 1)}
    info = cluster_from_env(two)
    assert (info.num_workers, info.task_id, info.is_chief, info.multi_worker) == (2, 1, False, True)
    assert cluster_from_env({"TF_CONFIG": tf_config([20000, 20001], 0)}).is_chief

    alone = cluster_from_env({})
    assert (alone.num_workers, alone.task_id, alone.is_chief, alone.multi_worker) == \
        (1, 0, True, False)

    with_chief = {"TF_CONFIG": json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:1", "c:1"]},
                                           "task": {"type": "worker", "index": 0}})}
    info = cluster_from_env(with_chief)
    assert (info.num_workers, info.task_id, info.is_chief) == (3, 1, False)
    assert task_id_from_env({**with_chief, "MGPU_TASK_INDEX": "7"}) == 7

    for bad in ("{not json", json.dumps({"cluster": {"worker": ["a:1"]},
                                         "task": {"type": "worker", "index": 3}})):
        with pytest.raises(ValueError, match="TF_CONFIG"):
            cluster_from_env({"TF_CONFIG": bad})


def test_progress_writer_is_atomic_and_throttled(tmp_path):
    writer = ProgressWriter(str(tmp_path / "task-0"), task=0, epochs=3, interval=60)
    assert writer.update(force=True, state="training", epoch=1)
    first = read_progress(str(tmp_path / "task-0"))
    assert set(first) == WRITER_FIELDS and first["state"] == "training"
    assert not writer.update(step=5)  # within the interval: kept, not written
    assert read_progress(str(tmp_path / "task-0"))["step"] == 0
    assert writer.update(force=True, metrics={"accuracy": float("nan")})
    last = read_progress(str(tmp_path / "task-0" / "progress.json"))
    assert last["step"] == 5 and last["metrics"] == {"accuracy": None}  # NaN -> null
    assert os.listdir(tmp_path / "task-0") == ["progress.json"]  # no temp file left behind
    with pytest.raises(ValueError):
        writer.update(state="bogus")
    line = format_epoch_line(3, 5, {"loss": 0.12, "accuracy": 0.97}, 1234.4)
    assert line == "epoch 3/5 loss=0.12 accuracy=0.97 samples/s=1234"


def test_importing_worker_does_not_import_tensorflow():
    code = ("import sys, worker, worker.tensorflow.runner, worker.training.progress, worker.tensorflow.strategy, "
            "worker.examples.digits; assert 'tensorflow' not in sys.modules, 'tf imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


@pytest.mark.cluster  # two TensorFlow imports: about 15 s of the quick tier's 60
def test_a_tensorflow_warning_is_printed_once_after_absl_configured_logging():
    """TensorFlow's own handler and the root logger's, which absl sets up at its first log call (the first
    checkpoint's save), printed each of its warnings twice in worker.log; a root logger the program
    configured before TensorFlow still shows them. Both cases at once: each process imports TensorFlow."""
    def code(root_first: bool) -> str:
        return ("import logging, sys\n" + ("logging.basicConfig()\n" if root_first else "")
                + "from worker.tensorflow.strategy import import_tensorflow\ntf = import_tensorflow()\n"
                "from absl import logging as absl_logging\nabsl_logging.info('the first save logs through absl')\n"
                "tf.get_logger().warning('said once')\n")
    procs = {case: subprocess.Popen([sys.executable, "-c", code(case == "root-configured-first")], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case in ("tf-handler", "root-configured-first")}
    errs = {case: proc.communicate(timeout=120)[1] for case, proc in procs.items()}
    for case, err in errs.items():
        assert procs[case].returncode == 0 and err.count("said once") == 1, (case, err)


def test_help_documents_the_flags():
    out = subprocess.run([sys.executable, "-m", "worker", "--help"], capture_output=True,
                         text=True, cwd=REPO, timeout=60).stdout
    for flag in ("--entrypoint", "--epochs", "--steps-per-epoch", "--batch-size-per-replica",
                 "--learning-rate", "--scale-learning-rate", "--no-scale-learning-rate",
                 "--checkpoint-dir", "--tensorboard", "--mixed-precision", "--model-dir",
                 "--run-dir", "--save-weights", "--collective", "TF_CONFIG", "MGPU_RUN_DIR"):
        assert flag in out, flag


def test_user_errors_are_one_line_and_exit_2(tmp_path):
    def worker(*args, code=None):
        argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "worker", *args]
        return subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(REPO)})

    bad = worker("--entrypoint", "no_such_module:task")
    assert bad.returncode == 2 and "cannot import 'no_such_module'" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert worker("--entrypoint", "worker.examples.digits").returncode == 2  # no :function

    no_keras = worker(code="import sys; sys.modules['tf_keras'] = None\n"
                           "from worker.__main__ import main; sys.exit(main(['--entrypoint', "
                           "'worker.examples.digits:task']))")
    assert no_keras.returncode == 2 and "pip install tf-keras" in no_keras.stderr

    if subprocess.run([sys.executable, "-c", "import tensorboard"], capture_output=True).returncode:
        tb = worker("--entrypoint", "worker.examples.digits:task", "--tensorboard", "logs")
        assert tb.returncode == 2 and "pip install tensorboard" in tb.stderr


def test_a_worker_waits_for_the_chiefs_port_before_it_asks_for_the_coordination_service():
    # TensorFlow retries a refused connection to the chief only after a second: wait for the port instead
    port, other = worker_ports(2)
    worker = cluster_from_env({"TF_CONFIG": tf_config([port, other], 1)})
    assert wait_for_chief(cluster_from_env({"TF_CONFIG": tf_config([port, other], 0)}), timeout=0)
    assert not wait_for_chief(worker, timeout=0.3)  # nobody listens: give up, TensorFlow takes over

    chief = socket.socket()
    chief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    chief.bind(("127.0.0.1", port))

    def listen_later():
        time.sleep(0.4)
        chief.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    t0 = time.monotonic()
    try:
        assert wait_for_chief(worker, timeout=30)
        assert time.monotonic() - t0 >= 0.35  # it did wait for the listener
    finally:
        chief.close()


# --- two workers train digits ----------------------------------------------------------------

@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """Two workers, digits defaults (5 epochs, 32/replica); progress.json sampled meanwhile."""
    run = tmp_path_factory.mktemp("digits") / "run"
    snapshots = []
    with Workers(run, ["--entrypoint", "worker.examples.digits:task",
                       "--save-weights", str(run / "weights-{task}.npz")]) as workers:
        while any(p.poll() is None for p in workers.procs):
            snap = read_progress(str(workers.task_dir(0)))
            if snap and (not snapshots or snap != snapshots[-1]):
                snapshots.append(snap)
            time.sleep(0.05)
        codes = workers.wait()
    assert codes == [0, 0], workers.tails()
    workers.snapshots = snapshots
    return workers


@pytest.mark.cluster
def test_two_workers_reach_90_percent_with_identical_weights(digits_run):
    final = [read_progress(str(digits_run.task_dir(i))) for i in range(2)]
    assert [f["state"] for f in final] == ["done", "done"]
    assert final[0]["metrics"]["val_accuracy"] >= 0.90, final[0]
    assert final[0]["metrics"] == final[1]["metrics"]  # one model, metrics reduced over both
    weights = [np.load(digits_run.run / f"weights-{i}.npz") for i in range(2)]
    assert weights[0].files == weights[1].files and len(weights[0].files) == 8
    diff = max(float(np.abs(weights[0][k] - weights[1][k]).max()) for k in weights[0].files)
    assert diff <= 1e-6
    assert "MultiWorker" in digits_run.log(0) or "CollectiveAllReduce" in digits_run.log(0)
    assert re.search(r"^epoch 5/5 loss=\S+ accuracy=\S+ val_loss=\S+ val_accuracy=\S+ "
                     r"samples/s=\d+$", digits_run.log(0), re.M), digits_run.log(0)


@pytest.mark.cluster  # digits_run trains two real workers
def test_progress_json_changes_during_the_run(digits_run):
    snaps = digits_run.snapshots
    assert len({s["time"] for s in snaps}) >= 5, snaps
    assert any(s["state"] == "training" for s in snaps)
    assert [s["epoch"] for s in snaps] == sorted(s["epoch"] for s in snaps)
    mid = [s for s in snaps if s["state"] == "training" and s["epoch"] >= 2 and s["loss"]]
    assert mid, snaps
    last = snaps[-1]
    assert set(last) == PROGRESS_FIELDS
    assert (last["task"], last["state"], last["epoch"], last["epochs"], last["first_epoch"]) == \
           (0, "done", 5, 5, 1)
    steps = last["steps_per_epoch"]
    assert steps == 1437 // 64 and last["step"] == steps and last["global_step"] == 5 * steps
    assert last["samples_per_sec"] > 0 and isinstance(last["pid"], int)
    assert {"accuracy", "val_loss", "val_accuracy"} <= set(last["metrics"])


@pytest.mark.cluster  # digits_run trains two real workers
def test_only_the_chiefs_model_file_remains(digits_run):
    models = sorted(p.relative_to(digits_run.run) for p in digits_run.run.rglob("*.keras"))
    assert models == [Path("model.keras")]
    assert not any(p.name.endswith(".tmp") for p in digits_run.run.rglob("*"))
    assert "model saved to" in digits_run.log(0) and "model saved to" not in digits_run.log(1)
    # the backup deleted once both saved, the run told finished (a restart of it after this trains nothing)
    assert [p.name for p in (digits_run.run / "checkpoint").iterdir()] == ["finished.json"]
    assert json.loads((digits_run.run / "checkpoint" / "finished.json").read_text()) == {"run": "test"}


@pytest.mark.cluster  # digits_run trains two real workers
def test_end_of_fit_is_prompt(digits_run):
    assert_prompt_end(digits_run)


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """No TF_CONFIG at all: one process, default strategy on CPU. Same global batch (64) and the same learning rate
    as the two workers after their warm-up (2 x 0.002): one run per session (train_shared, test_multidevice's too)."""
    return digits_alone(tmp_path_factory)


@pytest.mark.cluster
def test_one_worker_with_the_same_global_batch_is_within_2_points(digits_run, alone):
    assert "_DefaultDistributionStrategy, 1 replica(s)" in alone.log(0)
    one = read_progress(str(alone.task_dir(0)))["metrics"]["val_accuracy"]
    two = read_progress(str(digits_run.task_dir(0)))["metrics"]["val_accuracy"]
    assert one >= 0.90 and abs(one - two) <= 0.02, (one, two)


# --- kill and resume -------------------------------------------------------------------------

PAUSING_ENTRYPOINT = '''
"""digits, but the first attempt pauses after epoch 2 (so that the test can kill it there)."""
import os
import time

from worker.examples.digits import task as digits


def task():
    import tf_keras

    class PauseAfterEpoch2(tf_keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1 and os.environ.get("PAUSE") == "1":
                time.sleep(60)

    t = digits()
    t.callbacks = lambda: [PauseAfterEpoch2()]
    return t
'''


@pytest.mark.cluster
def test_killed_group_resumes_at_the_next_epoch(tmp_path):
    (tmp_path / "pausing.py").write_text(PAUSING_ENTRYPOINT)  # found through the cwd
    run = tmp_path / "run"
    args = ["--entrypoint", "pausing:task", "--epochs", "5"]
    with Workers(run, args, env={"PAUSE": "1"}, cwd=tmp_path) as first:
        deadline = time.time() + 120
        while not all("epoch 2/5 " in first.log(i) for i in range(2)):
            assert time.time() < deadline, first.tails()
            assert all(p.poll() is None for p in first.procs), first.tails()
            time.sleep(0.05)
        first.kill(1)  # one worker dies after epoch 2 ...
        first.kill(0)  # ... and the launcher stops the other one
    assert (run / "checkpoint").exists()
    assert all("epoch 3/5" not in first.log(i) for i in range(2))

    # a task that cannot see the chief's backup (another host, no shared folder) is refused
    with Workers(run, args, cwd=tmp_path, attempt=1,
                 task_args={1: ["--checkpoint-dir", str(tmp_path / "elsewhere")]}) as split:
        assert split.wait() == [2, 2], split.tails()
    for i in range(2):
        assert "task(s) [0] found a backup to resume from, task(s) [1] did not" in split.log(i)

    second = run_ok(Workers(run, args, cwd=tmp_path, attempt=2))
    for i in range(2):
        log = second.log(i)
        assert "resuming at epoch 3" in log, log
        assert "epoch 1/5" not in log and "epoch 2/5" not in log, log  # no epoch twice
        assert "epoch 3/5" in log and "epoch 5/5" in log
        progress = read_progress(str(second.task_dir(i)))
        assert (progress["first_epoch"], progress["epoch"], progress["state"]) == (3, 5, "done")
        assert progress["global_step"] == 5 * progress["steps_per_epoch"]
    assert (run / "model.keras").exists()
    assert_prompt_end(second)


# --- every example: a short two-worker training ----------------------------------------------

@pytest.mark.cluster
def test_example_mnist_from_a_local_npz(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist.npz",
             x_train=rng.integers(0, 256, (256, 28, 28), dtype=np.uint8),
             y_train=rng.integers(0, 10, 256), x_test=rng.integers(0, 256, (64, 28, 28),
                                                                   dtype=np.uint8),
             y_test=rng.integers(0, 10, 64))
    workers = run_ok(Workers(tmp_path / "run", [
        "--entrypoint", "worker.examples.mnist:task", "--epochs", "1",
        "--batch-size-per-replica", "32", "--mixed-precision"],
        env={"MGPU_DATA": str(tmp_path / "mnist.npz")}))
    for i in range(2):
        assert "epoch 1/1 loss=" in workers.log(i)
        assert read_progress(str(workers.task_dir(i)))["steps_per_epoch"] == 256 // 64
    assert (tmp_path / "run" / "model.keras").exists()
    assert_prompt_end(workers)


@pytest.mark.cluster
def test_example_reuters_with_only_tf_config(tmp_path):
    rng = np.random.default_rng(1)

    def sequences(n):
        return np.array([list(rng.integers(1, 500, rng.integers(5, 400))) for _ in range(n)],
                        dtype=object)

    np.savez(tmp_path / "reuters.npz", x_train=sequences(128), y_train=rng.integers(0, 46, 128),
             x_test=sequences(32), y_test=rng.integers(0, 46, 32))
    # no MGPU_* variables (started by hand): no progress file, model and checkpoint in ./
    workers = run_ok(Workers(tmp_path / "run", [
        "--entrypoint", "worker.examples.reuters:task", "--epochs", "1"],
        mgpu_env=False, env={"MGPU_DATA": str(tmp_path / "reuters.npz")}))
    for i in range(2):
        assert "epoch 1/1 loss=" in workers.log(i)
        assert not workers.task_dir(i).exists()
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.endswith(".log")) \
        == ["checkpoint", "model.keras"]
    assert_prompt_end(workers)


@pytest.mark.cluster
def test_example_images_fine_tunes_mobilenet_on_a_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(2)
    for label, colour in enumerate([(220, 30, 30), (30, 30, 220)]):
        folder = tmp_path / "images" / f"class{label}"
        folder.mkdir(parents=True)
        for k in range(10):
            pixels = np.clip(np.array(colour) + rng.integers(-30, 30, (40, 40, 3)), 0, 255)
            Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{k}.png")
    workers = run_ok(Workers(tmp_path / "run", [
        "--entrypoint", "worker.examples.images:task", "--epochs", "1",
        "--batch-size-per-replica", "4"],
        env={"MGPU_DATA": str(tmp_path / "images"), "MGPU_IMAGE_SIZE": "32",
             "MGPU_ALPHA": "0.35", "MGPU_WEIGHTS": "none"}))
    for i in range(2):
        assert "epoch 1/1 loss=" in workers.log(i) and "val_accuracy=" in workers.log(i)
        # 16 training files, each worker decodes its own 8; global batch 8 -> 2 steps
        assert read_progress(str(workers.task_dir(i)))["steps_per_epoch"] == 2
    assert (tmp_path / "run" / "model.keras").exists()
    assert_prompt_end(workers)


@pytest.mark.cluster
def test_example_custom_script_for_command_users(tmp_path):
    workers = run_ok(Workers(tmp_path / "run", [], env={"EPOCHS": "1", "BATCH_SIZE_PER_REPLICA": "256"},  # 2 steps
                             argv=[sys.executable, "-m", "worker.examples.custom_script"]))
    for i in range(2):
        assert "epoch 1/1 loss=" in workers.log(i)
        progress = read_progress(str(workers.task_dir(i)))
        assert (progress["task"], progress["state"], progress["epoch"]) == (i, "done", 1)
    assert "model saved to" in workers.log(0)
    assert [p.name for p in (tmp_path / "run").rglob("*.keras")] == ["model.keras"]
