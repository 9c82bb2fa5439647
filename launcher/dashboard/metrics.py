"""GET /metrics: every watched run's tasks in Prometheus' text format, collected anew at each scrape (a
registry per request: no global state)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from launcher.dashboard import data
from launcher.errors import MgpuError
from launcher.run.view import STARTING, TaskRow
from launcher.run.progress import real, whole
from launcher.run.states import Listed, RunState, TaskState

TASK_STATES = [STARTING, *(s.value for s in TaskState)]  # as `status --json` shows them (launcher.run.view.shown_state)
RUN_STATES = [*(s.value for s in RunState), Listed.REFUSED.value]  # as `status --json` shows them (shown_run_state)

TASK_GAUGES = {  # series name: (its field in `status --json`, help)
    "mgpu_task_step": ("global_step", "Steps the task has trained in this run (all epochs; the steps of a run it "
                                      "resumed with --resume are not counted)."),
    "mgpu_task_epoch": ("epoch", "The epoch the task trains (or ended at), counted from 1."),
    "mgpu_task_loss": ("loss", "The task's loss: the mean over every replica's batches of its epoch so far."),
    "mgpu_task_cpu_percent": ("cpu_percent", "CPU use of the task's training process (100 = one core)."),
    "mgpu_task_memory_bytes": ("rss", "Resident memory of the task's training process and its children."),
    "mgpu_task_samples_per_second": ("samples_per_sec", "The task's own measure of its group's training throughput, "
                                     "its epoch so far (mgpu_group_samples_per_second is the group's figure)."),
    "mgpu_task_steps_behind": ("behind", "Steps the task's last record is behind the group's newest one (records "
                               "are written at each task's own moments; tasks step together)."),
    "mgpu_task_heartbeat_age_seconds": ("heartbeat_age", "Seconds since the task's progress last changed."),
    "mgpu_task_compute_ms": ("compute_ms", "The task's own work per step (ms)."),
    "mgpu_task_wait_ms": ("wait_ms", "Time per step the task waited for its peers (ms)."),
}

GROUP_GAUGES = {  # series name: (its field in `status --json`'s group, help): the group at one moment
    "mgpu_group_step": ("global_step", "Steps the group has trained in this run (all epochs; the steps of a run it "
                                       "resumed with --resume are not counted), at its newest record."),
    "mgpu_group_epoch": ("epoch", "The epoch the group trains (or ended at), counted from 1."),
    "mgpu_group_loss": ("loss", "The group's loss: the mean over every replica's batches of its epoch so far."),
    "mgpu_group_samples_per_second": ("samples_per_sec", "Training throughput of the group, its epoch so far: samples "
                                      "trained / seconds spent training them (no validation or saves)."),
}

GPU_GAUGES = {  # series name: (its figure in a `gpus` row of `status --json`, the factor to its unit, help)
    "mgpu_task_gpu_utilization_percent": ("util", 1, "Use of one of the task's GPUs (label gpu: nvidia-smi's index), "
                                          "device-wide as nvidia-smi tells it: not the task's process alone."),
    "mgpu_task_gpu_memory_bytes": ("memory_used", 2**20, "Memory used on one of the task's GPUs (label gpu), "
                                   "device-wide as nvidia-smi tells it: not the task's process alone."),
}


def gpu_samples(task: TaskRow) -> list[tuple[str, str, float]]:
    """(series, gpu index, value) of a task's own GPUs (`status --json`'s `gpus`), only the figures known."""
    found = []
    gpus: object = task.get("gpus")  # as its host's probe said them (or the record's): anything, read with care
    for gpu in gpus if isinstance(gpus, list) else []:
        for name, (field, factor, _) in GPU_GAUGES.items():
            index, value = (whole(gpu.get("index")), real(gpu.get(field))) if isinstance(gpu, dict) else (None, None)
            if index is not None and value is not None:  # None: not known
                found.append((name, str(index), value * factor))
    return found


def watched_snapshots() -> Iterator[data.Status]:
    """The watched runs (data.watched) as `status --json` shows them at the moment of the scrape."""
    for run_id in data.watched():
        try:
            yield data.status(run_id)
        except MgpuError:  # removed or damaged meanwhile: `ls` says so; a scrape goes on with the others
            continue


STEPS = ("mgpu_task_step", "mgpu_group_step")  # counted from the run's own start (steps_before)


def steps_before(snap: data.Status) -> int:
    """The global steps a run resumed with --resume had trained before it (its start's steps_done), else 0."""
    start = snap["start"]
    done = whole(start.get("steps_done")) if start and start.get("run") else None
    return done or 0


def sample(name: str, figure: float, before: int) -> float:
    """A series' value: a step count from the run's own start (STEPS), any other figure as it is."""
    return max(0.0, figure - before) if name in STEPS else figure


class RunsCollector(Collector):
    """The watched runs as they are at the moment of the scrape."""

    def collect(self) -> Iterator[Metric]:
        gauges = {name: GaugeMetricFamily(name, help_, labels=["run", "task"])
                  for name, (_, help_) in TASK_GAUGES.items()}
        gpu_gauges = {name: GaugeMetricFamily(name, help_, labels=["run", "task", "gpu"])
                      for name, (_, _, help_) in GPU_GAUGES.items()}
        up = GaugeMetricFamily("mgpu_task_up", "1 while the task's process runs (state starting or running), else 0.",
                               labels=["run", "task"])
        task_state = GaugeMetricFamily("mgpu_task_state", "1 for the task's state now (as `status` shows it), 0 for "
                                       "the others.", labels=["run", "task", "state"])
        run_state = GaugeMetricFamily("mgpu_run_state", "1 for the run's state now, 0 for the others.",
                                      labels=["run", "state"])
        restarts = CounterMetricFamily("mgpu_run_restarts", "Restarts of the run after failures.", labels=["run"])
        preemptions = CounterMetricFamily("mgpu_run_preemptions", "Restarts of the run after preemptions.",
                                          labels=["run"])
        group = {name: GaugeMetricFamily(name, help_, labels=["run"]) for name, (_, help_) in GROUP_GAUGES.items()}
        for snap in watched_snapshots():
            run_id = snap["run_id"]
            together, before = snap["group"], steps_before(snap)
            for name, (field, _) in GROUP_GAUGES.items():
                figure = real(together.get(field)) if together else None
                if figure is not None:
                    group[name].add_metric([run_id], sample(name, figure, before))
            restarts.add_metric([run_id], snap["restarts"])
            for shown in RUN_STATES:
                run_state.add_metric([run_id, shown], 1.0 if snap["state"] == shown else 0.0)
            preemptions.add_metric([run_id], snap["preemptions"])
            for task in snap["tasks"]:
                labels = [run_id, str(task["index"])]
                up.add_metric(labels, 1.0 if task["state"] in (STARTING, TaskState.RUNNING.value) else 0.0)
                for shown in TASK_STATES:
                    task_state.add_metric([*labels, shown], 1.0 if task["state"] == shown else 0.0)
                for name, (field, _) in TASK_GAUGES.items():
                    figure = real(task.get(field))  # cpu_percent and rss as the host's probe said them
                    if figure is not None:  # unknown yet (or not a number): no sample, as Prometheus expects
                        gauges[name].add_metric(labels, sample(name, figure, before))
                for name, gpu, value in gpu_samples(task):
                    gpu_gauges[name].add_metric([*labels, gpu], value)
        yield from (*group.values(), *gauges.values(), *gpu_gauges.values(), up, task_state, run_state, restarts,
                    preemptions)


def exposition() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunsCollector())
    return generate_latest(registry)
