"""The multi-device path on real GPUs: `python3 deploy/gpu_check.py` on a machine with GPUs.

Runs the digits example (worker.examples.digits) twice with the built-in runner:
  1. one worker over all the machine's GPUs (MirroredStrategy, one replica per GPU);
  2. two local workers splitting the GPUs between them with CUDA_VISIBLE_DEVICES
     (MultiWorkerMirroredStrategy, NCCL; with one GPU both share it and use the ring collective).
and prints, for each, the replicas in sync, samples/s, validation accuracy and whether the two
workers ended with equal weights. Exit 0: both ran (and the weights are equal); 1: something
failed; 2: a package is missing. Without a GPU it says so and exits 0. `--cpu N` runs the same
on N logical CPU devices per run (local_replicas), to check this script where no GPU exists.

Needs this repository and pip-installed tensorflow, tf-keras and scikit-learn (the example's data).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from worker.host.devices import gpu_indices  # noqa: E402 (no TensorFlow import)

NEEDS = {"tensorflow": "tensorflow", "tf_keras": "tf-keras", "sklearn": "scikit-learn"}


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start(folder: Path, n: int, visible: list[str | None], extra: list[str], timeout: float) -> list[dict]:
    """n workers of one run (n=1: no TF_CONFIG); per worker: exit code, progress.json, log tail."""
    ports = free_ports(n)
    procs = []
    for i in range(n):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "MGPU_RUN_DIR": str(folder / f"task-{i}"), "MGPU_TASK_INDEX": str(i), "TF_USE_LEGACY_KERAS": "1",
               "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
        if visible[i] is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible[i]
        if n > 1:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                           "task": {"type": "worker", "index": i}})
        log = open(folder / f"worker-{i}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "worker", "--entrypoint",
                                        "worker.examples.digits:task", "--save-weights",
                                        str(folder / "weights-{task}.npz"), *extra],
                                       cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.time() + timeout
    out = []
    for i, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
        progress = folder / f"task-{i}" / "progress.json"
        out.append({"code": code, "progress": json.loads(progress.read_text()) if progress.exists() else {},
                    "log": (folder / f"worker-{i}.log").read_text(errors="replace")[-2000:]})
    return out


def equal_weights(folder: Path, n: int) -> bool | None:
    import numpy as np

    if n < 2:
        return None
    w = [np.load(folder / f"weights-{i}.npz") for i in range(n)]
    return all(np.array_equal(w[0][k], w[i][k]) for i in range(1, n) for k in w[0].files)


def report(name: str, folder: Path, results: list[dict]) -> bool:
    ok = all(r["code"] == 0 for r in results)
    p = results[0]["progress"]
    acc = (p.get("metrics") or {}).get("val_accuracy")
    line = (f"{name}: {'ok' if ok else 'FAILED'}; replicas {p.get('replicas')}, "
            f"samples/s {p.get('samples_per_sec') or 0:.0f}, val_accuracy {acc if acc is None else round(acc, 4)}")
    same = equal_weights(folder, len(results)) if ok else None
    if same is not None:
        line += f", weights equal on both workers: {'yes' if same else 'NO'}"
    print(line, flush=True)
    for i, r in enumerate(results):
        strategy = next((ln for ln in r["log"].splitlines() if "replica(s) in sync" in ln), "")
        print(f"  worker {i}: exit {r['code']}; {strategy.strip()}", flush=True)
        if r["code"] != 0:
            print("  " + r["log"][-1500:].replace("\n", "\n  "), flush=True)
    return ok and same is not False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", type=int, metavar="N", help="no GPUs: N logical CPU devices per run instead")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    args = parser.parse_args(argv)
    gpus = sorted(gpu_indices() or [])
    if not gpus and not args.cpu:
        print("no GPU here (nvidia-smi is missing or lists none): nothing to check; run this on a machine with "
              "GPUs (or with --cpu N to check the script itself)")
        return 0
    missing = [pip for module, pip in NEEDS.items() if importlib.util.find_spec(module) is None]
    if missing:
        print(f"missing: pip install {' '.join(missing)}", file=sys.stderr)
        return 2
    if args.cpu:
        n, extra_one, extra_two = args.cpu, ["--local-replicas", str(args.cpu)], []
        halves: list[str | None] = [""] * 2
        if args.cpu > 1:
            extra_two = ["--local-replicas", str(max(1, args.cpu // 2))]
        all_visible: str | None = ""
        print(f"no GPUs used: {n} logical CPU device(s) for the first run, {max(1, n // 2)} per worker for the second")
    else:
        n, extra_one, extra_two = len(gpus), [], []
        all_visible = ",".join(map(str, gpus))
        half = max(1, len(gpus) // 2)
        if len(gpus) == 1:  # NCCL takes one GPU per process: both share it over the ring collective
            halves, extra_two = [all_visible, all_visible], ["--collective", "ring"]
        else:
            halves = [",".join(map(str, gpus[:half])), ",".join(map(str, gpus[half:2 * half]))]
        print(f"GPUs here: {gpus}; worker GPUs for the second run: {halves}", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="mgpu-gpu-check-") as tmp:
        one, two = Path(tmp, "one"), Path(tmp, "two")
        one.mkdir()
        two.mkdir()
        ok &= report(f"one worker over {n} device(s) (MirroredStrategy)", one,
                     start(one, 1, [all_visible], extra_one, args.timeout))
        ok &= report("two local workers splitting them (MultiWorkerMirroredStrategy)", two,
                     start(two, 2, halves, extra_two, args.timeout))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
