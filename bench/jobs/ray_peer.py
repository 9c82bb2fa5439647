#!/usr/bin/env python3
"""The peer: the bench job through Ray Train's TensorflowTrainer, 2 CPU workers on this machine.

    bench/.venv-ray/bin/python bench/jobs/ray_peer.py [--storage DIR] -- JOB-ARGS...

JOB-ARGS are those of train.py beside it (e.g. --model mnist --batch 64 --steps 300 --warmup 5); each
Ray worker calls its `run()` with the TF_CONFIG that Ray sets. Run it with the interpreter of
its own venv (bench/ray.py makes bench/.venv-ray with `pip install "ray[train]"`); Ray is not
one of mgpu-cluster's dependencies.
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.time()
# Ray sets TF_USE_LEGACY_KERAS in its workers only after they imported TensorFlow, too late for
# Keras 3 (which cannot fit under MultiWorkerMirroredStrategy): set it before anything starts.
os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

JOBS = os.path.dirname(os.path.abspath(__file__))


def train_loop(config: dict) -> None:
    sys.path.insert(0, config["jobs"])
    import train

    train.run(train.parse_args(config["argv"]))


def main(argv: list[str]) -> int:
    storage = os.path.abspath("ray-results")
    if argv[:1] == ["--storage"]:
        storage, argv = os.path.abspath(argv[1]), argv[2:]
    job_args = argv[1:] if argv[:1] == ["--"] else argv
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    t_import = time.time()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}})
    t_init = time.time()
    trainer = TensorflowTrainer(
        train_loop, train_loop_config={"argv": job_args, "jobs": JOBS},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="bench", storage_path=storage),
    )
    trainer.fit()
    t_fit = time.time()
    ray.shutdown()
    print(f"RAY-TIMES import {t_import - T0:.2f} s, ray.init {t_init - t_import:.2f} s, "
          f"fit {t_fit - t_init:.2f} s, shutdown {time.time() - t_fit:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
