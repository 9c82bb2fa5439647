"""Step timing: a task's own work per step (input, forward and backward pass) apart from the rest of
the step, where it waits for its peers (the gradients' all-reduce, and the metrics' sync), plus the update.

`StepClock.install(optimizer)` wraps the optimizer's gradient aggregation with a `tf.timestamp()` taken
once every local gradient is computed (the gradients pass it before their all-reduce starts). The host
notes when each `train_function` call begins and ends (`time.time()`, the same clock). Per step:
own work = gradients ready - step begun; wait = step ended - gradients ready. Summed as offsets from a
base time in two variables, read once per progress window. The figures given out are the means over about
the last SPAN_S seconds of steps (from the last window start at least that long ago): on a shared host a
task is slower for a second or two now and then (a collection, a neighbour's burst), which names no straggler.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from typing import Any, Callable, Iterable

SPAN_S = 10.0


class StepClock:
    """Sums, per step, when it began and ended (host) and when its gradients were ready (graph), as
    seconds after `base`; a window's means give the split."""

    def __init__(self, tf: Any) -> None:  # Any (here and below): TensorFlow's module and tensors, without types
        self.tf = tf
        self.base = time.time()
        with tf.init_scope():  # plain local variables, never mirrored: each task keeps its own sums
            self.ready_s = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="mgpu_grads_ready_s")
            self.readies = tf.Variable(0, dtype=tf.int64, trainable=False, name="mgpu_grads_ready_n")
        self._began: float | None = None
        self._sums = [0.0, 0.0, 0]  # host: sum of begin, sum of end (s after base), steps
        self._marks: deque[tuple[float, tuple[float, ...]]] = deque()  # (time, the sums) at each window's start
        self.compute_ms: float | None = None
        self.wait_ms: float | None = None

    def install(self, optimizer: Any) -> None:
        """Wrap the optimizer's gradient aggregation (where the all-reduce starts): `aggregate_gradients`
        (Keras optimizers) or `_aggregate_gradients` (legacy ones), of the inner optimizer under a
        loss-scale optimizer. ValueError when it has neither."""
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        names = [n for n in ("aggregate_gradients", "_aggregate_gradients") if callable(getattr(inner, n, None))]
        if not names:
            raise ValueError(f"{type(inner).__name__} has no aggregate_gradients: the step split cannot be measured")
        for name in names:
            setattr(inner, name, self._timed(getattr(inner, name)))

    def _timed(self, aggregate: Callable[..., Any]) -> Callable[..., Any]:
        tf, base = self.tf, self.base

        @functools.wraps(aggregate)
        def timed(grads_and_vars: Iterable[tuple[Any, Any]], *args: Any, **kwargs: Any) -> Any:
            pairs = list(grads_and_vars)
            flat = [t for g, _ in pairs if g is not None for t in tf.nest.flatten(g, expand_composites=True)]
            with tf.control_dependencies(flat):  # every local gradient is computed
                ready = tf.timestamp()
            with tf.control_dependencies([ready]):  # the all-reduce starts after `ready`, not before
                pairs = [(None if g is None else tf.nest.map_structure(tf.identity, g, expand_composites=True), v)
                         for g, v in pairs]
            self.ready_s.assign_add(ready - base)
            self.readies.assign_add(1)
            return aggregate(pairs, *args, **kwargs)

        return timed

    # --- the host side, from the progress callback ---------------------------------------
    def begin(self) -> None:
        self._began = time.time()

    def end(self) -> None:
        if self._began is None:
            return
        self._sums[0] += self._began - self.base
        self._sums[1] += time.time() - self.base
        self._sums[2] += 1
        self._began = None
        if not self._marks:  # the first step traces the function and meets the peers: not counted
            self._marks.append((time.time(), self._now()))

    def _now(self) -> tuple[float, ...]:
        return (*self._sums, float(self.ready_s.numpy()), int(self.readies.numpy()))

    def window(self, min_steps: int = 3) -> tuple[float | None, float | None]:
        """(compute_ms, wait_ms) per step, means since the last window start at least SPAN_S seconds ago (a
        window: at least `min_steps` steps since the last; else the figures given last stand)."""
        if not self._marks or self._sums[2] - self._marks[-1][1][2] < min_steps:
            return self.compute_ms, self.wait_ms
        now, at = self._now(), time.time()
        while len(self._marks) > 1 and self._marks[1][0] <= at - SPAN_S:
            self._marks.popleft()
        began, ended, steps, ready, readies = (a - b for a, b in zip(now, self._marks[0][1]))
        self._marks.append((at, now))
        if readies <= 0:  # no gradients went through the optimizer (a custom step): no split
            return self.compute_ms, self.wait_ms
        began, ended, ready = began / steps, ended / steps, ready / readies
        ready = min(max(ready, began), ended)
        self.compute_ms, self.wait_ms = round(1000 * (ready - began), 3), round(1000 * (ended - ready), 3)
        return self.compute_ms, self.wait_ms

    def callback(self) -> Any:
        """A Keras callback that times each train_function call: put it first in fit's list, so that
        its batch end comes before any other callback's work (a checkpoint save is no part of a step)."""
        from worker.tensorflow.strategy import import_keras

        keras: Any = import_keras()
        clock = self

        class StepClockCallback(keras.callbacks.Callback):  # type: ignore[misc]  # tf_keras has no types
            def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
                clock.begin()

            def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
                clock.end()

        return StepClockCallback()
